"""Where this process stands in a run: rank, world size, and the collectives the core needs.

One process is the world ``World()`` (rank 0 of 1): every collective is the identity and torch
is never imported. Under ``torchrun`` (or ``epochal run --nproc N``) the launcher's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) makes
:func:`init_from_env` join torch's default process group; the core never sends a byte itself.

Host-side decisions (stop flags, metric sums, objects) go over a gloo *control* group, so that
they neither wait for the GPU nor queue behind NCCL kernels; training collectives (DDP's
gradient all-reduce) use the default group and its backend.
"""

from __future__ import annotations

import atexit
import gc
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from epochal._options import PositiveFloat, PositiveInt, check_options
from epochal.errors import ConfigError, EpochalError

ReduceOp = Literal["sum", "max", "min"]

#: seconds a collective may wait for a peer before the run fails (a dead rank must not hang us).
DEFAULT_TIMEOUT = 300.0
#: the values of ``[distributed] backend`` (and ``--backend``).
BACKENDS = ("auto", "gloo", "nccl")


class PeerLostError(EpochalError):
    """A collective failed: another rank stopped, died or did not answer within the timeout."""


def _lost(error: BaseException, what: str) -> PeerLostError:
    # torch's text: "[/path/to/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:6846. This is
    # typically caused by ..." -- keep what happened, without the source path and the advice
    cause = str(error).splitlines()[0] if str(error) else type(error).__name__
    cause = re.sub(r"^\[[^\]]*\]\s*", "", cause).split(". ")[0]
    return PeerLostError(
        f"{what} over the process group failed: another rank stopped, died or did not answer within "
        f"[distributed] timeout ({cause})"
    )


def peer_lost(error: BaseException) -> PeerLostError | None:
    """*error* as a :class:`PeerLostError` when it is torch's report of a broken process group
    (a collective outside epochal's own: DDP's gradient all-reduce, a plugin's), else None."""
    if isinstance(error, PeerLostError):
        return error
    import torch.distributed as dist

    text = str(error)
    broken = isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and any(words in text for words in ("by peer", "gloo/transport", "Connection refused"))
    )
    return _lost(error, "a collective") if broken else None


@dataclass(frozen=True)
class World:
    """This process's place among the processes of one run.

    :param rank: this process's global rank (0 … size-1).
    :param size: the number of processes training together.
    :param local_rank: the rank on this machine (picks the GPU).
    :param backend: the default process group's backend (``nccl``/``gloo``; None alone).
    :param nodes: the number of machines (launchers: torchrun's nodes) the processes run on.
    :param node_rank: this process's machine among them (torchrun's group rank; with a c10d
        rendezvous torch assigns it, so it need not be the launcher's ``--node-rank``).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    nodes: int = 1
    node_rank: int = 0
    #: how often the ranks agree on stop requests: after every n-th training batch (and at every
    #: epoch end); a request is honoured within 2n batches, on every rank at the same one.
    #: ``"auto"``: n chosen from the measured round trip and step time (see ``agreement``).
    agree_every_n_batches: int | Literal["auto"] = "auto"
    _control: Any = field(default=None, repr=False, compare=False)

    @property
    def distributed(self) -> bool:
        """True when more than one process trains."""
        return self.size > 1

    @property
    def several_nodes(self) -> bool:
        """True when the processes run on more than one machine: a relative path then names a
        different directory on each, and a file one machine writes is not seen by the others."""
        return self.nodes > 1

    @property
    def is_zero(self) -> bool:
        """True on rank 0, the process that writes files and prints for the run."""
        return self.rank == 0

    def all_reduce(self, values: Sequence[float], op: ReduceOp = "sum") -> list[float]:
        """*values* reduced element-wise over every rank (float64, on the host)."""
        if self.size == 1:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        reduce_op = _torch_op(op)
        try:
            dist.all_reduce(tensor, op=reduce_op, group=self._control)
        except RuntimeError as error:
            raise _lost(error, "an all-reduce") from error
        result: list[float] = tensor.tolist()
        return result

    def all_reduce_async(self, values: Sequence[float], op: ReduceOp = "max") -> Any:
        """Start reducing *values*; the returned handle's ``wait()`` gives the reduced list.

        For decisions taken one batch later without blocking this one (stop flags).
        """
        return _Pending(self, values, op)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """*obj* of rank *src*, on every rank (picklable objects only)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self._control)
        except RuntimeError as error:
            raise _lost(error, "a broadcast") from error
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's *obj*, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self._control)
        except RuntimeError as error:
            raise _lost(error, "an all-gather") from error
        return out

    def all_reduce_arrays(self, arrays: Sequence[Any], op: ReduceOp = "sum") -> list[Any]:
        """Numpy *arrays* reduced element-wise over every rank: fresh arrays, same shapes and dtypes.

        For models trained on the host (the numpy examples average their gradients with it).
        One collective over the control group for all of them; every rank gets the same bits.
        """
        import numpy as np

        arrays = [np.asarray(a) for a in arrays]
        if self.size == 1 or not arrays:
            return [a.copy() for a in arrays]
        import torch
        import torch.distributed as dist

        dtype = np.result_type(*arrays)
        flat = np.concatenate([a.astype(dtype, copy=False).ravel() for a in arrays])
        tensor = torch.from_numpy(flat)
        reduce_op = _torch_op(op)
        try:
            dist.all_reduce(tensor, op=reduce_op, group=self._control)
        except RuntimeError as error:
            raise _lost(error, "an all-reduce") from error
        out, start = [], 0
        for a in arrays:
            out.append(flat[start : start + a.size].reshape(a.shape).astype(a.dtype, copy=False))
            start += a.size
        return out

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.size > 1:
            import torch.distributed as dist

            try:
                dist.barrier(group=self._control)
            except RuntimeError as error:
                raise _lost(error, "a barrier") from error


