"""PyTorch features through the loop: dtypes in checkpoints, devices, precision, accumulation,
clipping, the before_optimizer_step hook, whole-stream metrics, lazy scalars, DataLoaders,
torch.compile."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("epochal_checkpoint")  # installed with every plugin by tox

from epochal_checkpoint.errors import StateMismatchError  # noqa: E402
from epochal_checkpoint.export import export_weights  # noqa: E402
from epochal_checkpoint.plugin import Checkpoint, read_from  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

from epochal import Loop, hookimpl  # noqa: E402
from epochal.errors import ConfigError  # noqa: E402
from epochal.torch import LoaderStream, TorchModel  # noqa: E402
from epochal.torch.device import move_to, resolve_device  # noqa: E402

SHAPE = (3, 5)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dtype_cases(seed: int = 0) -> dict[str, torch.Tensor]:
    base = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(seed)) * 10
    cases = {
        name: base.to(getattr(torch, name))
        for name in (
            "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
            "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "int16", "int32", "int64",
        )
    }  # fmt: skip
    cases["float8_e8m0fnu"] = base.abs().to(torch.float8_e8m0fnu)
    for name in ("uint8", "uint16", "uint32", "uint64"):
        cases[name] = base.abs().to(torch.int64).to(getattr(torch, name))
    cases["bool"] = base > 0
    cases["complex64"] = torch.complex(base, -base)
    cases["complex128"] = cases["complex64"].to(torch.complex128)
    cases["complex32"] = cases["complex64"].to(torch.complex32)
    cases["scalar_bf16"] = torch.tensor(3.5, dtype=torch.bfloat16)
    cases["empty_bf16"] = torch.empty(0, 4, dtype=torch.bfloat16)
    cases["transposed"] = base.t()  # non-contiguous
    cases["transposed_bf16"] = base.to(torch.bfloat16).t()
    return cases


class Buffers(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        for name, tensor in dtype_cases(seed).items():
            self.register_buffer(f"t_{name}", tensor.clone() if tensor.is_contiguous() else tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def regression_batches(count: int = 4, size: int = 8, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((size, 4)).astype(np.float32), rng.integers(0, 3, size)) for _ in range(count)
    ]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("async_save", [False, True])
def test_every_dtype_round_trips_bitwise_through_a_checkpoint(tmp_path: Path, async_save: bool) -> None:
    # asynchronous: the transposed buffers' arrays (copies made for the state) are written as
    # they are, the other tensors' views copied into the snapshot
    module = Buffers()
    model = TorchModel(
        module, torch.optim.Adam(module.parameters()), torch.nn.functional.cross_entropy, device="cpu"
    )
    plugins = {"checkpoint": Checkpoint(dir=str(tmp_path / "ckpt"), async_save=async_save)}
    Loop(model, {"train": regression_batches()}, plugins=plugins, max_epochs=1, run_dir=tmp_path).run()
    state, _ = read_from(tmp_path / "ckpt")
    fresh_module = Buffers(seed=1)  # other values everywhere, until loaded
    fresh = TorchModel(fresh_module, torch.optim.Adam(fresh_module.parameters()), None, device="cpu")
    assert _bits(fresh_module.t_float32) != _bits(module.t_float32)
    fresh.load_state_dict(state["model"])
    for name, tensor in module.state_dict().items():
        loaded = fresh_module.state_dict()[name]
        assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape, name
        assert _bits(loaded) == _bits(tensor), name
    assert state["model"]["module"]["t_bfloat16"]["__tensor__"] == "bfloat16"
    assert state["model"]["module"]["t_float16"].dtype == np.float16


class ArrayModel:
    """A numpy model whose state holds byte orders and layouts numpy has but torch does not."""

    def __init__(self) -> None:
        self.state = {
            "big_endian": np.arange(6, dtype=">f8").reshape(2, 3),
            "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
            "scalar": np.array(2.5, dtype=">f4"),
            "empty": np.zeros((0, 3), np.complex64),
            "flags": np.array([True, False]),
        }

    def train_step(self, batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    def eval_step(self, batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    def state_dict(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.state.items()}

    def load_state_dict(self, state: Any) -> None:
        self.state = dict(state)


def test_big_endian_non_contiguous_and_empty_arrays_round_trip(tmp_path: Path) -> None:
    model = ArrayModel()
    plugins = {"checkpoint": Checkpoint(dir=str(tmp_path / "ckpt"))}
    Loop(model, {"train": [[1.0], [2.0]]}, plugins=plugins, max_epochs=1, run_dir=tmp_path).run()
    state, _ = read_from(tmp_path / "ckpt")
    for name, array in ArrayModel().state.items():
        loaded = state["model"][name]
        assert loaded.dtype == array.dtype and loaded.shape == array.shape, name
        assert np.array_equal(loaded, array), name


def test_exported_weights_load_with_safetensors_into_the_same_module(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    state = TorchModel(module, torch.optim.SGD(module.parameters()), None, device="cpu").state_dict()
    path = export_weights(state, tmp_path / "w.safetensors", {"epochal.epoch": 3})
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    other.load_state_dict(load_file(str(path)))
    assert all(
        _bits(a) == _bits(b) for a, b in zip(module.state_dict().values(), other.state_dict().values())
    )
    # a numpy model's arrays export under their key paths, without torch's help
    numpy_path = export_weights(
        {"W": np.ones((2, 2), ">f4"), "nested": {"b": np.zeros(2)}}, tmp_path / "n.st"
    )
    loaded = load_file(str(numpy_path))
    assert set(loaded) == {"W", "nested.b"} and loaded["W"].dtype == torch.float32


def test_weights_only_loads_the_weights_and_keeps_the_fine_tunes_own_optimizer(tmp_path: Path) -> None:
    # found by an outside-user pass: it loaded the optimizer too (the pretraining's lr, momentum
    # and step count) and refused another optimizer class
    from epochal_checkpoint import Load

    x = torch.randn(32, 4)
    data = {"train": [(x[i : i + 8], (x[i : i + 8, 0] > 0).long()) for i in range(0, 32, 8)]}
    pre = mlp(1)
    pretrained = TorchModel(
        pre, torch.optim.SGD(pre.parameters(), lr=0.3, momentum=0.9), torch.nn.functional.cross_entropy
    )
    plugins = {"checkpoint": Checkpoint(dir=str(tmp_path / "ckpt"))}
    Loop(pretrained, data, plugins=plugins, max_epochs=1, run_dir=tmp_path).run()
    weights = {k: v.clone() for k, v in pre.state_dict().items()}
    fine = mlp(2)
    tuned = TorchModel(fine, torch.optim.AdamW(fine.parameters(), lr=1e-3), torch.nn.functional.cross_entropy)
    load = Load(path=str(tmp_path / "ckpt"), weights_only=True)
    loop = Loop(tuned, data, plugins={"load": load}, max_epochs=0, run_dir=tmp_path / "ft")
    loop.run()  # no epoch: before_training loads the weights, nothing trains
    assert all(torch.equal(fine.state_dict()[k], v) for k, v in weights.items())
    assert tuned.optimizer.param_groups[0]["lr"] == 1e-3 and type(tuned.optimizer) is torch.optim.AdamW
    assert tuned.optimizer.state == {} and tuned.optimizer_steps == 0
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 5))
    other = TorchModel(wrong, torch.optim.SGD(wrong.parameters(), 0.1), torch.nn.functional.cross_entropy)
    with pytest.raises(StateMismatchError, match=r"does not fit the model: cannot load TorchModel weights"):
        Loop(other, data, plugins={"load": load}, max_epochs=0, run_dir=tmp_path / "x").run()


# -- devices ----------------------------------------------------------------------------------


def test_devices_resolve_or_fail_clearly() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    if (
        not torch.cuda.is_available()
        and getattr(torch.backends, "mps", None)
        and torch.backends.mps.is_available()
    ):
        expected = "mps"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"device 'gpu' is not one of .*'cuda:N'"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"device 'cuda:1': CUDA is not available on this machine"):
            resolve_device("cuda:1")


class Pair(NamedTuple):
    x: Any
    y: Any


def test_batches_of_any_nesting_move_to_the_device() -> None:
    big = np.arange(4, dtype=">f4")
    batch = {"a": [np.ones(2, np.float32), (torch.zeros(3), "label")], "b": Pair(big, 7)}
    moved = move_to(batch, torch.device("cpu"), dtype=torch.bfloat16)
    assert isinstance(moved["a"][0], torch.Tensor) and moved["a"][0].dtype == torch.bfloat16
    assert isinstance(moved["a"][1], tuple) and moved["a"][1][1] == "label"
    assert isinstance(moved["b"], Pair) and moved["b"].y == 7
    assert moved["b"].x.tolist() == [0.0, 1.0, 2.0, 3.0]  # a big-endian array, read right
    assert move_to(np.arange(3), torch.device("cpu"), torch.bfloat16).dtype == torch.int64  # ints kept


# -- precision, accumulation, clipping, the hook ----------------------------------------------


def sgd_model(module: torch.nn.Module, metrics: Any = None, **options: Any) -> TorchModel:
    optimizer = torch.optim.SGD(module.parameters(), 0.1)
    return TorchModel(module, optimizer, torch.nn.functional.cross_entropy, metrics, device="cpu", **options)


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adagrad])
def test_bf16_true_trains_bf16_parameters_and_resumes_bitwise(optimizer: Any) -> None:
    # Adagrad makes its float32 `sum` before the module is cast: found by an outside-user pass,
    # a resume came back with it cast to bf16 by torch's Optimizer.load_state_dict
    def make() -> TorchModel:
        m = mlp()
        return TorchModel(m, optimizer(m.parameters(), 0.01), torch.nn.functional.cross_entropy,
                          device="cpu", precision="bf16-true")  # fmt: skip

    model, data = make(), regression_batches(6)
    assert all(p.dtype == torch.bfloat16 for p in model.module.parameters())
    for batch in data[:3]:
        model.train_step(batch)
    copy = make()
    copy.load_state_dict(model.state_dict())
    dtypes = [
        [v.dtype for v in s.values() if isinstance(v, torch.Tensor)] for s in model.optimizer.state.values()
    ]
    assert [
        [v.dtype for v in s.values() if isinstance(v, torch.Tensor)] for s in copy.optimizer.state.values()
    ] == dtypes
    assert [float(model.train_step(b)["loss"]) for b in data[3:]] == [
        float(copy.train_step(b)["loss"]) for b in data[3:]
    ]
    assert all(_bits(a) == _bits(b) for a, b in zip(model.module.parameters(), copy.module.parameters()))


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_trains_and_saves_its_scaler(precision: str) -> None:
    model = sgd_model(mlp(), precision=precision)
    losses = [float(model.train_step(b)["loss"]) for b in regression_batches(20)]
    assert losses[-1] < losses[0]
    state = model.state_dict()
    assert ("scaler" in state) == (precision == "16-mixed")
    if precision == "16-mixed":
        assert state["scaler"]["scale"] > 0 and "growth_interval" in state["scaler"]


def test_accumulating_two_half_batches_equals_one_full_batch() -> None:
    full, halves = mlp(), mlp()
    a = TorchModel(
        full, torch.optim.SGD(full.parameters(), 0.1), torch.nn.functional.cross_entropy, device="cpu"
    )
    b = TorchModel(halves, torch.optim.SGD(halves.parameters(), 0.1), torch.nn.functional.cross_entropy,
                   device="cpu", accumulate_grad_batches=2)  # fmt: skip
    for x, y in regression_batches(3, size=16):
        a.train_step((x, y))
        b.train_step((x[:8], y[:8]))
        assert not b.optimizer_stepped and b.accumulated == 1
        b.train_step((x[8:], y[8:]))
        assert b.optimizer_stepped and b.accumulated == 0
    assert a.optimizer_steps == b.optimizer_steps == 3
    for p, q in zip(full.parameters(), halves.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_state_saved_inside_an_accumulation_window_resumes_bitwise() -> None:
    def make() -> TorchModel:
        m = mlp()
        return TorchModel(m, torch.optim.Adam(m.parameters()), torch.nn.functional.cross_entropy,
                          device="cpu", accumulate_grad_batches=3)  # fmt: skip

    model, data = make(), regression_batches(8)
    for batch in data[:4]:  # one step, then one batch into the next window
        model.train_step(batch)
    state = model.state_dict()
    assert state["steps"]["accumulated"] == 1 and set(state["steps"]["grads"]) == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    }
    copy = make()
    copy.load_state_dict(state)
    for batch in data[4:]:
        model.train_step(batch)
        copy.train_step(batch)
    assert all(_bits(a) == _bits(b) for a, b in zip(model.module.parameters(), copy.module.parameters()))
    with pytest.raises(ValueError, match=r"steps\.accumulated: saved 1 batches into an accumulation window"):
        m = mlp()
        TorchModel(m, torch.optim.Adam(m.parameters()), None, device="cpu").load_state_dict(state)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradients_are_clipped_before_the_step(algorithm: str) -> None:
    module = mlp()
    loss = torch.nn.functional.cross_entropy
    model = TorchModel(module, torch.optim.SGD(module.parameters(), lr=1.0), loss,
                       device="cpu", gradient_clip_val=1e-3, gradient_clip_algorithm=algorithm)  # fmt: skip
    before = [p.detach().clone() for p in module.parameters()]
    model.train_step(regression_batches(1)[0])
    deltas = [(p.detach() - b) for p, b in zip(module.parameters(), before)]
    if algorithm == "value":
        assert max(float(d.abs().max()) for d in deltas) <= 1e-3 * (1 + 1e-4)  # float32 rounding of p - g
    else:
        assert float(torch.linalg.vector_norm(torch.cat([d.reshape(-1) for d in deltas]))) <= 1e-3 * (
            1 + 1e-5
        )


class GradientSpy:
    """Records the gradient norm at each optimizer step and (optionally) zeroes the gradients."""

    def __init__(self, zero: bool = False) -> None:
        self.zero = zero
        self.calls: list[tuple[int, float]] = []

    @hookimpl
    def before_optimizer_step(self, loop: Any, optimizer: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.calls.append(
            (loop.iteration, float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))))
        )
        if self.zero:
            for g in grads:
                g.zero_()


def test_before_optimizer_step_sees_unscaled_gradients_once_per_step() -> None:
    norms = {}
    for precision in ("32-true", "16-mixed"):
        module = mlp()
        spy = GradientSpy()
        model = sgd_model(module, precision=precision, accumulate_grad_batches=2)
        Loop(model, {"train": regression_batches(6)}, plugins={"spy": spy}, max_epochs=1).run()
        assert [iteration for iteration, _ in spy.calls] == [1, 3, 5]  # before batches 2, 4, 6 finish
        norms[precision] = spy.calls[0][1]
    assert norms["16-mixed"] == pytest.approx(norms["32-true"], rel=0.05)  # not 65536 times larger


def test_a_plugin_can_change_gradients_before_the_step() -> None:
    module = mlp()
    before = [p.detach().clone() for p in module.parameters()]
    model = TorchModel(
        module, torch.optim.SGD(module.parameters(), 0.1), torch.nn.functional.cross_entropy, device="cpu"
    )
    Loop(model, {"train": regression_batches(3)}, plugins={"spy": GradientSpy(zero=True)}, max_epochs=1).run()
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


# -- metrics ----------------------------------------------------------------------------------


def test_metric_objects_are_computed_over_the_whole_stream() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    from sklearn.metrics import f1_score

    module = mlp()
    f1 = torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro")
    model = sgd_model(module, {"f1": f1, "accuracy": lambda o, t: (o.argmax(1) == t).float().mean()})
    valid = regression_batches(5, size=7, seed=3)
    loop = Loop(model, {"train": regression_batches(2), "valid": valid}, max_epochs=1)
    loop.run()
    metrics = loop.last_metrics["valid"]
    with torch.no_grad():
        predictions = np.concatenate([module(torch.from_numpy(x)).argmax(1).numpy() for x, _ in valid])
    targets = np.concatenate([y for _, y in valid])
    assert metrics["f1"] == pytest.approx(f1_score(targets, predictions, average="macro"), abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(float(np.mean(predictions == targets)), abs=1e-6)
    assert loop.log.current_row["valid.f1"] == metrics["f1"]
    loop.evaluate("valid")  # reset between streams: the same value again, not a running total
    assert loop.last_metrics["valid"]["f1"] == pytest.approx(metrics["f1"], abs=1e-7)


class CountingScalar:
    """A device scalar that counts how often it is read on the host (each read would sync)."""

    device = SimpleNamespace(type="cuda")
    reads = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        CountingScalar.reads += 1
        return self.value

    def __mul__(self, other: float) -> CountingScalar:
        return CountingScalar(self.value * other)

    def __add__(self, other: CountingScalar) -> CountingScalar:
        return CountingScalar(self.value + other.value)

    def __radd__(self, other: float) -> CountingScalar:
        return CountingScalar(self.value + other)

    def __truediv__(self, other: float) -> CountingScalar:
        return CountingScalar(self.value / other)


class LazyModel:
    def train_step(self, batch: Any) -> dict[str, Any]:
        return {"loss": CountingScalar(1.0)}

    def eval_step(self, batch: Any) -> dict[str, Any]:
        return {"loss": CountingScalar(float(batch[0])), "name": "text"}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        pass


def test_evaluation_reads_each_metric_once_per_stream_not_per_batch() -> None:
    loop = Loop(LazyModel(), {"train": [[1.0]], "valid": [[1.0], [2.0], [3.0], [6.0]]}, max_epochs=1)
    CountingScalar.reads = 0
    metrics = loop.evaluate("valid")
    assert CountingScalar.reads == 1
    assert metrics == {"loss": 3.0}  # strings are not averaged


# -- DataLoaders ------------------------------------------------------------------------------


def loader(num_workers: int = 0) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(50)), batch_size=6, shuffle=True, num_workers=num_workers)


def epochs(stream: LoaderStream, count: int) -> list[list[list[int]]]:
    return [[batch[0].tolist() for batch in stream] for _ in range(count)]


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: worker processes
def test_a_dataloader_resumes_mid_epoch_with_the_same_order(num_workers: int) -> None:
    rng = torch.get_rng_state()
    straight = epochs(LoaderStream(loader(num_workers), seed=7), 2)
    assert torch.equal(torch.get_rng_state(), rng)  # the global generator is not drawn from
    assert straight[0] != straight[1] and sorted(i for batch in straight[0] for i in batch) == list(range(50))
    assert epochs(LoaderStream(loader(num_workers), seed=7), 2) == straight  # (seed, epoch) only
    resumed = LoaderStream(loader(num_workers), seed=7)
    resumed.load_state_dict({"seed": 7, "epoch": 0, "position": 4})
    assert [b[0].tolist() for b in resumed] == straight[0][4:]
    assert resumed.state_dict() == {"seed": 7, "epoch": 1, "position": 0, "batches": 9}
    assert [b[0].tolist() for b in resumed] == straight[1]
    with pytest.raises(ValueError, match="seeded with 7 into one seeded with 8"):
        LoaderStream(loader(), seed=8).load_state_dict({"seed": 7, "epoch": 0, "position": 1})


def test_a_dataloader_refuses_a_position_it_cannot_continue() -> None:
    # found by an outside-user pass: a position past the epoch resumed silently, the epoch's
    # remaining training skipped; and another batch size inside an epoch gave other examples
    saved = {"seed": 7, "epoch": 0, "position": 4, "batches": 9}  # 50 examples, batches of 6
    with pytest.raises(
        ValueError, match=r"LoaderStream state: position 11 is beyond the 9 batches of an epoch"
    ):
        LoaderStream(loader(), seed=7).load_state_dict({"seed": 7, "epoch": 0, "position": 11})  # older state
    with pytest.raises(ValueError, match=r"saved at batch 4 of an epoch of 13 batches: its epoch now has 9"):
        LoaderStream(loader(), seed=7).load_state_dict({**saved, "batches": 13})
    at_the_end = LoaderStream(loader(), seed=7)
    at_the_end.load_state_dict({**saved, "position": 13, "batches": 13})  # a complete epoch
    assert [b[0].tolist() for b in at_the_end] == [] and at_the_end.state_dict()["epoch"] == 1


class Counting(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(range(20))


def test_an_iterable_dataset_resumes_by_skipping() -> None:
    stream = LoaderStream(DataLoader(Counting(), batch_size=4), seed=0)
    stream.load_state_dict({"seed": 0, "epoch": 0, "position": 3})
    assert [b.tolist() for b in stream] == [[12, 13, 14, 15], [16, 17, 18, 19]]


def test_the_loop_makes_dataloaders_resumable_by_itself() -> None:
    module = mlp()
    x = torch.randn(40, 4)
    data = {"train": DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8, shuffle=True)}
    model = TorchModel(
        module, torch.optim.SGD(module.parameters(), 0.1), torch.nn.functional.cross_entropy, device="cpu"
    )
    loop = Loop(model, data, max_epochs=1, seed=3)
    assert isinstance(loop.data["train"], LoaderStream)
    loop.run()
    assert loop.state_dict()["data"]["train"] == {"seed": 3, "epoch": 1, "position": 0, "batches": 5}


def test_unseeded_runs_order_their_dataloaders_afresh_and_a_resume_continues_the_saved_order() -> None:
    # found by an outside-user pass: without [loop] seed every run shuffled alike (seed 0)
    x = torch.randn(60, 4)

    def loop(seed: int | None = None) -> Loop:
        module = mlp()
        model = TorchModel(
            module, torch.optim.SGD(module.parameters(), 0.1), torch.nn.functional.cross_entropy
        )
        data = {"train": DataLoader(TensorDataset(x, torch.arange(60) % 3), batch_size=4, shuffle=True)}
        return Loop(model, data, max_epochs=1, seed=seed)

    def order(stream: Any) -> list[list[float]]:
        return [batch[0][:, 0].tolist() for batch in stream]

    unseeded = [order(loop().data["train"]) for _ in range(3)]
    assert unseeded[0] != unseeded[1] or unseeded[1] != unseeded[2]  # 3 draws among 15! orders
    assert order(loop(seed=5).data["train"]) == order(loop(seed=5).data["train"])
    saved = loop().data["train"]
    batches = iter(saved)
    next(batches)  # one batch: position 1
    state = saved.state_dict()
    rest = order(batches)
    resumed = loop().data["train"]  # another drawn seed, until it loads the saved one
    resumed.load_state_dict(state)
    assert order(resumed) == rest and resumed.state_dict()["seed"] == state["seed"]


# -- torch.compile ----------------------------------------------------------------------------


def test_a_compiled_module_trains_and_its_state_uses_the_original_names() -> None:
    def make() -> TorchModel:
        module = mlp()
        compiled = torch.compile(module, backend="aot_eager")
        return TorchModel(
            compiled, torch.optim.Adam(module.parameters()), torch.nn.functional.cross_entropy, device="cpu"
        )

    model, data = make(), regression_batches(6)
    for batch in data[:3]:
        model.train_step(batch)
    state = model.state_dict()
    assert set(state["module"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    plain = mlp()
    copy = TorchModel(
        plain, torch.optim.Adam(plain.parameters()), torch.nn.functional.cross_entropy, device="cpu"
    )
    copy.load_state_dict(state)  # a plain module loads a compiled one's state, and back
    assert [float(model.train_step(b)["loss"]) for b in data[3:]] == [
        float(copy.train_step(b)["loss"]) for b in data[3:]
    ]


class _StopAt:
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == self.iteration:
            loop.request_stop("test stop")


def _checkpointed_run(run_dir: Path, async_save: bool, stop: int | None = None, resume: bool = False) -> Loop:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
    model = TorchModel(
        module,
        torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9),
        torch.nn.functional.cross_entropy,
        device="cpu",
    )
    plugins: dict[str, object] = {"stop": _StopAt(stop)} if stop else {}
    plugins["checkpoint"] = Checkpoint(every_n_batches=1, keep_last=2, async_save=async_save)
    data = {"train": regression_batches(6), "valid": regression_batches(2, seed=1)}
    loop = Loop(
        model,
        data,
        plugins=plugins,
        max_epochs=3,
        seed=0,
        run_dir=run_dir,
        resume=resume,
        handle_signals=False,
    )
    loop.run()
    return loop


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoints_saved_every_batch_while_training_goes_on_resume_bitwise(
    async_save: bool, tmp_path: Path
) -> None:
    # the synchronous save writes the tensors' own memory before the next batch changes it; the
    # asynchronous one writes its snapshot while the next batches change the tensors
    straight = _checkpointed_run(tmp_path / "straight", async_save)
    _checkpointed_run(tmp_path / "resumed", async_save, stop=7)
    resumed = _checkpointed_run(tmp_path / "resumed", async_save, resume=True)
    assert resumed.resumed and resumed.iteration == straight.iteration == 18
    for name, tensor in straight.model.module.state_dict().items():
        assert _bits(resumed.model.module.state_dict()[name]) == _bits(tensor), name
    moments = resumed.model.optimizer.state_dict()["state"]
    for pid, entry in straight.model.optimizer.state_dict()["state"].items():
        assert _bits(moments[pid]["momentum_buffer"]) == _bits(entry["momentum_buffer"]), pid
    read, _ = read_from(tmp_path / "resumed" / "checkpoints")
    fresh = _checkpointed_run(tmp_path / "unused", async_save, stop=1).model
    fresh.load_state_dict(read["model"])  # a checkpoint just read: taken, not copied
    for name, tensor in fresh.module.state_dict().items():
        array = read["model"]["module"][name]
        assert np.shares_memory(array, tensor.view(-1).view(torch.uint8).numpy()), name
        assert _bits(tensor) == _bits(straight.model.module.state_dict()[name]), name


def _overlap(array: np.ndarray, tensor: torch.Tensor) -> bool:
    start, storage = array.__array_interface__["data"][0], tensor.untyped_storage()
    return start < storage.data_ptr() + storage.nbytes() and storage.data_ptr() < start + array.nbytes


def test_a_synchronous_save_hands_the_tensors_memory_and_an_asynchronous_one_copies_once(
    tmp_path: Path,
) -> None:
    storage = pytest.importorskip("epochal_checkpoint.storage")
    module = Buffers()
    model = TorchModel(module, torch.optim.SGD(module.parameters()), None, device="cpu")
    loop = Loop(model, {"train": []}, plugins={}, run_dir=tmp_path)
    state = loop.state_dict(log_rows=False)
    synchronous = storage.flatten(state)  # what the checkpoint plugin writes from, sync_save
    snapshot = storage.flatten(state, copy_arrays=True)  # its snapshot, async_save
    arrays = {tuple(e["path"]): a for e, a in zip(synchronous.index, synchronous.arrays, strict=True)}
    copies = {tuple(e["path"]): a for e, a in zip(snapshot.index, snapshot.arrays, strict=True)}
    for name, tensor in module.state_dict().items():
        if not tensor.numel():
            continue
        path = ("model", "module", name)
        path += ("bits",) if (*path, "bits") in arrays else ()
        # no copy, but of a transposed tensor (made contiguous once: the checkpoint's layout)
        assert _overlap(arrays[path], tensor) == tensor.is_contiguous(), name
        assert not _overlap(copies[path], tensor), name
        # the snapshot copies a view of a live tensor; the transposed tensor's array, a copy
        # made for this state alone, is written as it is (as a GPU tensor's copy on the host)
        assert (copies[path] is arrays[path]) == (not tensor.is_contiguous()), name


class CountingLoads(TorchModel):
    """A TorchModel that counts its loads."""

    loads = 0

    def load_state_dict(self, state: Any) -> None:
        type(self).loads += 1
        super().load_state_dict(state)


def test_a_resume_loads_the_model_once_its_own_check_passed(tmp_path: Path) -> None:
    # the checkpoint plugin checks the state with check_state and leaves the one load to the loop
    # (on a GPU each load copies the whole state to the device)
    def run(resume: bool, max_epochs: int, size: int = 16) -> Loop:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, size), torch.nn.Linear(size, 3))
        model = CountingLoads(
            module, torch.optim.AdamW(module.parameters()), torch.nn.functional.cross_entropy, device="cpu"
        )
        plugins = {"checkpoint": Checkpoint()}
        data = {"train": regression_batches(4)}
        loop = Loop(model, data, plugins=plugins, max_epochs=max_epochs, run_dir=tmp_path, resume=resume)
        loop.run()
        return loop

    run(False, 1)
    CountingLoads.loads = 0
    resumed = run(True, 2)
    assert resumed.resumed and resumed.epoch == 2 and CountingLoads.loads == 1
    CountingLoads.loads = 0
    with pytest.raises(StateMismatchError, match=r"does not fit the model: .*shape"):
        run(True, 3, size=8)
    assert CountingLoads.loads == 0


def test_an_optimizer_that_needs_a_closure_is_one_error_when_the_model_is_made() -> None:
    # found by an outside-user pass: LBFGS failed at the first step with torch's TypeError
    module = mlp()
    with pytest.raises(ConfigError, match=r"optimizer LBFGS needs a closure at every step"):
        TorchModel(module, torch.optim.LBFGS(module.parameters()), torch.nn.functional.cross_entropy)
