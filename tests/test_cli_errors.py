"""Every bad input: one clear message naming the culprit, exit status 2, no traceback."""

from __future__ import annotations

import pytest


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_plugin_that_fails_to_import_named_explicitly(throwaway_cli, write_config):
    result = throwaway_cli("run", str(write_config(["tw_broken"])))
    assert_clean_error(
        result, "tw_broken", "epochal_throwaway.broken:Plugin", "epochal-throwaway", "broken on purpose"
    )


def test_misspelled_hook(throwaway_cli, write_config):
    result = throwaway_cli("run", str(write_config(["tw_typo"])))
    assert_clean_error(result, "'tw_typo'", "unknown hook 'after_bach'", "did you mean 'after_batch'")


def test_misspelled_argument(throwaway_cli, write_config):
    result = throwaway_cli("run", str(write_config(["tw_badarg"])))
    assert_clean_error(result, "'tw_badarg'", "'output'", "did you mean 'outputs'")


def test_unknown_option(throwaway_cli, write_config):
    config = write_config(["tw_alpha"], extra="[plugins.tw_alpha]\nslep = 1.0\n")
    assert_clean_error(
        throwaway_cli("run", str(config)), "[plugins.tw_alpha]", "'slep'", "did you mean 'sleep'", "fail_in"
    )


def test_option_of_the_wrong_type(throwaway_cli, write_config):
    config = write_config(["tw_alpha"], extra='[plugins.tw_alpha]\nsleep = "fast"\n')
    assert_clean_error(throwaway_cli("run", str(config)), "'sleep'", "must be float", "'fast'")


def test_ordering_cycle(throwaway_cli, write_config):
    result = throwaway_cli("run", str(write_config(["tw_cycle_a", "tw_cycle_b"])))
    assert_clean_error(result, "tw_cycle_a", "tw_cycle_b", "cycle")


def test_order_contradicting_a_declared_constraint(throwaway_cli, write_config):
    result = throwaway_cli("run", str(write_config(["tw_alpha", "tw_first"])))
    assert_clean_error(
        result, "'tw_first' declares run_before 'tw_alpha'", "lists 'tw_alpha' before 'tw_first'"
    )


@pytest.mark.parametrize("where", ["order", "disable", "plugins"])
def test_unknown_plugin_name_suggests_the_closest(throwaway_cli, write_config, where):
    config = write_config(["tw_alpha"])
    args = {
        "order": ["--plugins", "tw_alpah"],
        "disable": ["--disable", "tw_alpah"],
        "plugins": ["--set", "plugins.tw_alpah.sleep=1.0"],
    }[where]
    assert_clean_error(throwaway_cli("run", str(config), *args), "'tw_alpah'", "did you mean 'tw_alpha'")


def test_malformed_toml(throwaway_cli, tmp_path):
    (tmp_path / "bad.toml").write_text("[loop]\nmax_epochs = = 3\n")
    assert_clean_error(throwaway_cli("run", "bad.toml"), "bad.toml", "invalid TOML", "line 2")


def test_missing_config_file(throwaway_cli):
    assert_clean_error(throwaway_cli("run", "nowhere.toml"), "nowhere.toml")


def test_missing_factory(throwaway_cli, write_config, tmp_path):
    text = write_config(["tw_alpha"]).read_text().replace("make_model", "make_modle")
    (tmp_path / "f.toml").write_text(text)
    assert_clean_error(throwaway_cli("run", "f.toml"), "[model]", "make_modle", "did you mean 'make_model'")


def test_unknown_loop_key_and_bad_value(throwaway_cli, write_config):
    config = write_config(["tw_alpha"])
    assert_clean_error(
        throwaway_cli("run", str(config), "--set", "loop.max_epoch=3"), "[loop]", "did you mean 'max_epochs'"
    )
    assert_clean_error(
        throwaway_cli("run", str(config), "--set", "loop.on_empty_batch=explode"), "on_empty_batch"
    )


def test_bad_set_syntax(throwaway_cli, write_config):
    assert_clean_error(
        throwaway_cli("run", str(write_config()), "--set", "max_epochs"), "--set", "section.key=value"
    )


def test_resume_without_a_checkpoint_plugin(throwaway_cli, write_config):
    assert_clean_error(
        throwaway_cli("run", str(write_config(["tw_alpha"])), "--resume"), "--resume", "epochal-checkpoint"
    )


def test_traceback_flag_shows_the_traceback(throwaway_cli, write_config):
    result = throwaway_cli("--traceback", "run", str(write_config(["tw_typo"])))
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "PluginError" in result.stderr


def test_config_file_that_is_not_utf8(tmp_path):
    from epochal.testing import epochal_command

    config = tmp_path / "latin1.toml"
    data = "[loop]\nmax_epochs = 1\n# caf\u00e9\n".encode("latin-1")
    config.write_bytes(data)
    assert_clean_error(
        epochal_command("run", str(config), cwd=tmp_path),
        "latin1.toml",
        "not UTF-8",
        f"byte 0xe9 at offset {data.index(0xE9)}",
    )


FACTORIES = """
from epochal_throwaway.model import make_data, make_model


def returns_none(**options):
    return None


class TrainOnly:
    def train_step(self, batch):
        return {"loss": 1.0}


def train_only(**options):
    return TrainOnly()


def bad_stream(**options):
    return {"train": 5}
"""


