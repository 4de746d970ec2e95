"""The agreement of several processes, in one process: ``World()`` and a scripted peer rank.

``World()`` (one process) makes every collective the identity and the loop registers nothing for
it. :class:`PeerWorld` plays rank 0 of two whose peer, rank 1, is scripted: its flags are merged
into every reduction as the real all-reduce would merge them, so the loop's decisions (stop one
batch later, at the epoch end, out-of-step ranks) are tested without starting processes.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

import pytest

import epochal.distributed.world as world_module
from epochal import CompositePlugin, Loop, PluginError, hookimpl
from epochal.distributed import World
from epochal.distributed.agreement import RanksOutOfStepError
from epochal.distributed.state import WorldSizeError
from epochal.plugins import compose
from epochal.stopping import Stop
from epochal.testing import TinyModel, tiny_data

# -- one process ------------------------------------------------------------------------------


def test_one_process_world_is_the_identity():
    world = World()
    assert not world.distributed and world.is_zero
    assert world.all_reduce([1, 2.5]) == [1.0, 2.5]
    assert world.all_reduce_async([3], "max").wait() == [3.0]
    assert world.broadcast_object({"a": 1}) == {"a": 1}
    assert world.all_gather_object("x") == ["x"]
    world.barrier()


def test_one_process_registers_nothing_and_keeps_the_state_as_it_was():
    loop = Loop(TinyModel(), tiny_data(), max_epochs=1, handle_signals=False)
    assert type(loop.stopping) is Stop
    assert "epochal.agreement" not in dict(loop.plugin_set.pm.list_name_plugin())
    loop.run()
    state = loop.state_dict()
    assert "ranks" not in state and "world_size" not in state


# -- a scripted peer --------------------------------------------------------------------------


@dataclass
class PeerWorld:
    """Rank 0 of 2; rank 1 is scripted by *peer_stop_after* / *peer_finish* / *peer_batches*."""

    peer_stop_after: int | None = None
    peer_finish: bool = False
    peer_signal: int = 0
    peer_out_of_step: bool = False
    agree_every_n_batches: int = 1
    rank: int = 0
    size: int = 2
    local_rank: int = 0
    backend: str = "gloo"
    reductions: list[list[float]] = field(default_factory=list)
    iteration: int = 0

    @property
    def distributed(self) -> bool:
        return True

    @property
    def is_zero(self) -> bool:
        return True

    def _peer(self, values: list[float]) -> list[float]:
        peer = list(values)
        kind = int(values[3])
        batches = self.iteration
        peer[0] = float(self.peer_stop_after is not None and batches >= self.peer_stop_after)
        peer[1] = float(self.peer_finish)
        peer[2] = float(self.peer_signal)
        if self.peer_out_of_step:
            peer[3], peer[4] = float(1 - kind if kind < 2 else 0), -float(1 - kind if kind < 2 else 0)
        return peer

    def all_reduce(self, values: Any, op: str = "sum") -> list[float]:
        values = [float(v) for v in values]
        self.reductions.append(values)
        if op == "sum":  # the peer evaluated the same batches: everything doubles
            return [2 * v for v in values]
        peer = self._peer(values)
        return [max(a, b) for a, b in zip(values, peer)]

    def all_reduce_arrays(self, arrays: Any, op: str = "sum") -> list[Any]:
        return [2 * a for a in arrays]  # the peer's gradients are this rank's

    def all_reduce_async(self, values: Any, op: str = "max") -> Any:
        result = self.all_reduce(values, op)

        class Done:
            def wait(self) -> list[float]:
                return result

        return Done()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if obj is None or isinstance(obj, str):  # the stop reasons
            reason = "peer asked" if self.peer_stop_after is not None else None
            return [obj, reason]
        return [obj, obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


class Counter:
    """Keeps the scripted peer's batch count in step with the loop's."""

    def __init__(self, world: PeerWorld) -> None:
        self.world = world

    @hookimpl(tryfirst=True)
    def after_batch(self, loop: Any) -> None:
        self.world.iteration = loop.iteration


def run(
    world: PeerWorld, plugins: dict[str, object] | None = None, examples: int = 64, **options: Any
) -> Loop:
    options.setdefault("max_epochs", 3)
    loop = Loop(
        TinyModel(),
        tiny_data(examples=examples),  # sharded: examples / 16 batches of 8 per rank and epoch
        plugins={"counter": Counter(world), **(plugins or {})},
        world=world,  # type: ignore[arg-type]
        handle_signals=False,
        **options,
    )
    loop.run()
    return loop


def test_a_stop_asked_by_the_peer_stops_this_rank_one_batch_later_with_the_agreed_reason():
    loop = run(PeerWorld(peer_stop_after=2))
    assert loop.iteration == 3
    assert loop.log.status["finish_reason"] == "peer asked (on rank 1)"
    assert loop.log.status["status"] == "finished"


def test_agreeing_every_n_batches_honours_a_request_within_2n_batches():
    world = PeerWorld(peer_stop_after=2, agree_every_n_batches=3)
    loop = run(world, examples=128)  # 8 batches per rank and epoch
    # agreements start after batches 3 and 6; the one of batch 3 carries the request of batch 2
    assert loop.iteration == 6
    assert loop.log.status["finish_reason"] == "peer asked (on rank 1)"
    per_batch = [values for values in world.reductions if len(values) == 7 and values[3] == 0]
    assert len(per_batch) == 1


def test_a_local_stop_waits_for_the_agreement_too():
    class StopAt:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            if loop.iteration == 5:
                loop.request_stop("mine")

    loop = run(PeerWorld(), {"stop": StopAt()})
    assert loop.iteration == 6
    assert loop.log.status["finish_reason"] == "mine (on rank 0)"


def test_an_agreed_request_stops_at_once():
    class StopAt:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            if loop.iteration == 5:
                loop.request_stop("every rank counts batches", agreed=True)

    loop = run(PeerWorld(), {"stop": StopAt()})
    assert loop.iteration == 5
    assert loop.log.status["finish_reason"] == "every rank counts batches"


def test_the_peer_finishing_its_epoch_ends_training_at_this_epoch_end():
    loop = run(PeerWorld(peer_finish=True, peer_signal=signal.SIGINT))
    assert (loop.epoch, loop.iteration) == (1, 4)
    assert loop.log.status["status"] == "interrupted"
    assert loop.signal_received == signal.SIGINT


def test_a_signal_to_the_peer_interrupts_every_rank():
    world = PeerWorld(peer_stop_after=6, peer_signal=signal.SIGTERM)
    seen: list[int] = []

    class Interrupted:
        @hookimpl
        def on_interrupt(self, signum: int) -> None:
            seen.append(signum)

    loop = run(world, {"watch": Interrupted()})
    assert loop.iteration == 7 and seen == [signal.SIGTERM]
    assert loop.log.status["status"] == "interrupted"


def test_ranks_out_of_step_are_a_clear_error():
    with pytest.raises(RanksOutOfStepError, match="different numbers of training batches"):
        run(PeerWorld(peer_out_of_step=True))


def test_evaluation_reduces_sums_and_counts_in_one_all_reduce():
    world = PeerWorld()
    loop = run(world, max_epochs=1)
    sums = [values for values in world.reductions if len(values) == 2]  # [examples, loss sum]
    assert len(sums) == 1 and sums[0][0] == 8  # this rank's half of the 16 valid examples
    examples, total = (2 * v for v in sums[0])  # the peer's sums are this rank's
    assert loop.last_metrics["valid"] == {"loss": total / examples}


def test_state_holds_every_rank_and_resume_refuses_another_world_size_mid_epoch():
    loop = run(PeerWorld(), max_iterations=6)
    state = loop.state_dict()
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    assert set(state["ranks"][0]) == {"rng", "data", "plugins"}
    assert state["in_epoch"]
    alone = Loop(TinyModel(), tiny_data(), handle_signals=False)
    with pytest.raises(WorldSizeError, match=r"--nproc 2"):
        alone.load_state_dict(state)
    at_epoch_end = run(PeerWorld(), max_epochs=1).state_dict()
    alone.load_state_dict(at_epoch_end)  # re-sharded from the next epoch's start
    assert alone.epoch == 1


# -- where plugins run ------------------------------------------------------------------------


class Everywhere:
    @hookimpl
    def after_epoch(self) -> None:
        pass


class RankZero:
    rank = "zero"

    @hookimpl
    def after_epoch(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, state: Any) -> None:
        pass


class Bundle(CompositePlugin):
    rank = "zero"

    def __init__(self) -> None:
        super().__init__({"inner": Everywhere()})


def test_rank_zero_plugins_are_left_out_on_the_other_ranks(monkeypatch):
    everywhere, zero = Everywhere(), RankZero()
    on_zero = compose({"everywhere": everywhere, "zero": zero, "bundle": Bundle()})
    assert set(on_zero.plugins) == {"everywhere", "zero", "bundle/inner"}
    assert {i.name: i.rank for i in on_zero.infos}["zero"] == "zero"
    monkeypatch.setattr(world_module, "_current", World(rank=1, size=2))
    elsewhere = compose({"everywhere": Everywhere(), "zero": RankZero(), "bundle": Bundle()})
    assert set(elsewhere.plugins) == {"everywhere"}
    assert elsewhere.elsewhere == {"zero", "bundle/inner", "bundle"}
    assert [i.status for i in elsewhere.infos if i.name == "zero"] == ["rank 0 only"]


def test_a_rank_zero_plugins_state_is_no_orphan_on_the_other_ranks(monkeypatch, recwarn):
    saved = Loop(TinyModel(), tiny_data(), plugins={"zero": RankZero()}, max_epochs=1, handle_signals=False)
    saved.run()
    state = saved.state_dict()
    monkeypatch.setattr(world_module, "_current", World(rank=1, size=2))
    other = Loop(TinyModel(), tiny_data(), plugins={"zero": RankZero()}, world=World(), handle_signals=False)
    other.load_state_dict(state)
    assert "zero" in other.orphan_plugin_states  # kept, and not warned about
    assert not [w for w in recwarn if "not in this run" in str(w.message)]


def test_an_unknown_rank_declaration_names_the_plugin():
    class Odd:
        rank = "one"

        @hookimpl
        def after_epoch(self) -> None:
            pass

    with pytest.raises(PluginError, match="plugin 'odd' declares rank = 'one'"):
        compose({"odd": Odd()})


def test_an_instance_attribute_named_rank_is_not_a_declaration():
    class Mine:
        def __init__(self) -> None:
            self.rank = 3

        @hookimpl
        def after_epoch(self) -> None:
            pass

    assert {i.name: i.rank for i in compose({"mine": Mine()}).infos}["mine"] == "all"
