"""Every bad value of every option is one line, before anything is written: cases made from the schema.

``epochal schema`` is generated from the same annotations the run validates, so the cases are
generated from it: for every key of ``[loop]``, ``[distributed]``, ``[plugins]``, ``[model]`` and
``[data]`` (the example's factories) and of every installed standard plugin's table, a value of the
wrong type, values outside its range, and an unknown key. Each is checked the way ``epochal run``
checks a configuration before its first batch (the file read, the plugins built, the factories'
arguments checked) and must be one :class:`~epochal.errors.EpochalError` of one line that names
the table and the key. A sample goes through the CLI in a subprocess: exit status 2, one line, and
no run directory made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epochal._options import option_hints
from epochal.config import load_config
from epochal.errors import EpochalError
from epochal.imports import resolve
from epochal.runner import check_run
from epochal.schema import run_schema, type_schema

CONFIG = """\
[loop]
max_epochs = 1
run_dir = "{run_dir}"

[model]
factory = "epochal.examples.digits:make_model"

[data]
factory = "epochal.examples.digits:make_data"

[plugins]
order = {order}
autoload = false
"""
#: options a plugin needs to be built at all (their tables get these besides the bad value).
NEEDED = {"lr_scheduler": {"name": "StepLR", "step_size": 1}, "finish_after": {"epochs": 1}}
#: TOML spellings of candidate bad values, with the JSON type each has.
CANDIDATES = [
    ("{bad = 1}", "object"),
    ('["x", 1]', "array"),
    ("1.5", "number"),
    ('"x"', "string"),
    ("true", "boolean"),
]


def accepts(schema: dict[str, Any], kind: str, text: str) -> bool:
    """Whether *schema* may accept a value of JSON type *kind* (spelled *text* in TOML)."""
    if not schema:
        return True
    if "anyOf" in schema or "oneOf" in schema:
        return any(accepts(s, kind, text) for s in schema.get("anyOf", schema.get("oneOf", [])))
    if "const" in schema:
        return json.dumps(schema["const"]) == text
    if "enum" in schema:
        return text in [json.dumps(v) for v in schema["enum"]]
    declared = schema.get("type")
    if declared is None:
        return True
    types = declared if isinstance(declared, list) else [declared]
    return kind in types or (kind == "number" and "integer" in types and text.isdigit())


def bad_values(schema: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(label, TOML value) pairs that *schema* refuses: a wrong type, each bound crossed."""
    for text, kind in CANDIDATES:
        if not accepts(schema, kind, text):
            yield f"type {kind}", text
            break
    for part in schema.get("anyOf", [schema]):
        if part.get("type") in ("integer", "number"):
            step = 1 if part["type"] == "integer" else 0.5
            if "minimum" in part:
                yield "below minimum", repr(part["minimum"] - step)
            if "exclusiveMinimum" in part:
                yield "at exclusive minimum", repr(part["exclusiveMinimum"])
            if "maximum" in part:
                yield "above maximum", repr(part["maximum"] + step)
            if "exclusiveMaximum" in part:
                yield "at exclusive maximum", repr(part["exclusiveMaximum"])


def tables() -> dict[str, dict[str, Any]]:
    """Table (``loop``, ``plugins.checkpoint``, ...) → key → its JSON Schema."""
    schema = run_schema()["properties"]
    found = {
        "loop": schema["loop"]["properties"],
        "distributed": schema["distributed"]["properties"],
        "plugins": {
            k: v for k, v in schema["plugins"]["properties"].items() if k in ("order", "disable", "autoload")
        },
    }
    standard = (
        "checkpoint",
        "monitor",
        "early_stopping",
        "finish_after",
        "lr_scheduler",
        "timing",
        "progress",
        "printing",
        "sqlite_log",
        "tensorboard",
        "mlflow",
    )
    for name in standard:
        table = schema["plugins"]["properties"].get(name)
        if table is not None:
            found[f"plugins.{name}"] = {k: v for k, v in table["properties"].items() if k != "distribution"}
    for section in ("model", "data"):
        factory = resolve(f"epochal.examples.digits:make_{section}", section)
        found[section] = {
            key: type_schema(hint) for key, hint in option_hints(factory).items() if key != "return"
        }
    return found


def cases() -> list[Any]:
    out = []
    for table, keys in tables().items():
        out.append(pytest.param(table, "no_such_key", "1", id=f"{table}.no_such_key-unknown"))
        for key, schema in keys.items():
            for label, value in bad_values(schema):
                out.append(pytest.param(table, key, value, id=f"{table}.{key}-{label}"))
    return out


def write(tmp_path: Path, table: str, key: str, value: str) -> tuple[Path, list[str]]:
    """The base configuration (with the plugin of *table* alone) and the ``--set`` of the case."""
    plugin = table.partition(".")[2]
    config = tmp_path / "run.toml"
    order = json.dumps([plugin] if plugin else [])
    config.write_text(CONFIG.format(run_dir=tmp_path / "run", order=order))
    needed = [f"{table}.{k}={json.dumps(v)}" for k, v in NEEDED.get(plugin, {}).items() if k != key]
    return config, [*needed, f"{table}.{key}={value}"]


@pytest.mark.parametrize(("table", "key", "value"), cases())
def test_a_bad_value_is_one_line_naming_its_table_and_key(tmp_path, table, key, value):
    config, overrides = write(tmp_path, table, key, value)
    with pytest.raises(EpochalError) as raised:
        loaded = load_config(config, overrides)
        check_run(loaded)
        from epochal.distributed.world import init_from_env

        init_from_env(**loaded.get("distributed", {}))  # what a launched worker checks
    message = str(raised.value)
    assert "\n" not in message, message
    assert key in message, message
    assert f"[{table}]" in message or f"[plugins.{table.partition('.')[2]}]" in message, message
    assert not (tmp_path / "run").exists()


def test_the_cases_cover_every_table_and_many_keys():
    covered = {param.values[0] for param in cases()}
    assert {
        "loop",
        "distributed",
        "plugins",
        "model",
        "data",
        "plugins.checkpoint",
        "plugins.monitor",
    } <= covered
    assert len(cases()) >= 100


@pytest.mark.slow
@pytest.mark.parametrize(
    ("table", "key", "value"),
    [("loop", "max_epochs", "-1"), ("plugins.checkpoint", "keep_best", "-2"), ("data", "batch_size", '"64"')],
)
def test_through_the_cli_exit_2_one_line_nothing_written(tmp_path, table, key, value):
    config, overrides = write(tmp_path, table, key, value)
    sets = [arg for override in overrides for arg in ("--set", override)]
    done = subprocess.run(
        [sys.executable, "-m", "epochal", "run", str(config), *sets],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and key in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("line", "key", "expected"),
    [
        ('max_epochs = "none"\nmax_iterations = 3', "max_epochs", None),  # int | None: "none" is None
        ('seed = "none"', "seed", None),
        ('run_dir = "none"', "run_dir", "none"),  # a str option keeps the string
    ],
)
def test_none_in_the_loop_table_is_what_the_schema_says_it_is(tmp_path, line, key, expected):
    jsonschema = pytest.importorskip("jsonschema")
    text = f'[loop]\n{line}\n[model]\nfactory = "epochal.examples.tiny:TinyModel"\n'
    text += '[data]\nfactory = "epochal.examples.tiny:tiny_data"\n'
    (tmp_path / "run.toml").write_text(text)
    config = load_config(str(tmp_path / "run.toml"))
    assert config["loop"][key] == expected
    import tomllib

    jsonschema.validate(tomllib.loads(text), run_schema())  # the editor accepts what the run does
