"""The loop through its Python API: hook sequence, limits, policies, errors, state."""

from __future__ import annotations

import math
import re
import signal
import warnings

import numpy as np
import pytest

from epochal import CompositePlugin, EmptyDataError, Loop, PluginError, compose, hookimpl
from epochal.data import BatchStream
from epochal.plugins import new_plugin_manager, register


class Noisy:
    """A model whose steps draw from numpy's global RNG (so RNG state matters on resume)."""

    def __init__(self, seed: int = 0) -> None:
        self.w = np.random.default_rng(seed).normal(size=3)

    def train_step(self, batch):
        x, y = batch
        noise = np.random.normal(scale=0.01, size=self.w.shape)
        error = x @ self.w - y
        self.w = self.w - 0.1 * x.T @ error / len(x) + noise
        return {"loss": float((error**2).mean())}

    def eval_step(self, batch):
        x, y = batch
        return {"loss": float(((x @ self.w - y) ** 2).mean()), "n": len(x)}

    def state_dict(self):
        return {"w": self.w.copy()}

    def load_state_dict(self, state):
        self.w = np.array(state["w"])


def make_data(n=20, batch_size=4, valid=6):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 3))
    y = x @ np.array([1.0, 2.0, 3.0])
    return {
        "train": BatchStream(x, y, batch_size=batch_size, seed=3),
        "valid": BatchStream(x[:valid], y[:valid], batch_size=4, shuffle=False),
    }


class Recorder:
    def __init__(self, calls: list, name: str = "rec") -> None:
        self.calls = calls
        self.name = name
        self.batches = 0

    @hookimpl
    def before_training(self, loop):
        self.calls.append((self.name, "before_training"))

    @hookimpl
    def on_resumption(self, loop):
        self.calls.append((self.name, "on_resumption"))

    @hookimpl
    def before_epoch(self, loop):
        self.calls.append((self.name, "before_epoch", loop.epoch))

    @hookimpl
    def before_batch(self, loop, batch):
        self.calls.append((self.name, "before_batch", loop.iteration))

    @hookimpl
    def after_batch(self, loop, outputs):
        self.batches += 1
        loop.log.current_row[f"{self.name}.seen"] = self.batches
        self.calls.append((self.name, "after_batch", loop.iteration))

    @hookimpl
    def before_evaluation(self, stream):
        self.calls.append((self.name, "before_evaluation", stream))

    @hookimpl
    def after_eval_batch(self, stream, outputs):
        self.calls.append((self.name, "after_eval_batch", stream))

    @hookimpl
    def after_evaluation(self, loop, stream, metrics):
        self.calls.append((self.name, "after_evaluation", stream, dict(metrics)))

    @hookimpl
    def after_epoch(self, loop):
        self.calls.append((self.name, "after_epoch", loop.epoch))

    @hookimpl
    def after_training(self, loop):
        self.calls.append((self.name, "after_training", loop.log.status["finish_reason"]))

    @hookimpl
    def on_error(self, loop, error):
        self.calls.append((self.name, "on_error", type(error).__name__))

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def kinds(calls, name="rec"):
    return [c[1] for c in calls if c[0] == name]


def test_hook_sequence_of_a_run_with_epoch_zero_evaluation():
    calls: list = []
    loop = Loop(Noisy(), make_data(n=8), plugins={"rec": Recorder(calls)}, max_epochs=2, eval_at_start=True)
    loop.run()
    evaluation = ["before_evaluation", "after_eval_batch", "after_eval_batch", "after_evaluation"]
    epoch = [
        "before_epoch",
        "before_batch",
        "after_batch",
        "before_batch",
        "after_batch",
        *evaluation,
        "after_epoch",
    ]
    assert kinds(calls) == ["before_training", *evaluation, *epoch, *epoch, "after_training"]
    assert loop.epoch == 2 and loop.iteration == 4
    assert loop.log.status["status"] == "finished"
    assert loop.log.status["finish_reason"] == "max_epochs=2 reached"


