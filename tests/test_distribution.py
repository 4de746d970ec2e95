"""A third-party plugin distribution, pip-installed, used through the `epochal` CLI."""

from __future__ import annotations

import json


def hooks_of(events, hook):
    return [e["plugin"] for e in events() if e["hook"] == hook]


def test_plugins_json_lists_the_installed_distribution(throwaway_cli):
    result = throwaway_cli("plugins", "--json", "--disable", "tw_cycle_a")
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


def test_plugins_table_and_order(throwaway_cli):
    table = throwaway_cli("plugins", "--plugins", "tw_beta,tw_alpha", "--disable", "tw_cycle_a")
    assert table.returncode == 0, table.stderr
    assert "tw_alpha" in table.stdout and "epochal-throwaway 1.2.3" in table.stdout
    order = throwaway_cli(
        "plugins", "--order", "--json", "--plugins", "tw_beta,tw_alpha", "--disable", "tw_cycle_a"
    )
    after_batch = json.loads(order.stdout)["order"]["after_batch"]
    assert after_batch.index("tw_beta") < after_batch.index("tw_alpha")


def test_run_calls_plugins_in_the_configured_order(throwaway_cli, write_config, events):
    config = write_config(["tw_beta", "tw_alpha"])
    result = throwaway_cli("run", str(config))
    assert result.returncode == 0, result.stderr
    calls = hooks_of(events, "after_batch")
    assert calls[:4] == ["tw_beta", "tw_alpha", "tw_beta", "tw_alpha"]
    assert len(calls) == 2 * 2 * 4  # two plugins, two epochs of four batches
    assert "finished" in result.stdout


def test_plugins_option_reorders_per_run(throwaway_cli, write_config, events):
    config = write_config(["tw_beta", "tw_alpha"])
    result = throwaway_cli("run", str(config), "--plugins", "tw_alpha,tw_beta")
    assert result.returncode == 0, result.stderr
    assert hooks_of(events, "before_training") == ["tw_alpha", "tw_beta"]


def test_run_before_is_honoured_and_autoload_appends_sorted(throwaway_cli, write_config, events):
    config = write_config([], extra="")
    result = throwaway_cli(
        "run",
        str(config),
        "--set",
        "plugins.autoload=true",
        "--disable",
        "tw_cycle_a,tw_cycle_b,tw_typo,tw_badarg,tw_needy,tw_rival,tw_forgetful",
    )
    assert result.returncode == 0, result.stderr
    assert "tw_broken" in result.stderr  # an autoloaded plugin failing to import is a warning
    order = hooks_of(events, "before_training")
    # sorted by name, except tw_first which declares run_before tw_alpha; tw_shy only loads when named
    assert order == ["tw_first", "tw_alpha", "tw_beta", "tw_bundle/one", "tw_bundle/two"]
    named = throwaway_cli(
        "plugins", "--json", "--plugins", "tw_shy", "--disable", "tw_cycle_a,tw_cycle_b,tw_needy,tw_rival"
    )
    statuses = {p["name"]: p["status"] for p in json.loads(named.stdout)}
    assert statuses["tw_shy"] == "loaded"
    unnamed = throwaway_cli("plugins", "--json", "--disable", "tw_cycle_a,tw_cycle_b,tw_needy,tw_rival")
    assert {p["name"]: p["status"] for p in json.loads(unnamed.stdout)}["tw_shy"] == "available"


def test_disable_per_run_and_composite_child(throwaway_cli, write_config, events):
    config = write_config(["tw_alpha", "tw_bundle", "tw_beta"])
    result = throwaway_cli("run", str(config), "--disable", "tw_beta,tw_bundle/two")
    assert result.returncode == 0, result.stderr
    assert hooks_of(events, "before_training") == ["tw_alpha", "tw_bundle/one"]


