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
from collections.abc import Sequence
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
        if command is None and not self._plugin_commands_loaded:
            # a command a distribution declares (entry point group epochal.commands): only its
            # module is imported, not every installed plugin
            from epochal.plugins import declared_command

            command = declared_command(cmd_name)
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
            from epochal.distributed.launch import report_error
            from epochal.distributed.world import launched

            if launched():
                from epochal.errors import ConfigError

                # under `epochal run --nproc` the launcher prints it, once for every rank
                if report_error(str(error), isinstance(error, ConfigError)):
                    sys.exit(2)
                raise _Failure(f"rank {os.environ.get('RANK')}: {error}") from None  # which process
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


_NPROC_OPTION = click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Train on this many local processes, started by torch's elastic launcher (torchrun's).",
)
_BACKEND_OPTION = click.option(
    "--backend",
    type=click.Choice(["auto", "gloo", "nccl"]),
    default=None,
    help="The process group's backend with several processes (default: [distributed] backend, "
    "else auto: nccl on GPUs, gloo on CPUs).",
)

_PLUGINS_HELP = (
    "Call order for this run: these plugins first, in this order; every other installed plugin "
    "still loads after them (unless [plugins] autoload = false), except those that load only when "
    "named (early_stopping, lr_scheduler, load, ...). a,b,c"
)
_ONLY_HELP = "Load only these plugins, in this order (no autoloading): a,b,c."


def _plugin_choice(config: dict[str, Any], order: tuple[str, ...], only: tuple[str, ...]) -> list[str] | None:
    """The --plugins order, or --only's list (which also turns autoloading off in *config*)."""
    if only and order:
        raise click.UsageError("--plugins and --only exclude each other (--only sets the order too)")
    if only:
        config.setdefault("plugins", {})["autoload"] = False
        return _split(only)
    return _split(order) if order else None


@cli.command()
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option("--plugins", "order", multiple=True, metavar="A,B", help=_PLUGINS_HELP)
@click.option("--only", multiple=True, metavar="A,B", help=_ONLY_HELP)
@click.option("--disable", multiple=True, metavar="X,Y", help="Plugins not to load this run: x,y.")
@click.option(
    "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config value."
)
@click.option(
    "--resume",
    is_flag=False,
    flag_value="latest",
    default=None,
    metavar="[auto|PATH]",
    help="Resume from the latest complete checkpoint (an error if none); `--resume auto`: the latest "
    "if any, else start fresh (preemptible jobs); `--resume PATH`: that checkpoint.",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Print the timing plugin's table (where the time went) when training ends.",
)
@click.option(
    "--trace-plugins",
    "trace",
    is_flag=False,
    flag_value="-",
    default=None,
    metavar="[FILE]",
    help="Print every hook call with the plugins called and their durations (to FILE as JSON lines).",
)
@_NPROC_OPTION
@_BACKEND_OPTION
@click.option(
    "--port",
    type=int,
    default=None,
    help="With --nproc: the local TCP port of the processes' rendezvous (default: a free one).",
)
@click.option(
    "--nnodes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Train on this many machines, --nproc processes each: run the same command on every one "
    "(with --rdzv-endpoint).",
)
@click.option(
    "--rdzv-endpoint",
    "endpoint",
    default=None,
    metavar="HOST:PORT",
    help="With --nnodes: where the machines meet (torch's c10d rendezvous; one of the machines).",
)
def run(
    config_file: str,
    order: tuple[str, ...],
    only: tuple[str, ...],
    disable: tuple[str, ...],
    overrides: tuple[str, ...],
    resume: str | None,
    profile: bool,
    trace: str | None,
    nproc: int,
    backend: str | None,
    port: int | None,
    nnodes: int,
    endpoint: str | None,
) -> None:
    """Train as CONFIG_FILE (TOML) says.

    Interrupted by a signal, it exits with 128 + the signal number (SIGTERM: 143, SIGINT: 130)
    after the plugins saved what they save on an interrupt; a third Ctrl-C stops at once
    (nothing saved) with 130. A signal after training ended changes nothing (a finished run
    exits 0).

    Every installed plugin runs unless disabled (--disable, [plugins] disable) or autoloading is
    off, but one that changes training or sends data elsewhere (early_stopping, lr_scheduler,
    load, tensorboard, ...) runs only when named: its [plugins.NAME] table, --plugins or --only;
    --plugins only puts the named ones first, --only runs the named ones and no other. The
    run ends with a summary: last and best metrics, the checkpoint directory, the log database
    and the commands to resume and to plot.

    --nproc N trains on N local processes started by torch's elastic launcher (what torchrun
    does); `torchrun ... -m epochal run CONFIG` works the same. --nnodes M --rdzv-endpoint
    HOST:PORT, the same command on each of M machines, trains on M x N processes. See
    docs/scaling-out.md.
    """
    from epochal.config import load_config
    from epochal.distributed import launched, shutdown
    from epochal.distributed.world import peer_lost
    from epochal.errors import ConfigError

    global _END_WITHOUT_FINALIZING
    _END_WITHOUT_FINALIZING = nproc > 1 or nnodes > 1 or launched()
    if profile:
        overrides = (*overrides, "plugins.timing.table=true")
    config = load_config(config_file, overrides)
    if backend is not None:
        config.setdefault("distributed", {})["backend"] = backend
    if nproc > 1 or nnodes > 1 or endpoint is not None:
        option = "--nproc" if nproc > 1 else "--nnodes" if nnodes > 1 else "--rdzv-endpoint"
        if launched():
            raise ConfigError(
                f"{option}: this process was started by a launcher already (torchrun sets WORLD_SIZE); "
                f"leave {option} out and let torchrun start the processes"
            )
        from epochal.distributed.launch import check_nodes

        nodes = (nnodes, check_nodes(nnodes, endpoint, port))
        where = "--backend" if backend is not None else f"{config_file}: [distributed] backend"
        sys.exit(_launch(config, config_file, nproc, port, nodes, order, only, disable, resume, where))
    try:
        # The loop lives only inside _train: when the process group is left, nothing that holds
        # it (DDP, synced metrics) is reachable any more, so it is freed before the group is.
        signum = _train(config, config_file, order, only, disable, resume, profile, trace)
    except Exception as error:
        # a collective that failed outside epochal's own (a DDP all-reduce, a plugin's): the
        # survivor of a dead rank says it in one line, not with torch's traceback
        lost = peer_lost(error) if launched() else None
        if lost is None:
            raise
        raise lost from error
    finally:
        shutdown()
    if signum is not None:
        sys.exit(128 + signum)