def test_eval_metrics_are_batch_size_weighted_and_logged():
    calls: list = []
    data = make_data(n=8, valid=6)  # valid batches of 4 and 2 examples
    model = Noisy()
    loop = Loop(model, data, plugins={"rec": Recorder(calls)}, max_epochs=1)
    loop.run()
    x, y = data["valid"].arrays
    expected = (4 * ((x[:4] @ model.w - y[:4]) ** 2).mean() + 2 * ((x[4:] @ model.w - y[4:]) ** 2).mean()) / 6
    assert loop.log[loop.iteration]["valid.loss"] == pytest.approx(expected)
    assert loop.log[loop.iteration]["valid.n"] == pytest.approx((4 * 4 + 2 * 2) / 6)
    evaluation = next(c for c in calls if c[1] == "after_evaluation")
    assert evaluation[3]["loss"] == pytest.approx(expected)


def test_max_iterations_stops_mid_epoch_without_after_epoch():
    calls: list = []
    loop = Loop(Noisy(), make_data(), plugins={"rec": Recorder(calls)}, max_iterations=7)
    loop.run()
    assert loop.iteration == 7 and loop.epoch == 1
    assert kinds(calls).count("after_epoch") == 1
    assert calls[-1] == ("rec", "after_training", "max_iterations=7 reached")


def test_request_stop_ends_at_the_batch_boundary():
    class Stopper:
        @hookimpl
        def after_batch(self, loop):
            if loop.iteration == 3:
                loop.request_stop("enough")

    calls: list = []
    loop = Loop(Noisy(), make_data(), plugins={"rec": Recorder(calls), "stop": Stopper()}, max_epochs=5)
    loop.run()
    assert loop.iteration == 3
    assert loop.log.status["finish_reason"] == "enough"
    assert kinds(calls)[-1] == "after_training"


class StopIn:
    """Asks for a stop in *hook* at *iteration* (the loop's counter when the hook runs)."""

    def __init__(self, hook: str, iteration: int) -> None:
        self.hook, self.at = hook, iteration

    def _maybe(self, loop, hook):
        if hook == self.hook and loop.iteration == self.at:
            loop.request_stop(f"asked in {hook}")

    @hookimpl
    def before_training(self, loop):
        self._maybe(loop, "before_training")

    @hookimpl
    def before_epoch(self, loop):
        self._maybe(loop, "before_epoch")

    @hookimpl
    def before_batch(self, loop):
        self._maybe(loop, "before_batch")

    @hookimpl
    def after_batch(self, loop):
        self._maybe(loop, "after_batch")

    @hookimpl
    def after_epoch(self, loop):
        self._maybe(loop, "after_epoch")


@pytest.mark.parametrize(
    ("hook", "at", "iterations", "epochs"),
    [
        ("before_training", 0, 0, 0),  # no epoch starts
        ("before_epoch", 5, 5, 1),  # a boundary too: the epoch trains no batch
        ("before_batch", 7, 8, 1),  # the batch being started still trains
        ("after_batch", 7, 7, 1),
        ("after_batch", 5, 5, 0),  # the epoch's last batch: the epoch does not end
        ("after_epoch", 5, 5, 1),
    ],
)
def test_a_stop_requested_in_any_hook_ends_at_the_next_batch_boundary(hook, at, iterations, epochs):
    loop = Loop(Noisy(), make_data(), plugins={"stop": StopIn(hook, at)}, max_epochs=5)
    loop.run()
    assert (loop.iteration, loop.epoch) == (iterations, epochs)
    assert loop.log.status["finish_reason"] == f"asked in {hook}"


def test_a_stop_asked_at_the_iteration_limit_keeps_its_own_reason():
    loop = Loop(Noisy(), make_data(), plugins={"stop": StopIn("after_batch", 7)}, max_iterations=7)
    loop.run()
    assert loop.iteration == 7
    assert loop.log.status["finish_reason"] == "asked in after_batch"


def test_batch_in_epoch_counts_the_epochs_trained_batches_across_a_mid_epoch_resume():
    full, empty = (np.ones((2, 3)), np.ones(2)), (np.zeros((0, 3)), np.zeros(0))
    data = {"train": [full, full, empty, full, empty]}  # 3 batches per epoch, 2 skipped

    class Counts:
        def __init__(self) -> None:
            self.seen: list[tuple[int, int, int]] = []

        @hookimpl
        def before_batch(self, loop):
            self.seen.append((loop.epoch, loop.batch_in_epoch, loop.iteration))

    first = Loop(Noisy(), data, plugins={"c": Counts()}, max_iterations=5, on_empty_batch="ignore")
    first.run()
    assert first.plugins["c"].seen == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4)]
    assert (first.batch_in_epoch, first.in_epoch) == (2, True)
    state = first.state_dict()
    assert (state["iteration"], state["batch_in_epoch"], state["in_epoch"]) == (5, 2, True)
    resumed = Loop(Noisy(), data, plugins={"c": Counts()}, max_epochs=3, on_empty_batch="ignore")
    resumed.load_state_dict(state)
    assert resumed.batch_in_epoch == 2
    resumed.run()
    assert resumed.plugins["c"].seen == [(1, 2, 5), (2, 0, 6), (2, 1, 7), (2, 2, 8)]
    assert (resumed.iteration, resumed.epoch, resumed.batch_in_epoch, resumed.in_epoch) == (9, 3, 3, False)


