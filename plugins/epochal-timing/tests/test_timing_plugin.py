"""The ``timing`` plugin, installed as a distribution, through real runs of the digits example."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from epochal import Loop, hookimpl, load_plugins
from epochal.examples.digits import make_data, make_model
from epochal.testing import EpochalCli, digits_config

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")


class Slow:
    """A test plugin that sleeps 1 ms in every before_batch and 5 ms in every after_epoch."""

    @hookimpl
    def before_batch(self) -> None:
        time.sleep(0.001)

    @hookimpl
    def after_epoch(self) -> None:
        time.sleep(0.005)


class Boom:
    """A test plugin that raises in the 5th after_batch."""

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == 5:
            raise RuntimeError("boom")


def make_loop(
    order: list[str],
    options: dict[str, Any] | None = None,
    extra: dict[str, object] | None = None,
    **loop: Any,
) -> Loop:
    plugins = load_plugins(order=[*order, *(extra or {})], autoload=False, options=options or {}, extra=extra)
    loop.setdefault("max_epochs", 2)
    return Loop(make_model(), make_data(), plugins=plugins, seed=0, handle_signals=False, **loop)


def epoch_rows(loop: Loop) -> list[dict[str, Any]]:
    return [row for _, row in loop.log.rows() if "epochs_done" in row]


def test_the_installed_distribution_provides_timing() -> None:
    from importlib.metadata import distribution

    dist = distribution("epochal-timing")
    names = {ep.name: ep.value for ep in dist.entry_points if ep.group == "epochal.plugins"}
    assert names == {"timing": "epochal_timing.plugin:Timing"}


def test_epoch_records_per_stage_hook_and_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    loop = make_loop(["timing", "monitor", "early_stopping"], {"timing": {"table": True}})
    loop.run()
    rows = epoch_rows(loop)
    assert len(rows) == 2
    for row in rows:
        for key in (
            "timing.epoch",
            "timing.read_data",
            "timing.train_step",
            "timing.eval.valid",
            "timing.hook.after_batch",
            "timing.plugin.monitor.after_batch",
            "timing.plugin.monitor.before_epoch",
            "timing.plugin.early_stopping.after_evaluation",
        ):
            assert isinstance(row[key], float) and row[key] >= 0, key
        parts = [v for k, v in row.items() if k.startswith(("timing.hook.", "timing.eval.")) and v]
        parts += [row["timing.read_data"], row["timing.train_step"]]
        assert sum(parts) <= row["timing.epoch"]  # the parts are disjoint slices of the interval
        plugin_sum = sum(
            v for k, v in row.items() if k.startswith("timing.plugin.") and k.endswith(".after_batch")
        )
        assert row["timing.hook.after_batch"] == pytest.approx(plugin_sum)
    # other plugins' after_epoch time is counted in the next epoch's record
    assert "timing.plugin.monitor.after_epoch" not in rows[0]
    assert "timing.plugin.monitor.after_epoch" in rows[1]
    assert not any(k.startswith("timing.plugin.timing") for row in rows for k in row)
    summary = loop.log.status["timing"]
    assert summary["train_step"]["calls"] == loop.iteration
    assert summary["plugin.monitor.after_batch"]["calls"] == loop.iteration
    assert summary["plugin.early_stopping.after_training"]["calls"] == 1
    json.dumps(summary)
    table = capsys.readouterr().err
    assert "timing:" in table and "train_step" in table and "monitor.after_batch" in table


def test_the_slow_plugin_is_named_first() -> None:
    loop = make_loop(["timing", "monitor"], {"timing": {"per_plugin": True}}, extra={"slow": Slow()})
    loop.run()
    summary = loop.log.status["timing"]
    assert summary["plugin.slow.before_batch"]["seconds"] >= 0.001 * loop.iteration
    assert summary["plugin.slow.after_epoch"]["seconds"] >= 0.005 * 2
    plugins = sorted((k for k in summary if k.startswith("plugin.")), key=lambda k: -summary[k]["seconds"])
    assert plugins[0] == "plugin.slow.before_batch"
    # the sleeps are the plugin's, not the train step's
    assert summary["train_step"]["seconds"] < summary["plugin.slow.before_batch"]["seconds"]
    lines = Timing_table(loop)
    assert lines.index("  slow.before_batch") < lines.index("  monitor.after_batch")


def Timing_table(loop: Loop) -> list[str]:  # noqa: N802 - reads like the table it returns
    timing = loop.plugins["timing"]
    return [re.split(r"(?<=\S) {2,}", line)[0] for line in timing.format_table().splitlines()]  # type: ignore[attr-defined]


def test_hooks_are_unwrapped_after_training_and_after_an_error() -> None:
    def wrapped(loop: Loop) -> list[str]:
        pm = loop.plugin_set.pm
        return [
            f"{impl.plugin_name}.{name}"
            for name in ("after_batch", "after_epoch", "before_epoch")
            for impl in getattr(pm.hook, name).get_hookimpls()
            if hasattr(impl.function, "__wrapped__")
        ]

    loop = make_loop(["timing", "monitor"], {"timing": {"per_plugin": True}})
    loop.run()
    assert wrapped(loop) == []
    failing = make_loop(["timing", "monitor"], {"timing": {"per_plugin": True}}, extra={"boom": Boom()})
    with pytest.raises(RuntimeError, match="boom"):
        failing.run()
    assert wrapped(failing) == []
    assert failing.log.status["timing"]["train_step"]["calls"] == 4  # the 5th never completed
    assert failing.log.status["timing"]["plugin.boom.after_batch"]["calls"] == 5


@pytest.mark.parametrize("options", [{"per_plugin": False, "table": True}, {}], ids=["false", "default"])
def test_per_plugin_false_wraps_nothing(options: dict[str, Any]) -> None:
    """Nor does the default, without a profile asked for (issue 48: wrapping costs every call)."""
    loop = make_loop(["timing", "monitor"], {"timing": options})
    loop.run()
    (row, _) = epoch_rows(loop)
    assert "timing.train_step" in row and "timing.read_data" in row
    assert not any(k.startswith(("timing.plugin.", "timing.hook.")) for k in row)


def test_records_false_keeps_the_log_clean() -> None:
    loop = make_loop(["timing"], {"timing": {"records": False, "table": False}})
    loop.run()
    assert not any(k.startswith("timing.") for _, row in loop.log.rows() for k in row)
    assert loop.log.status["timing"]["train_step"]["calls"] == loop.iteration


def test_cli_prints_the_table_only_when_asked(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    config = digits_config(tmp_path / "run.toml")
    quiet = epochal_cli("run", str(config), "--only", "timing,monitor,early_stopping")
    assert quiet.returncode == 0, quiet.stderr
    assert "stage / plugin.hook" not in quiet.stderr and "timing:" not in quiet.stderr
    result = epochal_cli("run", str(config), "--only", "timing,monitor,early_stopping", "--profile")
    assert result.returncode == 0, result.stderr
    assert "stage / plugin.hook" in result.stderr
    for name in (
        "read_data",
        "train_step",
        "eval.valid",
        "monitor.after_batch",
        "early_stopping.after_epoch",
    ):
        assert name in result.stderr
    assert max(len(line) for line in result.stderr.splitlines()) <= 100  # fitted, not 100+ wide
    table = epochal_cli("run", str(config), "--only", "timing", "--set", "plugins.timing.table=true")
    assert table.returncode == 0 and "stage / plugin.hook" in table.stderr


def test_profile_without_timing_is_a_usage_error(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    config = digits_config(tmp_path / "run.toml")
    result = epochal_cli("run", str(config), "--only", "monitor", "--profile")
    assert result.returncode == 2
    assert "--profile" in result.stderr and "timing" in result.stderr


def test_order_timing_brackets_the_batch(epochal_cli: EpochalCli) -> None:
    result = epochal_cli("plugins", "--order", "--json")
    assert result.returncode == 0, result.stderr
    order = json.loads(result.stdout)["order"]
    assert order["before_batch"][0] == "timing"
    assert order["after_batch"][-1] == "timing"
    assert order["after_epoch"][0] == "timing"


@pytest.mark.parametrize(
    ("setting", "culprit"), [('table = "yes"', "table"), ("per_hook = true", "per_hook")]
)
def test_bad_options(tmp_path: Path, epochal_cli: EpochalCli, setting: str, culprit: str) -> None:
    config = digits_config(tmp_path / "run.toml", extra=f"\n[plugins.timing]\n{setting}\n")
    result = epochal_cli("run", str(config), "--plugins", "timing")
    assert result.returncode == 2
    assert culprit in result.stderr and "timing" in result.stderr
    assert "Traceback" not in result.stderr


class Counter:
    """A test plugin counting its after_batch calls."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def after_batch(self) -> None:
        self.calls += 1


