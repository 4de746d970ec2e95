"""What epochal writes for a person to read: tables fitted to the terminal, and the same rows as CSV.

Every table of the CLI and of the standard plugins (``epochal plugins``, ``epochal log ...``,
the timing report) goes through :func:`print_table`, so they look alike and wrap their cells
instead of running past the terminal's width. Scripts get ``--json`` or ``--csv`` instead
(:func:`print_csv`).
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from typing import IO, Any

__all__ = ["print_csv", "print_table", "render_table", "terminal_width"]


def terminal_width(file: IO[str] | None = None, default: int = 100) -> int:
    """The width of the terminal *file* writes to; ``$COLUMNS`` or *default* when not a terminal."""
    import os
    import shutil

    file = file or sys.stdout
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    try:
        if file.isatty():
            return shutil.get_terminal_size((default, 24)).columns
    except (AttributeError, ValueError):
        pass
    return default


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None, numeric: set[int]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for index, name in enumerate(header):
        table.add_column(str(name), justify="right" if index in numeric else "left", overflow="fold")
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) for cell in row))
    return table


def render_table(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    width: int | None = None,
    numeric: Sequence[int] = (),
) -> str:
    """*rows* under *header* as text at most *width* columns wide (cells wrap to fit).

    *numeric* lists the indices of right-aligned columns.
    """
    from rich.console import Console

    console = Console(width=width or terminal_width(), color_system=None, force_terminal=False, record=True)
    with console.capture() as captured:
        console.print(_table(header, rows, title, set(numeric)))
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


def print_table(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    file: IO[str] | None = None,
    numeric: Sequence[int] = (),
) -> None:
    """Print a table fitted to the width of the terminal *file* (stdout by default) writes to."""
    file = file or sys.stdout
    text = render_table(header, rows, title=title, width=terminal_width(file), numeric=numeric)
    print(text, file=file, flush=True)


def print_csv(header: Sequence[str], rows: Sequence[Sequence[Any]], file: IO[str] | None = None) -> None:
    """Print *rows* under *header* as CSV (for scripts: ``--csv``)."""
    writer = csv.writer(file or sys.stdout, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
