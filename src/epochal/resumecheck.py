"""``epochal check-resume``: does a run interrupted at batch N and resumed match a straight run?

Five runs of the same configuration, each in its own temporary run directory:

1. a straight run;
2. a run stopped right after batch N (by default the batch inside an epoch nearest to half way:
   a resume in the middle of an epoch is the harder one, and a boundary is never chosen while an
   epoch has a batch inside it) the way SIGTERM from a scheduler stops it (the loop takes the
   path its signal handler starts, without a signal being sent or announced: the batch
   finishes, ``on_interrupt`` and ``after_training`` run and the checkpoint plugin saves);
3. a run started with ``--resume`` from what that run saved;
4. a run ended right after an epoch's end (the one nearest to half way), once every plugin's
   ``after_epoch`` ran, the way ``kill -9`` ends it there: no ``on_interrupt``, nothing more
   saved (the writes in flight finish, as they would have before the kill). A plugin that
   changes its state in ``after_epoch`` after the checkpoint was taken passes the SIGTERM check
   (its interrupt checkpoint comes later) and fails this one;
5. a run started with ``--resume auto`` from what that run saved (a fresh start where no
   checkpoint was saved by then, said in the report).

The final model state, the training-log rows, the counters, the RNG states and every plugin's
state of runs 3 and 5 must be bitwise equal to the straight run's; the first difference is
reported with its key path.

Plugins whose class says ``deterministic = False`` (wall-clock timings, say) cannot match and are
left out of all three runs; they are named in the report.
"""

from __future__ import annotations

import json
import math
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epochal._markers import hookimpl
from epochal.errors import ConfigError
from epochal.isolation import isolated, moved_options, output_options
from epochal.loop import Loop
from epochal.runner import build_loop


@dataclass
class ResumeReport:
    """The outcome of a resume check."""

    at: int
    iterations: int
    difference: str | None
    left_out: list[str] = field(default_factory=list)
    #: the training batches completed at each epoch end of the straight run.
    epoch_ends: list[int] = field(default_factory=list)
    #: the epoch after whose end run 4 was ended as ``kill -9`` ends it (None: not run).
    killed_after_epoch: int | None = None
    #: the batch run 5 resumed at (None: no checkpoint was saved by then: a fresh start).
    revived_at: int | None = None
    #: the first difference of run 5 from the straight run (None: none).
    kill_difference: str | None = None
    #: the plugin that saved and restored the checkpoints (the ``checkpoint`` plugin, or the one
    #: that provides it).
    saver: str = "checkpoint"

    @property
    def place(self) -> str:
        """Where batch :attr:`at` is: ``"batch 3 of epoch 2"`` or ``"the end of epoch 2"``."""
        start, epoch = 0, 1
        for end in self.epoch_ends:
            if self.at == end:
                return f"the end of epoch {epoch}"
            if self.at < end:
                break
            start, epoch = end, epoch + 1
        return f"batch {self.at - start} of epoch {epoch}"

    @property
    def ok(self) -> bool:
        """True when both resumed runs matched the straight run bitwise."""
        return self.difference is None and self.kill_difference is None


class InterruptAt:
    """Stops the run right after training batch *at* as the loop's SIGTERM handler would."""

    def __init__(self, at: int) -> None:
        self.at = at

    @hookimpl
    def after_batch(self, loop: Loop) -> None:
        if loop.iteration == self.at:
            # What Loop._on_signal does for SIGTERM, minus its "SIGTERM received" notice: the
            # user sent no signal, and check-resume says what it is doing in its own words. On
            # several processes every rank does it after the same batch: an agreed stop.
            loop.stopping.stop_as_signal(
                signal.SIGTERM, f"check-resume: stopped after batch {self.at} as SIGTERM would"
            )


_InterruptAt = InterruptAt


class Killed(BaseException):
    """What ends check-resume's fourth run: not an ``Exception``, so that no plugin saves on it."""