def test_streams_may_be_callables_and_plain_iterables():
    batches = [(np.ones((2, 3)), np.ones(2))] * 3
    loop = Loop(Noisy(), {"train": lambda: iter(batches), "valid": batches}, max_epochs=2)
    loop.run()
    assert loop.iteration == 6
    assert "valid.loss" in loop.log[6]


@pytest.mark.parametrize("policy", ["error", "warn", "ignore"])
def test_empty_batch_policy(policy):
    empty = (np.zeros((0, 3)), np.zeros(0))
    full = (np.ones((2, 3)), np.ones(2))
    loop = Loop(Noisy(), {"train": [full, empty, full]}, max_epochs=2, on_empty_batch=policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if policy == "error":
            with pytest.raises(EmptyDataError, match="empty batch"):
                loop.run()
            return
        loop.run()
    assert loop.iteration == 4  # the empty batches were skipped
    messages = [str(w.message) for w in caught if "empty batch" in str(w.message)]
    assert len(messages) == (1 if policy == "warn" else 0)  # reported once


@pytest.mark.parametrize("policy", ["error", "warn", "ignore"])
def test_empty_eval_stream_policy(policy):
    full = (np.ones((2, 3)), np.ones(2))
    loop = Loop(Noisy(), {"train": [full], "valid": []}, max_epochs=1, on_empty_stream=policy)
    if policy == "error":
        with pytest.raises(EmptyDataError, match="'valid' yielded no batch"):
            loop.run()
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.run()
    assert loop.last_metrics["valid"] == {}
    assert any("no batch" in str(w.message) for w in caught) == (policy == "warn")


def test_empty_train_stream_without_epoch_limit_stops():
    loop = Loop(Noisy(), {"train": []}, on_empty_stream="ignore")
    loop.run()
    assert loop.log.status["finish_reason"] == "the train stream is empty"


def test_on_error_reaches_every_plugin_and_the_error_is_reraised():
    class Bad:
        @hookimpl
        def after_batch(self, loop):
            raise ValueError("boom")

        @hookimpl
        def on_error(self, loop, error):
            raise RuntimeError("on_error fails too")

    calls: list = []
    loop = Loop(Noisy(), make_data(), plugins={"bad": Bad(), "rec": Recorder(calls)}, max_epochs=1)
    with pytest.warns(RuntimeWarning, match="'bad' raised in on_error"), pytest.raises(ValueError) as info:
        loop.run()
    assert str(info.value) == "boom"
    assert "raised in hook 'after_batch' of plugin 'bad'" in info.value.__notes__[0]
    assert calls[-1] == ("rec", "on_error", "ValueError")
    assert loop.error_plugin == "bad"
    assert loop.log.status["status"] == "failed"
    assert "after_training" not in kinds(calls)


def test_error_in_the_model_calls_on_error_with_no_plugin_to_blame():
    class Broken(Noisy):
        def train_step(self, batch):
            raise FloatingPointError("nan")

    calls: list = []
    loop = Loop(Broken(), make_data(), plugins={"rec": Recorder(calls)}, max_epochs=1)
    with pytest.raises(FloatingPointError):
        loop.run()
    assert calls[-1] == ("rec", "on_error", "FloatingPointError")
    assert loop.error_plugin is None


def test_hooks_without_implementations_compile_to_nothing():
    loop = Loop(Noisy(), make_data(), plugins={"rec": Recorder([])})
    assert loop.hooks.after_batch is not None
    assert loop.hooks.on_interrupt is None


def test_misspelled_hook_or_argument_is_refused_leaving_nothing_registered():
    class Typo:
        @hookimpl
        def after_epoch(self, loop):
            pass

        @hookimpl
        def after_bach(self, loop):
            pass

    class BadArg:
        @hookimpl
        def before_training(self, loop):
            pass

        @hookimpl
        def after_batch(self, loop, outptus):
            pass

    with pytest.raises(PluginError, match=r"'typo'.*unknown hook 'after_bach'.*did you mean 'after_batch'"):
        compose({"typo": Typo()})
    pm = new_plugin_manager()
    plugin = BadArg()
    with pytest.raises(PluginError, match=r"'bad'.*'outptus'.*did you mean 'outputs'"):
        register(pm, "bad", plugin)
    assert pm.get_plugin("bad") is None
    assert not pm.hook.before_training.get_hookimpls()


def test_composite_children_run_as_one_unit_and_can_be_disabled():
    calls: list = []

    class Pair(CompositePlugin):
        def __init__(self):
            super().__init__({"a": Recorder(calls, "pair/a"), "b": Recorder(calls, "pair/b")})

    plugins = {"first": Recorder(calls, "first"), "pair": Pair(), "last": Recorder(calls, "last")}
    plugin_set = compose(plugins)
    assert list(plugin_set.plugins) == ["first", "pair/a", "pair/b", "last"]
    assert plugin_set.call_order("after_batch") == ["first", "pair/a", "pair/b", "last"]
    assert list(compose(plugins, disable=["pair/b"]).plugins) == ["first", "pair/a", "last"]
    loop = Loop(Noisy(), make_data(), plugins=plugins, max_iterations=1)
    loop.run()
    assert [c[0] for c in calls if c[1] == "after_batch"] == ["first", "pair/a", "pair/b", "last"]
    assert loop.plugins["pair/b"] is plugins["pair"].plugins["b"]


def test_order_contradiction_is_an_error_naming_both():
    class MustBeFirst(Recorder):
        run_before = ("a",)

    with pytest.raises(PluginError, match=r"'a'.*'b'.*cycle"):
        compose({"a": Recorder([]), "b": MustBeFirst([])})


def run_straight(epochs=3):
    calls: list = []
    loop = Loop(Noisy(), make_data(), plugins={"rec": Recorder(calls)}, max_epochs=epochs, seed=5)
    loop.run()
    return loop


@pytest.mark.parametrize("stop_at", [1, 4, 5, 6, 10, 14])
def test_state_dict_resumes_bitwise_at_any_batch_boundary(stop_at):
    straight = run_straight()
    first = Loop(
        Noisy(), make_data(), plugins={"rec": Recorder([])}, max_epochs=3, seed=5, max_iterations=stop_at
    )
    first.run()
    state = first.state_dict()
    np.random.seed(1234)  # the resumed run must not depend on the RNG state it starts with
    calls: list = []
    resumed = Loop(Noisy(seed=99), make_data(), plugins={"rec": Recorder(calls)}, max_epochs=3, seed=5)
    resumed.load_state_dict(state)
    resumed.log.status["finish_reason"] = None
    resumed.run()
    assert np.array_equal(resumed.model.w, straight.model.w)
    assert resumed.plugins["rec"].batches == straight.plugins["rec"].batches
    rows = lambda loop: [(i, r) for i, r in loop.log.rows()]  # noqa: E731
    assert rows(resumed) == rows(straight)
    assert resumed.resumed_from == first.run_id != resumed.run_id
    assert "on_resumption" in kinds(calls)
    # a mid-epoch resume does not start the epoch again
    assert kinds(calls).count("before_epoch") == 3 - math.ceil(stop_at / 5)


def test_state_for_plugins_not_in_the_run_is_kept_and_reported():
    first = Loop(Noisy(), make_data(), plugins={"rec": Recorder([])}, max_iterations=2)
    first.run()
    state = first.state_dict()
    second = Loop(Noisy(), make_data(), plugins={}, max_iterations=3)
    with pytest.warns(RuntimeWarning, match="not in this run.*rec"):
        second.load_state_dict(state)
    assert second.state_dict()["plugins"]["rec"]["state"] == {"batches": 2}


# -- min_epochs / min_steps: a plugin's stop waits for them -------------------------------------


class StopAt:
    """Asks to stop after batch *batch* (counted over the run), or at the end of epoch *epoch*."""

    def __init__(self, batch: int = 0, epoch: int = 0, signal_instead: bool = False) -> None:
        self.batch, self.epoch, self.signal_instead = batch, epoch, signal_instead

    @hookimpl
    def after_batch(self, loop):
        if loop.iteration == self.batch:
            if self.signal_instead:
                import signal

                loop.stopping.interrupt(signal.SIGTERM)
            else:
                loop.request_stop("asked")

    @hookimpl
    def after_epoch(self, loop):
        if loop.epoch == self.epoch:
            loop.request_stop("asked at an epoch end")


def run_tiny(plugin: object, **options: object) -> Loop:
    from epochal.examples.tiny import TinyModel, tiny_data

    loop = Loop(TinyModel(), tiny_data(), plugins={"stop": plugin}, handle_signals=False, **options)
    loop.run()
    return loop


def test_a_stop_asked_before_min_epochs_waits_for_them():
    loop = run_tiny(StopAt(epoch=1), max_epochs=10, min_epochs=3)
    assert (loop.epoch, loop.iteration) == (3, 12)
    assert (
        loop.log.status["finish_reason"] == "asked at an epoch end (deferred until min_epochs=3, min_steps=0)"
    )
    assert run_tiny(StopAt(epoch=1), max_epochs=10).epoch == 1  # without a minimum: at once


def test_a_stop_asked_before_min_steps_takes_effect_at_that_batch():
    loop = run_tiny(StopAt(batch=2), max_epochs=10, min_steps=7)
    assert loop.iteration == 7 and loop.log.status["finish_reason"].startswith("asked (deferred until")
    both = run_tiny(StopAt(batch=2), max_epochs=10, min_epochs=2, min_steps=5)
    assert both.iteration == 8 and both.epoch == 2  # min_steps passed during epoch 2: at its end


def test_limits_and_signals_are_not_deferred():
    assert run_tiny(StopAt(batch=99), max_epochs=2, min_steps=6).iteration == 8
    signalled = run_tiny(StopAt(batch=2, signal_instead=True), max_epochs=10, min_epochs=5)
    assert signalled.iteration == 2 and signalled.log.status["status"] == "interrupted"


class SignalAt:
    """Gives the loop *signum* after batch *batch*; with *stop_first* / *stop_after*, a plugin asks to
    stop in the same batch, before or after the signal."""

    def __init__(self, signum: int, batch: int, stop_first: bool = False, stop_after: bool = False) -> None:
        self.signum, self.batch, self.stop_first, self.stop_after = signum, batch, stop_first, stop_after
        self.interrupted: list[int] = []

    @hookimpl
    def after_batch(self, loop):
        if loop.iteration == self.batch:
            if self.stop_first:
                loop.request_stop("asked")
            loop.stopping.interrupt(self.signum)
            if self.stop_after:
                loop.request_stop("asked")

    @hookimpl
    def on_interrupt(self, signum):
        self.interrupted.append(signum)


@pytest.mark.parametrize(
    ("plugin", "options", "reason"),
    [
        # a first SIGINT in the last epoch finishes that epoch: the run completed
        (SignalAt(signal.SIGINT, 10), {"max_epochs": 3}, "max_epochs=3 reached"),
        (SignalAt(signal.SIGTERM, 6), {"max_epochs": 5, "max_iterations": 6}, "max_iterations=6 reached"),
        (SignalAt(signal.SIGTERM, 5, stop_first=True), {"max_epochs": 5}, "asked"),
    ],
    ids=["first-sigint-in-the-last-epoch", "sigterm-at-the-iteration-limit", "sigterm-after-a-plugins-stop"],
)
def test_a_signal_that_cuts_nothing_short_leaves_the_run_finished(plugin, options, reason):
    loop = run_tiny(plugin, **options)
    name = signal.Signals(plugin.signum).name
    assert loop.log.status["status"] == "finished"
    assert loop.log.status["finish_reason"] == f"{reason} ({name} received as training ended)"
    assert plugin.interrupted == []  # no interrupt checkpoint: the final one is saved


@pytest.mark.parametrize(
    ("plugin", "options", "at"),
    [
        (SignalAt(signal.SIGINT, 2), {"max_epochs": 3}, (1, 4)),  # an epoch before the last
        (SignalAt(signal.SIGTERM, 12), {"max_epochs": 3}, (2, 12)),  # the last epoch's end is not run
        (SignalAt(signal.SIGTERM, 5, stop_after=True), {"max_epochs": 5}, (1, 5)),
        (SignalAt(signal.SIGINT, 10), {"max_epochs": 3, "test_streams": ["valid"]}, (3, 12)),
    ],
    ids=[
        "first-sigint-before-the-last-epoch",
        "sigterm-in-the-last-batch",
        "sigterm-before-a-plugins-stop",
        "test-streams-left-for-the-resume",
    ],
)
def test_a_signal_that_cuts_the_run_short_interrupts_it(plugin, options, at):
    loop = run_tiny(plugin, **options)
    assert (loop.epoch, loop.iteration) == at
    assert loop.log.status["status"] == "interrupted"
    assert plugin.interrupted == [plugin.signum]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_epochs": 5, "max_epochs": 3}, r"Loop\(\): min_epochs = 5 is more than max_epochs = 3"),
        ({"min_steps": 9, "max_iterations": 4}, r"Loop\(\): min_steps = 9 is more than max_iterations = 4"),
    ],
)
def test_a_minimum_above_its_limit_is_one_error(options, message):
    from epochal.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        run_tiny(StopAt(), **options)


