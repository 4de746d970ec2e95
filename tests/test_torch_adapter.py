"""The PyTorch adapter: steps, state round-trips for every optimizer, checks, RNG helpers."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epochal._rng_torch import set_torch_rng_state, torch_rng_state  # noqa: E402
from epochal.errors import ConfigError  # noqa: E402
from epochal.torch import TorchModel  # noqa: E402

OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
    "adadelta": lambda m: torch.optim.Adadelta(m.parameters()),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05),
    "two-groups": lambda m: torch.optim.AdamW(
        [
            {"params": m[0].parameters(), "lr": 0.01, "weight_decay": 0.0},
            {"params": m[2].parameters(), "lr": 0.003, "weight_decay": 0.1},
        ]
    ),
}


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=1) == targets).float().mean()


def make(seed: int = 0, optimizer: str = "adam", **options: object) -> TorchModel:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))
    return TorchModel(
        module,
        OPTIMIZERS[optimizer](module),
        torch.nn.functional.cross_entropy,
        {"accuracy": accuracy},
        device="cpu",
        **options,  # type: ignore[arg-type]
    )


def batches(count: int, seed: int = 0, size: int = 16) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.standard_normal((size, 4)).astype(np.float32)
        out.append((x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)))
    return out


def params(model: TorchModel) -> dict[str, bytes]:
    return {k: v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for k, v in model.module.state_dict().items()}  # fmt: skip


def test_steps_return_device_scalars_reduce_the_loss_and_eval_restores_the_mode() -> None:
    model, data = make(), batches(60)
    first = model.eval_step(data[0])
    for batch in data:
        out = model.train_step(batch)
        assert set(out) == {"loss", "accuracy"}
        assert all(isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad for v in out.values())
    last = model.eval_step(data[0])
    assert float(last["loss"]) < float(first["loss"]) * 0.8
    assert float(last["accuracy"]) > float(first["accuracy"])
    model.module.train()
    model.module[1].eval()  # a mixed mode survives eval_step
    before = params(model)
    model.eval_step({"inputs": torch.from_numpy(data[1][0]), "targets": torch.from_numpy(data[1][1])})
    assert params(model) == before
    assert [m.training for m in model.module] == [True, False, True]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_optimizer_resumes_bitwise_into_a_fresh_model(optimizer: str) -> None:
    model, data = make(seed=1, optimizer=optimizer), batches(10, seed=1)
    for batch in data[:5]:
        model.train_step(batch)
    state = model.state_dict()
    assert state["optimizer"]["state"], "the optimizer keeps per-parameter state after a step"
    json.dumps(state["optimizer"]["param_groups"])  # plain values only
    fresh = make(seed=2, optimizer=optimizer)  # never stepped: no optimizer state yet
    fresh.load_state_dict(state)
    assert params(fresh) == params(model)
    rng = torch_rng_state()
    original = [float(model.train_step(b)["loss"]) for b in data[5:]]
    set_torch_rng_state(rng)  # the same dropout masks
    continued = [float(fresh.train_step(b)["loss"]) for b in data[5:]]
    assert original == continued
    assert params(fresh) == params(model)


def test_a_model_that_has_not_stepped_round_trips_both_ways() -> None:
    unstepped = make(seed=3).state_dict()
    assert unstepped["optimizer"]["state"] == {}
    stepped = make(seed=3)
    stepped.train_step(batches(1)[0])
    stepped.load_state_dict(unstepped)  # back to before the first step
    assert stepped.optimizer.state_dict()["state"] == {}
    assert params(stepped) == params(make(seed=3))


def _shares(array: np.ndarray, tensor: torch.Tensor) -> bool:
    return np.shares_memory(array, tensor.detach().view(-1).view(torch.uint8).numpy())


def test_the_saved_state_is_read_only_views_of_the_cpu_tensors_and_deepcopy_keeps_it() -> None:
    model = make()
    model.train_step(batches(1)[0])  # Adam's moments exist
    state = model.state_dict()
    kept = copy.deepcopy(state)
    module, optimizer = model.module.state_dict(), model.optimizer.state_dict()["state"]
    for name, array in state["module"].items():  # no copy: a synchronous save writes these
        assert _shares(array, module[name]), name
        assert not array.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0  # the live model cannot be changed through its state
    for pid, entry in state["optimizer"]["state"].items():
        assert _shares(entry["exp_avg"], optimizer[int(pid)]["exp_avg"]), pid
    model.train_step(batches(2)[1])
    assert all(np.array_equal(state["module"][k], v.numpy()) for k, v in module.items())
    assert any(not np.array_equal(kept["module"][k], v) for k, v in state["module"].items())
    fresh = make(seed=4)
    fresh.load_state_dict(kept)  # the copy taken before the step is what loads
    assert {k: v.tobytes() for k, v in kept["module"].items()} == params(fresh)


def test_loading_another_models_live_state_copies_it() -> None:
    model = make(seed=1)
    model.train_step(batches(1)[0])
    fresh = make(seed=2)
    fresh.load_state_dict(model.state_dict())
    live = dict(model.module.named_parameters())
    for name, param in fresh.module.named_parameters():
        assert not np.shares_memory(param.detach().numpy(), live[name].detach().numpy()), name
    assert params(fresh) == params(model)
    before = params(model)
    fresh.train_step(batches(2)[1])
    assert params(model) == before  # training the copy leaves the original alone


def test_a_state_read_from_disk_becomes_the_tensors_memory_once() -> None:
    model = make(seed=1)
    for batch in batches(3):
        model.train_step(batch)
    read = copy.deepcopy(model.state_dict())  # writable arrays of their own, as a checkpoint read
    first, second = make(seed=2), make(seed=3)
    weights = [p for p in first.module.parameters()]
    first.load_state_dict(read)
    assert [p for p in first.module.parameters()] == weights  # the same objects: the optimizer's
    assert [p for g in first.optimizer.param_groups for p in g["params"]] == weights
    for name, tensor in first.module.state_dict().items():
        assert _shares(read["module"][name], tensor), name
        assert not read["module"][name].flags.writeable, name  # taken
    moments = first.optimizer.state_dict()["state"]
    for pid, entry in read["optimizer"]["state"].items():
        assert _shares(entry["exp_avg_sq"], moments[int(pid)]["exp_avg_sq"]), pid
    second.load_state_dict(read)  # a second load copies: the two models share nothing
    for a, b in zip(first.module.parameters(), second.module.parameters(), strict=True):
        assert not np.shares_memory(a.detach().numpy(), b.detach().numpy())
    assert params(first) == params(second) == params(model)
    rng = torch_rng_state()
    data = batches(4, seed=5)
    original = [float(model.train_step(b)["loss"]) for b in data]
    for resumed in (first, second):
        set_torch_rng_state(rng)
        assert [float(resumed.train_step(b)["loss"]) for b in data] == original
        assert params(resumed) == params(model)


def test_a_module_with_a_load_hook_is_loaded_by_copying() -> None:
    model = make(seed=1)
    model.train_step(batches(1)[0])
    read = copy.deepcopy(model.state_dict())
    fresh = make(seed=2)
    calls: list[int] = []
    fresh.module[2].register_load_state_dict_post_hook(lambda module, keys: calls.append(1))
    fresh.load_state_dict(read)
    assert calls == [1]  # torch's load_state_dict ran, with its hooks
    for name, tensor in fresh.module.state_dict().items():
        assert not _shares(read["module"][name], tensor), name
    assert params(fresh) == params(model)


def test_load_state_dict_lists_mismatches_and_changes_nothing() -> None:
    model = make()
    model.train_step(batches(1)[0])
    before = params(model)
    state = model.state_dict()
    state["module"]["0.weight"] = np.zeros((8, 5), np.float32)
    state["module"]["2.bias"] = state["module"]["2.bias"].astype(np.float64)
    del state["module"]["0.bias"]
    state["module"]["extra"] = np.zeros(1, np.float32)
    with pytest.raises(ValueError) as info:
        model.load_state_dict(state)
    message = str(info.value)
    assert "missing keys ['module.0.bias']" in message
    assert "unexpected keys ['module.extra']" in message
    assert "module.0.weight: shape [8, 5] != expected [8, 4]" in message
    assert "module.2.bias: dtype float64 != expected float32" in message
    assert params(model) == before

    state = model.state_dict()
    state["optimizer"]["state"]["0"]["exp_avg"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"optimizer.state.0.exp_avg: shape \[3\] does not fit parameter 0"):
        make().load_state_dict(state)  # checked against the parameters, not a live state

    linear = torch.nn.Linear(4, 3)
    sgd = TorchModel(linear, torch.optim.SGD(linear.parameters()), None, device="cpu")
    with pytest.raises(ValueError, match=r"missing keys \['optimizer'\]"):
        sgd.load_state_dict({"module": {}})
    adam_state = model.state_dict()
    with pytest.raises(ValueError, match=r"unexpected keys \['optimizer.param_groups.0.amsgrad', "):
        sgd.load_state_dict({"module": sgd.state_dict()["module"], "optimizer": adam_state["optimizer"]})
    other = make().module
    other_sgd = TorchModel(other, torch.optim.SGD(other.parameters()), None, device="cpu").state_dict()
    with pytest.raises(ValueError, match=r"param_groups\.0: 4 parameters != expected 2"):
        sgd.load_state_dict({"module": sgd.state_dict()["module"], "optimizer": other_sgd["optimizer"]})


def test_bad_options_are_one_clear_error_each() -> None:
    with pytest.raises(ConfigError, match=r"precision 'fp16' is not one of .*did you mean '16-mixed'"):
        make(precision="fp16")
    with pytest.raises(ConfigError, match="accumulate_grad_batches must be greater than or equal to 1"):
        make(accumulate_grad_batches=0)
    with pytest.raises(ConfigError, match=r"gradient_clip_val must be greater than 0, not -1\.0"):
        make(gradient_clip_val=-1.0)
    with pytest.raises(ConfigError, match="gradient_clip_algorithm must be 'norm' or 'value'"):
        make(gradient_clip_algorithm="l2")
    with pytest.raises(ConfigError, match="pinned_state_copies must be bool, not 'yes'"):
        make(pinned_state_copies="yes")


def test_torch_rng_helpers_round_trip() -> None:
    state = torch_rng_state()
    assert state is not None and state["cpu"].dtype == np.uint8 and state["cpu"].ndim == 1
    first = torch.rand(5)
    set_torch_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    set_torch_rng_state(None)  # no-op
    with pytest.raises(ValueError, match="must have the key 'cpu'"):
        set_torch_rng_state({"cuda": [state["cpu"]]})
    with pytest.raises(ValueError, match="1-D uint8"):
        set_torch_rng_state({"cpu": state["cpu"].astype(np.int16)})


def test_a_state_read_into_the_load_destinations_loads_in_place() -> None:
    model = make(seed=1)
    for batch in batches(3):
        model.train_step(batch)
    model.module.register_buffer("scale", torch.full((3,), 1.5, dtype=torch.bfloat16))
    saved = copy.deepcopy(model.state_dict())
    target = make(seed=2)
    target.module.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))
    target.train_step(batches(1, seed=9)[0])  # the optimizer's state exists
    tensors = dict(target.module.state_dict(keep_vars=True))
    moments = {pid: dict(s) for pid, s in target.optimizer.state_dict()["state"].items()}
    into = target.load_destinations()
    assert set(into["module"]) == set(tensors)
    assert set(into["optimizer"]["state"]) == {str(pid) for pid in moments}
    state = copy.deepcopy(saved)
    for key, value in into["module"].items():  # what the checkpoint reader does
        state["module"][key] = value
        if isinstance(value, dict):
            np.copyto(value["bits"], saved["module"][key]["bits"])
        else:
            np.copyto(value, saved["module"][key])
    for pid, entries in into["optimizer"]["state"].items():
        for key, value in entries.items():
            np.copyto(value, saved["optimizer"]["state"][pid][key])
            state["optimizer"]["state"][pid][key] = value
    target.load_state_dict(state)
    for key, tensor in target.module.state_dict(keep_vars=True).items():
        assert tensor is tensors[key], key  # the same tensors, on the same memory
        assert tensor.data_ptr() == tensors[key].data_ptr(), key
    for pid, entries in target.optimizer.state_dict()["state"].items():
        for key, tensor in entries.items():
            if key != "step":
                assert tensor is moments[pid][key], (pid, key)
    assert params(target) == params(model)
    data = batches(4, seed=5)
    rng = torch_rng_state()
    original = [float(model.train_step(b)["loss"]) for b in data]
    set_torch_rng_state(rng)
    assert [float(target.train_step(b)["loss"]) for b in data] == original  # the optimizer too


def test_a_module_with_a_load_hook_offers_no_destination() -> None:
    model = make()
    model.module[2].register_load_state_dict_post_hook(lambda module, keys: None)
    assert "module" not in model.load_destinations()


def test_a_resume_reads_the_checkpoint_into_the_parameters(tmp_path: Path) -> None:
    checkpoint = pytest.importorskip("epochal_checkpoint")
    from epochal import Loop

    def loop(model: TorchModel, **options: Any) -> Loop:
        plugins = {"checkpoint": checkpoint.Checkpoint()}
        return Loop(model, {"train": batches(4)}, plugins=plugins, max_epochs=1, seed=0,
                    run_dir=tmp_path, handle_signals=False, **options)  # fmt: skip

    trained = make(seed=1)
    loop(trained).run()
    fresh = make(seed=2)
    pointers = {k: t.data_ptr() for k, t in fresh.module.state_dict().items()}
    assert params(fresh) != params(trained)
    resumed = loop(fresh, resume=True)
    resumed.run()
    assert resumed.resumed
    assert params(fresh) == params(trained)
    assert {k: t.data_ptr() for k, t in fresh.module.state_dict().items()} == pointers


def test_a_damaged_checkpoint_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    checkpoint = pytest.importorskip("epochal_checkpoint")
    from epochal_checkpoint.storage.load import read_state_document

    from epochal import Loop

    def loop(model: TorchModel, epochs: int, **options: Any) -> Loop:
        plugins = {"checkpoint": checkpoint.Checkpoint(keep_last=None)}
        return Loop(model, {"train": batches(4)}, plugins=plugins, max_epochs=epochs, seed=0,
                    run_dir=tmp_path, handle_signals=False, **options)  # fmt: skip

    def damage(path: Path) -> None:  # the last array of data.bin: those before it verify
        entry = max(read_state_document(path)["arrays"], key=lambda e: e["offset"])
        data = bytearray((path / "data.bin").read_bytes())
        data[entry["offset"] + 130] ^= 0xFF  # past its .npy header
        (path / "data.bin").write_bytes(data)

    loop(make(seed=1), 2).run()
    older, newest = (info.path for info in checkpoint.list_checkpoints(tmp_path / "checkpoints")[0])
    damage(newest)
    fresh = make(seed=2)
    with pytest.warns(RuntimeWarning, match=f"{newest.name}.*fails its checksum"):
        loop(fresh, 1, resume=True).run()  # the previous checkpoint, the last epoch: no training
    saved, _ = checkpoint.read_checkpoint(older, model_only=True)
    for key, tensor in fresh.module.state_dict().items():
        assert np.array_equal(tensor.numpy(), saved["model"]["module"][key]), key

    damage(older)
    untouched = make(seed=3)
    before = params(untouched)
    with pytest.raises(checkpoint.CorruptCheckpointError), pytest.warns(RuntimeWarning):
        loop(untouched, 2, resume=True).run()
    assert params(untouched) == before


def test_importing_the_adapter_leaves_dcp_and_dtensor_to_runs_that_shard() -> None:
    """``import epochal.torch`` costs about what ``import torch`` does: torch.distributed.checkpoint
    and DTensor (a second of CPU) are imported by FSDP and sharded checkpoints only."""
    import subprocess
    import sys

    heavy = "('torch.distributed.checkpoint', 'torch.distributed.tensor')"
    code = f"import sys, epochal.torch; print(sorted(m for m in {heavy} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
