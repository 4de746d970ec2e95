"""The PyTorch adapter: training steps, bitwise state round-trips and the torch RNG helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epochal._rng_torch import set_torch_rng_state, torch_rng_state  # noqa: E402
from epochal.torch import TorchModel  # noqa: E402


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs.argmax(dim=1) == targets).float().mean())


def make(seed: int = 0, lr: float = 0.05) -> TorchModel:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    return TorchModel(module, optimizer, torch.nn.functional.cross_entropy, {"accuracy": accuracy})


def batches(count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.standard_normal((16, 4)).astype(np.float32)
        out.append((x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)))
    return out


def params(model: TorchModel) -> dict[str, bytes]:
    return {k: v.detach().numpy().tobytes() for k, v in model.module.state_dict().items()}


def test_training_steps_reduce_the_loss_and_eval_restores_the_mode() -> None:
    model, data = make(), batches(60)
    first = model.eval_step(data[0])
    for batch in data:
        out = model.train_step(batch)
        assert set(out) == {"loss", "accuracy"} and all(type(v) is float for v in out.values())
    last = model.eval_step(data[0])
    assert last["loss"] < first["loss"] * 0.8
    assert last["accuracy"] > first["accuracy"]
    model.module.train()
    model.module[1].eval()  # a mixed mode survives eval_step
    before = params(model)
    model.eval_step((torch.from_numpy(data[1][0]), torch.from_numpy(data[1][1])))
    assert params(model) == before
    assert [m.training for m in model.module] == [True, False, True]


def test_state_round_trip_is_bitwise_and_training_continues_identically() -> None:
    model, data = make(seed=1), batches(10, seed=1)
    for batch in data[:5]:
        model.train_step(batch)
    state = model.state_dict()
    assert set(state) == {"module", "optimizer"}
    assert all(isinstance(v, np.ndarray) for v in state["module"].values())
    adam_state = state["optimizer"]["state"]
    assert set(adam_state) == {"0", "1", "2", "3"}
    assert set(adam_state["0"]) == {"step", "exp_avg", "exp_avg_sq"}
    groups = state["optimizer"]["param_groups"]
    json.dumps(groups)  # plain values only
    assert groups[0]["betas"] == [0.9, 0.999]

    copy = make(seed=2, lr=0.5)
    copy.load_state_dict(state)
    assert params(copy) == params(model)
    assert copy.optimizer.param_groups[0]["lr"] == 0.05
    assert copy.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    saved = {k: v.copy() for k, v in state["module"].items()}

    rng = torch_rng_state()
    original = [model.train_step(b) for b in data[5:]]
    set_torch_rng_state(rng)  # same dropout masks
    continued = [copy.train_step(b) for b in data[5:]]
    assert original == continued
    assert params(copy) == params(model)
    # The state did not alias the live tensors, in either direction.
    assert all(np.array_equal(saved[k], v) for k, v in state["module"].items())
    assert params(model) != {k: v.tobytes() for k, v in saved.items()}


def test_load_state_dict_lists_mismatches_and_changes_nothing() -> None:
    model = make()
    model.train_step(batches(1)[0])
    before = params(model)
    state = model.state_dict()
    state["module"]["0.weight"] = np.zeros((8, 5), np.float32)
    state["module"]["2.bias"] = state["module"]["2.bias"].astype(np.float64)
    del state["module"]["0.bias"]
    state["module"]["extra"] = np.zeros(1, np.float32)
    state["optimizer"]["state"]["0"]["exp_avg"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError) as info:
        model.load_state_dict(state)
    message = str(info.value)
    assert "missing keys ['module.0.bias']" in message
    assert "unexpected keys ['module.extra']" in message
    assert "module.0.weight: shape (8, 5) != expected (8, 4)" in message
    assert "module.2.bias: dtype float64 != expected float32" in message
    assert "optimizer.state.0.exp_avg: shape (3,) != expected (8, 4)" in message
    assert params(model) == before

    sgd = TorchModel(torch.nn.Linear(4, 3), torch.optim.SGD(torch.nn.Linear(4, 3).parameters()), None)
    with pytest.raises(ValueError, match=r"missing keys \['optimizer'\]"):
        sgd.load_state_dict({"module": {}})
    with pytest.raises(ValueError, match=r"unexpected keys \['optimizer.param_groups.0.amsgrad', "):
        sgd.load_state_dict({"module": sgd.state_dict()["module"], "optimizer": state["optimizer"]})
    two_layers = make().module
    other_sgd = TorchModel(two_layers, torch.optim.SGD(two_layers.parameters()), None).state_dict()
    with pytest.raises(ValueError, match=r"param_groups\.0: 4 parameters != expected 2"):
        sgd.load_state_dict({"module": sgd.state_dict()["module"], "optimizer": other_sgd["optimizer"]})


def test_torch_rng_helpers_round_trip() -> None:
    state = torch_rng_state()
    assert state is not None and state["cpu"].dtype == np.uint8 and state["cpu"].ndim == 1
    first = torch.rand(5)
    set_torch_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    set_torch_rng_state(None)  # no-op
    with pytest.raises(ValueError, match="single key 'cpu'"):
        set_torch_rng_state({"cuda": state["cpu"]})
    with pytest.raises(ValueError, match="1-D uint8"):
        set_torch_rng_state({"cpu": state["cpu"].astype(np.int16)})