def test_a_gated_plugin_is_timed_when_its_trigger_lets_it_run() -> None:
    counter = Counter()
    loop = make_loop(
        ["timing", "monitor"],
        {"timing": {"per_plugin": True}, "counter": {"every_n_batches": 3}},
        extra={"counter": counter},
    )
    loop.run()
    summary = loop.log.status["timing"]
    assert counter.calls == loop.iteration // 3 > 0
    assert summary["plugin.counter.after_batch"]["calls"] == counter.calls
    assert summary["plugin.monitor.after_batch"]["calls"] == loop.iteration
    assert summary["hook.after_batch"]["calls"] == loop.iteration + counter.calls


class Sleepy:
    """A test plugin sleeping 1 ms in every after_batch."""

    @hookimpl
    def after_batch(self) -> None:
        time.sleep(0.001)


def test_an_isolated_failure_between_timed_plugins_leaves_their_counts_whole() -> None:
    loop = make_loop(
        ["timing", "monitor"],
        {"timing": {"per_plugin": True}, "boom": {"on_failure": "isolate"}},
        extra={"boom": Boom(), "sleepy": Sleepy()},
        max_epochs=1,
    )
    with pytest.warns(RuntimeWarning, match="boom"):
        loop.run()
    summary = loop.log.status["timing"]
    assert summary["plugin.boom.after_batch"]["calls"] == 5  # then isolated: never called again
    for plugin in ("monitor", "sleepy"):
        assert summary[f"plugin.{plugin}.after_batch"]["calls"] == loop.iteration
    assert summary["plugin.sleepy.after_batch"]["seconds"] >= 0.001 * loop.iteration
