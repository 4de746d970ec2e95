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

A model with several optimizers (``TorchModel``'s ``optimizers``: a GAN's generator and
discriminator) gets one scheduler of this class per optimizer, or of the one ``optimizer``
names; its rates are logged as ``lr.<optimizer>``. With ``interval = "batch"`` each scheduler
steps after the batches in which its own optimizer stepped (under manual optimization they may
differ). Another schedule for another optimizer is a second table of this class::

    [plugins.lr_discriminator]
    factory = "epochal_schedule:LRScheduler"
    optimizer = "discriminator"
    name = "StepLR"
    step_size = 10

A model without an optimizer but with a numeric ``lr`` attribute (a numpy model) is scheduled
through a one-parameter stand-in optimizer whose learning rate is copied into ``model.lr``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from epochal import ConfigError, PluginError, hookimpl
from epochal.protocol import Phase, PositiveInt, Rank, checked_options

if TYPE_CHECKING:
    import torch

__all__ = ["LRScheduler"]

WHERE = "[plugins.lr_scheduler]"


@dataclass
class Schedule:
    """One optimizer's scheduler, and the steps counted for it (``interval = "batch"``)."""

    #: the optimizer's name in the model (None: the model's one optimizer, or the stand-in).
    name: str | None
    optimizer: Any
    scheduler: Any
    steps: int = 0


