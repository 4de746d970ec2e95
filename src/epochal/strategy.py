"""Where the loop's work runs: one process, or one rank among several.

The loop reads top to bottom as if it ran on one process; what differs on several processes is
behind a :class:`Strategy` (Lightning's loops call ``trainer.strategy`` the same way): which
part of every stream this process trains on, how the model's steps agree, how evaluation sums
are combined, which parts of the state are this process's own, who reads the state to resume
from, and the stop object. :class:`Strategy` is the one-process strategy, where each of these is
the identity; :class:`epochal.distributed.strategy.DistributedStrategy` is the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from epochal.stopping import Stop

if TYPE_CHECKING:
    from epochal.distributed.world import World


class Strategy:
    """One process: every stream whole, nothing to agree, the state as it is."""

    def __init__(self, world: World) -> None:
        self.world = world

    def make_stop(self) -> Stop:
        """The loop's stop object."""
        return Stop()

    def hook_objects(self, stop: Stop) -> dict[str, object]:
        """Objects taking part in the loop's hooks as the last implementations (by name)."""
        return {}

    def shard_data(self, data: dict[str, Any], uneven: str, seed: int | None, source: str) -> dict[str, Any]:
        """This process's part of every stream."""
        return data

    def order_seed(self, seed: int | None) -> int:
        """The seed of the data order: *seed* (``[loop] seed``), else one drawn afresh."""
        from epochal.adapters import draw_seed

        return seed if seed is not None else draw_seed()

    def distribute(self, model: Any) -> None:
        """Make the model's training steps agree across the processes."""

    def reduce_evaluation(
        self, stream: str, seen: int, totals: dict[str, Any], weights: dict[str, int]
    ) -> tuple[int, dict[str, Any], dict[str, int]]:
        """The example count, the batch-size-weighted metric sums and each metric's weight (the
        examples of the batches that returned it) of *stream* over every process."""
        return seen, totals, weights

    def resume_state(self, ask: Callable[[], Mapping[str, Any] | None]) -> Mapping[str, Any] | None:
        """The state to resume from, as *ask* (the plugins' ``resume_state``) gives it."""
        return ask()

    def add_rank_parts(self, state: dict[str, Any], parts: dict[str, Any]) -> None:
        """Add every process's own *parts* of the state (RNG, streams, plugin states) to *state*."""

    def own_parts(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """This process's own parts of a loaded *state* (empty: use the state's top level).

        A state saved by several processes holds each one's parts; one process continues with
        rank 0's (:func:`epochal.distributed.state.own_parts` says when it cannot).
        """
        if "ranks" not in state:
            return {}
        from epochal.distributed.state import own_parts

        return own_parts(state, self.world) or {}
