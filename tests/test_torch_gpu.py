"""PyTorch on a CUDA device: placement, precisions, checkpoints, no host sync per batch.

Skipped on machines without CUDA (CI); run on a GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("epochal_checkpoint")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from epochal_checkpoint.plugin import Checkpoint, read_from  # noqa: E402
from epochal_monitor.plugin import Monitor  # noqa: E402

from epochal import Loop, hookimpl  # noqa: E402
from epochal.testing import epochal_command  # noqa: E402
from epochal.torch import TorchModel  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits_torch.toml"


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 3))


def numpy_batches(count: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((16, 4)).astype(np.float32), rng.integers(0, 3, 16)) for _ in range(count)]


def model(precision: str = "32-true", seed: int = 0) -> TorchModel:
    module = mlp(seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    return TorchModel(
        module, optimizer, torch.nn.functional.cross_entropy, device="auto", precision=precision
    )


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed", "bf16-true"])
def test_numpy_batches_train_on_the_gpu_and_checkpoints_resume(tmp_path: Path, precision: str) -> None:
    trained = model(precision)
    assert next(trained.module.parameters()).device.type == "cuda"
    plugins = {"checkpoint": Checkpoint(dir=str(tmp_path / "ckpt"))}
    Loop(trained, {"train": numpy_batches()}, plugins=plugins, max_epochs=1, run_dir=tmp_path).run()
    state, _ = read_from(tmp_path / "ckpt")
    fresh = model(precision, seed=1)
    fresh.load_state_dict(state["model"])
    for a, b in zip(trained.module.parameters(), fresh.module.parameters()):
        assert b.device.type == "cuda" and torch.equal(a, b)
    if precision == "16-mixed":
        assert fresh.precision.scaler is not None
        assert fresh.precision.scaler.get_scale() == trained.precision.scaler.get_scale()
    batch = numpy_batches(1)[0]
    torch.manual_seed(5)
    one = float(trained.train_step(batch)["loss"])
    torch.manual_seed(5)
    assert float(fresh.train_step(batch)["loss"]) == one


class SyncGuard:
    """Turns CUDA's sync debug mode to "error" around each training step and monitor's work."""

    @hookimpl
    def before_batch(self) -> None:
        torch.cuda.set_sync_debug_mode("error")

    @hookimpl
    def after_batch(self) -> None:  # ordered after monitor: its after_batch ran under "error"
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_training_steps_never_wait_for_the_device(precision: str) -> None:
    trained = model(precision)
    data = [(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()) for x, y in numpy_batches()]
    plugins = {"monitor": Monitor(), "guard": SyncGuard()}
    try:
        loop = Loop(trained, {"train": data}, plugins=plugins, max_epochs=2)
        loop.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert np.isfinite(loop.log.last("train.loss"))


def test_check_resume_on_the_gpu(tmp_path: Path) -> Any:
    result = epochal_command(
        "check-resume", str(EXAMPLE), "--at", "50", "--set", "loop.max_epochs=2",
        "--set", "model.device=cuda", "--set", "model.precision=bf16-mixed", "--disable", "progress",
        cwd=tmp_path, timeout=600,
        env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    assert "ok: interrupted after batch 50" in result.stdout


def test_an_asynchronous_save_copies_each_gpu_tensor_once(tmp_path: Path) -> None:
    # the host copy of a GPU tensor is made for the state alone: the asynchronous save's
    # snapshot writes that array as it is (one copy per save, the device-to-host one)
    from epochal_checkpoint import storage

    trained = model()
    Loop(trained, {"train": numpy_batches(2)}, plugins={}, max_epochs=1).run()  # AdamW has moments
    state = Loop(trained, {"train": []}, plugins={}, run_dir=tmp_path).state_dict(log_rows=False)
    snapshot = storage.flatten(state, copy_arrays=True)
    moments = state["model"]["optimizer"]["state"].values()
    on_device = list(state["model"]["module"].values())
    on_device += [entry[key] for entry in moments for key in ("exp_avg", "exp_avg_sq")]
    kept = {id(array) for array in snapshot.arrays}
    assert on_device and all(id(array) in kept for array in on_device)
    plugins = {"checkpoint": Checkpoint(dir=str(tmp_path / "ckpt"), async_save=True)}
    Loop(trained, {"train": numpy_batches()}, plugins=plugins, max_epochs=1, run_dir=tmp_path).run()
    saved, _ = read_from(tmp_path / "ckpt")
    for name, tensor in trained.module.state_dict().items():
        assert np.array_equal(saved["model"]["module"][name], tensor.cpu().numpy()), name


def host_arrays(state: dict[str, Any]) -> list[np.ndarray]:
    """The arrays of a TorchModel state's module and optimizer moments (its GPU tensors' copies)."""
    moments = state["optimizer"]["state"].values()
    arrays = list(state["module"].values())
    return arrays + [entry[key] for entry in moments for key in ("exp_avg", "exp_avg_sq")]


def big_model(pinned: bool = True) -> TorchModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 3))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    return TorchModel(
        module, optimizer, torch.nn.functional.cross_entropy, device="cuda", pinned_state_copies=pinned
    )


def batches_on_gpu(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(256, 512, device="cuda", generator=generator) for _ in range(count)]
    return [(x, torch.randint(0, 3, (256,), device="cuda", generator=generator)) for x in inputs]


def test_a_save_copies_gpu_tensors_into_page_locked_memory_once_the_queued_steps_ran() -> None:
    trained = big_model()
    for batch in batches_on_gpu(20):  # queued: the state is taken while the device still works
        trained.train_step(batch)
    state = trained.state_dict()
    arrays = host_arrays(state)
    assert arrays and all(torch.from_numpy(array).is_pinned() for array in arrays)
    expected = host_arrays(big_model_state_by_cpu_copies(trained))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, expected, strict=True))
    # the page-locked memory of one save serves the next (torch's caching host allocator)
    first = {array.__array_interface__["data"][0] for array in arrays}
    del state, arrays
    again = {array.__array_interface__["data"][0] for array in host_arrays(trained.state_dict())}
    assert again == first


def big_model_state_by_cpu_copies(trained: TorchModel) -> dict[str, Any]:
    """The state as ``tensor.cpu()`` copies it (after a wait for the device)."""
    torch.cuda.synchronize()
    optimizer = trained.optimizer.state_dict()
    return {
        "module": {k: v.cpu().numpy() for k, v in trained.raw_module.state_dict().items()},
        "optimizer": {
            "state": {
                pid: {k: v.cpu().numpy() for k, v in entry.items() if k != "step"}
                for pid, entry in optimizer["state"].items()
            }
        },
    }


def test_pinned_state_copies_false_copies_through_pageable_memory(tmp_path: Path) -> None:
    trained = big_model(pinned=False)
    for batch in batches_on_gpu(3):
        trained.train_step(batch)
    arrays = host_arrays(trained.state_dict())
    assert arrays and not any(torch.from_numpy(array).is_pinned() for array in arrays)
    expected = host_arrays(big_model_state_by_cpu_copies(trained))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, expected, strict=True))
    # and a checkpoint of either kind resumes bitwise
    plugins = {"checkpoint": Checkpoint(dir=str(tmp_path / "ckpt"))}
    Loop(trained, {"train": batches_on_gpu(4)}, plugins=plugins, max_epochs=1, run_dir=tmp_path).run()
    saved, _ = read_from(tmp_path / "ckpt")
    fresh = big_model()
    fresh.load_state_dict(saved["model"])
    for a, b in zip(trained.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(a, b)
