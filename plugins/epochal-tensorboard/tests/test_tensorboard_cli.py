"""``epochal run`` with the tensorboard plugin installed as a distribution, resumed once.

The figure this test draws from the event files (read with tensorboard's own reader) is the one
in docs/plugins/tensorboard.md: set ``EPOCHAL_DOCS_ASSETS=docs/assets`` to write it there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from epochal.testing import digits_config, epochal_command

ENV = {"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_digits_run_resumed_gives_one_timeline_per_tag(tmp_path: Path) -> None:
    config = digits_config(
        tmp_path / "digits.toml",
        ["monitor", "checkpoint", "sqlite_log", "timing", "tensorboard"],
        max_epochs=3,
        batch_size=64,
        extra="[plugins.tensorboard]\nhistogram_every = 1\nflush_every = 5\n",
    )
    first = epochal_command("run", str(config), cwd=tmp_path, env=ENV)
    assert first.returncode == 0, first.stderr
    resumed = epochal_command(
        "run", str(config), "--resume", "--set", "loop.max_epochs=6", cwd=tmp_path, env=ENV
    )
    assert resumed.returncode == 0, resumed.stderr
    events = EventAccumulator(
        str(tmp_path / "run" / "version_0" / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}
    )
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "valid/loss", "valid/accuracy"} <= set(tags["scalars"])
    # the timing plugin's profiling records (dozens) stay out of the metrics' cards (issue 29)
    assert not [t for t in tags["scalars"] if t.startswith("timing/")], tags["scalars"]
    assert any(t.startswith("parameters/") for t in tags["histograms"])
    for tag in ("train/loss", "valid/loss"):
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == sorted(set(steps)), f"{tag}: duplicated steps"
    assert len(events.Scalars("valid/loss")) == 6  # one per epoch, across both runs
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for panel, metric in zip(axes, ("loss", "accuracy"), strict=True):
        for stream in ("train", "valid"):
            points = events.Scalars(f"{stream}/{metric}")
            panel.plot([p.step for p in points], [p.value for p in points], label=f"{stream}/{metric}")
        panel.set_xlabel("step (iteration)")
        panel.set_ylabel(metric)
        panel.set_title(f"{metric}: event files read back by TensorBoard (run resumed at epoch 3)")
        panel.title.set_fontsize(9)
        panel.grid(True, alpha=0.3)
        panel.legend()
    fig.tight_layout()
    png = tmp_path / "tensorboard-digits.png"
    fig.savefig(png)
    plt.close(fig)
    assert png.read_bytes()[:4] == b"\x89PNG"
    if os.environ.get("EPOCHAL_DOCS_ASSETS"):
        shutil.copy(png, Path(os.environ["EPOCHAL_DOCS_ASSETS"]) / png.name)
