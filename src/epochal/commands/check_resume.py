"""``epochal check-resume``: interrupt a run, resume it, and compare it with a straight run."""

from __future__ import annotations

import sys

import click

from epochal.commands import common

__all__ = ["check_resume_command"]


@click.command(name="check-resume")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option(
    "--at",
    type=click.IntRange(min=1),
    default=None,
    help="Interrupt after this batch (default: the batch inside an epoch nearest to half way).",
)
@click.option("--plugins", "order", multiple=True, metavar="A,B", help=common.PLUGINS_HELP)
@click.option("--only", multiple=True, metavar="A,B", help=common.ONLY_HELP)
@click.option("--disable", multiple=True, help="Plugins to leave out: x,y.")
@click.option(
    "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config value."
)
@common.NPROC_OPTION
@common.BACKEND_OPTION
def check_resume_command(
    config_file: str,
    at: int | None,
    order: tuple[str, ...],
    only: tuple[str, ...],
    disable: tuple[str, ...],
    overrides: tuple[str, ...],
    nproc: int,
    backend: str | None,
) -> None:
    """Check that a run interrupted at batch N and resumed matches a straight run bitwise.

    Also a run ended right after an epoch's end as kill -9 ends it, and resumed from its latest
    complete checkpoint. With --nproc N the five runs are `epochal run --nproc N` runs, and
    every rank's RNG, stream and plugin states are compared too.
    """
    from epochal.closed_pipes import keep_running_on_closed_pipes
    from epochal.config import load_config
    from epochal.resumecheck import check_resume, check_resume_processes

    keep_running_on_closed_pipes()  # it trains: `... | head` must not kill it half way
    config = load_config(config_file, overrides)
    choice = common.plugin_choice(config, order, only)
    if nproc > 1:
        from epochal.distributed.world import check_backend

        check_backend(backend or config.get("distributed", {}).get("backend"), "--backend")
        arguments = [a for o in overrides for a in ("--set", o)]
        arguments += [a for o in order for a in ("--plugins", o)] + [a for o in only for a in ("--only", o)]
        arguments += [a for o in disable for a in ("--disable", o)]
        arguments += ["--backend", backend] if backend else []
        report = check_resume_processes(config_file, nproc, at, arguments, say=click.echo)
    else:
        report = check_resume(config, at, choice, common.split(disable), say=click.echo)
    if report.left_out:
        click.echo(f"left out (not deterministic): {', '.join(report.left_out)}")
    if report.difference is None:
        click.echo(
            f"ok: interrupted after batch {report.at} of {report.iterations} and resumed ({report.place}): "
            "parameters, log rows, counters, RNG and plugin states match the straight run bitwise"
        )
    else:
        click.echo(f"MISMATCH after resuming at batch {report.at}: {report.difference}", err=True)
    killed = f"ended after epoch {report.killed_after_epoch} as kill -9 ends it"
    source = (
        "afresh (no checkpoint was saved by then)"
        if report.revived_at is None
        else f"from its latest complete checkpoint (batch {report.revived_at})"
    )
    if report.kill_difference is None:
        click.echo(f"ok: {killed} and resumed {source}: it matches the straight run bitwise")
    else:
        click.echo(
            f"MISMATCH: {killed} and resumed {source}: {report.kill_difference}. A plugin whose "
            f"state changes in after_epoch after the checkpoint was taken (it runs after "
            f"{report.saver!r}) gives this: order it before {report.saver!r} (--plugins, [plugins] "
            'order) or give it a phase before "save"',
            err=True,
        )
    if not report.ok:
        sys.exit(1)
