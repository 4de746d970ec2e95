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

import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from epochal.errors import ConfigError

#: options of ``epochal run`` that only the launcher reads (the workers do not get them).
LAUNCHER_OPTIONS = ("--nproc", "--port")


@dataclass
class LaunchFailure:
    """The worker whose failure ended a run, in words."""

    rank: int
    pid: int
    exitcode: int

    def describe(self) -> str:
        """``rank 1 (pid 123) was killed by SIGKILL`` / ``... exited with status 2``."""
        if self.exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-self.exitcode}"
        elif self.exitcode == 2:  # epochal's status for an error it has printed
            how = "stopped with the error above"
        else:
            how = f"exited with status {self.exitcode}"
        return f"rank {self.rank} (pid {self.pid}) {how}"


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


def root_failure(failures: dict[int, Any]) -> LaunchFailure:
    """The failure that started it all among torch's per-rank failures.

    When one worker dies the agent stops the others with SIGTERM, so a worker killed by another
    signal, or one that exited with an error of its own, is the cause; the others followed.
    """

    def blame(item: tuple[int, Any]) -> tuple[int, float]:
        failure = item[1]
        code = failure.exitcode
        followed = code in (-signal.SIGTERM, 128 + signal.SIGTERM, 128 + signal.SIGINT)
        return (1 if followed else 0, float(getattr(failure, "timestamp", 0) or 0))

    rank, failure = min(failures.items(), key=blame)
    return LaunchFailure(rank, int(failure.pid), int(failure.exitcode))


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    port: int | None = None,
    shutdown_timeout: float = 300.0,
    on_failure: Callable[[LaunchFailure], str] | None = None,
) -> int:
    """Run ``python -m epochal ARGV`` on *nproc* local processes; return the exit status.

    *argv* are the workers' arguments (``run CONFIG ...``). 0 when every worker succeeded;
    128 + N when the launcher got signal N (forwarded to the workers, which stop at an agreed
    batch boundary and save) or the workers all stopped on one; otherwise the status of the
    worker that failed first (1 for one killed by a signal), after *on_failure*'s message.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc > 1:  # what torchrun does: one thread per process unless the user chose otherwise
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    endpoint = f"127.0.0.1:{port if port is not None else free_port()}"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        max_restarts=0,
        monitor_interval=0.1,
        shutdown_timeout=int(shutdown_timeout),
    )
    # torch's agent logs every step of a failure (and a page of report); epochal says it in one line
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "epochal", *argv)
    except SignalException as raised:
        return 128 + int(raised.sigval)
    except ChildFailedError as failed:
        codes = {f.exitcode for f in failed.failures.values()}
        interrupted = {128 + signal.SIGTERM, 128 + signal.SIGINT}
        if codes <= interrupted:  # every rank stopped on an agreed signal and saved
            return max(codes)
        failure = root_failure(failed.failures)
        if on_failure is not None:
            print(f"Error: {on_failure(failure)}", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
