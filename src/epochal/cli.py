"""The ``epochal`` command: run a configuration, list plugins and hooks, plugins' commands.

Built-in commands answer without importing any plugin; the first unknown command name (or
``--help``) imports the installed plugins and lets them add theirs (``register_commands``).
Every :class:`~epochal.errors.EpochalError` is printed as one line and exits with status 2;
``--traceback`` shows the traceback instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from typing import Any

import click

from epochal.errors import EpochalError

_TRACEBACK_ENV = "EPOCHAL_TRACEBACK"


class _Failure(click.ClickException):
    exit_code = 2


class EpochalGroup(click.Group):
    """A click group that loads plugins' commands only when they are asked for."""

    _plugin_commands_loaded = False

    def _load_plugin_commands(self) -> None:
        if self._plugin_commands_loaded:
            return
        self._plugin_commands_loaded = True
        from epochal.plugins import register_commands

        register_commands(self)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None:
            self._load_plugin_commands()
            command = super().get_command(ctx, cmd_name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load_plugin_commands()
        return super().list_commands(ctx)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EpochalError as error:
            if ctx.meta.get("epochal.traceback"):
                raise
            raise _Failure(str(error)) from None


def _split(values: tuple[str, ...]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


@click.group(cls=EpochalGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--traceback", is_flag=True, envvar=_TRACEBACK_ENV, help="Show tracebacks of errors.")
@click.version_option(package_name="epochal", prog_name="epochal")
@click.pass_context
def cli(ctx: click.Context, traceback: bool) -> None:
    """epochal: a training loop whose every feature is a plugin."""
    ctx.meta["epochal.traceback"] = traceback


@cli.command()
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option("--plugins", "order", multiple=True, help="Plugin order for this run: a,b,c.")
@click.option("--disable", multiple=True, help="Plugins not to load this run: x,y.")
@click.option(
    "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config value."
)
@click.option("--resume", is_flag=True, help="Resume from the latest complete checkpoint.")
@click.option(
    "--trace-plugins",
    "trace",
    is_flag=False,
    flag_value="-",
    default=None,
    metavar="[FILE]",
    help="Print every hook call with the plugins called and their durations (to FILE as JSON lines).",
)
def run(
    config_file: str,
    order: tuple[str, ...],
    disable: tuple[str, ...],
    overrides: tuple[str, ...],
    resume: bool,
    trace: str | None,
) -> None:
    """Train as CONFIG_FILE (TOML) says."""
    from epochal.config import load_config
    from epochal.runner import build_loop

    config = load_config(config_file, overrides)
    loop = build_loop(config, _split(order) if order else None, _split(disable), resume)
    if trace is not None:
        loop.trace_plugins = trace
    log = loop.run()
    status = log.status
    click.echo(
        f"epochal: run {loop.run_id} {status['status']} after {loop.epoch} epoch(s), "
        f"{loop.iteration} batch(es): {status['finish_reason']}"
    )
    for stream, metrics in loop.last_metrics.items():
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        click.echo(f"epochal: {stream}: {shown}")
    if status["status"] == "interrupted" and loop.signal_received is not None:
        sys.exit(128 + loop.signal_received)


@cli.command(name="plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--order", "show_order", is_flag=True, help="Show the call order of every hook.")
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="Use this run config's plugin settings."
)
@click.option("--plugins", "order", multiple=True, help="Plugin order: a,b,c.")
@click.option("--disable", multiple=True, help="Plugins to leave out: x,y.")
@click.option(
    "--check",
    "check_file",
    type=click.Path(dir_okay=False),
    help="Run every check a run of this config makes before training (plugins, options, order, "
    "requires/conflicts, factories), without training.",
)
def plugins_command(
    as_json: bool,
    show_order: bool,
    config_file: str | None,
    order: tuple[str, ...],
    disable: tuple[str, ...],
    check_file: str | None,
) -> None:
    """List installed plugins: distribution, version, hooks, status, position."""
    from epochal._dispatch import HOOK_ARGS
    from epochal.config import load_config, plugins_for
    from epochal.plugins import PluginLoadWarning

    if check_file:
        from epochal.runner import check_run

        checked = check_run(load_config(check_file), _split(order) if order else None, _split(disable))
        click.echo(f"ok: {check_file}: plugins in call order: {', '.join(checked.plugins) or 'none'}")
        return

    config = load_config(config_file) if config_file else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)  # shown as status "failed" instead
        plugin_set = plugins_for(config, _split(order) if order else None, _split(disable))
    infos = [info.as_dict() for info in plugin_set.infos]
    orders = {hook: plugin_set.call_order(hook) for hook in HOOK_ARGS}
    if as_json:
        payload: Any = {"plugins": infos, "order": orders} if show_order else infos
        click.echo(json.dumps(payload, indent=2))
        return
    if show_order:
        for hook, names in orders.items():
            click.echo(f"{hook}: {' -> '.join(names) if names else '(none)'}")
        return
    if not infos:
        click.echo("no plugins installed")
        return
    rows = [
        (
            "" if i["position"] is None else str(i["position"]),
            i["name"],
            i["status"],
            f"{i['distribution'] or '-'} {i['version'] or ''}".strip(),
            ", ".join(i["hooks"]),
        )
        for i in infos
    ]
    header = ("#", "name", "status", "distribution", "hooks")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(4)]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    for i in infos:
        if i["error"]:
            click.echo(f"{i['name']}: {i['error']}", err=True)