class ReadsOutputs:
    """A plugin that reads the step's outputs as the contract says they are (a mapping)."""

    @hookimpl
    def after_batch(self, loop, batch, outputs):
        sum(float(value) for value in outputs.values())


class ListSteps(Noisy):
    def __init__(self, bad: str) -> None:
        super().__init__()
        self.bad = bad

    def train_step(self, batch):
        loss = super().train_step(batch)["loss"]
        return [loss] if self.bad == "train" else {"loss": loss}

    def eval_step(self, batch):
        metrics = super().eval_step(batch)
        return list(metrics.values()) if self.bad == "eval" else metrics


class TrainOnly:
    def train_step(self, batch):
        return {"loss": 1.0}


@pytest.mark.parametrize(("bad", "step"), [("train", "train_step"), ("eval", "eval_step")])
def test_a_step_that_returns_no_mapping_names_the_model_not_the_plugin(bad, step):
    loop = Loop(
        ListSteps(bad), make_data(), plugins={"reader": ReadsOutputs()}, max_epochs=1, handle_signals=False
    )
    with pytest.raises(
        TypeError, match=rf"the model's {step}\(batch\) returned a list, not a mapping"
    ) as caught:
        loop.run()
    assert loop.error_plugin is None  # the model's fault: no plugin is blamed
    assert not any("of plugin" in note for note in getattr(caught.value, "__notes__", []))


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        (
            None,
            make_data(),
            "Loop(model=...) is an object of type NoneType with no train_step and no eval_step",
        ),
        (
            type("TrainOnly", (), {"train_step": lambda self, b: {}})(),
            make_data(),
            "no eval_step method (the data",
        ),
        (Noisy(), [("x", "y")], "Loop(data=...) must be a mapping of streams, not list"),
        (Noisy(), {"train": 5}, "Loop(data=...): stream 'train' is of type int, not an iterable"),
    ],
)
def test_a_model_or_data_the_loop_cannot_use_is_refused_when_made(model, data, message):
    from epochal.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        Loop(model, data, max_epochs=1, handle_signals=False)


