"""epochal-schedule: learning-rate schedules from ``torch.optim.lr_scheduler`` as a plugin."""

from epochal_schedule.plugin import LRScheduler

__all__ = ["LRScheduler"]
