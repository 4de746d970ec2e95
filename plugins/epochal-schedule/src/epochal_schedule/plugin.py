"""The ``lr_scheduler`` plugin: any ``torch.optim.lr_scheduler`` class, configured in TOML.

::

    [plugins.lr_scheduler]
    name = "OneCycleLR"        # a class of torch.optim.lr_scheduler
    interval = "batch"         # step after every optimizer step ("epoch": after every epoch)
    max_lr = 0.1               # the other keys are the class's own arguments
    total_steps = 3000

``ReduceLROnPlateau`` steps with the log value named by ``monitor``, only in the rows that hold
it: with ``[loop] eval_every_n_epochs = 2`` it steps after every second epoch, never on the
previous evaluation's value again. ``SequentialLR`` and ``ChainedScheduler`` take ``schedulers = [{name = ...,
...}, ...]``; ``LambdaLR``-style callables are given as ``"module:function"``. The learning rate
used by each epoch (or optimizer step) is written into the log as ``lr`` (``lr.groupN`` for
further parameter groups). The scheduler's state is saved in checkpoints and restored exactly.

A model without an optimizer but with a numeric ``lr`` attribute (a numpy model) is scheduled
through a one-parameter stand-in optimizer whose learning rate is copied into ``model.lr``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from epochal import ConfigError, PluginError, hookimpl
from epochal.protocol import Phase, PositiveInt, Rank

if TYPE_CHECKING:
    import torch

__all__ = ["LRScheduler"]

WHERE = "[plugins.lr_scheduler]"


class LRScheduler:
    """Step a ``torch.optim.lr_scheduler`` scheduler of the model's optimizer.

    :param name: the scheduler class, e.g. ``"StepLR"``, ``"CosineAnnealingLR"``,
        ``"OneCycleLR"``, ``"ReduceLROnPlateau"``.
    :param interval: ``"epoch"`` (after each epoch, after its evaluation) or ``"batch"``
        (after each optimizer step: with gradient accumulation, every N batches).
    :param frequency: step every *frequency* epochs or optimizer steps.
    :param monitor: the log key ``ReduceLROnPlateau`` watches (e.g. ``"valid.loss"``); it steps
        only in the rows (epochs, or batches with ``interval = "batch"``) that hold it.
    :param log: write the learning rate into the log (``lr``, ``lr.group1``, ...).
    :param arguments: the scheduler's own keyword arguments (``step_size``, ``T_max``, ...).
        A length argument (``total_steps``, ``T_max``, ``total_iters``) may be ``"auto"``: the
        steps the schedule takes in this run (optimizer steps from
        ``loop.estimated_stepping_batches`` with ``interval = "batch"``, else ``max_epochs``;
        divided by *frequency*). Resumed with more epochs after it ended, such a schedule starts
        again over the steps added.
    """

    autoload = False  # it changes the learning rate: it runs only when a run names it
    #: every rank steps its own optimizer's schedule (on reduced metrics for ReduceLROnPlateau).
    rank: ClassVar[Rank] = "all"
    phase: ClassVar[Phase] = "adjust"  # from the records, before the decisions
    state_version = 1

    def __init__(
        self,
        name: str,
        interval: Literal["epoch", "batch"] = "epoch",
        frequency: PositiveInt = 1,
        monitor: str = "valid.loss",
        log: bool = True,
        **arguments: Any,
    ) -> None:
        from epochal_schedule.build import check_arguments, scheduler_class

        cls = scheduler_class(name, WHERE)
        check_arguments(cls, arguments, WHERE)
        self.name = name
        self.interval = interval
        self.frequency = frequency
        self.monitor = monitor
        self.log = log
        self.arguments = dict(arguments)
        #: stepping once per epoch, it has nothing to do after a batch.
        self.idle_hooks = frozenset({"after_batch"}) if interval == "epoch" else frozenset()
        self.plateau = cls.__name__ == "ReduceLROnPlateau"
        #: the scheduler (made in before_training, when the optimizer is known).
        self.scheduler: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self._proxy_model: Any = None
        #: a saved state (load_state_dict) for the next run to continue, if that one is resumed.
        self._pending: Mapping[str, Any] | None = None
        #: whether the monitored record was seen in the log, and the streams evaluated so far.
        self._seen = False
        self._evaluated: set[str] = set()

    # -- the optimizer ------------------------------------------------------------------------

    def _optimizer_of(self, model: Any) -> torch.optim.Optimizer:
        import torch

        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        lr = getattr(model, "lr", None)
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            self._proxy_model = model
            return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(lr))
        raise PluginError(
            f"plugin 'lr_scheduler': the model ({type(model).__name__}) has no torch optimizer "
            "(model.optimizer) and no numeric learning rate (model.lr) to schedule"
        )

    def _length(self, loop: Any, done: int = 0) -> float:
        """The steps this schedule takes in the run: what a length argument ``"auto"`` becomes
        (*done*: the steps an earlier run took already, for a schedule that starts again)."""
        if self.interval == "batch":
            total = loop.estimated_stepping_batches
        else:
            total = loop.max_epochs if loop.max_epochs is not None else math.inf
        return total if total == math.inf else total // self.frequency - done // self.frequency

    def _check_length(self, loop: Any, saved: Mapping[str, Any]) -> str | None:
        """Refuse a resume whose ``"auto"`` length differs from the saved schedule's while that
        schedule is under way: the saved state would keep the old length (OneCycleLR then fails
        once past it), and a schedule that ends elsewhere has another shape from its first step on.

        A schedule that had ended (the summary's command to train on after ``max_epochs`` was
        reached raises ``max_epochs``) is not refused: the length argument it names is returned,
        and the schedule starts again over what this run adds.

        :raises ConfigError: naming the configuration file, the checkpoint, the argument, both
            lengths and the ways out.
        """
        from epochal_schedule.build import LENGTH_ARGUMENTS

        length = self._length(loop)
        for key in LENGTH_ARGUMENTS:
            was = saved.get(key)
            if self.arguments.get(key) != "auto" or not isinstance(was, int) or length == math.inf:
                continue
            if int(length) == was:
                continue
            done = saved.get("last_epoch")
            if isinstance(done, int) and done >= was:
                return key  # the saved schedule ran to its end
            config = f"{loop.config_file}: " if loop.config_file else ""
            source = f" in {loop.resumed_source}" if loop.resumed_source else ""
            raise ConfigError(
                f"{config}{WHERE} {key} = 'auto' makes this run's schedule {int(length)} steps long, "
                f"and the schedule saved{source} is {was} steps long, {done} of them done: a resumed "
                f"run cannot change the length of a schedule under way (its shape depends on it). "
                f"Keep the run's length ([loop] max_epochs / max_iterations), start afresh without "
                f"--resume, or give {key} a number"
            )
        return None

    def _restart(self, loop: Any, key: str, pending: Mapping[str, Any]) -> None:
        """Start the saved schedule, which had ended, again over the steps this run adds (from
        the initial learning rates), and say so."""
        from epochal.torch import from_plain
        from epochal_schedule.build import build

        done = int(pending["steps"]) if self.interval == "batch" else loop.epoch
        length = self._length(loop, done)
        assert self.optimizer is not None
        for group, saved in zip(self.optimizer.param_groups, pending["param_groups"], strict=True):
            group.update(from_plain(saved))
            group["lr"] = group.get("initial_lr", group["lr"])
        self.scheduler = build(self.name, self.arguments, self.optimizer, WHERE, length)
        if loop.world.is_zero:
            from epochal.console import fit_lines, terminal_width

            unit = "optimizer steps" if self.interval == "batch" else "epochs"
            notice = (
                f"epochal: lr_scheduler: the saved schedule ({key} = 'auto' = "
                f"{pending['scheduler'][key]}) had ended; it starts again from the initial learning "
                f"rate over the {int(length)} {unit} this run adds (give {key} a number to keep "
                "one schedule over the whole run)"
            )
            print("\n".join(fit_lines(notice, terminal_width(sys.stderr))), file=sys.stderr, flush=True)

    def _sync_proxy(self) -> None:
        if self._proxy_model is not None and self.optimizer is not None:
            self._proxy_model.lr = self.optimizer.param_groups[0]["lr"]

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def before_training(self, loop: Any) -> None:
        """Make the scheduler (and on a resumed run restore its state and the rates).

        A fresh run starts afresh: no step counted, nothing seen from an earlier run.
        """
        from epochal.torch import from_plain
        from epochal_schedule.build import build

        self.steps, self._seen, self._evaluated, self._proxy_model = 0, False, set(), None
        self.optimizer = self._optimizer_of(loop.model)
        self.scheduler = build(self.name, self.arguments, self.optimizer, WHERE, self._length(loop))
        pending, self._pending = self._pending, None
        if pending is not None and loop.resumed:
            ended = self._check_length(loop, pending["scheduler"])
            if ended is not None:
                self._restart(loop, ended, pending)
            else:
                # Making a scheduler steps it once and rewrites the rates; the saved ones win.
                self.scheduler.load_state_dict(from_plain(pending["scheduler"]))
                for group, saved in zip(self.optimizer.param_groups, pending["param_groups"], strict=True):
                    group.update(from_plain(saved))
            self.steps = int(pending["steps"])
            if getattr(loop.model, "optimizer_steps", 0):
                # the optimizer stepped before the checkpoint: what torch's step wrapper records,
                # so that a scheduler that had not stepped yet (a run saved at an epoch's last
                # batch) does not warn that it steps before the optimizer
                self.optimizer._opt_called = True  # type: ignore[attr-defined]
        self._sync_proxy()

    @hookimpl
    def after_evaluation(self, stream: str) -> None:
        """Note the stream evaluated (the monitored record's absence is an error only after it)."""
        self._evaluated.add(stream)

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        """With ``interval = "batch"``: log the rate and step after each optimizer step."""
        if self.interval != "batch" or not getattr(loop.model, "optimizer_stepped", True):
            return
        self.steps += 1
        if self.steps % self.frequency == 0:
            self._step(loop)

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """With ``interval = "epoch"``: log the epoch's rate and step (after evaluation)."""
        if self.interval == "epoch" and loop.epoch % self.frequency == 0:
            self._step(loop)

    def _step(self, loop: Any) -> None:
        assert self.optimizer is not None
        if self.log:
            row = loop.log.current_row
            for i, group in enumerate(self.optimizer.param_groups):
                row["lr" if i == 0 else f"lr.group{i}"] = float(group["lr"])
        if self._proxy_model is not None:
            self.optimizer.step()  # a no-op (no gradients) that tells torch the optimizer stepped
        if self.plateau:
            row = loop.log.current_row
            value = row.get(self.monitor)
            if value is None:
                # No value in this row (an epoch without evaluation): no step, rather than a step
                # on the previous evaluation's value, which would count as "no improvement".
                self._check_monitor(loop, row)
                return
            self._seen = True
            self.scheduler.step(float(value))
        else:
            self.scheduler.step()
        self._sync_proxy()

    def _check_monitor(self, loop: Any, row: Mapping[str, Any]) -> None:
        """Refuse a monitored record that is not logged once it should have been."""
        if self._seen:
            return
        stream = self.monitor.partition(".")[0]
        if stream in loop.eval_streams and stream not in self._evaluated:
            return  # it may come with the stream's first evaluation
        if loop.log.last(self.monitor) is not None:
            self._seen = True  # logged in other rows (e.g. an epoch's, with interval = "batch")
            return
        raise ConfigError(
            f"{WHERE} monitor {self.monitor!r} is not in the log at epoch {loop.epoch} "
            "(ReduceLROnPlateau needs it); this row has: "
            f"{', '.join(sorted(row)) or 'nothing'}"
        )

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state, the optimizer's rates and the steps counted."""
        from epochal.torch import to_plain
        from epochal_schedule.build import hyperparameters

        if self.scheduler is None:
            return self._pending if self._pending is not None else {}  # type: ignore[return-value]
        assert self.optimizer is not None
        return {
            "scheduler": to_plain(self.scheduler.state_dict()),
            "param_groups": to_plain(hyperparameters(self.optimizer)),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep a saved state until before_training makes the scheduler."""
        if state:
            missing = {"scheduler", "param_groups", "steps"} - set(state)
            if missing:
                raise PluginError(f"plugin 'lr_scheduler': saved state lacks {sorted(missing)}")
            self._pending = state
