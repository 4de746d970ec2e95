"""The commands for authors and editors: ``epochal new-plugin`` (a plugin distribution's
skeleton), ``epochal schema`` (the run configuration's JSON Schema) and ``epochal hooks`` (every
hook's documentation)."""

from __future__ import annotations

import json

import click

__all__ = ["hooks", "new_plugin_command", "schema"]


@click.command(name="new-plugin")
@click.argument("name")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    default=".",
    show_default=True,
    help="Where to create the distribution folder.",
)
def new_plugin_command(name: str, directory: str) -> None:
    """Create a plugin distribution NAME: pyproject, a documented hook, tests, README."""
    from pathlib import Path

    from epochal.scaffold import new_plugin

    root = new_plugin(name, Path(directory))
    click.echo(f"created {root}: pip install -e '{root}[test]' && pytest {root}")


@click.command()
@click.argument("config_file", type=click.Path(dir_okay=False), required=False)
def schema(config_file: str | None) -> None:
    """Print the JSON Schema of a run configuration (for editors' TOML completion).

    Every installed plugin's table is in it, with its options' types, defaults and docs; with
    CONFIG_FILE, also the tables of the plugins from your own code that it names.
    """
    from epochal.config import load_config
    from epochal.schema import run_schema

    config = load_config(config_file) if config_file else None
    click.echo(json.dumps(run_schema(config), indent=2))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (docstrings as written, reST).")
def hooks(as_json: bool) -> None:
    """Document every hook a plugin can implement (as plain text)."""
    import inspect

    from epochal import hookspecs
    from epochal._dispatch import HOOK_ARGS
    from epochal.console import fit_text, plain_text, terminal_width

    docs = {name: inspect.getdoc(getattr(hookspecs, name)) or "" for name in HOOK_ARGS}
    if as_json:
        click.echo(
            json.dumps(
                [{"name": n, "arguments": list(HOOK_ARGS[n]), "doc": d} for n, d in docs.items()], indent=2
            )
        )
        return
    width = terminal_width(default=80)  # a reference to read: 80 columns in a pipe too
    for name, doc in docs.items():
        click.echo(f"{name}({', '.join(HOOK_ARGS[name])})")
        click.echo(fit_text("    " + plain_text(doc).replace("\n", "\n    ").rstrip(), width) + "\n")
