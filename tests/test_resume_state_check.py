"""The core checks the state a plugin's ``resume_state`` returns (issue 44, item 9): a state
that does not fit the model, or that the model refuses to load, is one :class:`EpochalError`
naming the plugin and the source it named; ``Loop.check_state`` says why, for any plugin."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from epochal import Loop, hookimpl
from epochal.errors import EpochalError
from epochal.examples.tiny import TinyModel, tiny_data


def saved_state(features: int = 3) -> dict[str, Any]:
    loop = Loop(TinyModel(features=features), tiny_data(), max_epochs=1, handle_signals=False)
    loop.run()
    return copy.deepcopy(loop.state_dict())


class FromDocs:
    """A checkpoint plugin written from the docs: returns whatever it read."""

    def __init__(self, state: Any) -> None:
        self.state = state

    @hookimpl
    def resume_state(self, loop: Any, resume: bool) -> Any:
        loop.resumed_source = "checkpoint /somewhere/ckpt-1"
        return self.state


def resume(state: Any, model: Any = None) -> Loop:
    loop = Loop(
        model or TinyModel(),
        tiny_data(),
        plugins={"from_docs": FromDocs(state)},
        max_epochs=2,
        handle_signals=False,
        resume=True,
    )
    loop.run()
    return loop


def test_a_state_of_another_model_is_one_error_naming_the_plugin_and_the_source() -> None:
    state = saved_state()
    state["model"]["w"] = np.zeros(5)  # another model's
    with pytest.raises(EpochalError) as raised:
        resume(state)
    message = str(raised.value)
    assert message.startswith(
        "cannot resume from checkpoint /somewhere/ckpt-1 (given by plugin 'from_docs'): model.w: shape (5,)"
    ), message


def test_a_state_the_model_refuses_to_load_is_one_error_naming_the_plugin() -> None:
    class Strict(TinyModel):
        def load_state_dict(self, state: Any) -> None:
            raise KeyError("no such layer")

    with pytest.raises(EpochalError, match=r"given by plugin 'from_docs'\): KeyError: 'no such layer'"):
        resume(saved_state(), Strict())


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda s: s.update(format=99), "loop state format 99"),
        (lambda s: s.pop("rng"), "the state has no rng"),
        (  # inside an epoch, a train stream without a position of its own to share out afresh
            lambda s: s.update(world_size=2, in_epoch=True, batch_in_epoch=1, ranks=[{}, {}], data={}),
            "--nproc 2",
        ),
        (lambda s: s["model"].pop("w"), "missing keys model.w"),
    ],
    ids=["format", "keys", "world-size", "model-keys"],
)
def test_check_state_says_why_a_state_does_not_fit(change: Any, said: str) -> None:
    loop = Loop(TinyModel(), tiny_data(), max_epochs=1, handle_signals=False)
    state = saved_state()
    assert loop.check_state(state) == []
    change(state)
    problems = loop.check_state(state)
    assert any(said in p for p in problems), problems
