"""Elastic runs: workers that torch's elastic agent restarted continue from the newest checkpoint.

Under ``torchrun --nnodes MIN:MAX --max-restarts N`` (or ``epochal run --nnodes MIN:MAX
--max-restarts N``) the agent restarts every worker when one fails or a node leaves, and again
when a node joins: the new world may have another number of processes. A restarted worker
knows it from ``TORCHELASTIC_RESTART_COUNT`` (the agent's count of failed rounds); when any
rank's count is above 0 the run continues as ``--resume auto`` does, through the same hooks
(``latest_checkpoint``, ``resume_state``), and a checkpoint taken inside an epoch shares the
rest of that epoch out afresh among the new processes (:func:`epochal.data.resplit_start`).
A first start (every count 0) is a fresh run, with the fresh-run checks of any other.

``epochal run --nnodes MIN:MAX`` tells its workers the range (:data:`NODES_ENV`), and they
refuse a per-process batch size that some world of the range could not share out after
another one's checkpoint (:func:`check_batch_size`).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from epochal.errors import ConfigError

#: the agent's count of restarts after a failure, in every worker's environment.
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
#: ``MIN:MAX`` machines of ``epochal run --nnodes MIN:MAX``, for its workers (with
#: ``LOCAL_WORLD_SIZE``, the worlds a run may have).
NODES_ENV = "EPOCHAL_ELASTIC_NODES"


def restart_count() -> int:
    """How many times the elastic agent restarted this process's workers (0: a first start)."""
    try:
        return max(0, int(os.environ.get(RESTART_ENV, "0") or 0))
    except ValueError:
        return 0


def resume_after_restart(world: Any, resume: str | None) -> str | None:
    """*resume* (``epochal run --resume``'s value), or ``"auto"`` for the workers of a restart.

    Every rank takes part (the largest count of the ranks decides: a node that joins a
    restarted job counts 0 itself); rank 0 says once what the run does.
    """
    count = restart_count()
    if world.distributed:
        count = int(world.all_reduce([count], "max")[0])
    if count == 0 or resume == "auto":
        return resume
    if world.is_zero:
        print(
            f"epochal: restart {count} of this elastic job ({RESTART_ENV}), now on {world.size} "
            "process(es): continuing from the newest complete checkpoint (--resume auto)",
            file=sys.stderr,
            flush=True,
        )
    return "auto"


def parse_nodes(value: str) -> tuple[int, int]:
    """``"M"`` or ``"MIN:MAX"`` (torchrun's ``--nnodes``) as ``(MIN, MAX)``.

    :raises ConfigError: naming ``--nnodes`` and the value.
    """
    low, _, high = value.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"--nnodes {value!r}: expected a number of machines M >= 1, or a range MIN:MAX")
    return bounds


def worlds(nodes: tuple[int, int], nproc: int) -> list[int]:
    """The numbers of processes a job of *nodes* machines, *nproc* processes each, may have."""
    return [k * nproc for k in range(nodes[0], nodes[1] + 1)]


def batch_multiple(sizes: list[int]) -> int:
    """The smallest per-process batch size ``b`` (and its multiples) such that the examples
    every world of *sizes* consumes per step, ``b * N``, can be shared out by every other one."""
    multiple = 1
    for n in sizes:
        for m in sizes:
            multiple = math.lcm(multiple, m // math.gcd(n, m))
    return multiple


def train_batch_size(stream: Any) -> int | None:
    """The per-process batch size of a train stream (a BatchStream's, a DataLoader's), if known."""
    size = getattr(stream, "batch_size", None)
    if size is None:
        size = getattr(getattr(stream, "loader", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_batch_size(loop: Any, where: str = "") -> None:
    """Refuse, under ``epochal run --nnodes MIN:MAX``, a train batch size whose steps some world
    of the range cannot share out after a checkpoint of another (the rest of an epoch would
    be padded, some examples trained twice).

    :raises ConfigError: naming ``--nnodes``, the batch size and the multiple it needs.
    """
    value = os.environ.get(NODES_ENV)
    size = train_batch_size(loop.data.get("train"))
    if value and size is not None:
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        check_elastic_batch(
            size, value, nproc, f"{where}: [data] stream 'train'" if where else "[data] stream 'train'"
        )


def check_elastic_batch(size: int, nodes: str, nproc: int, what: str) -> None:
    """Refuse a per-process batch *size* (of *what*) that some world of ``--nnodes`` *nodes*
    (``MIN:MAX``) with *nproc* processes each cannot share out after another world's checkpoint.

    :raises ConfigError: naming ``--nnodes``, *what*, the batch size and the multiple it needs.
    """
    sizes = worlds(parse_nodes(nodes), nproc)
    multiple = batch_multiple(sizes)
    if len(sizes) > 1 and size % multiple:
        counts = ", ".join(map(str, sizes))
        raise ConfigError(
            f"--nnodes {nodes} --nproc {nproc}: {what}, a batch size of {size} per process, cannot be "
            f"shared out on every world of the range ({counts} processes): after a checkpoint "
            "inside an epoch the rest of it would not split evenly, and some examples would be trained "
            f"twice. Use a batch size that is a multiple of {multiple}"
        )