def _train(
    config: dict[str, Any],
    config_file: str,
    order: tuple[str, ...],
    only: tuple[str, ...],
    disable: tuple[str, ...],
    resume: str | None,
    profile: bool,
    trace: str | None,
) -> int | None:
    """Build and run the loop of ``epochal run``; the signal that interrupted it (None: none)."""
    import time

    from epochal.errors import ConfigError
    from epochal.resume_hint import continuing_command
    from epochal.run_dirs import choose_for, discard_if_empty
    from epochal.runner import build_loop
    from epochal.stopping import ProcessSignals, install_handlers
    from epochal.summary import RunSummary

    loop = build_loop(config, _plugin_choice(config, order, only), _split(disable), resume or False)
    if profile and "timing" not in loop.plugins and loop.world.is_zero:
        raise ConfigError(
            "--profile needs the 'timing' plugin, which this run does not load (from a clone of "
            "epochal: pip install plugins/epochal-timing; or name it in --only, or do not disable it)"
        )
    command = _command(config_file, sys.argv)
    made = choose_for(loop, resume or False, command)  # its own directory (a fresh run's is new)
    if trace is not None:
        loop.trace_plugins = trace
    loop.command = command
    summary = RunSummary()
    if loop.world.is_zero:  # the run's messages come from rank 0 only
        loop.plugin_set.pm.register(summary, name="epochal.summary")
        loop.hooks.rebuild()
    # Kept until the process ends (Loop.run swaps in its own handler while it trains): a signal
    # during the summary or the shutdown must neither kill the process nor change the outcome.
    signals = ProcessSignals(loop.stopping, _say if loop.world.is_zero else None)
    install_handlers(signals)
    started = time.perf_counter()
    try:
        log = loop.run()
    except KeyboardInterrupt:  # a third Ctrl-C: stopped at once, nothing saved
        click.echo(
            f"epochal: run {loop.run_id} stopped at once by a third SIGINT after {loop.iteration} "
            "batch(es); nothing was saved at this point",
            err=True,
        )
        sys.exit(128 + signal.SIGINT)
    except BaseException:
        discard_if_empty(made)
        raise
    finally:
        signals.end()
    if loop.world.is_zero:
        loop.command = continuing_command(loop, summary.started)  # a resume that trains on
        for line in summary.lines(loop, time.perf_counter() - started):
            click.echo(line)
    if log.status["status"] == "interrupted" and loop.signal_received is not None:
        return loop.signal_received
    return None


