"""The digits example: data factory, numpy MLP training and exact state round-trips."""

from __future__ import annotations

import numpy as np
import pytest

from epochal._options import check_options
from epochal.data import BatchStream, batch_size
from epochal.errors import ConfigError
from epochal.examples.digits import DigitsMLP, load_arrays, make_data, make_model


def evaluate(model: DigitsMLP, stream: BatchStream) -> dict[str, float]:
    totals, count = {"loss": 0.0, "accuracy": 0.0}, 0
    for batch in stream:
        metrics, n = model.eval_step(batch), batch_size(batch)
        count += n
        for key in totals:
            totals[key] += metrics[key] * n
    return {key: value / count for key, value in totals.items()}


def all_examples(stream: BatchStream) -> tuple[np.ndarray, np.ndarray]:
    batches = list(stream)
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


def test_make_data_shapes_dtypes_and_deterministic_split() -> None:
    data = make_data(batch_size=32, seed=1)
    assert set(data) == {"train", "valid"}
    train, valid = data["train"], data["valid"]
    assert (train.num_examples, valid.num_examples) == (1797 - 359, 359)
    assert (train.batch_size, train.shuffle, valid.shuffle) == (32, True, False)
    x, y = train.arrays
    assert x.dtype == np.float32 and x.shape == (1438, 64)
    assert y.dtype == np.int64 and set(np.unique(y)) == set(range(10))
    assert x.min() == 0.0 and x.max() == 1.0
    again = make_data(batch_size=32, seed=1)
    for a, b in zip(train.arrays + valid.arrays, again["train"].arrays + again["valid"].arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    # Train and valid partition the dataset, and other seeds split differently.
    full_x, full_y = load_arrays()

    def rows(xs: np.ndarray, ys: np.ndarray) -> list[bytes]:
        return sorted(a.tobytes() + b.tobytes() for a, b in zip(xs, ys, strict=True))

    joined = [np.concatenate([t, v]) for t, v in zip(train.arrays, valid.arrays, strict=True)]
    assert rows(*joined) == rows(full_x, full_y)
    other = make_data(seed=2)["valid"].arrays[1]
    assert not np.array_equal(other, valid.arrays[1])
    with pytest.raises(ConfigError, match=r"option 'valid_fraction' of 'make_data' must be less than 1"):
        check_options("make_data", make_data, {"valid_fraction": 1.0}, "[data]", ConfigError)


def test_training_reduces_loss_and_reaches_high_accuracy() -> None:
    data, model = make_data(), make_model()
    before = evaluate(model, data["valid"])
    for _ in range(5):
        for batch in data["train"]:
            metrics = model.train_step(batch)
            assert type(metrics["loss"]) is float and type(metrics["accuracy"]) is float
    after = evaluate(model, data["valid"])
    assert after["loss"] < before["loss"] / 3
    assert after["accuracy"] > 0.9 > before["accuracy"]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_state_round_trip_is_bitwise_and_training_continues_identically(momentum: float) -> None:
    data = make_data(seed=3)
    model = make_model(seed=3, momentum=momentum, lr=0.05, weight_decay=1e-4)
    stream = data["train"]
    for batch in stream:
        model.train_step(batch)
    model_state, stream_state = model.state_dict(), stream.state_dict()
    assert set(model_state) == (
        {"W1", "b1", "W2", "b2"} | ({"v_W1", "v_b1", "v_W2", "v_b2"} if momentum else set())
    )
    assert all(v.dtype == np.float32 for v in model_state.values())

    copy = make_model(seed=99, momentum=momentum, lr=0.05, weight_decay=1e-4)
    copy.load_state_dict(model_state)
    copy_stream = make_data(seed=3)["train"]
    copy_stream.load_state_dict(stream_state)
    for key, value in copy.state_dict().items():
        assert value.tobytes() == model_state[key].tobytes()

    original = [model.train_step(b) for b in stream]
    continued = [copy.train_step(b) for b in copy_stream]
    assert original == continued
    for key, value in model.state_dict().items():
        assert value.tobytes() == copy.state_dict()[key].tobytes()
    # state_dict returned copies, and load_state_dict copied in: training changed neither.
    assert not np.array_equal(model_state["W1"], model.state_dict()["W1"])


def test_same_seed_gives_the_same_weights() -> None:
    a, b, c = make_model(seed=5).state_dict(), make_model(seed=5).state_dict(), make_model(seed=6)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["W1"], c.state_dict()["W1"])


def test_load_state_dict_reports_every_mismatch_and_changes_nothing() -> None:
    model = make_model()
    before = model.state_dict()
    state = make_model(hidden=32).state_dict()
    state["b2"] = state["b2"].astype(np.float64)
    del state["W1"]
    state["extra"] = np.zeros(1)
    with pytest.raises(ValueError) as info:
        model.load_state_dict(state)
    message = str(info.value)
    assert "missing keys ['W1']" in message
    assert "unexpected keys ['extra']" in message
    assert "b1: shape (32,) != expected (64,)" in message
    assert "W2: shape (32, 10) != expected (64, 10)" in message
    assert "b2: dtype float64 != expected float32" in message
    assert all(np.array_equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"missing keys \['v_W1', 'v_W2', 'v_b1', 'v_b2'\]"):
        make_model(momentum=0.9).load_state_dict(before)
