"""What epochal writes for a person to read: tables fitted to the terminal, and the same rows as CSV.

Every table of the CLI and of the standard plugins (``epochal plugins``, ``epochal log ...``,
the timing report) goes through :func:`print_table`, so they look alike and wrap their cells
instead of running past the terminal's width. Scripts get ``--json`` or ``--csv`` instead
(:func:`print_csv`).
"""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

__all__ = [
    "JOB_LOG_WIDTH",
    "fit_groups",
    "fit_lines",
    "fit_summary",
    "fit_text",
    "format_seconds",
    "group_records",
    "metric_order",
    "plain_text",
    "print_csv",
    "print_table",
    "render_table",
    "terminal_width",
]


#: the width of a table written to a file or a pipe: as wide as its rows (no wrapping).
UNLIMITED = 100_000


def terminal_width(file: IO[str] | None = None, default: int = UNLIMITED) -> int:
    """The width of the terminal *file* writes to; ``$COLUMNS``, else *default* when not a terminal."""
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


def metric_order(names: Iterable[str]) -> list[str]:
    """*names* in the order every view shows metrics: losses first, then alphabetical.

    The same on every rank and every run, whatever order a model or a reduction across
    processes returned them in.
    """
    return sorted(names, key=lambda name: ("loss" not in name, name))


#: the width of the lines a run writes into a job log (stdout or stderr not a terminal, no
#: ``$COLUMNS``): what CI pages and ``less`` show without scrolling sideways.
JOB_LOG_WIDTH = 120
#: log keys the loop itself writes, not metrics.
_LOOP_KEYS = frozenset({"epochs_done"})


def group_records(
    row: Mapping[str, Any], exclude: Sequence[str] = ()
) -> list[tuple[str, list[tuple[str, Any, Any]]]]:
    """A log row's records as every per-epoch view shows them: ``(stream, [(metric, value,
    best)])``, ``train`` first, then the eval streams, then keys without a stream under ``log``
    (``lr``), each stream's metrics in :func:`metric_order`.

    A record ``STREAM.METRIC.best`` (early stopping's best so far) is the *best* of
    ``STREAM.METRIC`` when that is in the row too (None otherwise: it is no metric of the
    stream). Flags (booleans), the loop's own keys and keys matching a pattern of *exclude*
    (``fnmatch``: ``"timing.*"``) are left out.
    """
    import fnmatch

    groups: dict[str, list[tuple[str, Any, Any]]] = {}
    for key in metric_order(row):
        value = row[key]
        if key in _LOOP_KEYS or _is_flag(value) or any(fnmatch.fnmatchcase(key, p) for p in exclude):
            continue
        if key.endswith(".best") and key.removesuffix(".best") in row:
            continue
        stream, dot, metric = key.partition(".")
        if not dot:
            stream, metric = "log", key
        groups.setdefault(stream, []).append((metric, value, row.get(f"{key}.best")))
    order = sorted(groups, key=lambda stream: (stream != "train", stream == "log"))  # stable otherwise
    return [(stream, groups[stream]) for stream in order]


def _is_flag(value: Any) -> bool:
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def fit_groups(
    head: str, groups: Sequence[tuple[str, Sequence[str]]], width: int, separator: str, after_head: str = ""
) -> str:
    """``HEAD SEP stream item item SEP stream item ...`` on one line when it fits *width* (with
    *after_head* after *head*, when given, instead of *separator*); else *head* on its own line
    and each stream on an indented line of its own, its items wrapping under the first (no item
    is cut)."""
    streams = separator.join(f"{stream} {' '.join(items)}" for stream, items in groups)
    line = f"{head}{after_head or separator}{streams}" if groups else head
    if len(line) <= width:
        return line
    lines = [head]
    for stream, items in groups:
        current = f"  {stream}"
        for item in items:
            if len(current) + 1 + len(item) > width and current.strip() != stream:
                lines.append(current)
                current = " " * (len(stream) + 2)
            current += " " + item
        lines.append(current)
    return "\n".join(lines)


def format_seconds(seconds: float) -> str:
    """A duration with significant digits: ``4.2ms``, ``0.35ms``, ``1.25s``, ``312s``."""
    if seconds < 0.9995:
        return f"{seconds * 1000:.2g}ms" if seconds < 0.0995 else f"{seconds * 1000:.3g}ms"
    return f"{seconds:.3g}s" if seconds < 99.95 else f"{seconds:.0f}s"


