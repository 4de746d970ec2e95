"""A directory of its own for each fresh run of a configuration: ``<[loop] run_dir>/version_N``.

As Lightning's ``version_N``: ``epochal run`` makes the next free ``version_N`` under the
configuration's ``[loop] run_dir`` (the *run root*) for every fresh run, with ``os.mkdir``, so
two runs started at the same moment never get the same one. ``--resume`` and ``--resume auto``
continue the newest run that has a complete checkpoint, in its directory; the core asks the
plugins which one that is (``latest_checkpoint``), it knows no checkpoint file. ``--resume PATH``
starts a new directory from that checkpoint. On several processes rank 0 chooses and every
rank gets its choice (or its refusal) by a broadcast.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pluggy

from epochal.errors import ConfigError
from epochal.run_hooks import latest_checkpoint, refuse_fresh_run

PREFIX = "version_"
_VERSION = re.compile(rf"{PREFIX}(\d+)")


def versions(root: Path) -> list[Path]:
    """The run directories under *root*, oldest (lowest N) first."""
    try:
        entries = list(os.scandir(root))
    except OSError:  # no root yet: no run
        return []
    found = [
        (int(match.group(1)), Path(root) / entry.name)
        for entry in entries
        if (match := _VERSION.fullmatch(entry.name)) and entry.is_dir()
    ]
    return [path for _, path in sorted(found)]


def make_fresh(root: Path) -> Path:
    """Create the next free ``version_N`` under *root* (atomically: ``mkdir`` fails if taken).

    :raises ConfigError: when the directory cannot be made (permissions, a file in the way).
    """
    taken = versions(root)
    number = int(taken[-1].name.removeprefix(PREFIX)) + 1 if taken else 0
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            path = root / f"{PREFIX}{number}"
            try:
                path.mkdir()
                return path
            except FileExistsError:  # a concurrent run took it first
                number += 1
    except OSError as error:
        raise ConfigError(
            f"[loop] run_dir: cannot make a directory for this run under {str(root)!r}: "
            f"{error.strerror or error}"
        ) from None


def newest_resumable(pm: pluggy.PluginManager, root: Path) -> Path | None:
    """The newest run directory under *root* whose plugins name a complete checkpoint.

    *root* itself comes last: where runs of epochal before run directories kept their files.
    """
    for candidate in [*reversed(versions(root)), root]:
        if latest_checkpoint(pm, candidate) is not None:
            return candidate
    return None


def choose(pm: pluggy.PluginManager, root: Path, resume: bool | str, command: Sequence[str]) -> Path:
    """This run's directory under *root* (see the module docstring).

    ``--resume`` with nothing to resume points at the newest run and lets the plugin that
    restores checkpoints say why (where there is no run at all, it is refused here);
    ``--resume auto`` then continues the newest run directory when one exists (a preempted
    run that saved nothing yet goes on in its own directory) and makes a fresh one otherwise.

    :raises ConfigError: a plugin refuses a fresh run (``check_fresh_run``), or no directory
        can be made.
    """
    if resume in (True, "latest", "auto"):
        found = newest_resumable(pm, root)
        if found is not None:
            return found
        taken = versions(root)
        if taken:
            return taken[-1]
        if resume != "auto":
            if pm.hook.latest_checkpoint.get_hookimpls():
                raise ConfigError(
                    f"--resume: no run of this configuration under {str(root)!r} yet, so nothing to "
                    "resume; start one without --resume (or use --resume auto: the newest run if "
                    "any, else a fresh one)"
                )
            return root
    root_existed = root.is_dir()
    fresh = make_fresh(root)
    if resume:  # --resume PATH: a new run from that checkpoint, in a directory of its own
        return fresh
    try:
        refuse_fresh_run(pm, fresh, command)
    except BaseException:
        # empty: nothing of this run was written (nor is the root it made left behind)
        discard_if_empty([fresh] if root_existed else [fresh, root])
        raise
    return fresh


def choose_for(loop: Any, resume: bool | str, command: Sequence[str]) -> list[Path]:
    """Set ``loop.run_dir`` to this run's own directory under ``loop.run_root``; return the
    directories this process made for it (on rank 0: the new ``version_N``, and the root when it
    did not exist), innermost first.

    On several processes rank 0 chooses; the others get its directory, or its refusal (the
    same error on every rank).
    """
    root = loop.run_root
    if root is None:  # from Python without a run_dir: no directory to choose, only the check
        if not resume:
            refuse_fresh_run(loop.plugin_set.pm, None, command)
        return []
    world = loop.world
    root = Path(root)
    existed = {path.name for path in versions(root)} if world.is_zero else set()
    root_existed = root.is_dir()
    answer: tuple[bool, str] = (True, "")
    failed: BaseException | None = None
    if world.is_zero:
        try:
            answer = (True, str(choose(loop.plugin_set.pm, root, resume, command)))
        except Exception as error:  # every rank must leave the broadcast, then fail alike
            failed, answer = error, (False, str(error))
    if world.distributed:
        answer = world.broadcast_object(answer)
    if failed is not None:
        raise failed
    chosen, value = answer
    if not chosen:
        raise ConfigError(value)
    loop.run_dir = Path(value)
    if not world.is_zero or loop.run_dir == root or loop.run_dir.name in existed:
        return []
    return [loop.run_dir] if root_existed else [loop.run_dir, root]


def discard_if_empty(made: Sequence[Path]) -> None:
    """Remove the directories *made* for a run that ended before writing anything into them (a
    configuration error found when training starts), so that no empty ``version_N`` is left."""
    for directory in made:
        try:
            directory.rmdir()  # only an empty directory goes
        except OSError:
            return
