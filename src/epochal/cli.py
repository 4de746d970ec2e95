"""The ``epochal`` command: run a configuration, list plugins and hooks, plugins' commands.

``run`` is here; the other built-in commands are in :mod:`epochal.commands` (re-exported here).
Built-in commands answer without importing any plugin; the first unknown command name (or
``--help``) imports the installed plugins and lets them add theirs (``register_commands``).
Every :class:`~epochal.errors.EpochalError` is printed as one line and exits with status 2;
``--traceback`` shows the traceback instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import click

from epochal.commands import register_commands
from epochal.commands.check_resume import check_resume_command
from epochal.commands.common import (
    BACKEND_OPTION,
    NPROC_OPTION,
    ONLY_HELP,
    PLUGINS_HELP,
    plugin_choice,
    split,
)
from epochal.commands.plugins import plugins_command
from epochal.commands.reference import hooks, new_plugin_command, schema
from epochal.errors import EpochalError

__all__ = [
    "EpochalGroup",
    "check_resume_command",
    "cli",
    "hooks",
    "main",
    "new_plugin_command",
    "plugins_command",
    "run",
    "schema",
]

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
            from epochal.distributed.world import PeerLostError, launched

            if launched():
                from epochal.errors import ConfigError

                # under `epochal run --nproc` the launcher prints it, once for every rank (a lost
                # peer's survivor says so: the launcher names the rank that failed first instead)
                followed = isinstance(error, PeerLostError)
                if report_error(str(error), isinstance(error, ConfigError), followed):
                    sys.exit(2)
                raise _Failure(f"rank {os.environ.get('RANK')}: {error}") from None  # which process
            raise _Failure(str(error)) from None


@click.group(cls=EpochalGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--traceback", is_flag=True, envvar=_TRACEBACK_ENV, help="Show tracebacks of errors.")
@click.version_option(package_name="epochal", prog_name="epochal")
@click.pass_context
def cli(ctx: click.Context, traceback: bool) -> None:
    """epochal: a training loop whose every feature is a plugin."""
    ctx.meta["epochal.traceback"] = traceback


register_commands(cli)  # plugins, check-resume, new-plugin, schema, hooks: epochal.commands


@cli.command()
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option("--plugins", "order", multiple=True, metavar="A,B", help=PLUGINS_HELP)
@click.option("--only", multiple=True, metavar="A,B", help=ONLY_HELP)
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
@NPROC_OPTION
@BACKEND_OPTION
@click.option(
    "--port",
    type=int,
    default=None,
    help="With --nproc: the local TCP port of the processes' rendezvous (default: a free one).",
)
@click.option(
    "--nnodes",
    "nnodes_value",
    default="1",
    show_default=True,
    metavar="M|MIN:MAX",
    help="Train on this many machines, --nproc processes each: run the same command on every one "
    "(with --rdzv-endpoint). MIN:MAX: an elastic job, restarted on the machines left (--max-restarts).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Restart the workers this many times after a failure (an elastic job: they continue from "
    "the newest checkpoint).",
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
    nnodes_value: str,
    max_restarts: int,
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
    from epochal.closed_pipes import keep_running_on_closed_pipes
    from epochal.config import load_config
    from epochal.distributed import launched, shutdown
    from epochal.distributed.world import peer_lost
    from epochal.errors import ConfigError

    keep_running_on_closed_pipes()  # `epochal run ... | head` must not kill the training
    from epochal.distributed.elastic import parse_nodes

    try:
        least, nnodes = parse_nodes(nnodes_value)
    except EpochalError as error:
        raise click.BadParameter(str(error).partition(": ")[2], param_hint="'--nnodes'") from None
    if resume is not None and not resume.strip():  # `--resume "$CKPT"` with CKPT unset
        raise click.BadParameter(
            "an empty value: give a checkpoint's path, `auto`, or no value (the latest)",
            param_hint="'--resume'",
        )
    global _END_WITHOUT_FINALIZING
    _END_WITHOUT_FINALIZING = nproc > 1 or nnodes > 1 or launched()
    if profile:  # the timing table of the plugin that times this run
        timer = _timer(load_config(config_file, overrides), order, only, disable)
        overrides = (*overrides, f"plugins.{timer}.table=true")
    config = load_config(config_file, overrides)
    if backend is not None:
        config.setdefault("distributed", {})["backend"] = backend
    if nproc > 1 or nnodes > 1 or endpoint is not None or max_restarts:
        option = (
            "--nproc"
            if nproc > 1
            else "--nnodes"
            if nnodes > 1
            else "--rdzv-endpoint"
            if endpoint is not None
            else "--max-restarts"
        )
        if launched():
            raise ConfigError(
                f"{option}: this process was started by a launcher already (torchrun sets WORLD_SIZE); "
                f"leave {option} out and let torchrun start the processes"
            )
        from epochal.distributed.launch import check_nodes

        nodes = (nnodes, check_nodes(nnodes, endpoint, port), least, max_restarts)
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
            if launched() and not isinstance(error, EpochalError):
                # this rank failed first-hand: say so to the launcher before the process group
                # is left (the others then lose their peer, and may end before this one does)
                from epochal.distributed.launch import report_error

                report_error(f"{type(error).__name__}: {error}", config=False)
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

    from epochal.resume_hint import continuing_command
    from epochal.run_dirs import choose_for, discard_if_empty
    from epochal.runner import build_loop
    from epochal.stopping import ProcessSignals, install_handlers
    from epochal.summary import RunSummary

    loop = build_loop(config, plugin_choice(config, order, only), split(disable), resume or False)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torch's elastic agent started this worker
        from epochal.distributed.elastic import check_batch_size, resume_after_restart

        check_batch_size(loop, config_file)
        if loop.plugin_set.implements("resume_state"):  # a restart goes on from a checkpoint
            resume = resume_after_restart(loop.world, resume)
            loop.resume = resume or False
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
    failed = False
    try:
        log = loop.run()
    except KeyboardInterrupt:  # a third Ctrl-C: stopped at once
        saver = loop.plugin_set.provider("checkpoint")  # the standard one, or its replacement
        if loop.interrupt_hooks_ran:
            saved = (
                f"after its interrupt hooks ran (plugin {saver!r} saves an interrupt checkpoint "
                "there): only its wind-down was cut short"
                if saver is not None
                else "after its interrupt hooks ran: only its wind-down was cut short"
            )
        elif loop.training_ended:  # its outcome was settled; a final save may be cut short
            saved = (
                f"after training ended ({loop.log.status.get('finish_reason')}), during its "
                "after_training hooks: a final checkpoint they write may be cut short (earlier ones "
                "are kept)"
            )
        else:
            saved = "nothing was saved at this point"
        click.echo(
            f"epochal: run {loop.run_id} stopped at once by a third SIGINT after {loop.iteration} "
            f"batch(es); {saved}",
            err=True,
        )
        sys.exit(128 + signal.SIGINT)
    except BaseException:
        failed = True
        discard_if_empty(made)
        raise
    finally:
        signals.end(failed)
    if loop.world.is_zero:
        loop.command = continuing_command(loop, summary.started)  # a resume that trains on
        for line in summary.lines(loop, time.perf_counter() - started):
            click.echo(line)
    if log.status["status"] == "interrupted" and loop.signal_received is not None:
        return loop.signal_received
    return None


def _timer(config: Any, order: tuple[str, ...], only: tuple[str, ...], disable: tuple[str, ...]) -> str:
    """The plugin that times a run of *config* (``timing``, or the one that provides it), whose
    table ``--profile`` asks for.

    :raises ConfigError: when the run loads none.
    """
    from epochal.config import plugins_for
    from epochal.errors import ConfigError

    timer = plugins_for(config, plugin_choice(config, order, only), split(disable)).provider("timing")
    if timer is None:
        raise ConfigError(
            "--profile needs the 'timing' plugin (or one that provides it), which this run does not "
            "load (from a clone of epochal: pip install plugins/epochal-timing; or name it in --only, "
            "or do not disable it)"
        )
    return timer


def _say(message: str) -> None:
    """*message* on stderr from a signal handler (os.write: the handler may interrupt a print)."""
    try:
        descriptor = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file (click's test runner)
        print(message, file=sys.stderr, flush=True)
        return
    # its reader may be gone (a closed pipe): the signal is handled all the same
    with contextlib.suppress(OSError):
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
    nodes: tuple[int, str | None, int, int],
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
    nnodes, endpoint, least, restarts = nodes
    if endpoint is None:
        check_port(port)
    checked = check_run(config, plugin_choice(config, order, only), split(disable))
    run_dir = config.get("loop", {}).get("run_dir")
    argv = worker_arguments(sys.argv[1:])
    span = f"{least}:{nnodes}" if least != nnodes else str(nnodes)
    launcher_args = f"--nproc {nproc}" + (
        f" --nnodes {span} --rdzv-endpoint {endpoint}" if nnodes > 1 else ""
    )
    if restarts:
        launcher_args += f" --max-restarts {restarts}"
    if least != nnodes:  # every world of the range must share the batches out (the workers check too)
        from epochal.distributed.elastic import NODES_ENV, check_elastic_batch

        size = config.get("data", {}).get("batch_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            check_elastic_batch(size, span, nproc, f"{config_file}: [data] batch_size")
        os.environ[NODES_ENV] = span
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
        nproc,
        argv,
        port=port,
        nnodes=nnodes,
        endpoint=endpoint,
        shutdown_timeout=timeout,
        on_failure=explain,
        min_nodes=least,
        max_restarts=restarts,
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


_python_format_warning = warnings.formatwarning
_CORE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _package_dir(name: str) -> str:
    """The directory of the imported package *name* (a path nothing starts with: not imported)."""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else "\0"


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
        # a plugin's hook warned with a stacklevel past itself: pluggy's frame, or the hook caller
        # epochal generates, is named, never the user's code
        or filename.startswith("<epochal")
        or path.startswith(_package_dir("pluggy"))
    )
    if ours:
        return f"epochal: {category.__name__}: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


#: set by ``epochal run`` in a process of a run on several processes (a worker or the launcher).
_END_WITHOUT_FINALIZING = False


def _ignore_late_signals() -> None:
    """SIGINT and SIGTERM ignored for the rest of the process (its finalization)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, OSError):  # off the main thread: nothing to change
            signal.signal(signum, signal.SIG_IGN)


def main() -> None:
    """Entry point of the ``epochal`` console script."""
    warnings.formatwarning = _format_warning  # one line per warning, no source excerpt
    if os.name == "posix":  # a closed pipe (epochal plugins | head) is not an error; the
        # commands that train undo this (epochal.closed_pipes): they outlive their readers
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # Registered first, so run last of the exit functions: from then on the outcome is settled,
    # and the interpreter's finalization would reset the handlers to the default action (a
    # SIGTERM in the half second torch's and the plugins' teardown takes killed a finished run
    # with 143). An ignored signal stays ignored through finalization.
    atexit.register(_ignore_late_signals)
    try:
        cli(prog_name="epochal")
    except SystemExit as end:
        if not _END_WITHOUT_FINALIZING:
            raise
        from epochal.distributed.launch import end_process

        end_process(end.code)
