"""hookspecs.py agrees with the contract's hook list, and every hook is documented."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from epochal import hookspecs
from epochal._dispatch import HOOK_ARGS

CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "CONTRACT.md"


def contract_hooks() -> dict[str, tuple[str, ...]]:
    if not CONTRACT.exists():
        pytest.skip(f"the contract is not beside the repository ({CONTRACT})")
    text = CONTRACT.read_text()
    section = text.split("## Hooks", 1)[1].split("\n## ", 1)[0]
    return {
        name: tuple(a.strip() for a in args.split(",") if a.strip())
        for name, args in re.findall(r"`(\w+)\(([^)]*)\)(?: -> [^`]*)?`", section)
    }


def test_every_contract_hook_is_specified_with_the_same_arguments():
    hooks = contract_hooks()
    assert len(hooks) >= 13
    for name, args in hooks.items():
        assert name in HOOK_ARGS, f"hook {name} of the contract is missing from hookspecs.py"
        assert HOOK_ARGS[name] == args, name


def test_hooks_beyond_the_contract_are_only_the_documented_extension():
    # resume_state: checkpoint plugins hand the loop a state; latest_checkpoint, check_fresh_run:
    # what the launcher and the CLI ask (the contract says so in prose); best_model_state: the
    # best weights [loop] test_streams are evaluated with (test_weights = "best")
    extension = {"resume_state", "latest_checkpoint", "check_fresh_run", "best_model_state"}
    assert set(HOOK_ARGS) - set(contract_hooks()) == extension


@pytest.mark.parametrize("name", sorted(HOOK_ARGS))
def test_every_hook_is_documented(name):
    doc = inspect.getdoc(getattr(hookspecs, name))
    assert doc and doc.startswith("Called"), f"{name} must say when it is called"
    for arg in HOOK_ARGS[name]:
        assert f":param {arg}:" in doc, f"{name} does not document {arg}"
    assert "return" in doc.lower(), f"{name} must say what its return value means"


def test_hooks_command_prints_every_hook_with_its_documentation():
    result = subprocess.run(
        [sys.executable, "-m", "epochal", "hooks", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    listed = {h["name"]: h for h in json.loads(result.stdout)}
    assert set(listed) == set(HOOK_ARGS)
    assert listed["after_batch"]["arguments"] == ["loop", "batch", "outputs"]
    assert listed["on_interrupt"]["doc"] == inspect.getdoc(hookspecs.on_interrupt)
