"""Which log records are new since the last write: a cursor over the training log.

For plugins that copy the log somewhere else (``tensorboard``, ``mlflow``). The same rule as
``sqlite_log``: the cursor is the iteration of the row written last and the
records of that row already written; a collection returns every numeric record from the cursor
row to the current row that is new or was re-assigned since, and moves the cursor.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import Any

from epochal.log import TrainingLog

_MISSING = object()


def number(value: Any) -> float | None:
    """*value* as a finite float, or None for anything else (bools, text, NaN, inf, arrays)."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, numbers.Real):
        # numpy and torch scalars (0-d arrays and tensors); not arrays of several values.
        if getattr(value, "shape", None) != () or not hasattr(value, "item"):
            return None
        value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None
    result = float(value)
    return result if math.isfinite(result) else None


class Cursor:
    """Where a writer stands in the training log (see the module documentation)."""

    def __init__(self) -> None:
        self.iteration = 0
        self._written: dict[str, Any] = {}

    def start(self, log: TrainingLog, iteration: int) -> None:
        """Start at *iteration*: its row as restored (written by an earlier run) is not new."""
        self.iteration = iteration
        self._written = dict(log[iteration]) if iteration in log else {}

    def collect(self, log: TrainingLog, end: int) -> Iterator[tuple[int, str, float]]:
        """Yield ``(iteration, key, value)`` of the new numeric records up to row *end*."""
        written = self._written
        for iteration in range(self.iteration, end + 1):
            if iteration not in log:
                continue
            for key, value in log[iteration].items():
                if iteration == self.iteration and written.get(key, _MISSING) is value:
                    continue
                as_number = number(value)
                if as_number is not None:
                    yield iteration, key, as_number
        self.iteration = end
        self._written = dict(log[end]) if end in log else {}


def flat_config(config: Any, prefix: str = "") -> dict[str, str | int | float | bool]:
    """The run configuration as ``{"section.key": scalar}`` (lists and others as text)."""
    flat: dict[str, str | int | float | bool] = {}
    if isinstance(config, dict):
        for key, value in config.items():
            flat.update(flat_config(value, f"{prefix}{key}."))
        return flat
    name = prefix[:-1]
    if isinstance(config, (bool, int, float, str)):
        flat[name] = config
    elif config is not None:
        flat[name] = str(config)
    return flat
