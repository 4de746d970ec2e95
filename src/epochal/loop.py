"""The main loop: epochs of training batches, evaluation streams, and a hook at every stage.

The ancestors are Blocks' ``MainLoop`` (the training log, the stop-at-boundary interrupts) and
emloop's ``MainLoop`` (named eval streams, epoch-0 evaluation, empty batch/stream policies).
The loop owns only the control flow and the state; every feature is a plugin.
"""

from __future__ import annotations

import signal
import sys
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from epochal import _rng, epoch_batches, evaluation, heldout, loop_state
from epochal._dispatch import blame, each_implementation, implementations
from epochal._options import Fraction, NonEmptyStr, NonNegativeInt, PositiveInt, Seed, check_options
from epochal.batch_rules import empty_rule
from epochal.data import ShardOrder
from epochal.distributed.strategy import strategy_for
from epochal.distributed.world import World, current_world, peer_lost
from epochal.empty import EmptyData
from epochal.errors import ConfigError, EpochalError
from epochal.estimates import limit_ends_epoch, stepping_batches
from epochal.evaluation import batch_interval, due, due_inside, next_point, schedule
from epochal.log import TrainingLog
from epochal.loop_state import STATE_FORMAT as STATE_FORMAT  # re-exported: plugins read it here
from epochal.model import Model, check_model, check_outputs
from epochal.plugins import PluginSet, compose
from epochal.stopping import install_handlers, restore_handlers
from epochal.tracing import HookTracer, trace_target_from_env
from epochal.triggers import check_condition_streams

Policy = Literal["error", "warn", "ignore"]
#: the options of a run a configuration's ``[loop]`` sets (their annotations are the schema).
OPTIONS = (
    "max_epochs", "max_iterations", "min_epochs", "min_steps", "seed", "eval_every_n_epochs",
    "eval_every_n_batches", "epoch_size", "eval_at_start", "test_streams", "test_weights",
    "on_empty_batch", "on_empty_stream", "run_dir", "uneven_shards", "shard_order",
)  # fmt: skip


#: what next() gives for a stream that has ended.
_END = object()
#: the keys of ``log.status`` that say how a run ended: a resumed run starts without them.
_OUTCOME = ("error", "finish_reason", "isolated_plugins", "test_weights")


