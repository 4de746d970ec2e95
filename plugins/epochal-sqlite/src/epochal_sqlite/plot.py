"""What ``epochal log plot`` draws: runs overlaid, streams side by side, smoothing, HTML reports.

Keys are grouped into one panel per metric: ``train.loss`` and ``valid.loss`` share the panel
``loss`` (the part after the stream), each in its own line style; every run (read as its whole
resume chain, unless asked otherwise) has its own colour. A running record (``monitor``'s
``train.loss.running``, every 50 steps by default) is the per-step curve of its metric: drawn in
the same panel, style and colour as the epoch records, thinner and fainter, beneath them. The
output format follows the file's suffix: ``.png``, ``.svg``, ``.pdf`` — or ``.html``: one
self-contained file with the figure inlined as SVG and each run's status and configuration.
"""

from __future__ import annotations

import html
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochal_sqlite import reader as reading
from epochal_sqlite import store, views

#: line styles of the streams within a panel, in order of appearance.
STYLES = ("-", "--", ":", "-.")


@dataclass
class Series:
    """One key of one run (its resume chain joined): the points and where resumes happened."""

    run: reading.Run
    key: str
    xs: list[int]
    ys: list[float]
    resumes: list[int]


def split_key(key: str) -> tuple[str, str]:
    """``("valid", "loss")`` for ``valid.loss`` (and for ``valid.loss.running``, the same
    metric's running record); a key without a stream is its own metric."""
    stream, dot, metric = key.removesuffix(views.RUNNING).partition(".")
    return (stream, metric) if dot else ("", key)


def read_series(
    reader: reading.Reader,
    runs: Sequence[reading.Run],
    keys: Sequence[str],
    chain: bool,
    every: bool = False,
    timing: bool = False,
) -> list[Series]:
    """The finite numeric points of every key of every run (patterns allowed in *keys*).

    Without *keys*: each run's losses and monitored metrics (:func:`views.plot_keys`), or with
    *every* all its keys but the profiling records; *timing* adds those.
    """
    found: list[Series] = []
    for run in runs:
        members = reader.chain(run) if chain else [run]
        available = reader.keys(m.run_id for m in members)
        match = reading.key_matcher(keys)
        if keys:
            wanted = [k for k in views.order_keys(available) if match(k)]
        elif every:
            wanted = views.visible(available, timing)
        else:
            wanted = views.plot_keys(available, run.config, timing)
        missing = [k for k in keys if not any(ch in k for ch in "*?[") and k not in available]
        if missing:
            raise store.SQLiteLogError(
                f"run {run.run_id} has no key {', '.join(map(repr, missing))}; "
                f"its keys: {', '.join(available) or 'none'}"
            )
        finite = reading.finite
        for key in wanted:  # one index range per key and run
            points = [(i, finite(value)) for i, _, value in reader.series(run, key, chain=chain)]
            xs = [i for i, v in points if v is not None]
            ys = [v for _, v in points if v is not None]
            if xs:
                found.append(Series(run, key, xs, ys, [m.start_iteration for m in members[1:]]))
    if not found:
        raise store.SQLiteLogError(
            f"nothing to plot: no numeric values of {', '.join(keys) or 'any key'} in run(s) "
            f"{', '.join(r.run_id[:12] for r in runs)}"
        )
    return found


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    if not weight:
        return list(values)
    result, last, norm = [], 0.0, 0.0
    for value in values:
        last = last * weight + (1 - weight) * value
        norm = norm * weight + (1 - weight)
        result.append(last / norm)
    return result


def figure(series: Sequence[Series], smoothing: float = 0.0, title: str | None = None) -> Any:
    """A matplotlib figure: one panel per metric, a colour per run, a line style per stream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text in SVG: smaller, searchable
    metrics = list(dict.fromkeys(split_key(s.key)[1] for s in series))
    streams = list(dict.fromkeys(split_key(s.key)[0] for s in series))
    runs = list(dict.fromkeys(s.run.run_id for s in series))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    columns = min(len(metrics), 2)
    rows = (len(metrics) + columns - 1) // columns
    fig, grid = plt.subplots(rows, columns, figsize=(7 * columns, 4.2 * rows), dpi=100, squeeze=False)
    for index, metric in enumerate(metrics):
        axes = grid[index // columns][index % columns]
        for item in series:
            stream, name = split_key(item.key)
            if name != metric:
                continue
            colour = colours[runs.index(item.run.run_id) % len(colours)]
            style = STYLES[streams.index(stream) % len(STYLES)]
            label = item.key if len(runs) == 1 else f"{item.run.run_id[:8]} {item.key}"
            marker = "o" if len(item.xs) < 50 else None
            # the per-step curve beneath the epoch records, thinner and fainter
            running = item.key.endswith(views.RUNNING)
            look = {"linewidth": 1, "alpha": 0.5, "zorder": 1} if running else {"zorder": 2}
            if running:
                marker = None
            if smoothing:
                axes.plot(item.xs, item.ys, color=colour, linestyle=style, alpha=0.25, linewidth=1)
                ys = smooth(item.ys, smoothing)
            else:
                ys = item.ys
            axes.plot(
                item.xs, ys, color=colour, linestyle=style, marker=marker, markersize=3, label=label, **look
            )
            for start in item.resumes:
                axes.axvline(start, color=colour, linestyle=":", linewidth=1, alpha=0.6)
        axes.set_xlabel("iteration")
        axes.set_ylabel(metric)
        axes.set_title(metric + (f" (smoothing {smoothing:g})" if smoothing else ""))
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
    for index in range(len(metrics), rows * columns):
        grid[index // columns][index % columns].set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def write(series: Sequence[Series], output: str | Path, smoothing: float = 0.0) -> None:
    """Draw *series* into *output* (.png, .svg, .pdf, or an .html report)."""
    import matplotlib.pyplot as plt

    output = Path(output)
    runs = list({s.run.run_id: s.run for s in series}.values())
    title = f"run {runs[0].run_id[:12]}" if len(runs) == 1 else f"{len(runs)} runs"
    fig = figure(series, smoothing, title)
    try:
        if output.suffix.lower() in (".html", ".htm"):
            buffer = io.StringIO()
            fig.savefig(buffer, format="svg")
            output.write_text(report(runs, buffer.getvalue()), encoding="utf-8")
        else:
            fig.savefig(output)
    except (OSError, ValueError) as error:
        raise store.SQLiteLogError(f"cannot write plot {output}: {error}") from None
    finally:
        plt.close(fig)


def report(runs: Sequence[reading.Run], svg: str) -> str:
    """One self-contained HTML page: the figure (inline SVG) and each run's status and config."""
    start = svg.find("<svg")
    parts = [
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>epochal runs</title>",
        "<style>body{font-family:sans-serif;margin:2em}pre{background:#f6f6f6;padding:1em;"
        "overflow:auto}td,th{padding:.2em .8em;text-align:left}</style></head><body>",
        "<h1>epochal runs</h1>",
        svg[start:] if start >= 0 else svg,
        "<table><tr><th>run</th><th>status</th><th>epochs</th><th>iterations</th><th>resumed from</th></tr>",
    ]
    for run in runs:
        parts.append(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(v))}</td>"
                for v in (
                    run.run_id,
                    run.status,
                    run.epochs_done,
                    run.iterations_done,
                    run.resumed_from or "",
                )
            )
            + "</tr>"
        )
    parts.append("</table>")
    for run in runs:
        config = json.dumps(run.config, indent=2, sort_keys=True, default=str)
        parts.append(f"<h2>run {html.escape(run.run_id)}: configuration</h2><pre>{html.escape(config)}</pre>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