def test_environment_selects_plugins(throwaway_cli, write_config, events):
    config = write_config([], extra="")
    result = throwaway_cli(
        "run",
        str(config),
        "--set",
        "plugins.autoload=true",
        env={"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "EPOCHAL_PLUGINS": "tw_beta,tw_alpha"},
    )
    assert result.returncode == 0, result.stderr
    assert hooks_of(events, "before_training") == ["tw_beta", "tw_alpha"]


def test_register_commands_adds_a_subcommand(throwaway_cli):
    result = throwaway_cli("tw-hello", "tester")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hello tester from epochal-throwaway"
    assert "tw-hello" in throwaway_cli("--help").stdout


def test_on_error_reaches_every_plugin_and_the_error_is_reraised(throwaway_cli, write_config, events):
    config = write_config(
        ["tw_alpha", "tw_beta"],
        extra='[plugins.tw_alpha]\nfail_in = "after_batch"\nfail_on_error = true\n',
    )
    result = throwaway_cli("run", str(config))
    assert result.returncode == 1
    assert "tw_alpha fails in after_batch as asked" in result.stderr
    assert "raised in hook 'after_batch' of plugin 'tw_alpha'" in result.stderr
    errors = [e for e in events() if e["hook"] == "on_error"]
    assert [e["plugin"] for e in errors] == ["tw_alpha", "tw_beta"]
    assert all(e["error_plugin"] == "tw_alpha" for e in errors)
    assert "plugin 'tw_alpha' raised in on_error" in result.stderr
    assert "after_training" not in [e["hook"] for e in events()]


def test_isolated_plugin_is_unregistered_and_the_run_goes_on(throwaway_cli, write_config, events):
    config = write_config(
        ["tw_alpha", "tw_beta"],
        extra='[plugins.tw_alpha]\nfail_in = "after_batch"\non_failure = "isolate"\n',
    )
    result = throwaway_cli("run", str(config))
    assert result.returncode == 0, result.stderr
    assert "plugin 'tw_alpha' raised in hook 'after_batch'" in result.stderr
    assert "isolate" in result.stderr
    assert hooks_of(events, "after_batch").count("tw_alpha") == 1  # never called again
    assert hooks_of(events, "after_batch").count("tw_beta") == 8  # the others go on, every batch
    assert hooks_of(events, "after_training") == ["tw_beta"]
    assert "finished" in result.stdout


def test_bad_failure_policy_is_a_clear_error(throwaway_cli, write_config):
    config = write_config(["tw_alpha"], extra='[plugins.tw_alpha]\non_failure = "ignore"\n')
    result = throwaway_cli("run", str(config))
    assert result.returncode == 2
    assert "run.toml: [plugins.tw_alpha]: on_failure must be one of fatal, isolate" in result.stderr


def test_trace_plugins_to_stderr_and_to_a_json_file(throwaway_cli, write_config, tmp_path):
    config = write_config(["tw_beta", "tw_alpha"])
    result = throwaway_cli("run", str(config), "--trace-plugins")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("[epochal trace] after_batch")]
    assert len(lines) == 8
    assert "tw_beta" in lines[0] and lines[0].index("tw_beta") < lines[0].index("tw_alpha")
    result = throwaway_cli("run", str(config), "--trace-plugins=trace.jsonl")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    batches = [r for r in records if r["hook"] == "after_batch"]
    assert [c["plugin"] for c in batches[0]["calls"]] == ["tw_beta", "tw_alpha"]
    assert all(c["seconds"] >= 0 for r in records for c in r["calls"])
    assert [r["iteration"] for r in batches] == list(range(1, 9))
    quiet = throwaway_cli("run", str(config))
    assert "[epochal trace]" not in quiet.stderr
    via_env = throwaway_cli("run", str(config), env={"EPOCHAL_TRACE_PLUGINS": "1"})
    assert "[epochal trace] before_training" in via_env.stderr


def test_requires_and_conflicts_are_checked_before_training(throwaway_cli, write_config, events):
    needy = write_config(["tw_needy"])
    result = throwaway_cli("run", str(needy))
    assert result.returncode == 2
    assert f"Error: {needy}: plugin 'tw_needy' requires plugin 'tw_alpha'" in result.stderr  # the file
    assert events() == []  # nothing ran
    check = throwaway_cli("plugins", "--check", str(needy))
    assert check.returncode == 2 and "requires plugin 'tw_alpha'" in check.stderr
    rival = write_config(["tw_rival", "tw_beta"], name="rival.toml")
    result = throwaway_cli("plugins", "--check", str(rival))
    assert result.returncode == 2
    assert f"Error: {rival}: plugin 'tw_rival' conflicts with plugin 'tw_beta'" in result.stderr
    good = write_config(["tw_needy", "tw_alpha"], name="good.toml")
    result = throwaway_cli("plugins", "--check", str(good))
    assert result.returncode == 0, result.stderr
    assert "ok:" in result.stdout and "tw_needy, tw_alpha" in result.stdout
    assert events() == []


def test_a_declared_command_imports_only_its_plugin(throwaway_cli):
    """``tw-hello`` is declared in the entry-point group ``epochal.commands``: running it imports
    that module only, so a broken plugin of the same distribution is not even imported (no
    warning), while ``--help`` (every plugin asked) still reports it."""
    result = throwaway_cli("tw-hello", "again")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hello again from epochal-throwaway"
    assert "tw_broken" not in result.stderr
    listing = throwaway_cli("--help")
    assert "tw-hello" in listing.stdout and "tw_broken" in listing.stderr
