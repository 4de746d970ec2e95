"""An evaluation stream's metrics: batch-size-weighted means of the step results.

Each step's numbers are summed weighted by the batch's size; a host number (a float, a numpy
scalar, a CPU tensor) is read at once and summed in double precision, a device scalar (a CUDA
tensor) is summed where it is and read once at the end, so evaluation forces no host sync per
batch. Values that are not numbers (strings, arrays of several values) are left out of the means:
hooks still see them in the step's outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MetricSums:
    """The running, batch-size-weighted sums of one evaluation's step results."""

    def __init__(self) -> None:
        #: metric name → sum of value × batch size (a float, or a device scalar).
        self.totals: dict[str, Any] = {}
        #: examples seen.
        self.seen = 0
        self._skipped: set[str] = set()

    def add(self, outputs: Mapping[str, Any], size: int) -> None:
        """Add one batch's step results, weighted by its *size*."""
        totals, skipped = self.totals, self._skipped
        for key, value in outputs.items():
            if key in skipped:
                continue
            if type(value) is not float:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
                    skipped.add(key)
                    continue
                device = getattr(value, "device", None)
                if device is None or getattr(device, "type", "cpu") == "cpu":
                    try:  # a host number: read now, summed in double precision
                        value = float(value)
                    except (TypeError, ValueError):  # e.g. an array of several values
                        skipped.add(key)
                        continue
            try:  # a device scalar is summed where it is, read at the end
                totals[key] = totals.get(key, 0.0) + value * size
            except TypeError:
                skipped.add(key)
        self.seen += size


def means(totals: Mapping[str, Any], seen: int) -> dict[str, float]:
    """Each metric's sum over *seen* examples, read as a float (none when nothing was seen)."""
    metrics: dict[str, float] = {}
    for key, total in totals.items() if seen else ():
        try:
            metrics[key] = float(total / seen)
        except (TypeError, ValueError):  # e.g. an array of several values
            continue
    return metrics