def _torch_op(op: ReduceOp) -> Any:
    """torch's reduce operation named *op*."""
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


class _Pending:
    """An asynchronous all-reduce of a few host numbers over the control group."""

    def __init__(self, world: World, values: Sequence[float], op: ReduceOp) -> None:
        self._values = [float(v) for v in values]
        self._work = None
        if world.size > 1:
            import torch
            import torch.distributed as dist

            self._tensor = torch.tensor(self._values, dtype=torch.float64)
            reduce_op = _torch_op(op)
            try:
                self._work = dist.all_reduce(self._tensor, op=reduce_op, group=world._control, async_op=True)
            except RuntimeError as error:
                raise _lost(error, "an all-reduce") from error

    def wait(self) -> list[float]:
        """The reduced values (waits for the peers when they are not there yet)."""
        if self._work is None:
            return self._values
        try:
            self._work.wait()
        except RuntimeError as error:
            raise _lost(error, "an all-reduce") from error
        result: list[float] = self._tensor.tolist()
        return result


_current = World()


def current_world() -> World:
    """The world this process joined (``World()`` until :func:`init_from_env` joins one)."""
    return _current


def launched() -> bool:
    """True when a launcher (torchrun, ``epochal run --nproc``) started this process."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def default_backend() -> str:
    """``nccl`` when CUDA is there, else ``gloo``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def check_backend(backend: str | None, where: str = "[distributed] backend") -> str:
    """*backend* (``auto``/None resolved) if this machine can run it, else a :class:`ConfigError`."""
    if backend is None or backend == "auto":
        return default_backend()
    if backend not in BACKENDS:
        raise ConfigError(f"{where}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"{where} = 'nccl' needs CUDA GPUs and this machine has none; use 'gloo' "
                "(or 'auto': gloo on CPUs, nccl on GPUs)"
            )
    return backend


def init_from_env(
    backend: Literal["auto", "gloo", "nccl"] | None = None,
    timeout: PositiveFloat = DEFAULT_TIMEOUT,
    agree_every_n_batches: PositiveInt | Literal["auto"] = "auto",
) -> World:
    """Join the process group the launcher's environment describes; return this process's world.

    Idempotent: a second call returns the same world. Without a launcher (``WORLD_SIZE`` unset
    or 1) it returns ``World()`` and imports nothing.

    :param backend: the process group's backend on several processes: ``auto`` (nccl on GPUs,
        else gloo), ``gloo`` or ``nccl``; ``epochal run --backend`` overrides it.
    :param timeout: seconds a collective waits for a peer before the run fails (a dead rank must
        not hang the others).
    :param agree_every_n_batches: how often the ranks agree on stop requests and signals: after
        every n-th batch (and at every epoch end); a request is honoured within 2n batches.
        ``"auto"`` (the default) times the first batches and a few round trips, then picks the
        smallest n (1 to 128) for which the agreement costs at most 1% of the steps' time.
    """
    global _current
    options = {"backend": backend, "timeout": timeout, "agree_every_n_batches": agree_every_n_batches}
    check_options("distributed", init_from_env, options, "[distributed]", ConfigError, keys=list(options))
    if _current.distributed or not launched():
        return _current
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = check_backend(backend)
    if chosen == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend=chosen, timeout=timedelta(seconds=timeout))
    control = None
    if chosen != "gloo":
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    nodes, node_rank = _nodes(size)
    _current = World(
        rank=rank,
        size=size,
        local_rank=local_rank,
        backend=chosen,
        nodes=nodes,
        node_rank=node_rank,
        agree_every_n_batches=agree_every_n_batches,
        _control=control,
    )
    atexit.register(shutdown)
    return _current


def _nodes(size: int) -> tuple[int, int]:
    """(number of machines, this one's index) from the launcher's environment.

    torchrun (and ``epochal run --nproc``) set ``GROUP_WORLD_SIZE``/``GROUP_RANK``, its agents
    (one per node) and this one's rank among them; another launcher that sets only
    ``LOCAL_WORLD_SIZE`` gives ``WORLD_SIZE / LOCAL_WORLD_SIZE`` machines; one that sets neither
    is taken for one machine.
    """
    try:
        if "GROUP_WORLD_SIZE" in os.environ:
            return max(1, int(os.environ["GROUP_WORLD_SIZE"])), int(os.environ.get("GROUP_RANK", "0"))
        if "LOCAL_WORLD_SIZE" in os.environ:
            local = max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
            return max(1, -(-size // local)), int(os.environ.get("GROUP_RANK", "0"))
    except ValueError:
        pass
    return 1, 0


def shutdown() -> None:
    """Leave the process group (the end of a distributed run)."""
    global _current
    if _current.distributed:
        import torch.distributed as dist

        # Objects holding the group (DDP, synced metrics) may sit in reference cycles (the loop
        # and its model): freed by the interpreter's teardown after the group, they made ~1 in
        # 5 gloo runs end in "terminate called without an active exception". The rest of that
        # abort (a gloo thread that releases a Python-made tensor while the interpreter
        # finalizes) is why `epochal run` ends such a process without finalizing it
        # (epochal.distributed.launch.end_process).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    _current = World()
