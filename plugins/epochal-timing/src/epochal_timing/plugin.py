"""The ``timing`` plugin: where the wall time of a run goes, per stage and per plugin per hook.

Ancestors: Blocks' ``Timing``, emloop's epoch profile, Ignite's ``HandlersTimeProfiler``.

Stages: ``read_data`` (waiting for the train stream between batches), ``train_step`` (the model's
step), ``eval.<stream>`` (iterating an eval stream and its ``eval_step``), and every hook, in
total (``hook.<hook>``) and per plugin (``plugin.<name>.<hook>``). It answers "which plugin slows
my loop?".

How: when training starts, every hook implementation of the *other* plugins is replaced by a
small generated wrapper that adds its wall time (``time.perf_counter``) to a counter, and the
loop's compiled hook callers are rebuilt; the originals are put back when training ends. The
batch stages come from timing's own hooks, which run first in ``before_batch`` and last in
``after_batch``: the time between them minus the other plugins' batch hooks is the train step,
the time from the end of one batch to the start of the next is reading data.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from types import CodeType
from typing import Any, ClassVar

from epochal import hookimpl
from epochal.console import render_table, terminal_width
from epochal.protocol import Rank, checked_options

#: hooks never wrapped: called before timing starts, or outside a run.
UNTIMED = frozenset({"resume_state", "register_commands"})
_EVAL_HOOKS = ("before_evaluation", "after_eval_batch", "after_evaluation")
_BATCH_HOOKS = ("before_batch", "after_batch")


def make_timer(
    function: Callable[..., Any], argnames: tuple[str, ...], cell: list[Any]
) -> Callable[..., Any]:
    """A function calling *function* with *argnames*, adding its wall time (s) and a call to *cell*.

    It takes the same positional arguments as *function* (pluggy and epochal's compiled callers
    pass the arguments an implementation declares, positionally). Its ``epochal_timer`` attribute,
    ``(function, cell)``, lets epochal's compiled hook callers do the same timing inline, without
    this wrapper's call.
    """
    namespace: dict[str, Any] = {"_f": function, "_pc": time.perf_counter, "_cell": cell}
    exec(_timer_code(tuple(argnames)), namespace)
    timed: Callable[..., Any] = namespace["timed"]
    timed.__wrapped__ = function  # type: ignore[attr-defined]
    timed.epochal_timer = (function, cell)  # type: ignore[attr-defined]
    timed.__name__ = getattr(function, "__name__", "timed")
    return timed


@functools.lru_cache(maxsize=256)
def _timer_code(argnames: tuple[str, ...]) -> CodeType:
    """The code of :func:`make_timer`'s wrapper for *argnames*, compiled once per signature
    (a run wraps every hook implementation: compiling each was ~30 µs, running the code 0.2)."""
    args = ", ".join(argnames)
    lead = f"{args}, " if args else ""
    source = (
        f"def timed({lead}_f=_f, _pc=_pc, _cell=_cell):\n"
        "    t = _pc()\n"
        "    try:\n"
        f"        return _f({args})\n"
        "    finally:\n"
        "        _cell[0] += _pc() - t\n"
        "        _cell[1] += 1\n"
    )
    return compile(source, "<epochal timing wrapper>", "exec")


@checked_options("timing")
class Timing:
    """Record the wall time of every stage and of every plugin's hooks, per epoch and in total.

    :param records: write ``timing.*`` records (seconds) into the log row of every epoch.
    :param table: print a table of the totals to stderr when training ends (off by default: a
        profile is for when it is asked for, as ``epochal run --profile`` does); the records
        go into the log either way.
    :param per_plugin: time every other plugin's hooks (``timing.plugin.<name>.<hook>`` and
        ``timing.hook.<hook>``). When false, no hook is wrapped and ``train_step`` includes the
        other plugins' ``before_batch``/``after_batch`` time. None (the default): only when the
        table is asked for (``table = true``, ``epochal run --profile``): wrapping every hook
        costs each hook call, in every run that loads the plugin.
    """

    #: wall-clock records differ between any two runs: `epochal check-resume` leaves timing out.
    deterministic = False
    #: every rank times itself; the totals are gathered at the end and rank 0's table shows them
    #: per rank.
    rank: ClassVar[Rank] = "all"

    def __init__(self, records: bool = True, table: bool = False, per_plugin: bool | None = None) -> None:
        self.records = records
        self.table = table
        self.per_plugin = table if per_plugin is None else per_plugin
        self._pc = time.perf_counter
        self._wrapped: list[tuple[Any, Callable[..., Any]]] = []
        self._loop: Any = None
        self._reset()

    def _reset(self) -> None:
        """Zero every total: each run (fresh or resumed) times itself alone."""
        #: (plugin, hook) → [seconds, calls] since the last epoch record.
        self._cells: dict[tuple[str, str], list[Any]] = {}
        #: (plugin, hook) → [seconds, calls] over the run.
        self._totals: dict[tuple[str, str], list[Any]] = {}
        self._reset_interval()
        self._stages: dict[str, list[Any]] = {}
        self._started = 0.0
        self._mark = 0.0
        self._step_start = 0.0
        self._eval_start = 0.0
        self._eval_hooks = 0.0
        #: every rank's :meth:`summary` at the end of a run on several processes (else None).
        self.ranks: list[dict[str, Any]] | None = None

    def _reset_interval(self) -> None:
        self._read = self._step = 0.0
        self._batches = 0
        self._evals: dict[str, list[Any]] = {}
        self._interval_start = time.perf_counter()

    # -- wrapping -----------------------------------------------------------------------------

    def _wrap(self, loop: Any) -> None:
        pm = loop.plugin_set.pm
        for hook in loop.plugin_set.pm.hook.__dict__:
            if hook.startswith("_") or hook in UNTIMED:
                continue
            caller = getattr(pm.hook, hook)
            for impl in caller.get_hookimpls():
                if impl.plugin is self or impl.wrapper or impl.hookwrapper:
                    continue
                cell = self._cells.setdefault((impl.plugin_name, hook), [0.0, 0])
                original = impl.function
                impl.function = make_timer(original, tuple(impl.argnames), cell)
                self._wrapped.append((impl, original))
        loop.hooks.rebuild()

    def _unwrap(self) -> None:
        if not self._wrapped:
            return
        for impl, original in self._wrapped:
            impl.function = original
        self._wrapped = []
        if self._loop is not None:
            self._loop.hooks.rebuild()

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl(tryfirst=True)
    def before_training(self, loop: Any) -> None:
        """Wrap the other plugins' hooks (``per_plugin``) and start the clocks from zero."""
        self._unwrap()  # an earlier run that ended without after_training or on_error
        self._reset()
        self._loop = loop
        if self.per_plugin:
            self._wrap(loop)
        self._started = self._pc()
        self._reset_interval()

    @hookimpl(trylast=True)
    def before_epoch(self) -> None:
        """Mark the end of the epoch's start: reading the first batch begins."""
        self._mark = self._pc()

    @hookimpl(tryfirst=True)
    def before_batch(self) -> None:
        """The batch was read: count the wait for it and start the step's clock."""
        now = self._pc()
        if self._mark:
            self._read += now - self._mark
        self._step_start = now

    @hookimpl(trylast=True)
    def after_batch(self) -> None:
        """The batch is done (step and every batch hook): stop the step's clock."""
        now = self._pc()
        self._step += now - self._step_start
        self._batches += 1
        self._mark = now

    @hookimpl(tryfirst=True)
    def before_evaluation(self) -> None:
        """Start an eval stream's clock."""
        self._mark = 0.0
        self._eval_hooks = self._sum(_EVAL_HOOKS)
        self._eval_start = self._pc()

    @hookimpl(trylast=True)
    def after_evaluation(self, stream: str) -> None:
        """Stop an eval stream's clock (the other plugins' eval hooks are not counted)."""
        elapsed = self._pc() - self._eval_start - (self._sum(_EVAL_HOOKS) - self._eval_hooks)
        cell = self._evals.setdefault(stream, [0.0, 0])
        cell[0] += elapsed
        cell[1] += 1

    @hookimpl(tryfirst=True)
    def after_epoch(self, loop: Any) -> None:
        """Write the ``timing.*`` records of the interval since the previous record.

        It runs first so that plugins writing the row out in ``after_epoch`` see the records;
        the other plugins' ``after_epoch`` time is therefore counted in the next epoch's records.
        """
        self._mark = 0.0
        interval = self._close_interval()
        if self.records:
            row = loop.log.current_row
            for key, seconds in interval.items():
                row[f"timing.{key}"] = seconds

    @hookimpl(trylast=True)
    def after_training(self, loop: Any) -> None:
        """Put the hooks back, store the totals in ``log.status['timing']``, print the table.

        On several processes every rank's totals are gathered (``log.status['timing_ranks']``)
        and rank 0 prints the table with each stage's fastest and slowest rank.
        """
        self._finish(loop)
        world = getattr(loop, "world", None)
        if world is not None and world.distributed:
            self.ranks = world.all_gather_object(self.summary())
            loop.log.status["timing_ranks"] = self.ranks
            if not world.is_zero:
                return
        if self.table:
            print(self.format_table(terminal_width(sys.stderr)), file=sys.stderr, flush=True)

    @hookimpl
    def on_error(self, loop: Any) -> None:
        """Put the hooks back and store the totals."""
        self._finish(loop)

    # -- bookkeeping --------------------------------------------------------------------------

    def _sum(self, hooks: tuple[str, ...]) -> float:
        return sum(sec for (_, hook), (sec, _) in self._cells.items() if hook in hooks)

    def _add_stage(self, name: str, sec: float, calls: int) -> None:
        total = self._stages.setdefault(name, [0.0, 0])
        total[0] += sec
        total[1] += calls

    def _close_interval(self) -> dict[str, float]:
        """Seconds per stage, hook and plugin hook since the previous call; add them to the totals."""
        now = self._pc()
        batch_hooks = self._sum(_BATCH_HOOKS)
        step = self._step - batch_hooks if self.per_plugin else self._step
        out: dict[str, float] = {"epoch": (now - self._interval_start)}
        self._add_stage("read_data", self._read, self._batches)
        self._add_stage("train_step", step, self._batches)
        if self._batches:
            out["read_data"] = self._read
            out["train_step"] = step
        for stream, (sec, calls) in self._evals.items():
            out[f"eval.{stream}"] = sec
            self._add_stage(f"eval.{stream}", sec, calls)
        by_hook: dict[str, float] = {}
        for (plugin, hook), cell in self._cells.items():
            sec, calls = cell
            if not calls:
                continue
            by_hook[hook] = by_hook.get(hook, 0.0) + sec
            out[f"plugin.{plugin}.{hook}"] = sec
            total = self._totals.setdefault((plugin, hook), [0.0, 0])
            total[0] += sec
            total[1] += calls
            cell[0], cell[1] = 0.0, 0
        for hook, sec in by_hook.items():
            out[f"hook.{hook}"] = sec
        self._reset_interval()
        return out

    def _finish(self, loop: Any) -> None:
        if self._loop is None:
            return
        self._close_interval()
        self._unwrap()
        self._loop = None
        loop.log.status["timing"] = self.summary()

    def summary(self) -> dict[str, Any]:
        """Totals of this process's run: ``{"wall": s, "<stage>": {"seconds", "calls"}, ...}``."""
        wall = (self._pc() - self._started) if self._started else 0.0
        out: dict[str, Any] = {"wall": wall}
        for name, (sec, calls) in self._stages.items():
            out[name] = {"seconds": sec, "calls": calls}
        by_hook: dict[str, list[Any]] = {}
        for (plugin, hook), (sec, calls) in self._totals.items():
            out[f"plugin.{plugin}.{hook}"] = {"seconds": sec, "calls": calls}
            total = by_hook.setdefault(hook, [0.0, 0])
            total[0] += sec
            total[1] += calls
        for hook, (sec, calls) in by_hook.items():
            out[f"hook.{hook}"] = {"seconds": sec, "calls": calls}
        return out

    def format_table(self, width: int | None = None) -> str:
        """The totals as a table at most *width* columns wide: stages, then plugin hooks by time."""
        summary = self.summary()
        wall = summary.pop("wall")
        stages = [(k, v) for k, v in summary.items() if not k.startswith(("plugin.", "hook."))]
        plugins = sorted(
            ((k[len("plugin.") :], v) for k, v in summary.items() if k.startswith("plugin.")),
            key=lambda item: -item[1]["seconds"],
        )

        ranks = self.ranks or []

        def spread(key: str) -> tuple[str, ...]:
            if not ranks:
                return ()
            times = [(r[key]["seconds"], rank) for rank, r in enumerate(ranks) if key in r]
            if not times:
                return ("-", "-")
            (low, fast), (high, slow) = min(times), max(times)
            return (f"{low:.4f} (r{fast})", f"{high:.4f} (r{slow})")

        def row(key: str, name: str, entry: dict[str, Any]) -> tuple[str, ...]:
            seconds, calls = entry["seconds"], entry["calls"]
            mean = f"{seconds / calls * 1e6:.1f}" if calls else "-"
            share = f"{100 * seconds / wall:.1f}" if wall else "-"
            return (name, str(calls), f"{seconds:.4f}", mean, share, *spread(key))

        rows = [row(name, name, entry) for name, entry in stages]
        blank = ("",) * (6 if ranks else 4)
        if plugins:
            rows.append(("plugin hooks:", *blank))
            rows += [row("plugin." + name, "  " + name, entry) for name, entry in plugins]
        columns: tuple[str, ...] = ("stage / plugin.hook", "calls", "total s", "mean µs", "% wall")
        where = "in this process"
        if ranks:
            columns += ("min s (rank)", "max s (rank)")
            where = f"on rank 0 of {len(ranks)} (min/max: over the ranks)"
        return render_table(
            columns,
            rows,
            title=f"timing: {wall:.3f} s of training {where}",
            width=width or (130 if ranks else 100),  # a file or pipe: the table's own width
            numeric=tuple(range(1, len(columns))),
        )
