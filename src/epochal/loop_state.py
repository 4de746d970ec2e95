"""The loop's saved state: what a resumed run needs, captured and restored.

:meth:`Loop.state_dict <epochal.loop.Loop.state_dict>` and :meth:`Loop.load_state_dict
<epochal.loop.Loop.load_state_dict>` call :func:`capture` and :func:`restore`. A state holds the
counters, the training log, the model's state, the random generators, the streams' positions and
the plugins' states (:mod:`epochal.plugin_state`); on several processes each rank's own parts
are added by the strategy (:mod:`epochal.distributed.strategy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from epochal import _rng, plugin_state
from epochal.errors import EpochalError, StreamStateError

if TYPE_CHECKING:
    from epochal.loop import Loop

__all__ = ["STATE_FORMAT", "capture", "problems", "restore"]

#: the keys of a loop state (:func:`capture`).
_KEYS = ("epoch", "iteration", "in_epoch", "batch_in_epoch", "log", "model", "rng", "data", "plugins")

STATE_FORMAT = 1


def capture(loop: Loop, *, log_rows: bool = True, model: bool = True) -> dict[str, Any]:
    """*loop*'s state (:meth:`~epochal.loop.Loop.state_dict` documents the arguments)."""
    plugin_set = loop._plugin_set
    plugins = plugin_state.capture(
        loop.plugins, plugin_set.infos, loop.orphan_plugin_states, plugin_set.isolate_failure
    )
    rng = _rng.capture()
    data = {
        name: stream.state_dict()
        for name, stream in loop.data.items()
        if callable(getattr(stream, "state_dict", None))
    }
    state = {
        "format": STATE_FORMAT,
        "run_id": loop.run_id,
        "epoch": loop.epoch,
        "iteration": loop.iteration,
        "in_epoch": loop._in_epoch,
        "batch_in_epoch": loop.batch_in_epoch,
        "log": loop.log.state_dict(rows=log_rows),
        "model": loop.model.state_dict() if model else None,
        "rng": rng,
        "data": data,
        "plugins": plugins,
    }
    own = {n: e["state"] for n, e in plugins.items() if n not in loop.orphan_plugin_states}
    loop.strategy.add_rank_parts(state, {"rng": rng, "data": data, "plugins": own})
    return state


def restore(loop: Loop, state: Mapping[str, Any]) -> None:
    """Load *state* (from :func:`capture`) into *loop*: the run continues where it was saved."""
    if state.get("format") != STATE_FORMAT:
        raise EpochalError(f"unsupported loop state format {state.get('format')!r} (expected {STATE_FORMAT})")
    if (refusal := _resplit_refusal(loop, state)) is not None:
        from epochal.distributed.state import WorldSizeError

        raise WorldSizeError(refusal)
    own = loop.strategy.own_parts(state)
    loop.model.load_state_dict(state["model"])
    loop.log.load_state_dict(state["log"])
    loop.epoch, loop.iteration = int(state["epoch"]), int(state["iteration"])
    loop._in_epoch = bool(state["in_epoch"])
    loop._epoch_start = loop.iteration - int(state["batch_in_epoch"])
    for name, stream_state in own.get("data", state["data"]).items():
        stream = loop.data.get(name)
        if stream is not None and callable(getattr(stream, "load_state_dict", None)):
            try:
                stream.load_state_dict(stream_state)
            except StreamStateError:
                raise
            except ValueError as error:  # the stream's own words, with its name
                raise StreamStateError(f"cannot resume [data] stream {name!r}: {error}") from None
    loop.orphan_plugin_states = plugin_state.restore(
        loop.plugins,
        state["plugins"],
        own.get("plugins", {}),
        loop._plugin_set.elsewhere,
        loop._plugin_set.infos,
    )
    _rng.restore(own.get("rng", state["rng"]))
    loop.resumed = True
    loop.resumed_from = state.get("run_id")


def problems(loop: Loop, state: Any) -> list[str]:
    """Every reason *loop* cannot continue from *state* (empty: it fits); nothing is changed.

    The state's format and keys, the number of processes (a state saved in the middle of an
    epoch by another number of them), and the model: its own ``check_state(state)`` when it has
    one, else the keys, array shapes and dtypes of its ``state_dict()``.
    """
    if not isinstance(state, Mapping):
        return [f"the state is a {type(state).__name__}, not a loop state (a mapping)"]
    if state.get("format") != STATE_FORMAT:
        return [f"the state has loop state format {state.get('format')!r}; this epochal reads {STATE_FORMAT}"]
    if missing := [key for key in _KEYS if key not in state]:
        return [f"the state has no {', '.join(missing)}"]
    found: list[str] = []
    try:
        loop.strategy.own_parts(state)
    except EpochalError as error:  # saved mid-epoch by another number of processes
        found.append(str(error))
    else:
        if (refusal := _resplit_refusal(loop, state)) is not None:
            found.append(refusal)
    model = state.get("model")
    if model is not None:  # None: the model's state is read by its saver (sharded)
        check = getattr(loop.model, "check_state", None)
        if callable(check):
            found += [f"model: {problem}" for problem in check(model)]
        else:
            found += _structure(loop.model.state_dict(), model, "model")
    return found


def _resplit_refusal(loop: Loop, state: Mapping[str, Any]) -> str | None:
    """Why *loop* cannot continue *state*, saved inside an epoch by another number of processes,
    by sharing the rest of the epoch out afresh (None: it can, or nothing to share out).

    The train stream must say it can (``elastic = True``: :class:`~epochal.data.BatchStream`,
    :class:`~epochal.torch.LoaderStream`), and epochs must be the stream's (not ``epoch_size``
    batches, which count batches of the saved world).
    """
    if int(state.get("world_size", 1)) == loop.world.size or not state.get("in_epoch"):
        return None
    from epochal.distributed.state import world_size_refusal

    train = loop.data.get("train")
    if loop.epoch_size:
        why = "[loop] epoch_size counts an epoch in batches of the saved processes"
    elif train is not None and not getattr(train, "elastic", False):
        why = (
            f"its train stream ({type(train).__name__}) cannot share the rest of an epoch out afresh "
            "(an epochal.data.BatchStream or a torch DataLoader can; a stream of your own says so with "
            "elastic = True)"
        )
    else:
        return None
    return world_size_refusal(state, loop.world.size, why)


def _structure(expected: Any, found: Any, where: str) -> list[str]:
    """The differences in keys, array shapes and dtypes between two model states."""
    import numpy as np

    if isinstance(expected, Mapping):
        if not isinstance(found, Mapping):
            return [f"{where}: expected a table, found {type(found).__name__}"]
        out = []
        if missing := sorted(map(str, expected.keys() - found.keys())):
            out.append(f"missing keys {', '.join(f'{where}.{k}' for k in missing)}")
        if unexpected := sorted(map(str, found.keys() - expected.keys())):
            out.append(f"unexpected keys {', '.join(f'{where}.{k}' for k in unexpected)}")
        for key in sorted(expected.keys() & found.keys(), key=str):
            out += _structure(expected[key], found[key], f"{where}.{key}")
        return out
    if isinstance(expected, np.ndarray):
        if not isinstance(found, np.ndarray):
            return [f"{where}: expected an array, found {type(found).__name__}"]
        out = []
        if found.shape != expected.shape:
            out.append(f"{where}: shape {found.shape} != expected {expected.shape}")
        if found.dtype != expected.dtype:
            out.append(f"{where}: dtype {found.dtype} != expected {expected.dtype}")
        return out
    return []
