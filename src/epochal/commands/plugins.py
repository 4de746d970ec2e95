"""``epochal plugins``: list the installed plugins, their hooks and call order, or check a
run's plugins (``--check CONFIG``) without training."""

from __future__ import annotations

import json
import warnings
from typing import Any

import click

from epochal.commands.common import ONLY_HELP, PLUGINS_HELP, plugin_choice, split

__all__ = ["plugins_command"]


@click.command(name="plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--csv",
    "as_csv",
    is_flag=True,
    help="Print CSV: position, name, status, distribution, version, hooks, rank, autoload.",
)
@click.option("--order", "show_order", is_flag=True, help="Show the call order of every hook.")
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="Use this run config's plugin settings."
)
@click.option("--plugins", "order", multiple=True, metavar="A,B", help=PLUGINS_HELP)
@click.option("--only", multiple=True, metavar="A,B", help=ONLY_HELP)
@click.option("--disable", multiple=True, help="Plugins to leave out: x,y.")
@click.option(
    "--check",
    "check_file",
    type=click.Path(dir_okay=False),
    help="Check this config as a run does before training, without calling the model and data "
    "factories: loop limits, plugins, options, order, requires/conflicts, the factories' arguments. "
    "What needs the data or the model (streams named by test_streams, evaluation schedules and "
    "trigger conditions; test_weights) is checked when a run starts.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    help="With --check: also check a run on this many processes (backend; where each plugin runs).",
)
@click.option(
    "--no-cache",
    is_flag=True,
    help="Build the listing afresh: neither read nor write the listing cache (also EPOCHAL_NO_CACHE=1).",
)
def plugins_command(
    as_json: bool,
    as_csv: bool,
    show_order: bool,
    config_file: str | None,
    order: tuple[str, ...],
    only: tuple[str, ...],
    disable: tuple[str, ...],
    check_file: str | None,
    nproc: int,
    no_cache: bool,
) -> None:
    """List installed plugins: distribution, version, hooks, status, position.

    Warns (on stderr) about a plugin distribution that declares a range of epochal versions
    this epochal is not in. The listing of what is installed (no --config, --plugins, --only
    or --disable) is cached until a distribution is installed or removed or a plugin's code
    changes, so that it imports no plugin; --no-cache builds it afresh.
    """
    if check_file:
        _check_command(check_file, order, only, disable, nproc)
        return
    from epochal import _listing_cache

    cacheable = not (no_cache or config_file or order or only or disable)
    listing = _listing_cache.load() if cacheable else None
    if listing is None:
        build = _listing_cache.Build() if cacheable else None
        listing, warned = _listing(
            config_file, order, only, disable, cacheable or not (as_json or as_csv or show_order)
        )
        if build is not None and not warned:  # a warning may come from what the cache cannot see
            _listing_cache.store(listing, build)
    infos, orders = listing["infos"], listing["order"]
    if as_json:
        payload: Any = {"plugins": infos, "order": orders} if show_order else infos
        click.echo(json.dumps(payload, indent=2))
        return
    if show_order:
        for hook, names in orders.items():
            click.echo(f"{hook}: {' -> '.join(names) if names else '(none)'}")
        return
    from epochal.console import print_csv, print_table

    if as_csv:
        print_csv(
            ("position", "name", "status", "distribution", "version", "hooks", "rank", "autoload"),
            [
                (
                    i["position"],
                    i["name"],
                    i["status"],
                    i["distribution"],
                    i["version"],
                    " ".join(i["hooks"]),
                    i["rank"],
                    {True: "true", False: "false"}.get(i["autoload"], ""),
                )
                for i in infos
            ],
        )
        return
    if not infos:
        click.echo("no plugins installed")
        return
    # the name first: a table too wide for the terminal is split, each part keyed by column 0
    rows = [
        (
            i["name"],
            "" if i["position"] is None else str(i["position"]),
            i["status"],
            {True: "by default", False: "when named"}.get(i["autoload"], "-"),
            f"{i['distribution'] or '-'} {i['version'] or ''}".strip(),
            {"zero": "rank 0", "all": "all ranks"}.get(i["rank"] or "", "-"),
            ", ".join(i["hooks"]),
        )
        for i in infos
    ]
    print_table(("name", "#", "status", "loads", "distribution", "runs on", "hooks"), rows, numeric=(1,))
    for i in infos:
        if i["error"]:
            click.echo(f"{i['name']}: {i['error']}", err=True)
    for line in listing["warnings"]:
        click.echo(f"warning: {line}", err=True)