def test_a_model_with_no_eval_step_trains_without_evaluation_streams():
    log = Loop(TrainOnly(), {"train": make_data()["train"]}, max_epochs=2, handle_signals=False).run()
    assert log.status["epochs_done"] == 2


def test_a_third_sigint_ends_the_run_at_once_with_a_reason_the_log_keeps():
    class ThreeSigints:
        @hookimpl
        def after_batch(self, loop):
            if loop.iteration == 2:
                for _ in range(3):
                    loop.stopping.interrupt(signal.SIGINT)

    loop = Loop(Noisy(), make_data(), plugins={"sigints": ThreeSigints()}, max_epochs=2, handle_signals=False)
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert loop.log.status["status"] == "interrupted"
    # not "KeyboardInterrupt: " with nothing after it
    assert (
        loop.log.status["error"]
        == "KeyboardInterrupt: a third SIGINT: stopped at once, nothing saved at this point"
    )


@pytest.mark.parametrize(
    ("failed", "said"),
    [
        (False, "epochal: SIGTERM received after training ended; the run's outcome stands"),
        (True, "epochal: SIGTERM received while the failed run shuts down; its error stands"),
    ],
)
def test_a_signal_after_training_says_how_the_run_ended(failed, said):
    # a survivor of a lost peer, stopped by the agent, said its training had ended
    from epochal.stopping import ProcessSignals, Stop

    messages: list[str] = []
    signals = ProcessSignals(Stop(), messages.append)
    signals.end(failed)
    signals(signal.SIGTERM, None)
    assert messages[0].startswith(said) and signals.late == signal.SIGTERM


