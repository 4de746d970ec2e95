"""Checkpoints of a run that spans several machines: every machine must name the same store.

Rank 0 writes the checkpoints, into its machine's view of the directory, and which machine
runs rank 0 is torch's choice at each start (a c10d rendezvous orders the hosts by name; a
requeued job may get other hosts). A relative directory names a different directory on each
machine (each has its own working directory), so a resume could find nothing, or an older
run's checkpoints, and ranks that write their own shards would each see only theirs. Such a
directory is refused before anything is written. An absolute path (a filesystem every machine
mounts) or a URL is the user's statement that every machine reaches one store; it is not probed
(a file just written on one NFS client may not be visible on another yet).
"""

from __future__ import annotations

from pathlib import Path

from epochal.errors import ConfigError


def refuse_node_local(directory: str, key: str) -> None:
    """Raise when this run spans several machines and *directory* is relative.

    :param directory: the checkpoint directory as configured (a path or a URL).
    :param key: the option it came from, for the message (``[plugins.checkpoint] dir``).
    :raises ConfigError: one line naming *key*, *directory* and the number of machines.
    """
    from epochal.distributed import current_world

    world = current_world()
    if not world.several_nodes or "://" in directory or Path(directory).expanduser().is_absolute():
        return
    raise ConfigError(
        f"{key}: the checkpoint directory {directory!r} is relative to each machine's working "
        f"directory, and this run spans {world.nodes} machines: each would name a different "
        "directory, and a resume (on whichever machine runs rank 0 then) would not find the "
        f"checkpoints; set {key} to an absolute path that every machine mounts (a shared "
        "filesystem) or to an object store's URL"
    )
