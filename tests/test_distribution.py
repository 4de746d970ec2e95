"""A third-party plugin distribution, pip-installed, used through the `epochal` CLI."""

from __future__ import annotations

import json


def hooks_of(events, hook):
    return [e["plugin"] for e in events() if e["hook"] == hook]


def test_plugins_json_lists_the_installed_distribution(epochal_cli):
    result = epochal_cli("plugins", "--json", "--disable", "tw_cycle_a")
    assert result.returncode == 0, result.stderr
    listing = {p["name"]: p for p in json.loads(result.stdout)}
    alpha = listing["tw_alpha"]
    assert alpha["distribution"] == "epochal-throwaway"
    assert alpha["version"] == "1.2.3"
    assert alpha["status"] == "loaded"
    assert alpha["entry_point"] == "epochal_throwaway.plugins:Recorder"
    assert {"after_batch", "before_training", "on_error"} <= set(alpha["hooks"])
    assert listing["tw_cycle_a"]["status"] == "disabled"
    broken = listing["tw_broken"]
    assert broken["status"] == "failed"
    assert "epochal_throwaway.broken:Plugin" in broken["error"]
    assert "epochal-throwaway" in broken["error"]
    assert listing["tw_typo"]["status"] == "failed"
    assert "after_bach" in listing["tw_typo"]["error"]
    assert listing["tw_bundle/one"]["parent"] == "tw_bundle"
    positions = [p["position"] for p in listing.values() if p["status"] == "loaded"]
    assert sorted(positions) == list(range(len(positions)))


def test_plugins_table_and_order(epochal_cli):
    table = epochal_cli("plugins", "--plugins", "tw_beta,tw_alpha", "--disable", "tw_cycle_a")
    assert table.returncode == 0, table.stderr
    assert "tw_alpha" in table.stdout and "epochal-throwaway 1.2.3" in table.stdout
    order = epochal_cli(
        "plugins", "--order", "--json", "--plugins", "tw_beta,tw_alpha", "--disable", "tw_cycle_a"
    )
    after_batch = json.loads(order.stdout)["order"]["after_batch"]
    assert after_batch.index("tw_beta") < after_batch.index("tw_alpha")


def test_run_calls_plugins_in_the_configured_order(epochal_cli, write_config, events):
    config = write_config(["tw_beta", "tw_alpha"])
    result = epochal_cli("run", str(config))
    assert result.returncode == 0, result.stderr
    calls = hooks_of(events, "after_batch")
    assert calls[:4] == ["tw_beta", "tw_alpha", "tw_beta", "tw_alpha"]
    assert len(calls) == 2 * 2 * 4  # two plugins, two epochs of four batches
    assert "finished" in result.stdout


def test_plugins_option_reorders_per_run(epochal_cli, write_config, events):
    config = write_config(["tw_beta", "tw_alpha"])
    result = epochal_cli("run", str(config), "--plugins", "tw_alpha,tw_beta")
    assert result.returncode == 0, result.stderr
    assert hooks_of(events, "before_training") == ["tw_alpha", "tw_beta"]


def test_run_before_is_honoured_and_autoload_appends_sorted(epochal_cli, write_config, events):
    config = write_config([], extra="")
    result = epochal_cli(
        "run",
        str(config),
        "--set",
        "plugins.autoload=true",
        "--disable",
        "tw_cycle_a,tw_cycle_b,tw_typo,tw_badarg",
    )
    assert result.returncode == 0, result.stderr
    assert "tw_broken" in result.stderr  # an autoloaded plugin failing to import is a warning
    order = hooks_of(events, "before_training")
    # sorted by name, except tw_first which declares run_before tw_alpha
    assert order == ["tw_first", "tw_alpha", "tw_beta", "tw_bundle/one", "tw_bundle/two"]


def test_disable_per_run_and_composite_child(epochal_cli, write_config, events):
    config = write_config(["tw_alpha", "tw_bundle", "tw_beta"])
    result = epochal_cli("run", str(config), "--disable", "tw_beta,tw_bundle/two")
    assert result.returncode == 0, result.stderr
    assert hooks_of(events, "before_training") == ["tw_alpha", "tw_bundle/one"]


def test_environment_selects_plugins(epochal_cli, write_config, events):
    config = write_config([], extra="")
    result = epochal_cli(
        "run",
        str(config),
        "--set",
        "plugins.autoload=true",
        env={"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "EPOCHAL_PLUGINS": "tw_beta,tw_alpha"},
    )
    assert result.returncode == 0, result.stderr
    assert hooks_of(events, "before_training") == ["tw_beta", "tw_alpha"]


def test_register_commands_adds_a_subcommand(epochal_cli):
    result = epochal_cli("tw-hello", "tester")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hello tester from epochal-throwaway"
    assert "tw-hello" in epochal_cli("--help").stdout


def test_on_error_reaches_every_plugin_and_the_error_is_reraised(epochal_cli, write_config, events):
    config = write_config(
        ["tw_alpha", "tw_beta"],
        extra='[plugins.tw_alpha]\nfail_in = "after_batch"\nfail_on_error = true\n',
    )
    result = epochal_cli("run", str(config))
    assert result.returncode == 1
    assert "tw_alpha fails in after_batch as asked" in result.stderr
    assert "raised in hook 'after_batch' of plugin 'tw_alpha'" in result.stderr
    errors = [e for e in events() if e["hook"] == "on_error"]
    assert [e["plugin"] for e in errors] == ["tw_alpha", "tw_beta"]
    assert all(e["error_plugin"] == "tw_alpha" for e in errors)
    assert "plugin 'tw_alpha' raised in on_error" in result.stderr
    assert "after_training" not in [e["hook"] for e in events()]
