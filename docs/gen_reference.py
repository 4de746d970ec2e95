"""Generate docs/reference/: hooks.md (from hookspecs.py), cli.md (from click), benchmarks.md.

Run before `mkdocs build` (tox -e docs does); the generated pages are not committed, so the
reference can never drift from the code.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import click

from epochal import hookspecs
from epochal._dispatch import HOOK_ARGS
from epochal.cli import cli

OUT = Path(__file__).parent / "reference"


def hooks_page() -> str:
    lines = [
        "# Hook reference",
        "",
        "Generated from `src/epochal/hookspecs.py`. Implement a hook with `@epochal.hookimpl` on a",
        "function or method of the same name; declare any subset of its arguments.",
        "",
    ]
    for name in HOOK_ARGS:
        function = getattr(hookspecs, name)
        options = getattr(function, "epochal_spec", {}) or {}
        flags = " (first result wins)" if options.get("firstresult") else ""
        lines += [f"## `{name}({', '.join(HOOK_ARGS[name])})`{flags}", "", inspect.getdoc(function) or "", ""]
    return "\n".join(lines)


def cli_page() -> str:
    lines = [
        "# CLI reference",
        "",
        "Generated from the `epochal` click commands, plugins' commands included.",
        "",
    ]
    root = click.Context(cli, info_name="epochal")
    lines += ["## `epochal`", "", "```text", cli.get_help(root), "```", ""]
    for name in cli.list_commands(root):
        command = cli.get_command(root, name)
        if command is None:
            continue
        lines += _command(command, click.Context(command, info_name=name, parent=root), f"epochal {name}")
    return "\n".join(lines)


def _command(command: click.Command, ctx: click.Context, path: str) -> list[str]:
    lines = [f"## `{path}`", "", "```text", command.get_help(ctx), "```", ""]
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                lines += _command(sub, click.Context(sub, info_name=name, parent=ctx), f"{path} {name}")
    return lines


def main() -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "hooks.md").write_text(hooks_page(), encoding="utf-8")
    (OUT / "cli.md").write_text(cli_page(), encoding="utf-8")
    bench = (Path(__file__).parents[1] / "bench" / "README.md").read_text(encoding="utf-8")
    bench = bench.replace("](../docs/", "](../")  # links from bench/ to docs/, seen from docs/reference/
    (OUT / "benchmarks.md").write_text(bench, encoding="utf-8")
    print(f"wrote {OUT}/hooks.md, cli.md and benchmarks.md")


if __name__ == "__main__":
    main()
