"""The ``progress`` plugin, installed as a distribution, through real runs of the digits example."""

from __future__ import annotations

import copy
import logging
import os
import re
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epochal import Loop, hookimpl, load_plugins
from epochal.examples.digits import make_data, make_model
from epochal.testing import EpochalCli, ResumeFrom, StubModel, digits_config

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")


def make_loop(
    options: dict[str, Any] | None = None,
    extra: dict[str, object] | None = None,
    order: tuple[str, ...] = ("monitor", "progress"),
    data: Any = None,
    **loop: Any,
) -> Loop:
    opts = {"progress": {"force": True, "mininterval": 0.0, **(options or {})}}
    plugins = load_plugins(order=[*order, *(extra or {})], autoload=False, options=opts, extra=extra)
    loop.setdefault("max_epochs", 2)
    loop.setdefault("handle_signals", False)
    return Loop(make_model(), data or make_data(), plugins=plugins, seed=0, **loop)


def test_the_installed_distribution_provides_progress() -> None:
    from importlib.metadata import distribution, requires

    dist = distribution("epochal-progress")
    names = {ep.name: ep.value for ep in dist.entry_points if ep.group == "epochal.plugins"}
    assert names == {"progress": "epochal_progress.plugin:Progress"}
    assert any(r.startswith("tqdm") for r in requires("epochal-progress") or [])


def test_forced_bars_per_epoch_and_eval_stream_with_metrics(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    config = digits_config(tmp_path / "run.toml")
    result = epochal_cli(
        "run",
        str(config),
        "--plugins",
        "monitor,progress",
        "--set",
        "plugins.progress.force=true",
        "--set",
        "plugins.progress.mininterval=0",
    )
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert re.search(r"epoch 1/2: 100%\|.*\| 23/23 \[", err)
    assert re.search(r"epoch 2/2: 100%\|.*\| 23/23 \[", err)
    assert re.search(r"valid: .*\| ?\d+/6 \[", err)
    lines = err.replace("\r", "\n").splitlines()
    block = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("epoch 2/2 · "))) :][:3])
    for words in ("train loss", "accuracy", "valid loss"):
        assert words in block
    assert "best" not in block


