"""The command a person runs to go on with a run: how ``epochal run`` writes ``loop.command``.

Two things make a copied resume command go wrong, and both are fixed here (issue 29):

- under ``torchrun`` the worker's own arguments lack the launcher: :func:`torchrun_command`
  reads the command torchrun was started with (its process is the worker's parent);
- a run that ended because it reached ``max_epochs`` (or ``max_iterations``) set on the command
  line would, resumed with the same ``--set``, finish at once: :func:`continuing_command` drops
  that ``--set`` when the configuration file's own limit lies further, and otherwise asks for as
  many epochs (iterations) again as this run trained.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_LIMITS = (("max_epochs", "epoch"), ("max_iterations", "iteration"))


def torchrun_command(without_resume: Callable[[list[str]], list[str]]) -> list[str] | None:
    """``torchrun ARGS`` as this worker's launcher was started (without ``--resume``), or None
    when the parent process is not torchrun (or cannot be read: not Linux).

    :param without_resume: removes ``--resume`` and its value from a list of arguments.
    """
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return launcher_command(
        [part.decode(errors="replace") for part in raw.split(b"\0") if part], without_resume
    )


def launcher_command(
    parent: Sequence[str], without_resume: Callable[[list[str]], list[str]]
) -> list[str] | None:
    """``torchrun ARGS`` from the arguments of a torchrun process (``torchrun ...`` or
    ``python -m torch.distributed.run ...``), or None when *parent* is neither."""
    for k, arg in enumerate(parent):
        if Path(arg).name == "torchrun":
            return ["torchrun", *without_resume(list(parent[k + 1 :]))]
        if arg == "-m" and list(parent[k + 1 : k + 2]) == ["torch.distributed.run"]:
            return ["torchrun", *without_resume(list(parent[k + 2 :]))]
    return None


def _set_value(args: Sequence[str], k: int) -> tuple[str, int] | None:
    """The ``SECTION.KEY=VALUE`` of a ``--set`` at ``args[k]`` and how many arguments it takes."""
    arg = args[k]
    if arg == "--set" and k + 1 < len(args):
        return args[k + 1], 2
    if arg.startswith("--set="):
        return arg.removeprefix("--set="), 1
    return None


def without_set(command: Sequence[str], key: str) -> tuple[list[str], bool]:
    """*command* without its ``--set KEY=...`` arguments, and whether it had one."""
    out: list[str] = []
    found = False
    k = 0
    while k < len(command):
        given = _set_value(command, k)
        if given is not None and given[0].partition("=")[0].strip() == key:
            found = True
            k += given[1]
            continue
        out.append(command[k])
        k += 1
    return out, found


def _own_limit(config_file: str | None, option: str) -> Any:
    """``[loop] OPTION`` as the configuration file itself says (None: not set, or unreadable)."""
    if not config_file:
        return None
    import tomllib

    try:
        with open(config_file, "rb") as file:
            return tomllib.load(file).get("loop", {}).get(option)
    except (OSError, ValueError):
        return None


def continuing_command(loop: Any, started: tuple[int, int] = (0, 0)) -> list[str]:
    """``loop.command`` changed so that with ``--resume`` it trains on (see the module docstring).

    :param started: ``(epoch, iteration)`` where this run started (a resumed run's state).
    """
    command = list(loop.command)
    if not command:
        return command
    for (option, counter), begun in zip(_LIMITS, started, strict=True):
        limit = getattr(loop, option)
        count = getattr(loop, counter)
        if limit is None or count < limit:
            continue
        command, overridden = without_set(command, f"loop.{option}")
        own = _own_limit(loop.config_file, option)
        if overridden and isinstance(own, int) and not isinstance(own, bool) and own > count:
            continue  # the file's own limit trains on
        trained = count - begun if count > begun else limit
        command += ["--set", f"loop.{option}={count + max(trained, 1)}"]
    return command