class Loop:
    """Runs training epochs over a train stream, evaluates eval streams, calls the hooks.

    :param model: an object following the :class:`Model` protocol.
    :param data: ``"train"`` → training stream, any other name → evaluation stream. A stream is
        an iterable iterated afresh each epoch, or a zero-argument callable returning one.
    :param plugins: a :class:`~epochal.plugins.PluginSet` (from ``load_plugins``), or plugin
        objects by name in call order, or None.
    :param max_epochs: stop after this many epochs (None: no limit).
    :param max_iterations: stop after this many training batches (None: no limit); on an
        epoch's last batch, that epoch finishes first (:func:`epochal.estimates.limit_ends_epoch`).
    :param min_epochs: a plugin's stop request (early stopping, ``finish_after``) made before this
        many epochs are done is deferred until then (Lightning's ``min_epochs``); limits and
        signals are not.
    :param min_steps: likewise, until this many training batches are done.
    :param seed: seed Python's, numpy's (and torch's) global generators at the start of a fresh
        run (None: leave them alone).
    :param eval_every_n_epochs: evaluate every eval stream after every n-th epoch (0: never); a
        mapping ``stream → n`` gives each stream its own schedule (streams not named: every epoch).
    :param eval_every_n_batches: evaluate inside the epochs scheduled instead: every n batches,
        or a fraction in (0, 1] of the epoch; with ``eval_every_n_epochs=0`` every n batches of
        the run (:func:`epochal.evaluation.batch_interval`).
    :param epoch_size: an epoch is this many training batches (None: one pass over the train
        stream). The train stream is then iterated on across epochs, as an endless stream needs;
        it restarts only when it ends.
    :param eval_at_start: evaluate every eval stream before the first epoch (epoch 0).
    :param test_streams: streams evaluated only once training ends (:mod:`epochal.heldout`).
    :param test_weights: with the ``last`` weights, or the ``best`` saved ones.
    :param on_empty_batch: what an empty batch does: ``error``, ``warn`` (then skip) or
        ``ignore`` (skip).
    :param on_empty_stream: what a stream yielding no batch does: ``error``, ``warn``, ``ignore``.
    :param run_dir: where plugins keep this run's files (checkpoints, logs). ``epochal run``
        gives each fresh run its own directory under it (``loop.run_dir``; this one stays
        ``loop.run_root``).
    :param resume: ask the plugins for a state to resume from (``epochal run --resume``): True
        or ``"latest"`` (the newest complete checkpoint; an error if none), ``"auto"`` (the newest
        if any, else a fresh start), or a checkpoint path. Plugins read the mode from
        ``loop.resume``; the ``resume_state`` hook gets ``resume`` as a bool.
    :param config: the run configuration, for plugins that record it.
    :param handle_signals: install the SIGINT/SIGTERM handlers while running (main thread only).
    :param trace_plugins: trace every hook call: ``"-"`` to stderr, else a JSON-lines file path
        (default: from ``EPOCHAL_TRACE_PLUGINS``).
    :param world: this process's place among the processes training together (default: the
        world :func:`epochal.distributed.init_from_env` joined; one process when none).
    :param uneven_shards: on several processes, what to do when the train stream's examples
        cannot be shared evenly by the processes: ``pad`` (the default, as torch's
        ``DistributedSampler`` does: repeat the first examples of each epoch's order, said once),
        ``drop`` (leave the remainder out) or ``error`` (an error before training).
        Evaluation streams are shared out whole (the ranks' parts may differ by one batch).
    :param shard_order: how each epoch's order of the examples is derived: ``epochal`` (its own
        permutation of ``(seed, epoch)``), ``distributed_sampler`` (exactly
        ``torch.utils.data.DistributedSampler``'s, on one process or several:
        :func:`epochal.distributed.sharding.in_shard_order`) or ``torch`` (a DataLoader draws it
        from torch's global generator when its epoch starts, as in a plain PyTorch loop; one
        process: :class:`epochal.torch.LoaderStream`).
    """

    def __init__(
        self,
        model: Model,
        data: Mapping[str, Any],
        *,
        plugins: PluginSet | Mapping[str, object] | None = None,
        max_epochs: NonNegativeInt | None = None,
        max_iterations: NonNegativeInt | None = None,
        min_epochs: NonNegativeInt = 0,
        min_steps: NonNegativeInt = 0,
        seed: Seed | None = None,
        eval_every_n_epochs: NonNegativeInt | Mapping[str, NonNegativeInt] = 1,
        eval_every_n_batches: PositiveInt | Fraction | None = None,
        eval_at_start: bool = False,
        test_streams: list[str] | None = None,
        test_weights: Literal["last", "best"] = "last",
        epoch_size: NonNegativeInt | None = None,
        on_empty_batch: Policy = "error",
        on_empty_stream: Policy = "error",
        run_dir: NonEmptyStr | Path | None = None,
        resume: bool | str = False,
        config: Mapping[str, Any] | None = None,
        handle_signals: bool = True,
        trace_plugins: str | None = None,
        world: World | None = None,
        uneven_shards: Literal["error", "drop", "pad"] = "pad",
        shard_order: ShardOrder = "epochal",
    ) -> None:
        #: the file the run configuration was read from (None: not from a file).
        self.config_file: str | None = getattr(config, "source", None)
        self._source = self.config_file
        check_model(model, data, self._source)
        if "train" not in data:
            raise ConfigError(
                f"the data mapping has no 'train' stream (it has: {', '.join(data) or 'nothing'})"
            )
        options = {key: value for key, value in locals().items() if key in OPTIONS}
        where = f"{self._source}: [loop]" if self._source else "Loop()"
        check_options("loop", Loop, options, where, ConfigError, keys=OPTIONS)
        #: rank and size of the run's processes (``World()``: one process).
        self.world = world if world is not None else current_world()
        self.model = model
        #: what differs on several processes (sharding, reductions, agreed stops).
        self.strategy = strategy_for(self.world)
        #: the empty-batch and empty-stream policies (and the streams whose len() is 0, as given).
        self._empty = EmptyData(data)
        self.data = epoch_batches.prepare(data, seed, shard_order, uneven_shards, self.strategy, self._source)
        self._plugin_set = plugins if isinstance(plugins, PluginSet) else compose(plugins or {})
        self._plugin_set.check_dependencies()
        #: plugin instances by name, in call order.
        self.plugins: dict[str, object] = self._plugin_set.plugins
        self.max_epochs = max_epochs
        self.max_iterations = max_iterations
        self.seed = seed
        #: the streams evaluated only when training ends, with the ``test_weights``.
        self.test_streams = heldout.check_streams(test_streams or [], self.data, where)
        self.test_weights = test_weights
        self.eval_every_n_epochs = eval_every_n_epochs
        streams = self._schedule(eval_every_n_epochs)  # checked now, read each epoch (a plugin may change it)
        self.eval_at_start = eval_at_start
        self.epoch_size = epoch_size or None
        self.eval_every_n_batches = every = eval_every_n_batches
        #: evaluate after every this many batches of an epoch (None: at epoch ends).
        self.eval_interval = batch_interval(every, self.epoch_size, self.data["train"], streams, where)
        self._sized = epoch_batches.SizedEpochs()
        check_condition_streams(self._plugin_set.triggers, list(self.data), self._source)
        self.on_empty_batch = on_empty_batch
        self.on_empty_stream = on_empty_stream
        #: this run's files; ``epochal run`` makes it ``run_root/version_N`` (:mod:`epochal.run_dirs`).
        self.run_dir = self.run_root = Path(run_dir) if run_dir is not None else None
        self.resume = resume
        self.config = dict(config or {})
        self.handle_signals = handle_signals
        self.trace_plugins = trace_plugins if trace_plugins is not None else trace_target_from_env()
        #: the command line that started this run, without ``--resume`` (set by ``epochal run``;
        #: empty when the loop is run from Python): plugins append ``--resume`` to say how to go on.
        self.command: list[str] = []
        #: a fresh id for every run, resumed or not.
        self.run_id = uuid.uuid4().hex
        #: training epochs completed.
        self.epoch = 0
        #: training batches completed.
        self.iteration = 0
        self.log = TrainingLog(lambda: self.iteration)
        #: true once a saved state was loaded; ``resumed_from`` is the run that saved it.
        self.resumed = False
        self.resumed_from: str | None = None
        #: ``on_interrupt`` ran to its end (a checkpoint plugin saved there): a third SIGINT
        #: after it cut only the wind-down short.
        self.interrupt_hooks_ran = False
        #: training ended and ``after_training`` started (a third SIGINT now cuts only that short).
        self.training_ended = False
        #: ``after_training`` ran to its end: the run's outcome is settled, a signal only noted.
        self.wound_down = False
        self._ran = False
        #: where the resumed state came from, as the plugin that gave it says (e.g. a path).
        self.resumed_source: str | None = None
        #: the plugin whose ``resume_state`` gave the state (None: none, or not known here).
        self._resumed_by: str | None = None
        #: the plugin whose hook raised the error that ended the run (None: model or data).
        self.error_plugin: str | None = None
        #: plugin states found in a loaded state for plugins that are not part of this run.
        self.orphan_plugin_states: dict[str, Any] = {}
        #: the metrics of the last evaluation of each stream.
        self.last_metrics: dict[str, dict[str, float]] = {}
        self._in_epoch = False
        #: the iteration at which the current epoch started (``batch_in_epoch`` is counted from it).
        self._epoch_start = 0
        #: when training stops, and why (on several processes: as every rank agreed).
        self.stopping = self.strategy.make_stop()
        self.stopping.minimum(min_epochs, min_steps, (max_epochs, max_iterations), where)
        self.stopping.progress = lambda: (self.epoch, self.iteration)
        added = self.strategy.hook_objects(self.stopping)
        for name, hooks in added.items():
            self._plugin_set.pm.register(hooks, name=name)
        if added:
            self._plugin_set.hooks.rebuild()
        #: which best state ``test_weights = "best"`` loads, as the plugin giving it says.
        self.best_source = heldout.check_best(self, where)
        self.strategy.distribute(model)
        attach = getattr(model, "attach", None)
        if callable(attach):
            attach(self)

    def _schedule(self, every: int | Mapping[str, int]) -> dict[str, int]:
        """``[loop] eval_every_n_epochs`` as ``stream → n`` (0: never)."""
        where = f"{self._source}: [loop] eval_every_n_epochs" if self._source else "eval_every_n_epochs"
        return schedule(every, self.eval_streams, where)

    # -- public API for plugins ---------------------------------------------------------------

    @property
    def hooks(self) -> Any:
        """The compiled hook callers (``loop.hooks.after_batch(loop, batch, outputs)``)."""
        return self._plugin_set.hooks

    @property
    def plugin_set(self) -> PluginSet:
        """The run's plugin set (pluggy manager, listing, call order per hook)."""
        return self._plugin_set

    @property
    def in_epoch(self) -> bool:
        """True between an epoch's ``before_epoch`` and its end (also when resumed mid-epoch)."""
        return self._in_epoch

    @property
    def batch_in_epoch(self) -> int:
        """Training batches completed in the current epoch."""
        return self.iteration - self._epoch_start

    @property
    def estimated_stepping_batches(self) -> float:
        """The optimizer steps the whole run takes (``math.inf``: unbounded); see :mod:`epochal.estimates`."""
        return stepping_batches(self)

    def request_stop(self, reason: str, *, agreed: bool = False) -> None:
        """End training cleanly at the next batch boundary, then call ``after_training``.

        On several processes a request is a local event: every rank stops together one batch
        later (or at the epoch end when asked during ``after_epoch``), and the reason is agreed.
        ``agreed=True`` says that every rank makes this same request at this same point (it
        depends only on the loop's counters or on values reduced across ranks): the run then
        stops here, as on one process.
        """
        self.stopping.request(reason, agreed)

    @property
    def signal_received(self) -> int | None:
        """The number of the last SIGINT/SIGTERM received while running (None if none).

        On several processes, once training ended: the signal every rank agreed ended it (a
        signal to any rank counts).
        """
        return self.stopping.signal_received

    @property
    def stop_requested(self) -> str | None:
        """The reason given to the first :meth:`request_stop` (None if none).

        On several processes: the agreed reason once every rank agreed to stop, else this
        process's own request.
        """
        return self.stopping.reason or self.stopping.requested

    def evaluate(self, stream: str) -> dict[str, float]:
        """Run the evaluation stream *stream*; log and return its metrics.

        A metric is the batch-size-weighted mean of the step results of that name, unless the
        model's ``end_evaluation`` returns a value for it over the whole stream. A batch weighs
        its examples: the model's ``batch_size(batch)`` if it has one, else
        :func:`epochal.data.batch_size` (the leading dimension of the first array found).
        """
        return evaluation.evaluate(self, stream)

    @property
    def eval_streams(self) -> list[str]:
        """The names of the streams evaluated during training (not ``train``, not ``test_streams``)."""
        return [name for name in self.data if name != "train" and name not in self.test_streams]

    # -- running ------------------------------------------------------------------------------

    def run(self) -> TrainingLog:
        """Train until a limit, a stop request or a signal; return the training log.

        An exception from the model, the data or a hook calls ``on_error`` on every plugin and
        is re-raised. A loop runs once: to train on, make a new one and load this one's state.

        :raises EpochalError: when the loop ran already.
        """
        if self._ran:
            raise EpochalError(
                "Loop.run() was called before: a loop runs once (its plugins saw its training end). "
                "To train on, make a new Loop and load this one's state: "
                "new.load_state_dict(loop.state_dict()), with a higher max_epochs"
            )
        self._ran = True
        previous = install_handlers(self._on_signal) if self.handle_signals else {}
        tracer = HookTracer(self.trace_plugins) if self.trace_plugins else None
        if tracer is not None:
            self.hooks.trace(tracer)
        try:
            self._start()
            self._train()
            self._finish(heldout.evaluate_after_training(self))
        except BaseException as error:
            self._fail(error)
            raise
        finally:
            restore_handlers(previous)
            for stream in self.data.values():  # a DataLoader's workers end with the training
                close = getattr(stream, "close_workers", None)
                if callable(close):
                    close()
            if tracer is not None:
                self.hooks.trace(None)
                tracer.close()
        return self.log

    def _resume_state(self) -> Mapping[str, Any] | None:
        """The state to resume from, as the plugins give it (rank 0's, on several processes)."""
        if not self._plugin_set.implements("resume_state"):
            if self.resume:
                raise ConfigError(
                    "cannot resume: no installed plugin restores checkpoints "
                    "(from a clone of epochal: pip install plugins/epochal-checkpoint; "
                    "or enable the 'checkpoint' plugin)"
                )
            return None
        pm = self._plugin_set.pm
        impls = implementations(pm, "resume_state")
        state: Mapping[str, Any] | None = None
        if any(impl.wrapper or impl.hookwrapper for impl in impls):
            state = pm.hook.resume_state(loop=self, resume=bool(self.resume))
        else:  # pluggy's order, first result: which plugin gave it is known
            for name, call in each_implementation(pm, "resume_state", loop=self, resume=bool(self.resume)):
                try:
                    state = call()
                except Exception as error:
                    blame(error, name, "resume_state")
                    raise
                if state is not None:
                    self._resumed_by = name
                    break
        if state is not None and (problems := self.check_state(state)):
            raise EpochalError(f"cannot resume from {self._resumed_what()}: {'; '.join(problems)}"[:2000])
        return state

    def _resumed_what(self) -> str:
        """What the resumed state came from, as its plugin said (for one-line errors)."""
        source = self.resumed_source or "the state"
        return f"{source} (given by plugin {self._resumed_by!r})" if self._resumed_by else source

    def _start(self) -> None:
        evaluated = self._schedule(self.eval_every_n_epochs)
        self._empty.check_sized(self.on_empty_stream, evaluated, self.eval_at_start)
        state = self.strategy.resume_state(self._resume_state)
        if state is not None:
            try:
                self.load_state_dict(state)
            except EpochalError:
                raise
            except Exception as error:  # checked, yet the model or a stream refused it
                why = " ".join(f"{type(error).__name__}: {error}".split())
                raise EpochalError(f"cannot resume from {self._resumed_what()}: {why}"[:2000]) from error
        elif self.seed is not None and not self.resumed:
            _rng.seed_all(self.seed)
        status = self.log.status
        for outcome in _OUTCOME:  # the saved run's, not this one's (a resume from a failed run)
            status.pop(outcome, None)
        status.update(status="running", run_id=self.run_id, resumed_from=self.resumed_from)
        hooks = self.hooks
        if hooks.before_training is not None:
            hooks.before_training(self)
        if self.resumed and hooks.on_resumption is not None:
            hooks.on_resumption(self)
        if self.eval_at_start and not self.resumed:
            for stream in self.eval_streams:
                self.evaluate(stream)

    def _train(self) -> None:
        stopping = self.stopping
        while not stopping.done:
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                stopping.decide(f"max_epochs={self.max_epochs} reached")
                break
            if not self._run_epoch() or stopping.release() or stopping.finish_epoch:
                break

    def _run_epoch(self) -> bool:
        """Run (the rest of) one epoch; return whether it completed."""
        hooks = self.hooks
        if not self._in_epoch:
            self._in_epoch, self._epoch_start = True, self.iteration
            if hooks.before_epoch is not None:
                hooks.before_epoch(self)
        # An int limit: comparing ints is cheaper than comparing an int with float("inf").
        limit = self.max_iterations if self.max_iterations is not None else sys.maxsize
        stopping = self.stopping
        if self.iteration >= limit:
            stopping.decide(f"max_iterations={self.max_iterations} reached")
            return False
        # One comparison per batch for both ends of the epoch's batch loop: the iteration limit,
        # and a decided stop (which sets halt to -1).
        stopping.arm(limit)
        if stopping.reason is not None:  # asked in before_epoch (or earlier): not one batch more
            return False
        train_step = self.model.train_step
        started = self.batch_in_epoch
        interval = self.eval_interval  # at: the iteration of the next in-epoch evaluation
        at = next_point(
            interval, self._schedule(self.eval_every_n_epochs), self.epoch, self._epoch_start, self.iteration
        )
        # The hot path: per batch, only what a batch needs (measured by bench/loop_overhead.py).
        kind: type | None = None
        empty: Any = None  # whether a batch is empty: one check chosen per batch type
        batches = self._train_batches()
        for batch in batches:
            if type(batch) is not kind:
                kind = type(batch)
                empty = empty_rule(kind)  # None: a type without len, never empty
            if empty is not None and empty(batch) and self._empty_batch("train"):
                continue
            before = hooks.before_batch  # read per batch: a hook may rebuild the hooks
            if before is not None:
                before(self, batch)
            outputs = train_step(batch)
            self.iteration = iteration = self.iteration + 1  # batch_in_epoch is iteration - _epoch_start
            if iteration >= at:  # before after_batch: its plugins see the evaluation's rows
                at += interval or 1
                for stream in due_inside(self._schedule(self.eval_every_n_epochs), self.epoch + 1):
                    self.evaluate(stream)
            after = hooks.after_batch
            if after is not None:
                try:
                    after(self, batch, outputs)
                except Exception:
                    check_outputs(outputs, "train_step")  # the model's fault, not the plugin's
                    raise
            if self.iteration >= stopping.halt:
                if not stopping.release():  # a deferred stop's min_steps, else the limit
                    stopping.decide(f"max_iterations={self.max_iterations} reached")
                # at an epoch's last batch the epoch finishes, once its stream has ended
                if not limit_ends_epoch(self, limit) or next(batches, _END) is not _END:
                    return False
                break
        if self.batch_in_epoch == 0 and started == 0:
            self._empty_stream("train")
        self.epoch += 1
        self._in_epoch = False
        self.log.status.update(epochs_done=self.epoch, iterations_done=self.iteration)
        row = self.log.current_row
        row["epochs_done"] = self.epoch
        end_train = getattr(self.model, "end_train_epoch", None)  # metric objects over the epoch
        if callable(end_train) and self.batch_in_epoch:
            for key, value in end_train().items():
                row[f"train.{key}"] = value
        for stream in () if interval else due(self._schedule(self.eval_every_n_epochs), self.epoch):
            self.evaluate(stream)  # with an interval, evaluations are inside the epoch
        if hooks.after_epoch is not None:
            hooks.after_epoch(self)
        if self.batch_in_epoch == 0 and self.max_epochs is None:
            stopping.decide("the train stream is empty")
            return False
        return True

    def _finish(self, evaluated: bool) -> None:
        """Training ended: its status and reason, then ``on_interrupt`` and ``after_training``.

        *evaluated*: the held-out streams were evaluated (or there are none).
        """
        hooks = self.hooks
        status = self.log.status
        status.update(epochs_done=self.epoch, iterations_done=self.iteration)
        if self._plugin_set.isolated:
            status["isolated_plugins"] = dict(self._plugin_set.isolated)
        reason = self.stopping.reason
        signum = self.stopping.settle(self)
        if signum is not None and evaluated and (own := self.stopping.own_end(self)) is not None:
            # the signal came too late to cut anything short: the run finished
            name = signal.Signals(signum).name
            status.update(status="finished", finish_reason=f"{own} ({name} received as training ended)")
        elif signum is not None:
            name = signal.Signals(signum).name
            status.update(status="interrupted", finish_reason=reason or name)
            if hooks.on_interrupt is not None:
                hooks.on_interrupt(self, signum)
            self.interrupt_hooks_ran = True
        else:
            status.update(status="finished", finish_reason=reason or "completed")
        self.training_ended = True
        if hooks.after_training is not None:
            hooks.after_training(self)
        self.wound_down = True

    def _fail(self, error: BaseException) -> None:
        self.error_plugin = getattr(error, "epochal_plugin", None)
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        lost = peer_lost(error) if self.world.distributed else None  # torch's text, in one line
        reason = error if lost is None else lost
        self.log.status.update(status=status, error=f"{type(reason).__name__}: {reason}")
        if self._plugin_set.isolated:
            self.log.status["isolated_plugins"] = dict(self._plugin_set.isolated)
        for name, call in each_implementation(self._plugin_set.pm, "on_error", loop=self, error=error):
            try:
                call()
            except Exception as secondary:  # one plugin's failure must not hide the others
                blame(secondary, name, "on_error")
                warnings.warn(
                    f"plugin {name!r} raised in on_error: {type(secondary).__name__}: {secondary}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    # -- streams and policies -----------------------------------------------------------------

    def _train_batches(self) -> Iterator[Any]:
        """The rest of this epoch's training batches."""
        if self.epoch_size is None:
            return self._iterate("train", skip=self.batch_in_epoch)
        return self._sized.rest(self.data["train"], self.epoch_size, self.batch_in_epoch)

    def _iterate(self, stream: str, skip: int = 0) -> Iterator[Any]:
        return epoch_batches.iterate(self.data[stream], skip)

    def _empty_batch(self, stream: str) -> bool:
        """Apply the empty-batch policy; return True to skip the batch."""
        self._empty.batch(self.on_empty_batch, stream, self.epoch, self.iteration)
        return True

    def _empty_stream(self, stream: str) -> None:
        self._empty.stream(self.on_empty_stream, stream, self.epoch)

    # -- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.wound_down:  # the final hooks ran (a final checkpoint is written): outcome settled
            name = signal.Signals(signum).name
            message: str | None = f"epochal: {name} received after training ended; the run's outcome stands"
        else:
            message = self.stopping.interrupt(signum)
        if message is not None:
            print(message, file=sys.stderr, flush=True)

    # -- state --------------------------------------------------------------------------------

    def state_dict(self, log_rows: bool = True, model: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs: counters, log, model, RNG, streams, plugin states.

        Leaves are numpy arrays, numbers, strings, None, lists and dicts (no pickle needed).
        ``log_rows=False`` leaves the log's rows out, for a saver that writes them incrementally
        from ``loop.log.row_map``; ``model=False`` leaves ``model`` None, for a saver that
        writes the model's state its own way (sharded, by every rank).
        """
        return loop_state.capture(self, log_rows=log_rows, model=model)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`; the run continues where it was saved."""
        loop_state.restore(self, state)

    def check_state(self, state: Any) -> list[str]:
        """Every reason this loop cannot continue from *state* (empty: it fits); nothing changes.

        The format and keys of :meth:`state_dict`'s states, the number of processes (a state
        saved in the middle of an epoch by another number of them cannot continue here), and
        the model: its ``check_state(state)`` when it has one (``TorchModel`` does), else the
        keys, array shapes and dtypes of its ``state_dict()``. A checkpoint plugin calls it on a
        state it read, to refuse (or skip) one that does not fit before returning it from
        ``resume_state``; the loop calls it too on the state a plugin returns.
        """
        return loop_state.problems(self, state)