def test_off_when_stdout_is_not_a_terminal(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    config = digits_config(tmp_path / "run.toml")
    result = epochal_cli("run", str(config), "--plugins", "progress")  # stdout is a pipe
    assert result.returncode == 0, result.stderr
    assert "epoch 1" not in result.stderr and "batch/s" not in result.stderr
    disabled = epochal_cli(
        "run",
        str(config),
        "--plugins",
        "progress",
        "--set",
        "plugins.progress.force=true",
        "--set",
        "plugins.progress.enabled=false",
    )
    assert disabled.returncode == 0 and "batch/s" not in disabled.stderr


def test_unknown_total_for_a_stream_without_len(capsys: pytest.CaptureFixture[str]) -> None:
    streams = make_data()
    train = streams["train"]

    def unsized() -> Iterator[Any]:
        return iter(list(train))

    loop = make_loop(data={"train": unsized, "valid": streams["valid"]}, order=("progress",), max_epochs=1)
    loop.run()
    err = capsys.readouterr().err
    assert re.search(r"epoch 1/1: 23batch \[", err)
    assert "/23" not in err


def test_resumed_mid_epoch_bar_starts_at_batch_in_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    first = make_loop(max_iterations=10, options={"enabled": False})
    first.run()
    state = copy.deepcopy(first.state_dict())
    capsys.readouterr()
    resumed = make_loop(extra={"resume": ResumeFrom(state)})
    resumed.run()
    err = capsys.readouterr().err
    first_bar = err.replace("\r", "\n").split("\n")
    epoch_one = [line for line in first_bar if line.startswith("epoch 1/2")]
    assert " 10/23 " in epoch_one[0]
    assert not any(re.search(r"\|\s+[0-9]/23 ", line) for line in epoch_one)
    assert any(" 23/23 " in line for line in epoch_one)


def test_logging_and_warnings_do_not_garble_the_bars(capsys: pytest.CaptureFixture[str]) -> None:
    class Chatty:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            if loop.iteration == 12:
                logging.getLogger("chatty").warning("hello-from-logging")
                warnings.warn("hello-from-warnings", UserWarning, stacklevel=1)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            make_loop(extra={"chatty": Chatty()}, max_epochs=1).run()
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    for text in ("hello-from-logging", "hello-from-warnings"):
        assert text in err
        start = err.index(text)
        line_start = max(err.rfind("\n", 0, start), err.rfind("\r", 0, start))
        assert "batch" not in err[line_start + 1 : start], f"{text} was written onto a bar"


def test_bars_are_closed_and_output_restored_on_error(capsys: pytest.CaptureFixture[str]) -> None:
    class Boom:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            if loop.iteration == 7:
                raise RuntimeError("boom")

    show, handlers = warnings.showwarning, list(logging.getLogger().handlers)
    loop = make_loop(extra={"boom": Boom()})
    with pytest.raises(RuntimeError, match="boom"):
        loop.run()
    progress = loop.plugins["progress"]
    assert progress._epoch is None and progress._eval is None  # type: ignore[attr-defined]
    assert warnings.showwarning is show and logging.getLogger().handlers == handlers
    assert re.search(r"epoch 1/2:\s+\d+%.*\| 6/23 ", capsys.readouterr().err.replace("\r", "\n"))


def test_bars_are_closed_on_interrupt(capsys: pytest.CaptureFixture[str]) -> None:
    class Terminate:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            if loop.iteration == 9:
                os.kill(os.getpid(), signal.SIGTERM)

    loop = make_loop(extra={"terminate": Terminate()}, handle_signals=True)
    loop.run()
    assert loop.log.status["status"] == "interrupted"
    assert loop.plugins["progress"]._epoch is None  # type: ignore[attr-defined]
    err = capsys.readouterr().err.replace("\r", "\n")
    assert re.search(r"epoch 1/2:\s+\d+%.*\| (9|10)/23 ", err)


@pytest.mark.parametrize(
    ("setting", "culprit"),
    [
        ("mininterval = -1", "mininterval"),
        ('metrics = "loss"', "metrics"),
        ('file = "stdin"', "file"),
        ("force = 1", "force"),
        ("colour = true", "colour"),
    ],
)
def test_bad_options(tmp_path: Path, epochal_cli: EpochalCli, setting: str, culprit: str) -> None:
    config = digits_config(tmp_path / "run.toml", extra=f"\n[plugins.progress]\n{setting}\n")
    result = epochal_cli("run", str(config), "--plugins", "progress")
    assert result.returncode == 2
    assert culprit in result.stderr and "progress" in result.stderr
    assert "Traceback" not in result.stderr


class Counting(StubModel):
    """A model whose train loss is the batch's number: 1, 2, 3, ... (the mean is not the last)."""

    def __init__(self) -> None:
        super().__init__(evaluation={"loss": 0.5, "a_rather_long_metric_name_for_accuracy": 0.25})
        self.n = 0

    def train_step(self, batch: Any) -> dict[str, Any]:
        self.n += 1
        return {"loss": float(self.n), "note": "text"}


def _progress_lines(capsys: pytest.CaptureFixture[str], ncols: int) -> list[str]:
    """What the progress plugin writes (one line per redraw) for a run of :class:`Counting`."""
    opts = {"progress": {"force": True, "mininterval": 0.0, "ncols": ncols}}
    plugins = load_plugins(order=["progress"], autoload=False, options=opts)
    data = {"train": [[0]] * 4, "valid": [[0]] * 2, "test": [[0]]}
    Loop(Counting(), data, plugins=plugins, max_epochs=1, handle_signals=False).run()
    return capsys.readouterr().err.replace("\r", "\n").splitlines()


def test_the_bar_and_the_block_show_running_means(capsys: pytest.CaptureFixture[str]) -> None:
    # bars wide enough that tqdm never cuts the postfix (at 60 columns a fast rate such as
    # "12345.67it/s" leaves no room for it); a value counts only when its "," or "]" follows
    lines = _progress_lines(capsys, ncols=200)
    shown = {
        m
        for line in lines
        if line.startswith("epoch 1/1:")
        for m in re.findall(r"loss=([0-9.]+)(?=[,\]])", line)
    }
    assert shown and shown <= {"1", "1.5", "2", "2.5"}, shown  # means of 1..n, never the last batch's n
    lines = _progress_lines(capsys, ncols=60)
    block = lines[lines.index(next(x for x in lines if x.startswith("epoch 1/1 · "))) :]
    text = "\n".join(block)
    assert "train loss 2.5" in text and "loss 4" not in text and "note" not in text
    assert "valid loss 0.5" in text and "test loss 0.5" in text
    assert "a_rather_long_metric_name_for_accuracy 0.25" in text  # wrapped, never cut
    assert all(len(line) <= 60 for line in block if line.strip())


class TensorCounting(Counting):
    """:class:`Counting` whose loss is a 0-d tensor, as a device's loss is left unread."""

    def train_step(self, batch: Any) -> dict[str, Any]:
        import torch

        self.n += 1
        return {"loss": torch.tensor(float(self.n))}


def test_tensor_losses_are_summed_in_one_reduction_per_fold(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from epochal.testing import counting_torch_ops

    opts = {"progress": {"force": True, "mininterval": 3600.0, "ncols": 200}}
    plugins = load_plugins(order=["progress"], autoload=False, options=opts)
    batches = 2000
    data = {"train": [[0]] * batches}
    loop = Loop(TensorCounting(), data, plugins=plugins, max_epochs=1, handle_signals=False)
    with counting_torch_ops() as ops:
        loop.run()
    additions = [op for op in ops if op.startswith("add")]
    stacks = [op for op in ops if op.startswith(("stack", "cat"))]
    # one addition per batch before: now one stacked sum (and one addition) per fold of up to
    # 1024 batches; the 2000 tensors made by the model are the only per-batch ops
    assert 1 <= len(stacks) <= 12 and len(additions) <= 12, (len(stacks), len(additions))
    block = capsys.readouterr().err.replace("\r", "\n")
    mean = sum(range(1, batches + 1)) / batches
    assert f"train loss {mean:.4g}" in block, block[-300:]
