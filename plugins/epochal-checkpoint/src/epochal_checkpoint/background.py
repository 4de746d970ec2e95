"""Asynchronous saves (``async_save = true``): the writer thread, back-pressure, and sharded
checkpoints written in the background.

A save copies the state in memory on the training thread and writes it in a background thread
(:class:`BackgroundWrites`). A periodic save that comes due while the previous write still runs
is deferred, not waited for (:meth:`BackgroundWrites._busy`, :meth:`BackgroundWrites._defer`):
the loop never waits longer than one in-memory copy.

Sharded checkpoints (:mod:`epochal_checkpoint.sharded`) are written the same way, by every
rank (:class:`AsyncShards`): on the training thread each rank copies its own tensors into host
memory with DCP's stager (``DefaultStager``: the buffers are kept and reused by the next save)
and rank 0 makes the checkpoint's temporary directory; then each rank's thread runs ``dcp.save``
of that copy, checksums and fsyncs its files, and the threads all-gather what they wrote. That
gather is the barrier after which rank 0's thread knows every rank's files are durable, and
only then does it write the rest and the manifest, commit record last. The threads' collectives
run on a gloo process group of their own, made when training starts, so they never interleave
with the loop's. A kill at any moment leaves a temporary directory and no manifest: nothing
that looks complete (it is cleaned when the next run starts).

The ranks agree on the outcome at meeting points the loop already has (the next save, an
epoch end once every write finished, training end, a stop): each joins its own thread and the
ranks gather their errors, so a failure of any rank's write is raised once on every rank
(:meth:`BackgroundWrites._meet`).
"""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal_checkpoint import sharded as shards
from epochal_checkpoint.errors import CheckpointWriteError

if TYPE_CHECKING:
    from epochal.loop import Loop

__all__ = ["AsyncShards", "BackgroundWrites", "failure_line"]


def failure_line(error: BaseException) -> str:
    """What a failed background write says: its own message for a :class:`CheckpointWriteError`."""
    if isinstance(error, CheckpointWriteError):
        return str(error)
    return f"the asynchronous checkpoint save failed: {type(error).__name__}: {error}"


def _group_timeout() -> timedelta | None:
    """The loop's process group's timeout, for the writers' own group (None: torch's default)."""
    try:
        import torch.distributed as dist

        for info in dist.distributed_c10d._world.pg_config_info:
            if info.get("pg_name") == dist.distributed_c10d._get_default_group().group_name:
                return timedelta(seconds=float(info["timeout"]))
    except Exception:  # private bookkeeping of torch: its default then
        pass
    return None


class AsyncShards:
    """The background half of asynchronous sharded saves: host-memory staging and the writer
    threads' own process group."""

    def __init__(self) -> None:
        self.group: Any = None
        self._stager: Any = None

    def open(self, world: Any) -> None:
        """Make the writers' gloo process group (a collective: every rank, the training thread)."""
        if world.distributed and self.group is None:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=_group_timeout())

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A copy of *tensors* (DTensor shards stay shards) in host memory, in buffers reused by
        the next save; the write of the previous copy must be finished."""
        if self._stager is None:
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = torch.cuda.is_available()  # faster device-to-host copies
            self._stager = DefaultStager(StagingOptions(pinned, False, False, False))
        staged: dict[str, Any] = self._stager.stage(tensors)
        return staged

    def write(
        self,
        world: Any,
        tmp: Path,
        staged: dict[str, Any],
        directory: Path | None,
        name: str,
        remote: Any = None,
    ) -> dict[str, dict[str, Any]]:
        """In the writer thread: this rank's part into *tmp* (uploaded to *remote*, a store
        written from several machines), then every rank's files, durable.

        :raises CheckpointWriteError: on every rank, when any rank failed (see :func:`shards.agree`).
        """
        mine = shards.write_part(world, tmp, staged, self.group, shards.uploader(remote, name))
        every: list[Any] = [mine]
        if world.distributed:
            import torch.distributed as dist

            every = [None] * world.size
            dist.all_gather_object(every, mine, group=self.group)
        return shards.agree(every, tmp, directory, name)

    def close(self) -> None:
        """Free the staging buffers (the group stays: torch destroys it with the others)."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()


