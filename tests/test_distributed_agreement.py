"""The agreement of several processes, in one process: ``World()`` and a scripted peer rank.

``World()`` (one process) makes every collective the identity and the loop registers nothing for
it. :class:`PeerWorld` plays rank 0 of two whose peer, rank 1, is scripted: its flags are merged
into every reduction as the real all-reduce would merge them, so the loop's decisions (stop one
batch later, at the epoch end, out-of-step ranks) are tested without starting processes.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import epochal.distributed.agreement as agreement
import epochal.distributed.world as world_module
from epochal import CompositePlugin, Loop, PluginError, hookimpl, load_plugins
from epochal.distributed import World
from epochal.distributed.agreement import (
    CALIBRATION_BATCHES,
    MAX_EVERY,
    ROUND_TRIPS,
    RanksOutOfStepError,
    choose_every,
)
from epochal.distributed.state import WorldSizeError
from epochal.plugins import compose
from epochal.stopping import Stop
from epochal.testing import TinyModel, tiny_data

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collective_counter import Phases

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
    #: the n the peer proposes at the end of an "auto" calibration (None: this rank's)
    peer_every: int | None = None
    agree_every_n_batches: int | str = 1
    #: seconds each collective takes on *clock* (a scripted clock, when given)
    round_trip: float = 0.0
    clock: Any = None
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
        if len(values) == 8 and self.peer_every is not None:  # the calibration's proposal
            peer[7] = float(self.peer_every)
        return peer

    def all_reduce(self, values: Any, op: str = "sum") -> list[float]:
        values = [float(v) for v in values]
        self.reductions.append(values)
        if self.clock is not None:
            self.clock.now += self.round_trip
        if len(values) < 7:  # not stop flags: the timed round trips, evaluation sums
            return [2 * v for v in values] if op == "sum" else values
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
        if isinstance(obj, tuple):  # the stop reasons: (reason, whether a signal's)
            if self.peer_stop_after is None:
                return [obj, (None, False)]
            if self.peer_signal:
                return [obj, (f"{signal.Signals(self.peer_signal).name} received", True)]
            return [obj, ("peer asked", False)]
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


@pytest.mark.parametrize("option", [{"stopping_threshold": 1e9}, {"patience": 1, "min_delta": 1e9}])
def test_early_stopping_after_an_in_epoch_evaluation_stops_on_that_batch_as_on_one_process(option):
    # the evaluation's records are reduced across the ranks, so every rank decides alike: the
    # stop lands on the evaluation's batch, not on the next agreement (every 3 batches here;
    # with "auto" its interval depends on timing, and a resumed run would stop elsewhere)
    pytest.importorskip("epochal_earlystop")

    def stopper() -> dict[str, object]:
        options = {"early_stopping": {"monitor": "valid.loss", **option}}
        return load_plugins(order=["early_stopping"], autoload=False, options=options).plugins

    one = Loop(TinyModel(), tiny_data(examples=128), plugins=stopper(), max_epochs=3, eval_every_n_batches=2)
    one.run()
    loop = run(PeerWorld(agree_every_n_batches=3), stopper(), examples=128, eval_every_n_batches=2)
    assert loop.iteration == one.iteration == (2 if "stopping_threshold" in option else 4)
    assert str(loop.log.status["finish_reason"]).startswith("early_stopping:")


def test_a_collective_broken_by_a_lost_peer_is_logged_in_epochals_words():
    # a DDP all-reduce (torch's, not epochal's) fails with gloo's text: the run's log keeps what
    # happened in one line, as the CLI prints it, not the transport's message and advice
    pytest.importorskip("torch")

    class Broken:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            raise RuntimeError(
                "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6846. "
                "This is typically caused by a peer dying"
            )

    world: Any = PeerWorld()
    loop = Loop(TinyModel(), tiny_data(), plugins={"broken": Broken()}, world=world, handle_signals=False)
    with pytest.raises(RuntimeError):
        loop.run()
    status = loop.log.status
    assert status["status"] == "failed"
    assert status["error"] == (
        "PeerLostError: a collective over the process group failed: another rank stopped, died or "
        "did not answer within [distributed] timeout (Connection closed by peer [127.0.0.1]:6846)"
    )


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


def test_the_peers_first_sigint_in_the_last_epoch_leaves_every_rank_finished():
    loop = run(PeerWorld(peer_finish=True, peer_signal=signal.SIGINT), max_epochs=1)
    assert (loop.epoch, loop.iteration) == (1, 4)
    assert loop.log.status["status"] == "finished"
    assert loop.log.status["finish_reason"] == "max_epochs=1 reached (SIGINT received as training ended)"


def test_a_stop_the_peer_asked_for_a_signal_is_an_interrupt_and_a_plugins_is_not():
    signalled = run(PeerWorld(peer_stop_after=2, peer_signal=signal.SIGTERM))
    assert signalled.log.status["status"] == "interrupted"
    assert signalled.log.status["finish_reason"] == "SIGTERM received (on rank 1)"
    asked = run(PeerWorld(peer_stop_after=2))
    assert asked.log.status["status"] == "finished"


def test_ranks_out_of_step_are_a_clear_error():
    with pytest.raises(RanksOutOfStepError, match="different numbers of training batches"):
        run(PeerWorld(peer_out_of_step=True))


def test_evaluation_reduces_sums_and_counts_in_one_all_reduce():
    world = PeerWorld()
    loop = run(world, max_epochs=1)
    sums = [values for values in world.reductions if len(values) == 3]  # [examples, loss sum, its weight]
    assert len(sums) == 1 and sums[0][0] == 8  # this rank's half of the 16 valid examples
    examples, total, weight = (2 * v for v in sums[0])  # the peer's sums are this rank's
    assert weight == examples  # every batch returned the loss
    assert loop.last_metrics["valid"] == {"loss": total / weight}


def test_state_holds_every_rank_and_resume_refuses_another_world_size_mid_epoch():
    """Inside an epoch, another number of processes continues only a train stream with a
    position of its own to share out afresh (tests/test_elastic.py: the re-split rest)."""
    loop = run(PeerWorld(), max_iterations=6)
    state = loop.state_dict()
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    assert set(state["ranks"][0]) == {"rng", "data", "plugins"}
    assert state["in_epoch"]
    alone = Loop(TinyModel(), tiny_data(), handle_signals=False)
    positionless = {**state, "data": {k: v for k, v in state["data"].items() if k != "train"}}
    with pytest.raises(WorldSizeError, match=r"no position of its own.*--nproc 2"):
        alone.load_state_dict(positionless)
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


# -- agree_every_n_batches = "auto" ------------------------------------------------------------


class Clock:
    """A scripted clock: collectives and steps advance it by what they are said to take."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Step:
    """Each training step takes *seconds* on the scripted clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    @hookimpl
    def before_batch(self) -> None:
        self.clock.now += self.seconds


def auto_world(monkeypatch: pytest.MonkeyPatch, round_trip: float, **peer: Any) -> tuple[PeerWorld, Clock]:
    clock = Clock()
    monkeypatch.setattr(agreement, "_clock", clock)
    return PeerWorld(agree_every_n_batches="auto", round_trip=round_trip, clock=clock, **peer), clock


def test_choose_every_keeps_one_round_trip_within_one_percent_of_n_steps():
    assert choose_every(0.001, 0.01) == 10  # 1 ms per 10 steps of 10 ms: 1%
    assert choose_every(0.001, 0.2) == 1
    assert choose_every(0.0005, 0.0007) == 72
    assert choose_every(0.001, 1e-6) == MAX_EVERY  # bounded: a request waits at most 2n batches
    assert choose_every(0.001, 0.0) == MAX_EVERY and choose_every(0.0, 0.01) == 1
    for round_trip, step in [(0.001, 0.01), (0.0005, 0.0007), (0.003, 0.05)]:
        n = choose_every(round_trip, step)
        assert round_trip <= 0.01 * n * step and (n == 1 or round_trip > 0.01 * (n - 1) * step)


def test_auto_calibrates_from_the_measured_round_trip_and_step_then_agrees_every_n(monkeypatch):
    world, clock = auto_world(monkeypatch, round_trip=0.001)
    loop = run(world, {"step": Step(clock, 0.01)}, examples=1024, max_epochs=1)  # 64 batches
    stop = loop.stopping
    assert stop.calibration is not None
    assert stop.calibration["round_trip"] == pytest.approx(0.001)
    assert stop.calibration["step"] == pytest.approx(0.01)
    assert stop.every == 10
    flags = [values for values in world.reductions if len(values) >= 7 and values[3] == 0]
    # every batch while calibrating, the calibration's own (with the proposal), then at 20 … 60
    assert len(flags) == CALIBRATION_BATCHES - 1 + 1 + 5
    assert len([values for values in world.reductions if len(values) == 1]) == ROUND_TRIPS


def test_auto_every_rank_adopts_the_largest_proposal(monkeypatch):
    world, clock = auto_world(monkeypatch, round_trip=0.001, peer_every=32)
    loop = run(world, {"step": Step(clock, 0.01)}, examples=1024, max_epochs=1)
    assert loop.stopping.calibration is not None and loop.stopping.calibration["proposed"] == 10
    assert loop.stopping.every == 32


def test_auto_a_request_of_the_peer_stops_every_rank_within_2n_batches(monkeypatch):
    world, clock = auto_world(monkeypatch, round_trip=0.001, peer_stop_after=25)
    loop = run(world, {"step": Step(clock, 0.01)}, examples=1024, max_epochs=2)
    # n = 10: the agreement started after batch 30 carries the request; it is read after 40
    assert loop.iteration == 40
    assert loop.log.status["finish_reason"] == "peer asked (on rank 1)"


def test_auto_a_request_while_calibrating_stops_one_batch_later(monkeypatch):
    world, clock = auto_world(monkeypatch, round_trip=0.001, peer_stop_after=5)
    loop = run(world, {"step": Step(clock, 0.01)}, examples=1024, max_epochs=1)
    assert loop.iteration == 6 and loop.stopping.calibration is None


def test_auto_is_the_default_of_the_distributed_section():
    import inspect

    assert World().agree_every_n_batches == "auto"
    default = inspect.signature(world_module.init_from_env).parameters["agree_every_n_batches"].default
    assert default == "auto"


# -- collectives per step with the six standard plugins ----------------------------------------


@dataclass
class CountingWorld(PeerWorld):
    """Records every collective with the stage and the training step it was made in."""

    phases: Phases = field(default_factory=Phases)
    calls: list[tuple[str, int, str]] = field(default_factory=list)

    def _count(self, name: str) -> None:
        self.calls.append((self.phases.phase, self.phases.iteration, name))

    def all_reduce(self, values: Any, op: str = "sum") -> list[float]:
        self._count("all_reduce")
        return super().all_reduce(values, op)

    def all_reduce_async(self, values: Any, op: str = "max") -> Any:
        self._count("all_reduce_async")
        result = PeerWorld.all_reduce(self, values, op)  # the same reduction, counted once

        class Done:
            def wait(self) -> list[float]:
                return result

        return Done()

    def all_reduce_arrays(self, arrays: Any, op: str = "sum") -> list[Any]:
        self._count("all_reduce_arrays")
        return super().all_reduce_arrays(arrays, op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._count("all_gather_object")
        return super().all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._count("broadcast_object")
        return super().broadcast_object(obj, src)

    def barrier(self) -> None:
        self._count("barrier")


@pytest.mark.parametrize("running", [0, 1, None])  # None: monitor's default, every 50 steps
def test_six_standard_plugins_add_at_most_one_collective_per_n_steps(monkeypatch, tmp_path, running):
    clock = Clock()
    monkeypatch.setattr(agreement, "_clock", clock)
    world = CountingWorld(agree_every_n_batches="auto", round_trip=0.001, clock=clock)
    six = ["monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress"]
    plugins = load_plugins(
        order=six,
        autoload=False,
        options={
            "monitor": {} if running is None else {"every_n_batches": running},
            "early_stopping": {"monitor": "valid.loss"},
        },
        extra={"phases": world.phases, "counter": Counter(world), "step": Step(clock, 0.005)},
    )
    assert [name for name in plugins.plugins if name in six] == six
    loop = Loop(
        TinyModel(),
        tiny_data(examples=2048),  # 128 batches of 8 per rank and epoch
        plugins=plugins,
        world=world,  # type: ignore[arg-type]
        max_epochs=2,
        run_dir=tmp_path,
        handle_signals=False,
    )
    loop.run()
    written = [i for i, _ in loop.log.history("train.loss.running")]
    assert written == ([] if running == 0 else list(range(running or 50, 257, running or 50)))
    every = loop.stopping.every
    assert every == 20  # 1 ms per 20 steps of 5 ms: 1%
    steps = [(i, name) for phase, i, name in world.calls if phase == "step"]
    assert len([1 for _, name in steps if name == "all_reduce_arrays"]) == loop.iteration == 256
    # beyond the model's gradients, after the calibration: one agreement per n steps, nothing else
    others = [(i, name) for i, name in steps if name != "all_reduce_arrays"]
    steady = [(i, name) for i, name in others if i > CALIBRATION_BATCHES]
    assert {name for _, name in steady} == {"all_reduce_async"}
    assert all(i % every == 0 for i, _ in steady)
    assert len(steady) == loop.iteration // every - CALIBRATION_BATCHES // every <= loop.iteration / every
    # the calibration's one-off: one agreement per batch, its round trips and the proposal
    assert len(others) - len(steady) == CALIBRATION_BATCHES - 1 + ROUND_TRIPS + 1
