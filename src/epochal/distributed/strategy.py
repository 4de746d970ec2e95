"""The loop's work as one rank among several (``torchrun``, ``epochal run --nproc``).

Each rank trains on its shard of every stream (:mod:`epochal.distributed.sharding`), the model
averages its gradients (``model.distribute(world)``), evaluation sums are all-reduced, the
state carries every rank's own parts (:mod:`epochal.distributed.state`), rank 0 reads the state
to resume from and broadcasts it, and stops are agreed (:mod:`epochal.distributed.agreement`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from epochal.distributed.agreement import AgreedStop
from epochal.distributed.sharding import shard_stream
from epochal.distributed.state import agreed_resume_state, gather_rank_parts, own_parts
from epochal.errors import ConfigError, EpochalError
from epochal.stopping import Stop
from epochal.strategy import Strategy


class DistributedStrategy(Strategy):
    """One rank of ``world.size`` processes training together."""

    def __init__(self, world: Any) -> None:
        super().__init__(world)
        #: stream → the metric names every rank agreed on at its first evaluation.
        self._eval_names: dict[str, list[str]] = {}

    def make_stop(self) -> Stop:
        return AgreedStop(self.world)

    def hook_objects(self, stop: Stop) -> dict[str, object]:
        return {"epochal.agreement": stop}

    def shard_data(self, data: dict[str, Any], uneven: str, seed: int | None, source: str) -> dict[str, Any]:
        world = self.world
        return {
            name: shard_stream(name, stream, world.rank, world.size, uneven, seed, source)
            for name, stream in data.items()
        }

    def order_seed(self, seed: int | None) -> int:
        """*seed*, else rank 0's drawn seed on every rank: the shards split one order."""
        if seed is not None:
            return seed
        from epochal.adapters import DrawnSeed

        drawn = super().order_seed(None) if self.world.is_zero else None
        return DrawnSeed(self.world.broadcast_object(drawn))

    def distribute(self, model: Any) -> None:
        distribute = getattr(model, "distribute", None)
        if not callable(distribute):
            kind = type(model)
            raise ConfigError(
                f"the model ({kind.__module__}.{kind.__qualname__}) has no distribute(world) method, "
                f"so it cannot train on {self.world.size} processes: each would train its own copy. "
                "Give it one that averages the gradients across the ranks (see the Model protocol; "
                "epochal.torch.TorchModel has one), or run on one process"
            )
        distribute(self.world)

    def reduce_evaluation(
        self, stream: str, seen: int, totals: dict[str, Any], weights: dict[str, int]
    ) -> tuple[int, dict[str, Any], dict[str, int]]:
        """One all-reduce of the count, the sums and their weights (the names are agreed once
        per stream)."""
        values: dict[str, float] = {}
        for name in sorted(totals):
            try:  # a device scalar is read here, once per stream
                values[name] = float(totals[name])
            except (TypeError, ValueError):  # e.g. an array of several values: not reduced
                continue
        names = list(values)
        world = self.world
        expected = self._eval_names.get(stream)
        if expected is None:  # the first evaluation of the stream: the ranks agree on the names
            every = world.all_gather_object(names)
            if any(other != names for other in every):
                found = "; ".join(f"rank {r}: {', '.join(n) or 'none'}" for r, n in enumerate(every))
                raise EpochalError(
                    f"evaluation stream {stream!r}: the ranks' eval_step returned different metrics "
                    f"({found}); every rank must return the same names to reduce them"
                )
            expected = self._eval_names[stream] = names
        elif expected != names:
            raise EpochalError(
                f"evaluation stream {stream!r}: eval_step returned {', '.join(names) or 'no metric'} "
                f"on rank {world.rank}, {', '.join(expected)} before; every rank must return the "
                "same names at every evaluation to reduce them"
            )
        sums = world.all_reduce([seen, *values.values(), *(weights.get(n, 0) for n in names)], "sum")
        count = len(names)
        reduced = dict(zip(names, sums[1 : 1 + count]))
        return int(sums[0]), reduced, {n: int(w) for n, w in zip(names, sums[1 + count :])}

    def resume_state(self, ask: Callable[[], Mapping[str, Any] | None]) -> Mapping[str, Any] | None:
        return agreed_resume_state(self.world, ask)

    def add_rank_parts(self, state: dict[str, Any], parts: dict[str, Any]) -> None:
        """A collective: every rank calls it at the same point."""
        state["world_size"] = self.world.size
        state["ranks"] = gather_rank_parts(self.world, parts)

    def own_parts(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return own_parts(state, self.world) or {}


def strategy_for(world: Any) -> Strategy:
    """The strategy of a process in *world*: one process's, or one rank's among several."""
    return DistributedStrategy(world) if world.distributed else Strategy(world)