@cli.command(name="new-plugin")
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


@cli.command(name="check-resume")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option(
    "--at", type=click.IntRange(min=1), default=None, help="Interrupt after this batch (default: half way)."
)
@click.option("--plugins", "order", multiple=True, help="Plugin order: a,b,c.")
@click.option("--disable", multiple=True, help="Plugins to leave out: x,y.")
@click.option(
    "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config value."
)
def check_resume_command(
    config_file: str,
    at: int | None,
    order: tuple[str, ...],
    disable: tuple[str, ...],
    overrides: tuple[str, ...],
) -> None:
    """Check that a run interrupted at batch N and resumed matches a straight run bitwise."""
    from epochal.config import load_config
    from epochal.resumecheck import check_resume

    config = load_config(config_file, overrides)
    report = check_resume(config, at, _split(order) if order else None, _split(disable))
    if report.left_out:
        click.echo(f"left out (not deterministic): {', '.join(report.left_out)}")
    if report.ok:
        click.echo(
            f"ok: interrupted after batch {report.at} of {report.iterations} and resumed: parameters, "
            "log rows, counters, RNG and plugin states match the straight run bitwise"
        )
        return
    click.echo(f"MISMATCH after resuming at batch {report.at}: {report.difference}", err=True)
    sys.exit(1)


@cli.command()
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


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def hooks(as_json: bool) -> None:
    """Document every hook a plugin can implement."""
    import inspect

    from epochal import hookspecs
    from epochal._dispatch import HOOK_ARGS

    docs = {name: inspect.getdoc(getattr(hookspecs, name)) or "" for name in HOOK_ARGS}
    if as_json:
        click.echo(
            json.dumps(
                [{"name": n, "arguments": list(HOOK_ARGS[n]), "doc": d} for n, d in docs.items()], indent=2
            )
        )
        return
    for name, doc in docs.items():
        click.echo(f"{name}({', '.join(HOOK_ARGS[name])})")
        click.echo("    " + doc.replace("\n", "\n    ").rstrip() + "\n")


def _format_warning(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> str:
    return f"epochal: {category.__name__}: {message}\n"


def main() -> None:
    """Entry point of the ``epochal`` console script."""
    warnings.formatwarning = _format_warning  # one line per warning, no source excerpt
    if os.name == "posix":  # a closed pipe (epochal plugins | head) is not an error
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    cli(prog_name="epochal")