def _say(message: str) -> None:
    """*message* on stderr from a signal handler (os.write: the handler may interrupt a print)."""
    try:
        descriptor = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file (click's test runner)
        print(message, file=sys.stderr, flush=True)
        return
    os.write(descriptor, (message + "\n").encode(errors="replace"))


_LAUNCH_ARGS_ENV = "EPOCHAL_LAUNCH_ARGS"


def _command(config_file: str, argv: Sequence[str]) -> list[str]:
    """The command line of this run without ``--resume`` (with the launcher's ``--nproc``).

    :param argv: this process's arguments (a worker's have no ``--nproc``: the launcher passes
        it in the environment).
    """
    after = _without_resume(list(argv[argv.index(config_file) + 1 :])) if config_file in argv else []
    from epochal.distributed.world import launched

    if _LAUNCH_ARGS_ENV not in os.environ and launched():  # torchrun: its command, launcher first
        from epochal.resume_hint import torchrun_command

        under_torchrun = torchrun_command(_without_resume)
        if under_torchrun is not None:
            return under_torchrun
    return ["epochal", "run", config_file, *os.environ.get(_LAUNCH_ARGS_ENV, "").split(), *after]


def _launch(
    config: dict[str, Any],
    config_file: str,
    nproc: int,
    port: int | None,
    nodes: tuple[int, str | None],
    order: tuple[str, ...],
    only: tuple[str, ...],
    disable: tuple[str, ...],
    resume: str | None,
    where: str,
) -> int:
    """``epochal run --nproc N [--nnodes M --rdzv-endpoint E]``: check what can be checked
    here, then start N workers (this machine's, with M machines)."""
    import shlex
    from pathlib import Path

    from epochal.distributed.launch import check_port, launch, worker_arguments
    from epochal.distributed.world import DEFAULT_TIMEOUT, check_backend
    from epochal.run_dirs import newest_resumable
    from epochal.run_hooks import latest_checkpoint
    from epochal.runner import check_run

    section = config.get("distributed", {})
    check_backend(section.get("backend"), where)
    nnodes, endpoint = nodes
    if endpoint is None:
        check_port(port)
    checked = check_run(config, _plugin_choice(config, order, only), _split(disable))
    run_dir = config.get("loop", {}).get("run_dir")
    argv = worker_arguments(sys.argv[1:])
    launcher_args = f"--nproc {nproc}" + (
        f" --nnodes {nnodes} --rdzv-endpoint {endpoint}" if nnodes > 1 else ""
    )
    os.environ[_LAUNCH_ARGS_ENV] = launcher_args  # for the workers' resume commands
    command = _command(config_file, argv)  # the fresh-run check is rank 0's, in its run directory

    def explain(failure: Any) -> str:
        if failure.config:  # the same command fails the same way: no resume advice
            return failure.message if failure.everywhere else failure.describe()
        try:
            newest = newest_resumable(checked.pm, Path(run_dir)) if run_dir is not None else None
            latest = latest_checkpoint(checked.pm, newest) if newest is not None else None
        except EpochalError as error:
            return f"{failure.describe()}, and the other ranks were stopped; {error}"
        if latest is None:
            saved = "no complete checkpoint was written, so a rerun starts afresh"
        else:
            saved = f"the last complete checkpoint is {latest}; resume: {shlex.join([*command, '--resume'])}"
        return f"{failure.describe()}, and the other ranks were stopped; {saved}"

    timeout = float(section.get("timeout", DEFAULT_TIMEOUT))
    return launch(
        nproc, argv, port=port, nnodes=nnodes, endpoint=endpoint, shutdown_timeout=timeout, on_failure=explain
    )


def _without_resume(args: list[str]) -> list[str]:
    """*args* without ``--resume`` and the value it took (``auto`` or a path), if any."""
    out: list[str] = []
    skip = False
    for k, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "--resume":
            following = args[k + 1] if k + 1 < len(args) else ""
            skip = bool(following) and not following.startswith("-")
            continue
        if arg.startswith("--resume="):
            continue
        out.append(arg)
    return out


@cli.command(name="plugins")
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
@click.option("--plugins", "order", multiple=True, metavar="A,B", help=_PLUGINS_HELP)
@click.option("--only", multiple=True, metavar="A,B", help=_ONLY_HELP)
@click.option("--disable", multiple=True, help="Plugins to leave out: x,y.")
@click.option(
    "--check",
    "check_file",
    type=click.Path(dir_okay=False),
    help="Run every check a run of this config makes before training (plugins, options, order, "
    "requires/conflicts, factories), without training.",
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
    rows = [
        (
            "" if i["position"] is None else str(i["position"]),
            i["name"],
            i["status"],
            {True: "by default", False: "when named"}.get(i["autoload"], "-"),
            f"{i['distribution'] or '-'} {i['version'] or ''}".strip(),
            {"zero": "rank 0", "all": "all ranks"}.get(i["rank"] or "", "-"),
            ", ".join(i["hooks"]),
        )
        for i in infos
    ]
    print_table(("#", "name", "status", "loads", "distribution", "runs on", "hooks"), rows, numeric=(0,))
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
        plugin_set = plugins_for(config, _plugin_choice(config, order, only), _split(disable))
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
    """``epochal plugins --check CONFIG``: every check a run makes before training."""
    from epochal.config import load_config
    from epochal.runner import check_run

    checked_config = load_config(check_file)
    checked = check_run(checked_config, _plugin_choice(checked_config, order, only), _split(disable))
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
    "--at",
    type=click.IntRange(min=1),
    default=None,
    help="Interrupt after this batch (default: the batch inside an epoch nearest to half way).",
)
@click.option("--plugins", "order", multiple=True, metavar="A,B", help=_PLUGINS_HELP)
@click.option("--only", multiple=True, metavar="A,B", help=_ONLY_HELP)
@click.option("--disable", multiple=True, help="Plugins to leave out: x,y.")
@click.option(
    "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config value."
)
@_NPROC_OPTION
@_BACKEND_OPTION
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

    With --nproc N the three runs are `epochal run --nproc N` runs, and every rank's RNG, stream
    and plugin states are compared too.
    """
    from epochal.config import load_config
    from epochal.resumecheck import check_resume, check_resume_processes

    config = load_config(config_file, overrides)
    choice = _plugin_choice(config, order, only)
    if nproc > 1:
        from epochal.distributed.world import check_backend

        check_backend(backend or config.get("distributed", {}).get("backend"), "--backend")
        arguments = [a for o in overrides for a in ("--set", o)]
        arguments += [a for o in order for a in ("--plugins", o)] + [a for o in only for a in ("--only", o)]
        arguments += [a for o in disable for a in ("--disable", o)]
        arguments += ["--backend", backend] if backend else []
        report = check_resume_processes(config_file, nproc, at, arguments, say=click.echo)
    else:
        report = check_resume(config, at, choice, _split(disable), say=click.echo)
    if report.left_out:
        click.echo(f"left out (not deterministic): {', '.join(report.left_out)}")
    if report.ok:
        click.echo(
            f"ok: interrupted after batch {report.at} of {report.iterations} and resumed ({report.place}): "
            "parameters, log rows, counters, RNG and plugin states match the straight run bitwise"
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
@click.option("--json", "as_json", is_flag=True, help="Print JSON (docstrings as written, reST).")
def hooks(as_json: bool) -> None:
    """Document every hook a plugin can implement (as plain text)."""
    import inspect

    from epochal import hookspecs
    from epochal._dispatch import HOOK_ARGS
    from epochal.console import plain_text

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
        click.echo("    " + plain_text(doc).replace("\n", "\n    ").rstrip() + "\n")


_python_format_warning = warnings.formatwarning
_CORE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Warnings of epochal and its plugins (raised in their code, or of their classes: packages
    ``epochal`` and ``epochal_*``) as one line with epochal's name; every other one (the user's
    code, a library's) as Python prints it."""
    package = category.__module__.split(".")[0]
    path = os.path.abspath(filename)
    ours = (
        package == "epochal"
        or package.startswith("epochal_")
        or path.startswith(_CORE)
        or any(part.startswith("epochal_") for part in path.split(os.sep)[:-1])
    )
    if ours:
        return f"epochal: {category.__name__}: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


#: set by ``epochal run`` in a process of a run on several processes (a worker or the launcher).
_END_WITHOUT_FINALIZING = False


def main() -> None:
    """Entry point of the ``epochal`` console script."""
    warnings.formatwarning = _format_warning  # one line per warning, no source excerpt
    if os.name == "posix":  # a closed pipe (epochal plugins | head) is not an error
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        cli(prog_name="epochal")
    except SystemExit as end:
        if not _END_WITHOUT_FINALIZING:
            raise
        from epochal.distributed.launch import end_process

        end_process(end.code)
