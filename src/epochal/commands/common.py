"""What several built-in commands share: the ``--nproc``/``--backend`` options, the help of
``--plugins``/``--only``, and the plugin choice these make."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["BACKEND_OPTION", "NPROC_OPTION", "ONLY_HELP", "PLUGINS_HELP", "plugin_choice", "split"]


def split(values: tuple[str, ...]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


NPROC_OPTION = click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Train on this many local processes, started by torch's elastic launcher (torchrun's).",
)
BACKEND_OPTION = click.option(
    "--backend",
    type=click.Choice(["auto", "gloo", "nccl"]),
    default=None,
    help="The process group's backend with several processes (default: [distributed] backend, "
    "else auto: nccl on GPUs, gloo on CPUs).",
)

PLUGINS_HELP = (
    "Call order for this run: these plugins first, in this order; every other installed plugin "
    "still loads after them (unless [plugins] autoload = false), except those that load only when "
    "named (early_stopping, lr_scheduler, load, ...). a,b,c"
)
ONLY_HELP = "Load only these plugins, in this order (no autoloading): a,b,c."


def plugin_choice(config: dict[str, Any], order: tuple[str, ...], only: tuple[str, ...]) -> list[str] | None:
    """The --plugins order, or --only's list (which also turns autoloading off in *config*)."""
    if only and order:
        raise click.UsageError("--plugins and --only exclude each other (--only sets the order too)")
    if only:
        config.setdefault("plugins", {})["autoload"] = False
        return split(only)
    return split(order) if order else None
