"""``epochal run CONFIG --nproc N``: N local processes started by torch's elastic launcher.

Exactly what ``torchrun --standalone --nproc-per-node N -m epochal run CONFIG`` does: torch's
``elastic_launch`` with a c10d rendezvous on the loopback interface, no restarts, and the binary
entry point ``python -m epochal run CONFIG ...`` for every worker (the workers join the process
group from the launcher's environment). epochal adds only what a person needs around it: bad
input refused before anything starts, one clear line when a worker fails (which rank, how, the
last complete checkpoint and the command that resumes from it), and the exit status of a signal
(128 + its number) once the workers have saved and stopped.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from epochal.errors import ConfigError

#: options of ``epochal run`` that only the launcher reads (the workers do not get them).
LAUNCHER_OPTIONS = ("--nproc", "--port", "--nnodes", "--rdzv-endpoint", "--max-restarts")
#: the rendezvous id of a job on several machines: the same on every one, as torchrun's default
#: (a job is the endpoint's: one job per endpoint at a time).
RDZV_ID = "epochal"
#: the folder where a worker started by :func:`launch` leaves its error (``rank-N.json``) for
#: the launcher to print once, instead of printing it on every rank.
ERRORS_ENV = "EPOCHAL_LAUNCH_ERRORS"
#: a worker's exit status after an agreed stop on a signal (every rank saved and stopped).
_STOPPED = {128 + signal.SIGTERM, 128 + signal.SIGINT}


@dataclass
class LaunchFailure:
    """The worker whose failure ended a run, in words."""

    rank: int
    pid: int
    exitcode: int
    #: the error the worker reported (an :class:`~epochal.errors.EpochalError`'s line), if any.
    message: str | None = None
    #: the error is a configuration error (rerunning the same command fails the same way).
    config: bool = False
    #: every rank that reported an error reported this one.
    everywhere: bool = False

    def describe(self) -> str:
        """``rank 1 (pid 123) was killed by SIGKILL`` / ``rank 1 (pid 123) stopped: MESSAGE``."""
        if self.message is not None:  # what it said of itself (a signal may have ended it after)
            how = f"stopped: {self.message}"
        elif self.exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-self.exitcode}"
        else:
            how = f"exited with status {self.exitcode}"
        return f"rank {self.rank} (pid {self.pid}) {how}"


def report_error(message: str, config: bool, followed: bool = False) -> bool:
    """In a worker started by :func:`launch`: leave *message* for the launcher to print once.

    :param followed: the error follows another rank's failure (a lost peer): that rank is the
        one to name, not this one.
    :returns: False (the caller prints it) when this process was not started by :func:`launch`
        or the file cannot be written.
    """
    folder = os.environ.get(ERRORS_ENV)
    rank = os.environ.get("RANK")
    if not folder or rank is None:
        return False
    try:
        text = json.dumps({"message": message, "config": config, "followed": followed})
        (Path(folder) / f"rank-{int(rank)}.json").write_text(text, encoding="utf-8")
    except (OSError, ValueError):
        return False
    return True


def _reported(folder: Path) -> dict[int, dict[str, Any]]:
    """rank → the error that rank reported (see :func:`report_error`)."""
    found: dict[int, dict[str, Any]] = {}
    for path in folder.glob("rank-*.json"):
        try:
            found[int(path.stem.split("-", 1)[1])] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return found


def _with_report(failure: LaunchFailure, reports: dict[int, dict[str, Any]], ranks: int) -> LaunchFailure:
    """*failure* with the error its rank reported, if it reported one; *ranks*: how many
    workers could have reported (the error is everywhere only when each of them reported it:
    the agent may stop the others before they report the same error, and an error only one
    rank found must name that rank)."""
    report = reports.get(failure.rank)
    if report is None:
        return failure
    messages = {str(r.get("message")) for r in reports.values()}
    failure.message = str(report.get("message"))
    failure.config = bool(report.get("config"))
    failure.everywhere = len(messages) == 1 and len(reports) >= ranks
    return failure


def check_port(port: int | None) -> int | None:
    """*port* if nothing listens on it on this machine (None: let the launcher choose one).

    :raises ConfigError: naming ``--port`` when the port is taken or not a port number.
    """
    if port is None:
        return None
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port}: not a TCP port number (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise ConfigError(
                f"--port {port}: the port is in use on this machine ({error.strerror or error}); "
                "choose another one, or leave --port out to take a free one"
            ) from None
    return port


def check_nodes(nnodes: int, endpoint: str | None, port: int | None) -> str | None:
    """*endpoint* (``--rdzv-endpoint``) if it goes with *nnodes* and *port*, else a
    :class:`ConfigError` naming the option.

    Several machines need an endpoint (``HOST:PORT``, with a TCP port number), which names the
    port: ``--port`` is then refused.
    """
    if endpoint is None:
        if nnodes > 1:
            raise ConfigError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: where the machines meet, the same "
                "on every machine (one of them, e.g. the first of the job's nodes)"
            )
        return None
    if port is not None:
        raise ConfigError("--port and --rdzv-endpoint exclude each other (--rdzv-endpoint names the port)")
    host, sep, number = endpoint.rpartition(":")
    if not sep or not host or not number.isdigit() or not 0 < int(number) < 65536:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (a machine of the job and a TCP port, "
            "e.g. node1:29500), the same on every machine"
        )
    return endpoint


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def worker_arguments(argv: Sequence[str]) -> list[str]:
    """*argv* (``epochal``'s arguments) without the launcher's own options and their values."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in LAUNCHER_OPTIONS:
            skip = True
            continue
        if arg.startswith(tuple(f"{option}=" for option in LAUNCHER_OPTIONS)):
            continue
        out.append(arg)
    return out


def agreed_stop(codes: set[int]) -> int | None:
    """The exit status of a run whose workers ended with *codes*, if they all stopped on a signal.

    An agreed stop ends every rank with 128 + N after the save; a rank still winding down when
    the first one exits may be stopped by the agent's SIGTERM instead. That is no failure.
    """
    if codes & _STOPPED and codes <= _STOPPED | {-signal.SIGTERM}:
        return max(codes & _STOPPED)
    return None


def root_failure(failures: dict[int, Any], reports: dict[int, dict[str, Any]] | None = None) -> LaunchFailure:
    """The failure that started it all among torch's per-rank failures.

    When one worker dies the agent stops the others with SIGTERM, so a worker killed by another
    signal, or one that reported or exited with an error of its own, is the cause (even when the
    agent's SIGTERM caught it while it was ending); the others followed, and a worker that
    reported a lost peer (*reports*: :func:`report_error`'s ``followed``) followed last. torch's
    timestamps are whole seconds: they break ties only.
    """
    reports = reports or {}

    def blame(item: tuple[int, Any]) -> tuple[int, float]:
        rank, failure = item
        report = reports.get(rank)
        if report is not None:  # what the rank said of itself: it failed, or it lost a peer
            order = 2 if report.get("followed") else 0
        else:  # stopped by the agent (SIGTERM), or it died or exited by itself
            order = 1 if failure.exitcode in (-signal.SIGTERM, *_STOPPED) else 0
        return (order, float(getattr(failure, "timestamp", 0) or 0))

    rank, failure = min(failures.items(), key=blame)
    return LaunchFailure(rank, int(failure.pid), int(failure.exitcode))


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    port: int | None = None,
    nnodes: int = 1,
    endpoint: str | None = None,
    shutdown_timeout: float = 300.0,
    on_failure: Callable[[LaunchFailure], str] | None = None,
    min_nodes: int | None = None,
    max_restarts: int = 0,
) -> int:
    """Run ``python -m epochal ARGV`` on *nproc* local processes; return the exit status.

    *argv* are the workers' arguments (``run CONFIG ...``). With *nnodes* > 1 the same call on
    each machine meets the others at *endpoint* (``HOST:PORT``, c10d) and starts this machine's
    *nproc* workers of the job. 0 when every worker succeeded;
    128 + N when the launcher got signal N (forwarded to the workers, which stop at an agreed
    batch boundary and save) or the workers all stopped on one; otherwise the status of the
    worker that failed first (1 for one killed by a signal), after *on_failure*'s message.
    *min_nodes* < *nnodes*: an elastic job of *min_nodes* to *nnodes* machines; its workers are
    restarted up to *max_restarts* times (and go on from the newest checkpoint).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc > 1:  # what torchrun does: one thread per process unless the user chose otherwise
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if endpoint is None:
        endpoint = f"127.0.0.1:{port if port is not None else free_port()}"
    config = LaunchConfig(
        min_nodes=min_nodes or nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=RDZV_ID if nnodes > 1 else str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        shutdown_timeout=int(shutdown_timeout),
    )
    # torch's agent logs every step of a failure (and a page of report); epochal says it in one line
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="epochal-launch-") as folder:
        os.environ[ERRORS_ENV] = folder  # the workers' environment is a copy of this one
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "epochal", *argv)
        except SignalException as raised:
            return 128 + int(raised.sigval)
        except ChildFailedError as failed:
            stopped = agreed_stop({int(f.exitcode) for f in failed.failures.values()})
            if stopped is not None:  # every rank stopped on an agreed signal and saved
                return stopped
            reports = _reported(Path(folder))
            failure = _with_report(root_failure(failed.failures, reports), reports, len(failed.failures))
            if on_failure is not None:
                print(f"Error: {on_failure(failure)}", file=sys.stderr, flush=True)
            return failure.exitcode if failure.exitcode > 0 else 1
        finally:
            os.environ.pop(ERRORS_ENV, None)
    return 0


def end_process(code: object) -> NoReturn:
    """End this process as multiprocessing ends its children: wait for its non-daemon threads,
    run its exit functions, flush stdout and stderr, then ``os._exit`` without the interpreter's
    finalization.

    torch's threads (gloo's workers, a store's) may still release a tensor made in Python when
    the interpreter finalizes; taking the GIL then ends the thread inside C++ code, which aborts
    the process ("terminate called without an active exception", issue 31). Finalization also
    resets the signal handlers, so a late SIGTERM would kill the process by the signal.
    """
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): what the interpreter would do
        print(code, file=sys.stderr)
        status = 1
    # what multiprocessing's children run (process.py, _bootstrap): the threading module's exit
    # functions (concurrent.futures shuts its executors down there), then a join of every
    # non-daemon thread
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()  # what the interpreter's exit would run (the world's shutdown too)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)
