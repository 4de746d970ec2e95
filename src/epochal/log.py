"""The training log: rows of records keyed by iteration, plus the run's status.

Blocks' ``TrainingLog`` semantics: ``log[i]`` is the row (a dict) of iteration ``i``, created
empty on first access; ``log.current_row`` is the row of the loop's current iteration;
``log.status`` holds what describes the run rather than an iteration. Plugins write records
(``loop.log.current_row["valid.loss"] = 0.3``) and read them back (``log.last("valid.loss")``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any


class TrainingLog:
    """Rows of ``{key: value}`` keyed by iteration, and a ``status`` dict."""

    def __init__(self, iteration: Callable[[], int] = lambda: 0) -> None:
        self._rows: dict[int, dict[str, Any]] = {}
        self._iteration = iteration
        self.status: dict[str, Any] = {
            "status": "created",
            "epochs_done": 0,
            "iterations_done": 0,
            "finish_reason": None,
            "resumed_from": None,
        }
        #: how many times :meth:`load_state_dict` replaced every row (see :attr:`row_map`).
        self.load_count = 0

    def __getitem__(self, iteration: int) -> dict[str, Any]:
        row = self._rows.get(iteration)
        if row is None:
            if iteration < 0:
                raise IndexError(f"iteration {iteration} is negative")
            row = self._rows[iteration] = {}
        return row

    def __contains__(self, iteration: object) -> bool:
        return iteration in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def current_row(self) -> dict[str, Any]:
        """The row of the loop's current iteration (batches completed so far)."""
        return self[self._iteration()]

    @property
    def previous_row(self) -> dict[str, Any]:
        """The row of the iteration before the current one."""
        return self[self._iteration() - 1]

    def rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(iteration, row)`` for every non-empty row, in iteration order."""
        for iteration in sorted(self._rows):
            row = self._rows[iteration]
            if row:
                yield iteration, row

    @property
    def row_map(self) -> Mapping[int, dict[str, Any]]:
        """Every row by iteration, empty ones included, as a read-only view (no copy, O(1)).

        The view is in the order the rows were created (loaded rows first, in the loaded order).
        Rows are never removed, so the rows created after some moment are the ones past the
        view's length at that moment, until :meth:`load_state_dict` replaces them all (it
        increments :attr:`load_count`). The row dicts are the live rows: read them, don't change them
        through this view. Meant for savers that scan the whole log at C speed (``map``,
        ``itertools``) instead of rebuilding it, e.g. the checkpoint plugin's incremental save.
        """
        return MappingProxyType(self._rows)

    def last(self, key: str, default: Any = None) -> Any:
        """The most recent value recorded under *key*, or *default*."""
        for iteration in sorted(self._rows, reverse=True):
            row = self._rows[iteration]
            if key in row:
                return row[key]
        return default

    def history(self, key: str) -> list[tuple[int, Any]]:
        """Every ``(iteration, value)`` recorded under *key*, in order."""
        return [(i, row[key]) for i, row in self.rows() if key in row]

    def state_dict(self, rows: bool = True) -> dict[str, Any]:
        """The log as JSON-able data (numpy scalars become Python numbers).

        With ``rows=False`` the ``"rows"`` mapping is left empty: for a saver that writes the
        rows itself, incrementally, reading :attr:`row_map`, instead of rebuilding them all.
        """
        saved = {str(i): plain_row(row) for i, row in self.rows()} if rows else {}
        return {"rows": saved, "status": plain_row(self.status)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the log's contents with *state* from :meth:`state_dict`."""
        self._rows = {int(i): dict(row) for i, row in state["rows"].items()}
        self.status = copy.deepcopy(dict(state["status"]))
        self.load_count += 1


def plain_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of *row*, numpy scalars and arrays made Python values (as :meth:`TrainingLog.state_dict`)."""
    return {k: _plain(v) for k, v in row.items()}


def _plain(value: Any) -> Any:
    """Turn numpy scalars and arrays into Python values so they serialise as JSON."""
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else value