class BackgroundWrites:
    """The writer thread of the checkpoint plugin and its back-pressure (a mixin of
    :class:`epochal_checkpoint.plugin.Checkpoint`)."""

    async_save: bool
    sharded: bool
    deferred: int
    _writer: bool
    _pending: str | None
    _window_warned: bool
    idle_hooks: frozenset[str]
    _quiet: frozenset[str]
    _thread: threading.Thread | None
    _error: BaseException | None
    _shards: AsyncShards
    #: a background sharded write started since the ranks last met (the same on every rank).
    _unmet: bool

    def _writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _busy(self, loop: Loop) -> bool:
        """Whether the previous asynchronous write still runs: rank 0's answer on every rank
        (any rank's, for sharded writes: every rank has a writer thread).

        Deferring is then agreed, so every rank takes its part of a deferred snapshot together.
        """
        if not self.async_save:
            return False
        busy = self._writing()
        if loop.world.distributed:
            busy = loop.world.all_reduce([busy], "max")[0] > 0
        return busy

    def _inexact(self, loop: Loop) -> bool:
        """Whether the model's state taken now would leave something out (``state_exact`` False:
        under FSDP, inside a gradient accumulation window): periodic saves wait for it. The same
        on every rank (the ranks run the same batches)."""
        return getattr(loop.model, "state_exact", True) is False

    def _listen(self, loop: Loop, batches: bool) -> None:
        """Call ``after_batch`` from now on (*batches*), where the options made it idle, while a
        save waits for a batch end; back to the options' idle hooks once it is taken."""
        wanted = self._quiet - {"after_batch"} if batches else self._quiet
        if wanted != self.idle_hooks:
            self.idle_hooks = wanted
            loop.hooks.rebuild()

    def _defer_to_window(self, loop: Loop, reason: str) -> None:
        if self._pending is None:
            self._pending = reason
        self.deferred += 1
        self._listen(loop, batches=True)  # the window ends at a batch end
        if not self._window_warned and self._writer:
            self._window_warned = True
            warnings.warn(
                f"epochal-checkpoint: the {reason} save due at iteration {loop.iteration} came inside a "
                "gradient accumulation window, which the model cannot save exactly (FSDP holds its "
                "gradients unsharded); it is deferred to the window's optimizer step (save at "
                "multiples of accumulate_grad_batches to save on time). Said once per run; "
                "Checkpoint.deferred and the manifests' deferred_saves count it",
                RuntimeWarning,
                stacklevel=3,
            )

    def _defer(self, loop: Loop, reason: str) -> None:
        if self._pending is None:
            self._pending = reason
        self.deferred += 1
        if self.deferred == 1 and self._writer:
            warnings.warn(
                f"epochal-checkpoint: the {reason} save due at iteration {loop.iteration} came while the "
                "previous asynchronous write was still running; it is deferred to the first batch "
                "end after that write finishes (saves come faster than the disk writes them: "
                "save less often, or use async_save = false to wait instead). An epoch end's save "
                "is never deferred: it waits for the write, so that it stays an epoch-end "
                "checkpoint, which any number of processes can resume. Said once per run; "
                "Checkpoint.deferred and the manifests' deferred_saves count them",
                RuntimeWarning,
                stacklevel=3,
            )

    def _start(self, target: Any, *args: Any) -> None:
        """Run ``target(*args)`` in the writer thread; its error surfaces at the next wait."""

        def run() -> None:
            try:
                target(*args)
            except BaseException as error:  # surfaces on the next save or at the end
                self._error = error

        self._thread = threading.Thread(target=run, name="epochal-checkpoint-writer")
        self._thread.start()

    def wait(self, raise_error: bool = True) -> BaseException | None:
        """Wait for this process's write in flight; raise (or return) its error.

        :raises CheckpointWriteError: when the asynchronous write failed and *raise_error*.
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is None or not raise_error:
            return error
        if isinstance(error, CheckpointWriteError):
            raise error
        raise CheckpointWriteError(failure_line(error)) from error

    def _meet(self, loop: Loop) -> None:
        """Every rank: wait for its write in flight; a failure of any rank's write is raised on
        every rank, once (a collective when a background sharded write started since the last
        meeting: the same on every rank)."""
        if not (self.sharded and self.async_save) or not loop.world.distributed:
            self.wait()
            return
        failed = self.wait(raise_error=False)
        if not self._unmet:
            return
        self._unmet = False
        said = loop.world.all_gather_object(None if failed is None else failure_line(failed))
        problems = list(dict.fromkeys(line for line in said if line))
        if problems:
            raise CheckpointWriteError("; ".join(problems)) from failed
