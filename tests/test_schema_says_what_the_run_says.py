"""The JSON Schema refuses what the run refuses, naming the culprit (issue 45, item 6).

A scheduler argument that the scheduler does not take (``T_mx`` for ``T_max``) is refused by
``epochal plugins --check`` and by the schema, not only once a run starts; a misspelt plugin
table (``[plugins.checkpont]``) gets the installed name to use, not "'factory' is a required
property".
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

import pytest

from epochal.schema import run_schema
from epochal.testing import epochal_command

jsonschema = pytest.importorskip("jsonschema")

BASE = """
[loop]
max_epochs = 1

[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "epochal.examples.tiny:tiny_data"
"""


def problems(config: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    return [error.message for error in jsonschema.Draft7Validator(schema).iter_errors(config)]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return run_schema()


def test_a_misspelt_plugin_table_gets_the_name_to_use(schema):
    pytest.importorskip("epochal_checkpoint")
    config = tomllib.loads(BASE + '[plugins.checkpont]\ndir = "runs/x"\n')
    found = problems(config, schema)
    assert len(found) == 1, found
    assert "did you mean 'checkpoint'" in found[0] and "factory' is a required" not in found[0]
    config = tomllib.loads(BASE + "[plugins.chekpoint]\nkeep_last = 2\n")
    assert "did you mean 'checkpoint'" in " ".join(problems(config, schema))
    # a table of no plugin's name, far from any, lists the installed names
    far = problems(tomllib.loads(BASE + "[plugins.zzz_unknown]\nx = 1\n"), schema)
    assert len(far) == 1 and "installed: " in far[0] and "checkpoint" in far[0], far
    # a plugin from the user's own code may be named like an installed one: it has a factory
    for name in ("checkpoints", "zzz_unknown"):
        mine = tomllib.loads(BASE + f'[plugins.{name}]\nfactory = "mine:Plugin"\nevery = 2\n')
        assert problems(mine, schema) == []
    # installed names and the keys of [plugins] stay valid
    valid = tomllib.loads(BASE + '[plugins]\norder = ["monitor"]\n\n[plugins.checkpoint]\nkeep_last = 2\n')
    assert problems(valid, schema) == []


def test_a_misspelt_table_in_a_configs_schema_names_the_plugin(tmp_path):
    pytest.importorskip("epochal_checkpoint")
    config = tmp_path / "run.toml"
    config.write_text(BASE + '[plugins.checkpont]\ndir = "runs/x"\n')
    schema = json.loads(epochal_command("schema", str(config), cwd=tmp_path).stdout)
    found = problems(tomllib.loads(config.read_text()), schema)
    assert (
        len(found) == 1 and "no installed plugin is named 'checkpont'; did you mean 'checkpoint'?" in found[0]
    )


def test_a_scheduler_argument_typo_is_refused_by_the_check_and_the_schema(tmp_path, schema):
    pytest.importorskip("torch")
    pytest.importorskip("epochal_schedule")
    text = BASE + '[plugins.lr_scheduler]\nname = "CosineAnnealingLR"\nT_max = 3\n'
    assert problems(tomllib.loads(text), schema) == []
    assert problems(tomllib.loads(text.replace("T_max = 3", 'T_max = "auto"')), schema) == []
    typo = text.replace("T_max", "T_mx")
    assert any("'T_mx' was unexpected" in p for p in problems(tomllib.loads(typo), schema))
    wrong = problems(tomllib.loads(text.replace("T_max = 3", 'T_max = "three"')), schema)
    assert any("'three'" in p for p in wrong), wrong
    missing = problems(tomllib.loads(BASE + '[plugins.lr_scheduler]\nname = "StepLR"\n'), schema)
    assert any("'step_size' is a required property" in p for p in missing), missing
    (tmp_path / "run.toml").write_text(typo)
    checked = epochal_command("plugins", "--check", "run.toml", cwd=tmp_path)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "'T_mx' is not an argument of CosineAnnealingLR (did you mean 'T_max'?)" in checked.stderr