@checked_options("lr_scheduler")
class LRScheduler:
    """Step a ``torch.optim.lr_scheduler`` scheduler of the model's optimizer.

    :param name: the scheduler class, e.g. ``"StepLR"``, ``"CosineAnnealingLR"``,
        ``"OneCycleLR"``, ``"ReduceLROnPlateau"``.
    :param interval: ``"epoch"`` (after each epoch, after its evaluation) or ``"batch"``
        (after each optimizer step: with gradient accumulation, every N batches).
    :param frequency: step every *frequency* epochs or optimizer steps.
    :param monitor: the log key ``ReduceLROnPlateau`` watches (e.g. ``"valid.loss"``); it steps
        only in the rows (epochs, or batches with ``interval = "batch"``) that hold it.
    :param log: write the learning rate into the log (``lr``, ``lr.group1``, ...; with several
        optimizers ``lr.<optimizer>``, ``lr.<optimizer>.group1``).
    :param optimizer: the name of the model's optimizer to schedule (``model.optimizers``);
        None: every optimizer of the model, each with a scheduler of its own.
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
        optimizer: str | None = None,
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
        self.optimizer_name = optimizer
        self.arguments = dict(arguments)
        #: stepping once per epoch, it has nothing to do after a batch.
        self.idle_hooks = frozenset({"after_batch"}) if interval == "epoch" else frozenset()
        self.plateau = cls.__name__ == "ReduceLROnPlateau"
        #: one schedule per optimizer scheduled (made in before_training, when they are known).
        self.schedules: list[Schedule] = []
        self._proxy_model: Any = None
        #: a saved state (load_state_dict) for the next run to continue, if that one is resumed.
        self._pending: Mapping[str, Any] | None = None
        #: whether the monitored record was seen in the log, and the streams evaluated so far.
        self._seen = False
        self._evaluated: set[str] = set()

    @staticmethod
    def refine_schema(table: dict[str, Any]) -> dict[str, Any]:
        """Each scheduler's own arguments in the table's JSON Schema (``epochal schema``)."""
        from epochal_schedule.build import options_schema

        return options_schema(table)

    # -- the optimizers -----------------------------------------------------------------------

    @property
    def scheduler(self) -> Any:
        """The scheduler of the one optimizer scheduled (None before training, or with several)."""
        return self.schedules[0].scheduler if len(self.schedules) == 1 else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The one optimizer scheduled (None before training, or with several)."""
        return self.schedules[0].optimizer if len(self.schedules) == 1 else None

    def _optimizers_of(self, model: Any) -> dict[str | None, torch.optim.Optimizer]:
        """The optimizers to schedule by name (None: the model's one optimizer, or a stand-in).

        :raises ConfigError: ``optimizer`` names no optimizer of the model.
        """
        import torch

        from epochal.errors import did_you_mean

        named = getattr(model, "optimizers", None)
        if (
            isinstance(named, Mapping)
            and named
            and all(isinstance(o, torch.optim.Optimizer) for o in named.values())
        ):
            if self.optimizer_name is None:
                return {name if len(named) > 1 else None: opt for name, opt in named.items()}
            if self.optimizer_name not in named:
                raise ConfigError(
                    f"{WHERE} optimizer = {self.optimizer_name!r} is not an optimizer of the model"
                    f"{did_you_mean(self.optimizer_name, list(named))}; its optimizers: "
                    f"{', '.join(map(repr, named))}"
                )
            return {self.optimizer_name: named[self.optimizer_name]}
        if self.optimizer_name is not None:
            raise ConfigError(
                f"{WHERE} optimizer = {self.optimizer_name!r}: the model ({type(model).__name__}) has "
                "no optimizers by name (model.optimizers); leave optimizer out"
            )
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer):
            return {None: optimizer}
        lr = getattr(model, "lr", None)
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            self._proxy_model = model
            return {None: torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(lr))}
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

    def _restart(self, loop: Any, schedule: Schedule, key: str, pending: Mapping[str, Any]) -> None:
        """Start a saved schedule, which had ended, again over the steps this run adds (from
        the initial learning rates), and say so."""
        from epochal.torch import from_plain
        from epochal_schedule.build import build

        done = int(pending["steps"]) if self.interval == "batch" else loop.epoch
        length = self._length(loop, done)
        optimizer = schedule.optimizer
        for group, saved in zip(optimizer.param_groups, pending["param_groups"], strict=True):
            group.update(from_plain(saved))
            group["lr"] = group.get("initial_lr", group["lr"])
        schedule.scheduler = build(self.name, self.arguments, optimizer, WHERE, length)
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
        if self._proxy_model is not None and self.schedules:
            self._proxy_model.lr = self.schedules[0].optimizer.param_groups[0]["lr"]

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def before_training(self, loop: Any) -> None:
        """Make the schedulers (and on a resumed run restore their states and the rates).

        A fresh run starts afresh: no step counted, nothing seen from an earlier run.

        :raises ConfigError: ``optimizer`` names no optimizer of the model; a resumed state that
            schedules other optimizers.
        """
        from epochal_schedule.build import build

        self._seen, self._evaluated, self._proxy_model = False, set(), None
        optimizers = self._optimizers_of(loop.model)
        length = self._length(loop)
        self.schedules = [
            Schedule(name, opt, build(self.name, self.arguments, opt, WHERE, length))
            for name, opt in optimizers.items()
        ]
        pending, self._pending = self._pending, None
        if pending is not None and loop.resumed:
            saved = self._saved_by_name(pending)
            for schedule in self.schedules:
                self._restore(loop, schedule, saved[schedule.name])
        self._sync_proxy()

    def _saved_by_name(self, pending: Mapping[str, Any]) -> dict[str | None, Mapping[str, Any]]:
        """A saved state's schedules by optimizer name, refused unless they are this run's."""
        saved: dict[str | None, Mapping[str, Any]] = (
            dict(pending["optimizers"]) if "optimizers" in pending else {None: pending}
        )
        if set(saved) != {s.name for s in self.schedules}:

            def names(keys: Any) -> str:
                return ", ".join("the model's one optimizer" if k is None else repr(k) for k in keys)

            raise ConfigError(
                f"{WHERE} the resumed run's schedules were of the optimizers {names(saved)}, and this "
                f"run schedules {names(s.name for s in self.schedules)}: resume with the same "
                "optimizers and [plugins.lr_scheduler] optimizer, or start afresh without --resume"
            )
        return saved

    def _restore(self, loop: Any, schedule: Schedule, saved: Mapping[str, Any]) -> None:
        from epochal.torch import from_plain

        ended = self._check_length(loop, saved["scheduler"])
        if ended is not None:
            self._restart(loop, schedule, ended, saved)
        else:
            # Making a scheduler steps it once and rewrites the rates; the saved ones win.
            schedule.scheduler.load_state_dict(from_plain(saved["scheduler"]))
            for group, rates in zip(schedule.optimizer.param_groups, saved["param_groups"], strict=True):
                group.update(from_plain(rates))
        schedule.steps = int(saved["steps"])
        if getattr(loop.model, "optimizer_steps", 0):
            # the optimizer stepped before the checkpoint: what torch's step wrapper records,
            # so that a scheduler that had not stepped yet (a run saved at an epoch's last
            # batch) does not warn that it steps before the optimizer
            schedule.optimizer._opt_called = True

    @hookimpl
    def after_evaluation(self, stream: str) -> None:
        """Note the stream evaluated (the monitored record's absence is an error only after it)."""
        self._evaluated.add(stream)

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        """With ``interval = "batch"``: log the rate and step after each step of the optimizer
        (each schedule after its own optimizer's steps)."""
        if self.interval != "batch":
            return
        model = loop.model
        names = getattr(model, "stepped_optimizers", None)
        stepped = getattr(model, "optimizer_stepped", True)
        for schedule in self.schedules:
            if not (stepped if names is None or schedule.name is None else schedule.name in names):
                continue
            schedule.steps += 1
            if schedule.steps % self.frequency == 0:
                self._step(loop, schedule)

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        """With ``interval = "epoch"``: log the epoch's rate and step (after evaluation)."""
        if self.interval == "epoch" and loop.epoch % self.frequency == 0:
            for schedule in self.schedules:
                self._step(loop, schedule)

    def _step(self, loop: Any, schedule: Schedule) -> None:
        optimizer = schedule.optimizer
        if self.log:
            row = loop.log.current_row
            key = "lr" if schedule.name is None else f"lr.{schedule.name}"
            for i, group in enumerate(optimizer.param_groups):
                row[key if i == 0 else f"{key}.group{i}"] = float(group["lr"])
        if self._proxy_model is not None:
            optimizer.step()  # a no-op (no gradients) that tells torch the optimizer stepped
        if self.plateau:
            row = loop.log.current_row
            value = row.get(self.monitor)
            if value is None:
                # No value in this row (an epoch without evaluation): no step, rather than a step
                # on the previous evaluation's value, which would count as "no improvement".
                self._check_monitor(loop, row)
                return
            self._seen = True
            schedule.scheduler.step(float(value))
        else:
            schedule.scheduler.step()
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
        """Each scheduler's state, its optimizer's rates and the steps counted:
        ``{"scheduler", "param_groups", "steps"}`` for one optimizer, ``{"optimizers": {name:
        ...}}`` for several."""
        from epochal.torch import to_plain
        from epochal_schedule.build import hyperparameters

        if not self.schedules:
            return dict(self._pending) if self._pending is not None else {}
        states = {
            schedule.name: {
                "scheduler": to_plain(schedule.scheduler.state_dict()),
                "param_groups": to_plain(hyperparameters(schedule.optimizer)),
                "steps": schedule.steps,
            }
            for schedule in self.schedules
        }
        if None in states:
            return states[None]
        return {"optimizers": states}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep a saved state until before_training makes the schedulers."""
        if not state:
            return
        entries = state.get("optimizers") if "optimizers" in state else {None: state}
        if not isinstance(entries, Mapping) or not entries:
            raise PluginError("plugin 'lr_scheduler': saved state's optimizers must be a table by name")
        for name, entry in entries.items():
            missing = {"scheduler", "param_groups", "steps"} - set(
                entry if isinstance(entry, Mapping) else ()
            )
            if missing:
                which = "" if name is None else f" of optimizer {name!r}"
                raise PluginError(f"plugin 'lr_scheduler': saved state{which} lacks {sorted(missing)}")
        self._pending = state
