"""Whether a checkpoint's state fits the run that loads it: the model's keys, shapes and
dtypes (or the model's own ``check_state``), the loop state's format, the world size and the
streams' positions, each refusal one :class:`~epochal_checkpoint.errors.StateMismatchError`
naming the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal_checkpoint.errors import ForeignCheckpointError, StateMismatchError

if TYPE_CHECKING:
    from epochal.loop import Loop

__all__ = ["check_fits", "check_model", "structure_mismatches"]


def structure_mismatches(expected: Any, found: Any, where: str) -> list[str]:
    """The differences in keys, array shapes and dtypes between two model states."""
    import numpy as np

    if isinstance(expected, Mapping):
        if not isinstance(found, Mapping):
            return [f"{where}: expected a dict, found {type(found).__name__}"]
        problems = []
        if missing := sorted(map(str, expected.keys() - found.keys())):
            problems.append(f"missing keys {', '.join(f'{where}.{k}' for k in missing)}")
        if unexpected := sorted(map(str, found.keys() - expected.keys())):
            problems.append(f"unexpected keys {', '.join(f'{where}.{k}' for k in unexpected)}")
        for key in sorted(expected.keys() & found.keys(), key=str):
            problems += structure_mismatches(expected[key], found[key], f"{where}.{key}")
        return problems
    if isinstance(expected, np.ndarray):
        if not isinstance(found, np.ndarray):
            return [f"{where}: expected an array, found {type(found).__name__}"]
        problems = []
        if found.shape != expected.shape:
            problems.append(f"{where}: shape {found.shape} != expected {expected.shape}")
        if found.dtype != expected.dtype:
            problems.append(f"{where}: dtype {found.dtype} != expected {expected.dtype}")
        return problems
    return []


def check_model(loop: Loop, model_state: Any, where: Path, load: bool = True) -> None:
    """Load *model_state* into ``loop.model``, or raise one error naming the checkpoint.

    A model with a ``check_state(state) -> list[str]`` method checks the state itself (every
    reason it would not load the state); otherwise its keys, array shapes and dtypes are
    compared with the model's own state. Without *load* it is only checked (the loop loads it:
    a resume's state, a sharded checkpoint's tensors loaded by every rank together).

    :raises StateMismatchError: listing missing/unexpected keys and shape/dtype mismatches, or
        carrying the model's own refusal.
    """
    check_state = getattr(loop.model, "check_state", None)
    if callable(check_state):  # the model knows what fits it (a fresh optimizer has no state yet)
        problems = list(check_state(model_state))
    else:
        problems = structure_mismatches(loop.model.state_dict(), model_state, "model")
    if problems:
        raise StateMismatchError(f"checkpoint {str(where)!r} does not fit the model: " + "; ".join(problems))
    if not load:
        return
    try:
        loop.model.load_state_dict(model_state)
    except Exception as error:
        raise StateMismatchError(
            f"checkpoint {str(where)!r} does not fit the model: {type(error).__name__}: {error}"
        ) from error


def check_fits(loop: Loop, state: Mapping[str, Any], where: Path) -> None:
    """Check a full state against the loop's model and streams before the loop loads it.

    The streams load their parts here (the loop loads them again, with the same result), so
    their own refusals become one :class:`StateMismatchError` naming the checkpoint; so does the
    model, unless it checks states itself (``check_state``): a state it accepts is loaded once,
    by the loop (on a GPU each load is a copy of the state to the device).
    """
    from epochal.loop import STATE_FORMAT

    if state.get("format") != STATE_FORMAT:
        raise ForeignCheckpointError(
            f"checkpoint {str(where)!r} holds loop state format {state.get('format')!r}; this "
            f"epochal reads format {STATE_FORMAT}"
        )
    from epochal.distributed.state import WorldSizeError, own_parts

    try:  # saved by another number of processes: only at an epoch end
        own_parts(state, loop.world)
    except WorldSizeError as error:
        raise StateMismatchError(f"checkpoint {str(where)!r}: {error}") from None
    model = state.get("model")
    sharded = isinstance(model, Mapping) and "dcp" in model
    check_model(
        loop, model, where, load=not sharded and not callable(getattr(loop.model, "check_state", None))
    )
    for name, stream_state in (state.get("data") or {}).items():
        stream = loop.data.get(name)
        if stream is not None and callable(getattr(stream, "load_state_dict", None)):
            try:
                stream.load_state_dict(stream_state)
            except Exception as error:
                raise StateMismatchError(
                    f"checkpoint {str(where)!r}: stream {name!r} cannot continue from the saved "
                    f"position: {type(error).__name__}: {error}"
                ) from error
