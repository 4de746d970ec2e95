"""epochal-earlystop: the ``early_stopping`` and ``finish_after`` plugins."""

from epochal_earlystop.early_stopping import EarlyStopping, EarlyStoppingWarning
from epochal_earlystop.finish_after import FinishAfter

__all__ = ["EarlyStopping", "EarlyStoppingWarning", "FinishAfter"]