def test_a_run_resumed_from_a_failed_runs_state_does_not_keep_its_error():
    import copy

    from epochal.examples.tiny import TinyModel, tiny_data

    class FailThenSave:
        state = None

        @hookimpl
        def after_epoch(self, loop):
            if loop.epoch == 1:
                raise RuntimeError("boom at epoch 1")

        @hookimpl
        def on_error(self, loop):  # as the checkpoint plugin's save on error
            self.state = copy.deepcopy(loop.state_dict())

    saver = FailThenSave()
    failed = Loop(TinyModel(), tiny_data(), plugins={"fail": saver}, max_epochs=3, handle_signals=False)
    with pytest.raises(RuntimeError):
        failed.run()
    assert saver.state["log"]["status"]["error"] == "RuntimeError: boom at epoch 1"
    resumed = Loop(TinyModel(), tiny_data(), max_epochs=3, handle_signals=False)
    resumed.load_state_dict(saver.state)
    status = resumed.run().status
    assert status["status"] == "finished" and status["finish_reason"] == "max_epochs=3 reached"
    assert "error" not in status


def test_a_metric_some_batches_return_is_their_mean_not_diluted_by_the_others():
    # found by an outside-user pass: every metric was divided by the stream's whole example count
    from epochal.testing import StubModel

    def evaluation(batch):
        (x,) = batch
        return {"v": 1.0, **({"w": 2.0} if len(x) == 3 else {})}

    loop = Loop(
        StubModel(evaluation=evaluation),
        {"train": [(np.zeros((2, 1)),)], "valid": [(np.ones((3, 1)),), (np.zeros((1, 1)),)]},
        max_epochs=1,
        handle_signals=False,
    )
    assert loop.evaluate("valid") == {"v": 1.0, "w": 2.0}


