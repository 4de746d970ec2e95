"""`guarded`: monitor + early_stopping + checkpoint configured as one plugin (an example).

The options are shared: the metric early stopping watches is the metric the best checkpoints
are kept by, so the two can never disagree.
"""

from __future__ import annotations

from typing import Literal

from epochal_checkpoint import Checkpoint
from epochal_earlystop import EarlyStopping
from epochal_monitor import Monitor

from epochal import CompositePlugin


class Guarded(CompositePlugin):
    """Track the metrics, stop when ``metric`` stops improving, keep the best checkpoints.

    :param metric: the log record to watch (``valid.loss``, ``valid.accuracy``).
    :param mode: ``min`` when lower is better, ``max`` when higher is better.
    :param patience: evaluations without improvement before stopping.
    :param dir: where checkpoints go (default: ``<run_dir>/checkpoints``).
    :param keep_best: how many best checkpoints by ``metric`` to keep.
    :param keep_last: how many latest checkpoints to keep.
    """

    autoload = False  # load only when a run names it: it bundles plugins installed on their own

    def __init__(
        self,
        metric: str = "valid.loss",
        mode: Literal["min", "max"] = "min",
        patience: int = 5,
        dir: str | None = None,
        keep_best: int = 1,
        keep_last: int = 2,
    ) -> None:
        super().__init__(
            {
                "monitor": Monitor(),
                "stop": EarlyStopping(monitor=metric, mode=mode, patience=patience),
                "save": Checkpoint(
                    dir=dir, keep_best=keep_best, keep_last=keep_last, monitor=metric, mode=mode
                ),
            }
        )