class KillAfterEpoch:
    """Ends the run right after epoch *epoch*'s end, once every plugin's ``after_epoch`` ran, as
    ``kill -9`` would end it there (a :class:`Killed`: plugins' ``on_error`` only wait for the
    writes in flight)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    @hookimpl(trylast=True)
    def after_epoch(self, loop: Loop) -> None:
        if loop.epoch == self.epoch:
            raise Killed(f"check-resume: ended after the end of epoch {self.epoch} as kill -9 would")


class ResumedAt:
    """Notes the batch a run resumed at (None: it did not resume)."""

    def __init__(self) -> None:
        self.at: int | None = None

    @hookimpl
    def on_resumption(self, loop: Loop) -> None:
        self.at = loop.iteration


class DumpState:
    """Writes what check-resume compares of the final state to *path* (rank 0; a pickle).

    On several processes ``loop.state_dict()`` is a collective: every rank runs this.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.resumed = ResumedAt()

    @hookimpl
    def on_resumption(self, loop: Loop) -> None:
        self.resumed.on_resumption(loop)

    @hookimpl(trylast=True)
    def after_training(self, loop: Loop) -> None:
        compared = _comparable(loop)
        if loop.world.is_zero:
            import pickle

            Path(self.path).write_bytes(pickle.dumps({"state": compared, "resumed_at": self.resumed.at}))


def epoch_ends(rows: Mapping[Any, Mapping[str, Any]]) -> list[int]:
    """The iterations of the log *rows* (iteration → row) that end an epoch (``epochs_done``)."""
    return sorted(int(i) for i, row in rows.items() if "epochs_done" in row)


def interruption_point(total: int, ends: Sequence[int]) -> int:
    """The default batch to interrupt after: the one nearest to ``total // 2`` (the earlier of
    two as near) that is inside an epoch, not at its end (*ends*); ``total // 2`` if every
    epoch has a single batch."""
    middle, boundaries = total // 2, set(ends)
    for distance in range(total):
        for candidate in (middle - distance, middle + distance):
            if 0 < candidate < total and candidate not in boundaries:
                return candidate
    return middle


def kill_point(ends: Sequence[int]) -> int:
    """The epoch (1-based) after whose end run 4 is ended: the end nearest half way through the
    run (the earlier of two as near), before the last epoch's where there is one."""
    if not ends:
        return 1
    middle = ends[-1] / 2
    candidates = range(1, len(ends)) if len(ends) > 1 else range(1, 2)
    return min(candidates, key=lambda epoch: (abs(ends[epoch - 1] - middle), epoch))


def saver_of(plugin_set: Any) -> str:
    """The plugin that saves this run's checkpoints: the one that provides ``checkpoint``, else
    the first that restores them (``resume_state``)."""
    provider = plugin_set.provider("checkpoint")
    if provider is not None:
        return str(provider)
    restoring = plugin_set.call_order("resume_state")
    return str(restoring[0]) if restoring else "checkpoint"


def _nondeterministic(plugin_set: Any) -> list[str]:
    return [name for name in plugin_set.plugins if not plugin_set.records[name].deterministic]


def _saver_needed(plugin_set: Any) -> None:
    if not plugin_set.implements("resume_state"):
        raise ConfigError(
            "check-resume needs a plugin that saves and restores checkpoints (resume_state), "
            "and none is loaded (from a clone of epochal: pip install plugins/epochal-checkpoint)"
        )


def _comparable(loop: Loop) -> dict[str, Any]:
    state = loop.state_dict()
    compared = {
        "epoch": state["epoch"],
        "iteration": state["iteration"],
        "model": state["model"],
        "log rows": state["log"]["rows"],
        "rng": state["rng"],
        "data": state["data"],
        "plugins": {name: entry["state"] for name, entry in state["plugins"].items()},
    }
    if "ranks" in state:  # several processes: every rank's RNG, stream and plugin states
        compared["ranks"] = state["ranks"]
    return compared


