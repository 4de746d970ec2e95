"""epochal-tensorboard: every run's numeric log records, hyperparameters and parameter histograms
as TensorBoard event files (the ``tensorboard`` plugin, :class:`epochal_tensorboard.plugin.TensorBoard`)."""

from epochal_tensorboard.plugin import TensorBoard

__all__ = ["TensorBoard"]