def _listing(
    config_file: str | None,
    order: tuple[str, ...],
    only: tuple[str, ...],
    disable: tuple[str, ...],
    mismatches: bool,
) -> tuple[dict[str, Any], bool]:
    """What ``epochal plugins`` lists: every plugin's info, each hook's call order and the
    warnings about plugin distributions made for another epochal (when *mismatches*); and
    whether a warning was shown while plugins were loaded."""
    from epochal._dispatch import HOOK_ARGS
    from epochal.config import load_config, plugins_for
    from epochal.plugins import PluginLoadWarning

    config = load_config(config_file) if config_file else {}
    shown: list[object] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)  # shown as status "failed" instead
        show = warnings.showwarning

        def noted(message: Warning | str, *args: Any, **kwargs: Any) -> None:
            shown.append(message)
            show(message, *args, **kwargs)

        warnings.showwarning = noted
        plugin_set = plugins_for(config, plugin_choice(config, order, only), split(disable))
    infos = [info.as_dict() for info in plugin_set.infos]
    listing = {
        "infos": infos,
        "order": {hook: plugin_set.call_order(hook) for hook in HOOK_ARGS},
        "warnings": _core_mismatches(i["distribution"] for i in infos) if mismatches else [],
    }
    return listing, bool(shown)


def _check_command(
    check_file: str, order: tuple[str, ...], only: tuple[str, ...], disable: tuple[str, ...], nproc: int
) -> None:
    """``epochal plugins --check CONFIG``: the checks a run makes before training that need no
    call of the model and data factories (:func:`epochal.runner.check_run`)."""
    from epochal.config import load_config
    from epochal.runner import check_run

    checked_config = load_config(check_file)
    checked = check_run(checked_config, plugin_choice(checked_config, order, only), split(disable))
    click.echo(f"ok: {check_file}: plugins in call order: {', '.join(checked.plugins) or 'none'}")
    if nproc > 1:
        from epochal.distributed.world import check_backend

        backend = check_backend(
            checked_config.get("distributed", {}).get("backend"), f"{check_file}: [distributed] backend"
        )
        ranks = {i.name: i.rank for i in checked.infos if i.status == "loaded"}
        everywhere = [n for n in checked.plugins if ranks.get(n) != "zero"]
        zero = [n for n in checked.plugins if ranks.get(n) == "zero"]
        click.echo(
            f"ok: on {nproc} processes ({backend}): every rank runs "
            f"{', '.join(everywhere) or 'no plugin'}; rank 0 only: {', '.join(zero) or 'none'}"
        )


def _core_mismatches(distributions: Any) -> list[str]:
    """One line per plugin distribution whose declared ``epochal`` range excludes this epochal."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    core = metadata.version("epochal")
    lines = []
    for name in sorted({d for d in distributions if d and d != "epochal"}):
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requirements:
            try:
                requirement = Requirement(text)
            except InvalidRequirement:
                continue
            if requirement.name != "epochal" or requirement.marker is not None:
                continue
            if requirement.specifier and not requirement.specifier.contains(core, prereleases=True):
                lines.append(
                    f"{name} supports epochal{requirement.specifier}, but epochal {core} is installed: "
                    f"it may fail; install a {name} release made for epochal {core}"
                )
    return lines
