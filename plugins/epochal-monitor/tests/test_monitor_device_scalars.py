"""Device scalars (CUDA tensors) are summed without being read per batch, and resume exactly."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from epochal_monitor.plugin import Monitor, NonFiniteMetricWarning

from epochal import Loop, hookimpl
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


def test_with_running_records_each_device_scalar_is_read_once() -> None:
    # windows of 4 batches over epochs of 6: the values a running record read are added to the
    # epoch's means as read, so the epoch's end reads only those since the last record
    DeviceScalar.reads = 0
    loop = Loop(Model(), data(), plugins={"monitor": Monitor(every_n_batches=4)}, max_epochs=2)
    loop.run()
    assert DeviceScalar.reads == 2 * 6 * 2  # two metrics, six batches, two epochs: each value once
    sizes = [3, 5, 2, 4, 6, 1]
    for epoch in (0, 1):
        steps = range(epoch * 6 + 1, epoch * 6 + 7)
        expected = sum((1.0 / step) * size for step, size in zip(steps, sizes)) / sum(sizes)
        assert loop.log.history("train.loss")[epoch][1] == expected
    # the first window: batches 1-4 of epoch 1, sizes 3, 5, 2, 4
    first = sum((1.0 / step) * size for step, size in zip(range(1, 5), sizes)) / 14
    assert loop.log.history("train.loss.running")[0] == (4, first)


@pytest.mark.parametrize("at", [1, 3, 5, 7])
def test_a_run_resumed_mid_epoch_writes_the_same_bits(at: int) -> None:
    # windows of 4 batches: 1, 3, 5 and 7 are each inside one (1, 3 and 5 inside an epoch too)
    straight = Loop(Model(), data(), plugins={"monitor": Monitor(every_n_batches=4)}, max_epochs=2)
    straight.run()
    first = Loop(
        Model(), data(), plugins={"monitor": Monitor(every_n_batches=4)}, max_epochs=2, max_iterations=at
    )
    first.run()
    state = first.state_dict()
    plugins = {"monitor": Monitor(every_n_batches=4), "resume": ResumeFrom(state)}
    resumed = Loop(Model(), data(), plugins=plugins, max_epochs=2)
    resumed.run()
    for key in ("train.loss", "train.acc", "train.loss.running", "train.acc.running"):
        assert resumed.log.history(key) == straight.log.history(key)
    assert len(straight.log.history("train.loss.running")) == 3


class Mixed(Model):
    """Device scalars, host floats and numpy floats for the same metrics, in a fixed pattern."""

    def train_step(self, batch: Any) -> dict[str, Any]:
        self.step += 1
        value = 1.0 / self.step
        kind = self.step % 3
        loss = DeviceScalar(value) if kind == 0 else value if kind == 1 else np.float32(value)
        return {"loss": loss, "acc": 0.1 * (self.step % 7), "nan": float("nan") if self.step == 4 else 1.0}


class General(Monitor):
    """The monitor with its general ``after_batch`` only (what ``reduce = "step"`` on several
    processes runs): the reference the inline paths must match bit for bit."""

    @hookimpl
    def after_batch(self, loop: Any, batch: Any, outputs: Any) -> None:
        self._after_batch(loop, batch, outputs)


@pytest.mark.parametrize("every", [0, 4, 50])
def test_the_inline_paths_equal_the_general_path_bit_for_bit(every: int) -> None:
    # every_n_batches 0 and n > 1 (50: the default) each have an inline path for host floats;
    # the epochs' records and the running records must be the bits of the general path's (1
    # reads a device scalar at once, as its record is due at once: its sums are in batch order)
    records = {}
    for monitor in (Monitor(every_n_batches=every), General(every_n_batches=every)):
        model = Mixed()
        loop = Loop(model, data(), plugins={"monitor": monitor}, max_epochs=3 if every < 50 else 10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteMetricWarning)
            loop.run()
        keys = [f"train.{m}{s}" for m in ("loss", "acc", "nan") for s in ("", ".running")]
        records[type(monitor)] = [(key, [(i, repr(v)) for i, v in loop.log.history(key)]) for key in keys]
    assert records[Monitor] == records[General]
    epochs = 3 if every < 50 else 10
    assert all(len(history) == epochs for key, history in records[Monitor] if not key.endswith(".running"))
    running = dict(records[Monitor])["train.loss.running"]
    assert len(running) == (epochs * 6 // every if every else 0)


def test_a_window_of_torch_scalars_is_read_in_one_stack_with_no_op_per_value() -> None:
    # 50 values (the default window): one stack and one reshape, then the copy to the host;
    # before, a detach and a reshape per value (100 ops) cost more than the read itself
    torch = pytest.importorskip("torch")
    from epochal_monitor.plugin import _read_all

    from epochal.testing import counting_torch_ops

    values = [torch.tensor(step / 3.0, requires_grad=True) * 2 for step in range(50)]
    with counting_torch_ops() as ops:
        read = _read_all(values)
    assert [op.split(".")[0] for op in ops] == ["stack", "view"], ops
    assert read == [float(value.detach()) for value in values]  # the bits float() reads, one by one
    # half precision, integers and booleans are widened exactly; () and (1,) mixed are read too
    mixed = [torch.tensor(1.1, dtype=torch.bfloat16), torch.tensor([2.2], dtype=torch.float16)]
    assert _read_all(mixed) == [float(value) for value in mixed]
    # integers and booleans become floats on the host: no float64 op on the device (MPS has none)
    whole = [torch.tensor(True), torch.tensor(3)]
    with counting_torch_ops() as ops:
        integers = _read_all(whole)
    assert integers == [1.0, 3.0] and all(type(value) is float for value in integers)
    assert [op.split(".")[0] for op in ops] == ["stack", "view"], ops
