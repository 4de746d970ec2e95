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

__all__ = ["STATE_FORMAT", "capture", "restore"]

STATE_FORMAT = 1


def capture(loop: Loop, *, log_rows: bool = True, model: bool = True) -> dict[str, Any]:
    """*loop*'s state (:meth:`~epochal.loop.Loop.state_dict` documents the arguments)."""
    plugins = plugin_state.capture(loop.plugins, loop._plugin_set.infos, loop.orphan_plugin_states)
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