def test_the_loop_says_whether_its_interrupt_hooks_ran_before_a_third_sigint():
    # found by an outside-user pass: a third SIGINT during the wind-down said "nothing was
    # saved" though the interrupt checkpoint was on disk
    class Late:
        saved = False

        @hookimpl
        def after_batch(self, loop):
            if loop.iteration == 2:
                loop.stopping.interrupt(signal.SIGTERM)

        @hookimpl
        def on_interrupt(self, loop):
            self.saved = True

        @hookimpl
        def after_training(self, loop):
            for _ in range(3):
                loop.stopping.interrupt(signal.SIGINT)

    late = Late()
    loop = Loop(Noisy(), make_data(), plugins={"late": late}, max_epochs=2, handle_signals=False)
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert late.saved and loop.interrupt_hooks_ran
    early = Loop(Noisy(), make_data(), max_epochs=2, handle_signals=False)
    assert not early.interrupt_hooks_ran


def test_a_loop_runs_once_and_says_how_to_train_on():
    # found by an outside-user pass: a second run() (with a higher max_epochs) trained nothing
    # and said nothing, after calling before_training again
    from epochal.errors import EpochalError

    loop = Loop(Noisy(), make_data(), max_epochs=1, handle_signals=False)
    loop.run()
    loop.max_epochs = 2
    with pytest.raises(EpochalError, match=r"a loop runs once.*new.load_state_dict\(loop.state_dict\(\)\)"):
        loop.run()
    again = Loop(Noisy(), make_data(), max_epochs=2, handle_signals=False)
    again.load_state_dict(loop.state_dict())
    assert again.run().status["epochs_done"] == 2


def test_an_epoch_size_goes_on_through_the_stream_across_epochs_and_restarts_it_at_its_end():
    """``epoch_size`` = 3 over a stream of 5 batches with no position of its own: the epochs
    take batches in the stream's order, a pass running on into the next epoch and the stream
    starting again only when it ends (a restart once replayed the epoch's batches so far)."""
    from epochal.testing import StubModel

    seen: list[int] = []
    model = StubModel(train=lambda batch: (seen.append(int(batch)), {"loss": 0.0})[1])
    loop = Loop(model, {"train": [0, 1, 2, 3, 4]}, epoch_size=3, max_epochs=4, handle_signals=False)
    loop.run()
    assert seen == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert loop.epoch == 4 and loop.iteration == 12
