"""epochal-timing: the ``timing`` plugin (wall time per stage and per plugin per hook)."""

from epochal_timing.plugin import Timing, make_timer

__all__ = ["Timing", "make_timer"]
