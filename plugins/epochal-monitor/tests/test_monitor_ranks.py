"""The ``monitor`` on several processes, in one process: rank 0 of two with a scripted peer.

The peer (rank 1) reports, for every record the monitor reduces, this rank's accumulators with
three times the sums: a reduced mean is then twice this rank's own, so the tests see which
records were reduced and which are rank-local, and count the collectives the monitor makes.
"""

from __future__ import annotations

from typing import Any

import pytest

from epochal import Loop, hookimpl, load_plugins
from epochal.testing import TinyModel, tiny_data

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")


class TwoRanks:
    """Rank 0 of 2: collectives return what the peer would send; the monitor's are counted."""

    rank, size, local_rank, backend = 0, 2, 0, "gloo"
    distributed, is_zero = True, True
    agree_every_n_batches = 1

    def __init__(self) -> None:
        #: the monitor's all-gathers (dicts of accumulators), in order.
        self.monitor_gathers: list[dict[str, Any]] = []
        self.steps = 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        if isinstance(obj, dict) and all(isinstance(v, tuple) for v in obj.values()):
            self.monitor_gathers.append(obj)
            peer = {key: (kind, 3 * a, b) for key, (kind, a, b) in obj.items()}
            return [obj, peer]
        return [obj, obj if obj is None or not isinstance(obj, str) else None]

    def all_reduce(self, values: Any, op: str = "sum") -> list[float]:
        return [2 * float(v) if op == "sum" else float(v) for v in values]

    def all_reduce_async(self, values: Any, op: str = "max") -> Any:
        result = self.all_reduce(values, op)

        class Done:
            def wait(self) -> list[float]:
                return result

        return Done()

    def all_reduce_arrays(self, arrays: Any, op: str = "sum") -> list[Any]:
        return [2 * a for a in arrays]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


class Losses:
    """Keeps every train batch's loss, per epoch."""

    def __init__(self) -> None:
        self.epochs: list[list[float]] = [[]]

    @hookimpl
    def after_batch(self, outputs: Any) -> None:
        self.epochs[-1].append(outputs["loss"])

    @hookimpl
    def after_epoch(self) -> None:
        self.epochs.append([])


def run(world: TwoRanks, options: dict[str, Any], examples: int = 64) -> tuple[Loop, Losses]:
    losses = Losses()
    plugins = load_plugins(
        order=["monitor", "losses"], autoload=False, options={"monitor": options}, extra={"losses": losses}
    )
    # 64 examples in batches of 8, sharded: 4 batches of 8 per rank and epoch
    loop = Loop(
        TinyModel(),
        tiny_data(examples=examples),
        plugins=plugins,
        world=world,
        max_epochs=2,
        handle_signals=False,
    )  # type: ignore[arg-type]
    loop.run()
    return loop, losses


def test_by_default_running_records_are_this_ranks_own_and_epoch_records_are_reduced_once_per_epoch():
    world = TwoRanks()
    loop, losses = run(world, {"every_n_batches": 1})
    running = [value for _, value in loop.log.history("train.loss.running")]
    assert running == [loss for epoch in losses.epochs for loss in epoch]  # rank-local, no collective
    assert len(world.monitor_gathers) == 2  # one per epoch: the epoch records
    for (_, reduced), epoch in zip(loop.log.history("train.loss"), losses.epochs):
        # equal batch sizes: this rank's mean is the batches' mean; the peer's sums are three times
        assert reduced == pytest.approx(2 * sum(epoch) / len(epoch), rel=1e-12)


def test_the_default_running_records_add_no_collective():
    world = TwoRanks()
    loop, losses = run(world, {}, examples=960)  # 60 batches of 8 per rank and epoch
    batches = [loss for epoch in losses.epochs for loss in epoch]
    running = loop.log.history("train.loss.running")
    assert [i for i, _ in running] == [50, 100]  # every 50 batches, as Lightning's log_every_n_steps
    assert [v for _, v in running] == pytest.approx(
        [sum(batches[:50]) / 50, sum(batches[50:100]) / 50], rel=1e-12
    )
    assert len(world.monitor_gathers) == 2  # one per epoch: the epoch records; none per step


def test_reduce_step_reduces_every_running_record_in_one_collective_each():
    world = TwoRanks()
    loop, losses = run(world, {"every_n_batches": 1, "reduce": "step"})
    running = [value for _, value in loop.log.history("train.loss.running")]
    batches = [loss for epoch in losses.epochs for loss in epoch]
    assert running == pytest.approx([2 * loss for loss in batches], rel=1e-12)
    assert len(world.monitor_gathers) == len(batches) + 2  # one per running record, one per epoch


def test_a_window_of_several_batches_is_rank_local_too():
    world = TwoRanks()
    loop, losses = run(world, {"every_n_batches": 2})
    batches = [loss for epoch in losses.epochs for loss in epoch]
    running = [value for _, value in loop.log.history("train.loss.running")]
    assert running == pytest.approx([(a + b) / 2 for a, b in zip(batches[::2], batches[1::2])], rel=1e-12)
    assert len(world.monitor_gathers) == 2


def test_an_unknown_reduce_is_refused_naming_the_option():
    from epochal import PluginError

    with pytest.raises(PluginError, match="reduce"):
        load_plugins(order=["monitor"], autoload=False, options={"monitor": {"reduce": "batch"}})
