"""epochal-progress: the ``progress`` plugin (tqdm bars per epoch and per evaluation stream)."""

from epochal_progress.plugin import Progress

__all__ = ["Progress"]