def check_resume(
    config: Mapping[str, Any],
    at: int | None = None,
    order: list[str] | None = None,
    disable: list[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> ResumeReport:
    """Run *config* straight, interrupted at batch *at* and resumed; compare bitwise.

    *say* is told, in a line each, which of the three runs starts.
    """
    from epochal.config import plugins_for

    disable = list(disable or [])
    say = say or (lambda line: None)
    probe = plugins_for(config, order, disable)  # its plugins, built: nothing trains or writes
    left_out = _nondeterministic(probe)
    _saver_needed(probe)
    places = output_options(probe, set(left_out))

    def _config_in(config: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
        return isolated(config, run_dir, places)

    with tempfile.TemporaryDirectory(prefix="epochal-check-resume-") as tmp:
        disable += left_out
        straight = build_loop(_config_in(config, Path(tmp) / "straight"), order, disable)
        say("check-resume: 1/5 straight run (in a temporary directory)")
        straight.run()
        total = straight.iteration
        ends = epoch_ends(dict(straight.log.rows()))
        at = interruption_point(total, ends) if at is None else at
        if not 0 < at < total:
            raise ConfigError(
                f"--at must be between 1 and {total - 1} (the straight run has {total} batches)"
            )
        stopped = build_loop(_config_in(config, Path(tmp) / "resumed"), order, disable)
        stopped.plugin_set.pm.register(_InterruptAt(at), name="epochal.check-resume")
        stopped.hooks.rebuild()
        say(
            f"check-resume: 2/5 the same run, stopped after batch {at} as SIGTERM stops it "
            "(no signal is sent)"
        )
        stopped.run()
        if stopped.iteration != at or stopped.log.status["status"] != "interrupted":
            raise ConfigError(
                f"the interrupted run did not stop at batch {at} (it stopped at {stopped.iteration}: "
                f"{stopped.log.status['finish_reason']}); is another plugin stopping it earlier?"
            )
        resumed = build_loop(_config_in(config, Path(tmp) / "resumed"), order, disable, resume=True)
        say(f"check-resume: 3/5 resuming it from its checkpoint at batch {at}, to the end")
        resumed.run()
        expected = _comparable(straight)
        difference = first_difference(expected, _comparable(resumed))
        epoch = kill_point(ends)
        killed = build_loop(_config_in(config, Path(tmp) / "killed"), order, disable)
        killed.plugin_set.pm.register(KillAfterEpoch(epoch), name="epochal.check-resume")
        killed.hooks.rebuild()
        say(f"check-resume: 4/5 the same run, ended after the end of epoch {epoch} as kill -9 ends it")
        try:
            killed.run()
        except Killed:
            pass
        else:
            raise ConfigError(
                f"the run to end after epoch {epoch} ended at batch {killed.iteration} by itself "
                f"({killed.log.status['finish_reason']}); is another plugin stopping it earlier?"
            )
        revived = build_loop(_config_in(config, Path(tmp) / "killed"), order, disable, resume="auto")
        resumed_at = ResumedAt()
        revived.plugin_set.pm.register(resumed_at, name="epochal.check-resume")
        revived.hooks.rebuild()
        say("check-resume: 5/5 resuming it from its latest complete checkpoint, to the end")
        revived.run()
        kill_difference = first_difference(expected, _comparable(revived))
    report = ResumeReport(at, total, difference, left_out, ends, epoch, resumed_at.at, kill_difference)
    report.saver = saver_of(straight.plugin_set)
    return report


def check_resume_processes(
    config_file: str,
    nproc: int,
    at: int | None = None,
    arguments: Sequence[str] = (),
    say: Callable[[str], None] | None = None,
) -> ResumeReport:
    """:func:`check_resume` on *nproc* processes, each run an ``epochal run --nproc`` subprocess.

    *arguments* are ``epochal run``'s other options (``--set``, ``--plugins``, ``--disable``...).
    The interrupted run stops after batch *at* on every rank (an agreed stop, as a signal makes
    it); the final states of the straight and the resumed run, every rank's parts included, must
    be bitwise equal.
    """
    import pickle
    import subprocess
    import sys

    from epochal.config import load_config
    from epochal.runner import check_run

    say = say or (lambda line: None)
    overrides = [arguments[k + 1] for k, a in enumerate(arguments[:-1]) if a == "--set"]
    config = load_config(config_file, overrides)
    probe = check_run(config)
    left_out = _nondeterministic(probe)
    _saver_needed(probe)
    places = output_options(probe, set(left_out))
    disable = ["--disable", ",".join(left_out)] if left_out else []
    with tempfile.TemporaryDirectory(prefix="epochal-check-resume-") as tmp:

        def run(name: str, *extra: str, dump: bool = True) -> subprocess.CompletedProcess[str]:
            where = Path(tmp) / name
            sets = [f"loop.run_dir={json.dumps(str(where))}"]
            sets += moved_options(isolated(config, where, places), places)
            if dump:
                sets += [
                    "plugins.epochal_check_resume_dump.factory=epochal.resumecheck:DumpState",
                    f"plugins.epochal_check_resume_dump.path={json.dumps(str(Path(tmp) / f'{name}.pickle'))}",
                ]
            argv = [sys.executable, "-m", "epochal", "run", config_file, "--nproc", str(nproc), *arguments]
            argv += [*disable, *(a for s in sets for a in ("--set", s)), *extra]
            return subprocess.run(argv, capture_output=True, text=True)

        def failed(what: str, done: subprocess.CompletedProcess[str]) -> ConfigError:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            status = done.returncode
            return ConfigError(f"check-resume: the {what} failed (status {status}): " + " / ".join(tail))

        def dumped(name: str) -> dict[str, Any]:
            loaded: dict[str, Any] = pickle.loads((Path(tmp) / f"{name}.pickle").read_bytes())
            return loaded

        say(f"check-resume: 1/5 straight run on {nproc} processes (in a temporary directory)")
        done = run("straight")
        if done.returncode != 0:
            raise failed("straight run", done)
        straight = dumped("straight")["state"]
        total = int(straight["iteration"])
        ends = epoch_ends(straight["log rows"])
        at = interruption_point(total, ends) if at is None else at
        if not 0 < at < total:
            raise ConfigError(
                f"--at must be between 1 and {total - 1} (the straight run has {total} batches)"
            )
        say(
            f"check-resume: 2/5 the same run, stopped after batch {at} as SIGTERM stops it "
            "(no signal is sent)"
        )
        done = run("resumed", *_local_plugin("stop", "InterruptAt", at=at), dump=False)
        if done.returncode != 128 + signal.SIGTERM:
            raise failed(f"run interrupted at batch {at}", done)
        say(f"check-resume: 3/5 resuming it from its checkpoint at batch {at}, to the end")
        done = run("resumed", "--resume")
        if done.returncode != 0:
            raise failed("resumed run", done)
        difference = first_difference(straight, dumped("resumed")["state"])
        epoch = kill_point(ends)
        say(f"check-resume: 4/5 the same run, ended after the end of epoch {epoch} as kill -9 ends it")
        done = run("killed", *_local_plugin("kill", "KillAfterEpoch", epoch=epoch), dump=False)
        if done.returncode == 0 or "as kill -9 would" not in done.stderr + done.stdout:
            raise failed(f"run to end after epoch {epoch}", done)
        say("check-resume: 5/5 resuming it from its latest complete checkpoint, to the end")
        done = run("killed", "--resume", "auto")
        if done.returncode != 0:
            raise failed("run resumed after the kill", done)
        revived = dumped("killed")
    kill_difference = first_difference(straight, revived["state"])
    report = ResumeReport(at, total, difference, left_out, ends, epoch, revived["resumed_at"])
    report.kill_difference, report.saver = kill_difference, saver_of(probe)
    return report


def _local_plugin(name: str, factory: str, **options: int) -> list[str]:
    """``epochal run`` arguments adding this module's *factory* as plugin ``epochal_check_resume_NAME``."""
    table = f"plugins.epochal_check_resume_{name}"
    arguments = ["--set", f"{table}.factory=epochal.resumecheck:{factory}"]
    for key, value in options.items():
        arguments += ["--set", f"{table}.{key}={value}"]
    return arguments


def first_difference(expected: Any, found: Any, path: str = "") -> str | None:
    """The key path and values of the first place where *found* is not bitwise *expected*."""
    for where, a, b in _walk(expected, found, path):
        return f"{where or '(top)'}: straight run has {_show(a)}, resumed run has {_show(b)}"
    return None


def _walk(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                yield f"{path}.{key}".lstrip("."), a.get(key, "<missing>"), b.get(key, "<missing>")
                return
            yield from _walk(a[key], b[key], f"{path}.{key}".lstrip("."))
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield path, f"{len(a)} items", f"{len(b)} items"
            return
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _walk(x, y, f"{path}[{i}]")
        return
    if hasattr(a, "dtype") or hasattr(b, "dtype"):
        import numpy as np

        x, y = np.asarray(a), np.asarray(b)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            yield path, x, y
        return
    if isinstance(a, float) and isinstance(b, float):
        if struct.pack("<d", a) != struct.pack("<d", b) and not (math.isnan(a) and math.isnan(b)):
            yield path, a, b
        return
    if type(a) is not type(b) or a != b:
        yield path, a, b


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
