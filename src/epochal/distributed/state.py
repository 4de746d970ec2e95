"""The loop's state on several processes: one state for the run, with each rank's own parts.

``loop.state_dict()`` is then a collective: the model, the log, the counters and the plugin
states are rank 0's (DDP keeps the models equal, evaluation metrics and ``monitor`` records are
reduced), and what differs between ranks (each one's RNG, stream positions, plugin states) is
gathered into ``state["ranks"]`` with ``state["world_size"]``. Only rank 0 reads a checkpoint
(``resume_state``); the state, or the error, is broadcast to the others, so every rank resumes
from the same state or fails with the same message.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from epochal.errors import EpochalError

if TYPE_CHECKING:
    from epochal.distributed.world import World


class WorldSizeError(EpochalError):
    """A checkpoint saved mid-epoch by N processes cannot continue on another number of them
    (its train stream cannot share the rest of the epoch out afresh)."""


def agreed_resume_state(
    world: World, ask: Callable[[], Mapping[str, Any] | None]
) -> Mapping[str, Any] | None:
    """Rank 0 asks the plugins (*ask*) for the state to resume from; every rank gets it (or its
    error)."""
    outcome: tuple[str, Any] = ("state", None)
    error: BaseException | None = None
    if world.is_zero:
        try:
            outcome = ("state", ask())
        except Exception as raised:
            error = raised
            outcome = ("error", _portable(raised))
    kind, value = world.broadcast_object(outcome)
    if error is not None:
        raise error
    if kind == "error":
        raise value
    state: Mapping[str, Any] | None = value
    return state


def _portable(error: BaseException) -> BaseException:
    """*error* itself if it survives pickling, else an :class:`EpochalError` with its message."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if isinstance(copy, BaseException) and str(copy) == str(error):
            return copy
    except Exception:
        pass
    return EpochalError(
        f"{type(error).__name__}: {error}" if not isinstance(error, EpochalError) else str(error)
    )


def gather_rank_parts(world: World, parts: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's own parts of the state (RNG, stream and plugin states), in rank order."""
    return world.all_gather_object(parts)


def own_parts(state: Mapping[str, Any], world: World) -> dict[str, Any] | None:
    """This rank's parts of *state*, or None when *state* has none for it.

    On another number of processes than saved *state* the streams continue from rank 0's
    state (the top level's): at an epoch end the next epoch is sharded afresh, and inside an
    epoch its rest is (the streams that can: :func:`epochal.data.resplit_start`); each rank
    keeps its own saved RNG state, and ranks beyond the saved ones take rank 0's.

    :raises WorldSizeError: when *state* was saved by another number of processes in the middle
        of an epoch whose train stream has no position of its own to share out afresh.
    """
    saved = int(state.get("world_size", 1))
    if saved != world.size and state.get("in_epoch") and "train" not in state.get("data", {}):
        raise WorldSizeError(
            world_size_refusal(state, world.size, "its train stream has no position of its own")
        )
    ranks = state.get("ranks")
    if not ranks or world.rank >= len(ranks):
        return None
    if saved != world.size:  # the streams continue from rank 0's state, re-sharded
        return {"rng": ranks[world.rank]["rng"]}
    own: dict[str, Any] = ranks[world.rank]
    return own


def world_size_refusal(state: Mapping[str, Any], size: int, why: str) -> str:
    """The one line refusing to continue *state*, saved inside an epoch, on *size* processes."""
    saved = int(state.get("world_size", 1))
    return (
        f"cannot resume on {size} process(es) a state saved by {saved} in the middle of epoch "
        f"{int(state.get('epoch', 0)) + 1} (after batch {state.get('batch_in_epoch')} of it): {why}, "
        f"so the rest of that epoch cannot be shared out afresh. Resume it with --nproc {saved}, or "
        "from a checkpoint saved at an epoch end (checkpoint every_n_epochs), which any number of "
        "processes can continue"
    )