def fit_lines(text: str, width: int, indent: str = "    ") -> list[str]:
    """*text* wrapped at spaces into lines of at most *width* characters (a word longer than a
    line is not cut); the lines after the first are indented by *indent*."""
    import textwrap

    if len(text) <= width:
        return [text]
    return textwrap.wrap(
        text,
        width=max(width, len(indent) + 8),
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [text]


def fit_text(text: str, width: int) -> str:
    """*text* (documentation: paragraphs, fields, lists, indented examples) fitted to *width*.

    A paragraph (lines of one indentation, up to a blank line, a field such as ``loop:``, a list
    item or a change of indentation) with a line longer than *width* is wrapped again as a
    whole, its continuation lines under its first line's text (two spaces further for a field
    or a list item); paragraphs that fit are kept line for line, so the text's structure stays.
    """
    import textwrap

    paragraphs: list[list[str]] = []
    for line in text.splitlines():
        depth = len(line) - len(line.lstrip())
        current = paragraphs[-1] if paragraphs else None
        starts = (
            current is None
            or not line.strip()
            or not current[-1].strip()
            or depth != len(current[0]) - len(current[0].lstrip())
            or _ITEM.match(line) is not None
            or current[-1].rstrip().endswith("::")
        )
        if starts:
            paragraphs.append([line])
        else:
            current.append(line)  # type: ignore[union-attr]
    out: list[str] = []
    for lines in paragraphs:
        if all(len(line) <= width for line in lines):
            out.extend(lines)
            continue
        first = lines[0]
        indent = first[: len(first) - len(first.lstrip())]
        hanging = indent + ("  " if _ITEM.match(first) else "")
        joined = " ".join(line.strip() for line in lines)
        out.extend(
            textwrap.wrap(
                joined,
                width=max(width, len(hanging) + 20),
                initial_indent=indent,
                subsequent_indent=hanging,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(out)


#: a line that starts a field (``loop:``, ``raises ConfigError:``) or a list item (``- ``).
_ITEM = re.compile(r"\s*(?:[-*] |[\w.]+(?: [\w.]+)?: )")


def fit_summary(lines: Sequence[str], run_id: str, width: int) -> list[str]:
    """Summary *lines* within *width*: where a line does not fit, *run_id* in it is cut to its
    first 12 characters (as ``epochal log`` shows ids; any unique prefix names a run), and a
    line still too long wraps at spaces onto indented lines."""
    fitted: list[str] = []
    for line in lines:
        if len(line) > width and run_id in line:
            line = line.replace(run_id, run_id[:12])
        if _COMMAND.match(line) and len(line) > width:
            # a command (resume, plot) wraps with shell continuations: it still pastes as one
            parts = fit_lines(line, width - 2)
            fitted.extend(f"{part} \\" for part in parts[:-1])
            fitted.append(parts[-1])
        else:
            fitted.extend(fit_lines(line, width))
    return fitted


#: a summary line that gives a command: ``epochal: resume: epochal run ...`` (or ``torchrun
#: ...`` for a run torchrun launched), ``epochal: tensorboard: tensorboard --logdir ...``.
_COMMAND = re.compile(r"epochal: [\w ]+: (?:epochal|tensorboard|mlflow|torchrun|python) ")


def _table(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    title: str | None,
    numeric: set[int],
    no_wrap: set[int],
) -> Any:
    from rich.table import Table
    from rich.text import Text

    # No box: a header line and aligned columns, as `ps` or `kubectl get` print them, so the
    # lines stay easy to read back (awk, grep) while long cells wrap within their column.
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, padding=(0, 2, 0, 0))
    for index, name in enumerate(header):
        table.add_column(
            Text(str(name)),
            justify="right" if index in numeric else "left",
            overflow="fold",
            no_wrap=index in no_wrap,
            min_width=len(str(name)),
        )
    for row in rows:
        # Text, not str: rich would read "[brackets]" in a cell (an error message) as markup
        table.add_row(*(Text("" if cell is None else str(cell)) for cell in row))
    return table


def render_table(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    width: int | None = None,
    numeric: Sequence[int] = (),
    no_wrap: Sequence[int] = (),
    paths: Sequence[int] = (),
) -> str:
    """*rows* under *header* as text at most *width* columns wide; nothing is cut.

    Long cells wrap within their column. When the columns cannot all fit side by side even so
    (a log with thirty keys on an 80-column terminal), they are split into several tables, one
    under the other, each repeating the first column (the row's name: iteration, run id), as
    pandas prints a wide frame. *numeric* lists the indices of right-aligned columns,
    *no_wrap* those never wrapped (ids, timestamps), *paths* those of file paths, which break
    only after a ``/`` (a path is not cut inside a name).
    """
    width = width or terminal_width()
    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    if paths and cells:
        # each path fits beside the first column (where the table splits it off, it stands there)
        first = max(len(str(header[0])), *(len(row[0]) for row in cells))
        room = max(_WRAP_TO, width - first - _GAP)
        cells = [
            [_fold_path(text, room) if c in paths else text for c, text in enumerate(row)] for row in cells
        ]
        # a name longer than that is folded by rich, not cropped
        no_wrap = (*no_wrap, *(c for c in paths if all(_longest_line(row[c]) <= room for row in cells)))
    plain = _aligned(header, cells, width, set(numeric)) if title is None else None
    if plain is not None:
        return plain
    from rich.console import Console

    groups = _column_groups(header, cells, width, set(no_wrap))
    console = Console(width=width, color_system=None, force_terminal=False, record=True)
    with console.capture() as captured:
        for number, columns in enumerate(groups):
            if number:
                console.print()
            console.print(
                _table(
                    [header[c] for c in columns],
                    [[row[c] for c in columns] for row in cells],
                    title if number == 0 else None,
                    {i for i, c in enumerate(columns) if c in numeric},
                    {i for i, c in enumerate(columns) if c in no_wrap},
                )
            )
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


#: cells rich prints as they are: printable ASCII, no markup (``[``), no escape, no emoji code
#: (``:name:`` needs two colons), single spaces between words only.
_PLAIN = re.compile(r"(?:[!-Z^-~]+(?: [!-Z^-~]+)*)?")


def _aligned(
    header: Sequence[str], cells: Sequence[Sequence[str]], width: int, numeric: set[int]
) -> str | None:
    """The text rich prints for a table that fits *width* without wrapping, or None.

    Importing rich and laying out its table costs ~20 ms, most of a listing command's start;
    a table whose cells are plain text and fit side by side is only aligned columns, which
    this writes directly (the same characters: tests compare the two). Anything else (a cell
    rich would interpret or wrap) returns None, and rich draws the table.
    """
    texts = [str(name) for name in header]
    if any(len(row) != len(texts) for row in cells):
        return None
    for text in (*texts, *(cell for row in cells for cell in row)):
        if text.count(":") > 1 or not _PLAIN.fullmatch(text):
            return None
    widths = [max([len(text), *(len(row[c]) for row in cells)]) for c, text in enumerate(texts)]
    if min(widths, default=0) < 1 or sum(widths) + _GAP * (len(widths) - 1) > width:
        return None

    def line(row: Sequence[str]) -> str:
        return (
            (" " * _GAP)
            .join(
                text.rjust(widths[c]) if c in numeric else text.ljust(widths[c]) for c, text in enumerate(row)
            )
            .rstrip()
        )

    return "\n".join([line(texts), *(line(row) for row in cells)])


#: the narrowest a wrapped column is made before the table is split instead.
_WRAP_TO = 24
_GAP = 2


def _column_groups(
    header: Sequence[str], cells: Sequence[Sequence[str]], width: int, no_wrap: set[int]
) -> list[list[int]]:
    """Column indices per table: all in one when they fit, else groups each repeating column 0."""

    def need(column: int) -> int:
        natural = max([len(str(header[column])), *(_longest_line(row[column]) for row in cells)])
        least = natural if column in no_wrap else min(natural, max(_WRAP_TO, len(str(header[column]))))
        return least + _GAP

    needs = [need(c) for c in range(len(header))]
    if sum(needs) <= width or len(header) <= 2:
        return [list(range(len(header)))]
    groups: list[list[int]] = []
    current = [0]
    used = needs[0]
    for column in range(1, len(header)):
        if used + needs[column] > width and len(current) > 1:
            groups.append(current)
            current, used = [0], needs[0]
        current.append(column)
        used += needs[column]
    groups.append(current)
    return groups


def _longest_line(text: str) -> int:
    return max(map(len, text.split("\n")))


def _fold_path(path: str, width: int) -> str:
    """*path* on lines of at most *width* characters, each broken after a ``/`` (a name longer
    than *width* stays whole on its line)."""
    if len(path) <= width:
        return path
    lines, current = [], ""
    for part in re.split(r"(?<=/)", path):
        if current and len(current) + len(part) > width:
            lines.append(current)
            current = part
        else:
            current += part
    lines.append(current)
    return "\n".join(lines)


def print_table(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    file: IO[str] | None = None,
    numeric: Sequence[int] = (),
    no_wrap: Sequence[int] = (),
    paths: Sequence[int] = (),
) -> None:
    """Print a table fitted to the width of the terminal *file* (stdout by default) writes to."""
    file = file or sys.stdout
    width = terminal_width(file)
    text = render_table(header, rows, title=title, width=width, numeric=numeric, no_wrap=no_wrap, paths=paths)
    print(text, file=file, flush=True)


def print_csv(header: Sequence[str], rows: Sequence[Sequence[Any]], file: IO[str] | None = None) -> None:
    """Print *rows* under *header* as CSV (for scripts: ``--csv``)."""
    writer = csv.writer(file or sys.stdout, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)


_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|attr|mod|obj|data|exc|const):`~?([^`]+)`")
_FIELD = re.compile(r"^(\s*):(param|parameter|arg|type|returns?|raises?)\s*([^:]*):", re.MULTILINE)


def plain_text(doc: str) -> str:
    """A reST/Sphinx docstring as text a person reads in a terminal.

    ``:func:`before_training``` becomes ``before_training()``, ``:class:`~a.b.Loop``` becomes
    ``Loop``, double back-quoted literals lose their quotes and ``:param x:`` fields become ``x:``.
    """

    def role(match: re.Match[str]) -> str:
        whole = match.group(0)
        target = match.group(1).rsplit(".", 1)[-1] if "~" in whole else match.group(1)
        return f"{target}()" if whole.startswith((":func:", ":meth:")) else target

    def field(match: re.Match[str]) -> str:
        indent, kind, name = match.group(1), match.group(2), match.group(3).strip()
        if kind.startswith("return"):
            return f"{indent}returns:"
        if kind.startswith("raise"):
            return f"{indent}raises {name}:"
        return f"{indent}{name}:"

    text = _ROLE.sub(role, doc)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return _FIELD.sub(field, text)