@pytest.mark.parametrize(
    ("section", "factory", "fragments"),
    [
        (
            "model",
            "returns_none",
            ("f.toml: [model] factory returned an object of type NoneType", "train_step"),
        ),
        ("model", "train_only", ("[model] factory", "no eval_step method (the data has evaluation streams)")),
        ("data", "bad_stream", ("f.toml: [data] factory: stream 'train' is of type int", "not an iterable")),
    ],
)
def test_a_factory_that_returns_what_the_loop_cannot_use(
    throwaway_cli, write_config, tmp_path, section, factory, fragments
):
    (tmp_path / "factories.py").write_text(FACTORIES)
    text = write_config(["tw_alpha"]).read_text()
    text = text.replace(f'epochal_throwaway.model:make_{section}"', f'factories:{factory}"')
    (tmp_path / "f.toml").write_text(text)
    assert_clean_error(throwaway_cli("run", "f.toml"), *fragments)
    assert not (tmp_path / "runs" / "f").exists()  # refused before the run's directory is made


@pytest.mark.parametrize(
    ("loop_keys", "fragment"),
    [
        ("min_epochs = 5\n", "[loop]: min_epochs = 5 is more than max_epochs = 2"),
        ("max_iterations = 3\nmin_steps = 4\n", "[loop]: min_steps = 4 is more than max_iterations = 3"),
    ],
)
def test_check_refuses_the_loop_limits_a_run_refuses(throwaway_cli, write_config, loop_keys, fragment):
    config = write_config(["tw_alpha"])
    config.write_text(config.read_text().replace("max_epochs = 2\n", "max_epochs = 2\n" + loop_keys))
    for command in (("plugins", "--check", config.name), ("run", config.name)):
        assert_clean_error(throwaway_cli(*command), f"{config.name}: {fragment}")


def test_a_bad_set_is_named_not_the_file_it_overrides(throwaway_cli, write_config):
    config = write_config(["tw_alpha"])
    good, bad = "loop.max_epochs=3", "loop.max_epoch=3"
    result = throwaway_cli("run", str(config), "--set", good, "--set", bad)
    assert_clean_error(result, f"--set {bad!r}: [loop]: unknown key 'max_epoch'")
    assert config.name not in result.stderr
    # the file's own mistake is the file's, whatever --set says beside it
    config.write_text(config.read_text().replace("max_epochs = 2", "max_epoch = 2"))
    result = throwaway_cli("run", str(config), "--set", good)
    assert_clean_error(result, f"{config}: [loop]: unknown key 'max_epoch'")
    assert "--set" not in result.stderr


def test_an_empty_run_dir_is_refused_not_the_current_directory(throwaway_cli, write_config, tmp_path):
    config = write_config(["tw_alpha"])
    config.write_text(config.read_text().replace("seed = 0\n", 'seed = 0\nrun_dir = ""\n'))
    result = throwaway_cli("run", str(config))
    assert_clean_error(result, "[loop]: run_dir must be non-empty str | Path | None")
    assert not (tmp_path / "version_0").exists()  # it used to train into the working directory


@pytest.mark.parametrize("argument", [["--resume", ""], ["--resume="], ["--resume", "  "]])
def test_an_empty_resume_value_is_refused_not_a_fresh_start(throwaway_cli, write_config, argument):
    config = write_config(["checkpoint"])
    result = throwaway_cli("run", str(config), *argument)
    assert_clean_error(result, "'--resume'", "an empty value")
    assert not (config.parent / "runs").exists()  # nothing trained, no run directory


@pytest.mark.parametrize(
    ("extra", "args", "env", "culprit"),
    [
        ("", [], {"EPOCHAL_PLUGINS": "tw_alpah"}, "unknown plugin 'tw_alpah' in EPOCHAL_PLUGINS"),
        ("", ["--set", "plugins.tw_alpha.slep=1"], {}, "--set 'plugins.tw_alpha.slep=1': [plugins.tw_alpha]"),
        ("", ["--set", "data.nn=3"], {}, "--set 'data.nn=3': [data]: unknown option 'nn'"),
        ("[data]\nnn = 3\n", [], {}, "run.toml: [data]: unknown option 'nn'"),
        # the file's typo, though a --set sets the key the message suggests
        ("[data]\nnn = 3\n", ["--set", "data.n=3"], {}, "run.toml: [data]: unknown option 'nn'"),
    ],
    ids=["environment", "set-plugin-option", "set-data-key", "file-data-key", "file-key-beside-a-set"],
)
def test_an_error_names_the_culprit_the_file_a_set_or_the_environment(
    throwaway_cli, write_config, extra, args, env, culprit
):
    # found by an outside-user pass: EPOCHAL_PLUGINS's and --set's mistakes were blamed on the
    # file, and [model]/[data] errors named neither
    config = write_config(["tw_alpha"])
    if extra:
        config.write_text(config.read_text().replace("[data]\n", extra, 1))
    result = throwaway_cli("run", str(config), *args, env=env)
    assert_clean_error(result, culprit)
    if "run.toml" not in culprit:
        assert "run.toml" not in result.stderr.splitlines()[-1]
