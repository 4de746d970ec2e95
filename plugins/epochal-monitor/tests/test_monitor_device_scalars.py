"""Device scalars (CUDA tensors) are summed without being read per batch, and resume exactly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from epochal_monitor.plugin import Monitor

from epochal import Loop
from epochal.testing import ResumeFrom


class DeviceScalar:
    """Looks like a 0-d CUDA tensor to the monitor: a device, and a read that is counted."""

    device = SimpleNamespace(type="cuda")
    reads = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        DeviceScalar.reads += 1
        return self.value


class Model:
    def __init__(self) -> None:
        self.step = 0

    def train_step(self, batch: Any) -> dict[str, Any]:
        self.step += 1
        return {"loss": DeviceScalar(1.0 / self.step), "acc": DeviceScalar(0.1 * (self.step % 7))}

    def eval_step(self, batch: Any) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: Any) -> None:
        self.step = state["step"]


def data() -> dict[str, Any]:
    return {"train": [np.zeros(size) for size in (3, 5, 2, 4, 6, 1)]}


def test_device_scalars_are_read_once_per_record_and_averaged_exactly() -> None:
    DeviceScalar.reads = 0
    reads_during_batches = []

    class Spy:
        from epochal import hookimpl

        @hookimpl
        def after_batch(self) -> None:
            reads_during_batches.append(DeviceScalar.reads)

    loop = Loop(Model(), data(), plugins={"monitor": Monitor(), "spy": Spy()}, max_epochs=1)
    loop.run()
    assert set(reads_during_batches) == {0}  # nothing read while the epoch ran
    sizes = [3, 5, 2, 4, 6, 1]
    expected = 0.0
    for step, size in enumerate(sizes, 1):
        expected += (1.0 / step) * size
    assert loop.log.last("train.loss") == expected / sum(sizes)


@pytest.mark.parametrize("at", [1, 3, 5])
def test_a_run_resumed_mid_epoch_writes_the_same_bits(at: int) -> None:
    straight = Loop(Model(), data(), plugins={"monitor": Monitor()}, max_epochs=2)
    straight.run()
    first = Loop(Model(), data(), plugins={"monitor": Monitor()}, max_epochs=2, max_iterations=at)
    first.run()
    state = first.state_dict()
    resumed = Loop(Model(), data(), plugins={"monitor": Monitor(), "resume": ResumeFrom(state)}, max_epochs=2)
    resumed.run()
    for key in ("train.loss", "train.acc"):
        assert resumed.log.history(key) == straight.log.history(key)


class Mixed(Model):
    """Device scalars, host floats and numpy floats for the same metrics, in a fixed pattern."""

    def train_step(self, batch: Any) -> dict[str, Any]:
        self.step += 1
        value = 1.0 / self.step
        kind = self.step % 3
        loss = DeviceScalar(value) if kind == 0 else value if kind == 1 else np.float32(value)
        return {"loss": loss, "acc": 0.1 * (self.step % 7), "nan": float("nan") if self.step == 4 else 1.0}


def test_epoch_records_alone_equal_the_general_path_bit_for_bit() -> None:
    # every_n_batches=0 (the default) has an inline path for host floats; every_n_batches=4 goes
    # through the general one for every batch: the epochs' records must be the same bits
    records = {}
    for every in (0, 4):
        model = Mixed()
        loop = Loop(model, data(), plugins={"monitor": Monitor(every_n_batches=every)}, max_epochs=3)
        loop.run()
        assert model.step == 18
        keys = ("train.loss", "train.acc", "train.nan")
        records[every] = [(key, [(i, repr(v)) for i, v in loop.log.history(key)]) for key in keys]
    assert records[0] == records[4]
    assert all(len(history) == 3 for _, history in records[0])
