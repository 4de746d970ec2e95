"""Training on several processes with torch.distributed: the world a process is part of.

The launcher is torch's (``torchrun``, or ``epochal run --nproc N`` which calls it); the
transport is torch's process group. See docs/scaling-out.md.
"""

from epochal.distributed.world import World, current_world, init_from_env, launched, shutdown

__all__ = ["World", "current_world", "init_from_env", "launched", "shutdown"]
