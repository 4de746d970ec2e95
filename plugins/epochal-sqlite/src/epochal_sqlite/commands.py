"""``epochal log``: list, show, plot and compare the runs of an epochal-sqlite database.

Which database: ``--db PATH``; else ``--config CONFIG.toml`` (its ``[plugins.sqlite_log]
path``, else ``epochal.sqlite`` beside its run directory, which defaults to ``runs/<config
stem>`` as for ``epochal run``); else the environment variable ``EPOCHAL_SQLITE_DB``; else the
project's ``runs/epochal.sqlite`` or ``epochal.sqlite`` in the working directory, or the one
``runs/*/epochal.sqlite`` (an error if there are none or several).

Tables go through :mod:`epochal.console` (rich, fitted to the terminal); ``--json`` and ``--csv``
print every value for scripts.

A RUN is a full run id, a unique prefix of one, or ``latest``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from epochal.console import print_csv, print_table
from epochal_sqlite import reader as reading
from epochal_sqlite import store, views
from epochal_sqlite.plugin import CONFIG_FILE, default_path

ENV_DB = "EPOCHAL_SQLITE_DB"
DEFAULT_MAXIMIZE = ("*acc*", "*accuracy*", "*auc*", "*f1*", "*precision*", "*recall*", "*score*", "*iou*")


def find_db(db: str | None, config: str | None) -> Path:
    """The database the command reads (see the module documentation)."""
    import os

    if db:
        return Path(db)
    if config:
        from epochal.config import load_config

        settings = load_config(config)
        path = settings.get("plugins", {}).get("sqlite_log", {}).get("path")
        if path:
            return Path(path)
        return default_path(settings["loop"]["run_dir"])
    if os.environ.get(ENV_DB):
        return Path(os.environ[ENV_DB])
    found = sorted({*Path().glob("epochal.sqlite"), *Path().glob("runs/epochal.sqlite")})
    if not found:  # logs written before one database per project was the default
        found = sorted(Path().glob("runs/*/epochal.sqlite"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise store.DatabaseNotFoundError(
            "no epochal-sqlite database found (no runs/epochal.sqlite, ./epochal.sqlite or "
            "runs/*/epochal.sqlite here); "
            "pass --db PATH or --config CONFIG.toml"
        )
    raise store.DatabaseNotFoundError(
        f"{len(found)} databases found ({', '.join(map(str, found))}); choose one with --db PATH"
    )


@contextlib.contextmanager
def _reading(db: str | None, config: str | None) -> Iterator[reading.Reader]:
    """The database of ``--db``/``--config`` opened for reading; a SQLite error while it is read
    (a damaged page) is one line naming the file."""
    path = find_db(db, config)
    with (
        store.failures(path, "cannot read the training log", "it was left as it is"),
        reading.Reader(path) as reader,
    ):
        yield reader


def _db_options(function: Any) -> Any:
    function = click.option(
        "--config",
        "config",
        type=click.Path(dir_okay=False),
        help="Find the database of this run config (its run_dir).",
    )(function)
    return click.option(
        "--db",
        "db",
        type=click.Path(),
        help=f"The database file (default: see `epochal log --help`; ${ENV_DB}).",
    )(function)


@click.group(name="log")
def log_group() -> None:
    """Query the training logs that the sqlite_log plugin wrote.

    The database is --db PATH; else the one of --config CONFIG.toml ([plugins.sqlite_log]
    path, else epochal.sqlite beside its run_dir); else $EPOCHAL_SQLITE_DB; else
    runs/epochal.sqlite or ./epochal.sqlite (one per project), or the only
    runs/*/epochal.sqlite. RUN is a run id, a unique prefix of one, or "latest".
    """


@log_group.command(name="runs")
@_db_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every column).")
@click.option("--csv", "as_csv", is_flag=True, help="Print the table as CSV.")
def runs_command(db: str | None, config: str | None, as_json: bool, as_csv: bool) -> None:
    """List the runs: id, status, start, duration, epochs, iterations, config, run directory,
    resumed from, reason.

    With --config, only the runs of that config (its file, or for runs logged before the file
    was recorded, its run_dir). The table wraps onto further blocks when the terminal is too
    narrow (each repeating the run id); ids are cut to 12 characters there (any unique prefix
    names a run), --csv and --json give them whole.
    """
    if as_csv and as_json:
        raise click.UsageError("--csv and --json exclude each other")
    with _reading(db, config) as reader:
        runs = reader.runs()
    if config:
        runs = _of_config(runs, config)
    if as_json:
        click.echo(json.dumps([run.as_dict() for run in runs], indent=2))
        return
    if not runs and not as_csv:
        click.echo(f"no runs of {config}" if config else "no runs")
        return
    header = (
        "run_id", "status", "started", "duration", "epochs", "iterations", "config", "run_dir",
        "resumed_from", "reason",
    )  # fmt: skip
    cut = (lambda text: text) if as_csv else (lambda text: text[:12])
    rows = [
        (
            cut(run.run_id),
            run.status,
            time.strftime("%Y-%m-%d %H:%M:%S" if as_csv else "%Y-%m-%d %H:%M", time.localtime(run.started)),
            _duration((run.ended or run.updated or run.started) - run.started),
            str(run.epochs_done),
            str(run.iterations_done),
            _config_file(run, as_csv),
            run.run_dir or "-",
            cut(run.resumed_from or "-"),
            run.error or run.finish_reason or "",
        )
        for run in runs
    ]
    if as_csv:
        print_csv(header, rows)
        return
    print_table(header, rows, numeric=(3, 4, 5), no_wrap=(0, 2), paths=(6, 7))


def _config_file(run: reading.Run, whole: bool) -> str:
    """The config file *run* was started from: relative to the working directory when under it."""
    recorded = run.config.get(CONFIG_FILE) if isinstance(run.config, dict) else None
    if not isinstance(recorded, str):
        return "-"
    if whole:
        return recorded
    with contextlib.suppress(ValueError):
        return str(Path(recorded).relative_to(Path.cwd()))
    return recorded


def _of_config(runs: Sequence[reading.Run], config: str) -> list[reading.Run]:
    """The runs started from config file *config*; a run logged without its file, by its run_dir."""
    import os

    from epochal.config import load_config

    source = str(Path(config).resolve())
    run_dir = os.path.normpath(str(load_config(config)["loop"]["run_dir"]))
    chosen = []
    for run in runs:
        recorded = run.config.get(CONFIG_FILE) if isinstance(run.config, dict) else None
        directory = os.path.normpath(run.run_dir) if run.run_dir else None
        if recorded == source or (
            recorded is None and directory and run_dir in (directory, os.path.dirname(directory))
        ):  # its run root, or one of its runs' own directories under it
            chosen.append(run)
    return chosen


@log_group.command(name="show")
@click.argument("run")
@_db_options
@click.option("--keys", "keys", multiple=True, help="Keys to show (glob patterns; a,b or repeated).")
@click.option("--timing", is_flag=True, help="Also the profiling records (timing.*) without --keys.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV: iteration, run_id, one column per key.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: the run and its rows.")
@click.option(
    "--superseded",
    "with_superseded",
    is_flag=True,
    help="Also show rows a crashed run wrote after the point a later run resumed from.",
)
@click.option(
    "--chain/--no-chain",
    default=True,
    help="Include the runs this one resumed from, as one timeline (default), or only this run's rows.",
)
def show_command(
    run: str,
    db: str | None,
    config: str | None,
    keys: tuple[str, ...],
    timing: bool,
    as_csv: bool,
    as_json: bool,
    with_superseded: bool,
    chain: bool,
) -> None:
    """Show the log of RUN: one row per iteration, one column per key.

    The metrics come first; the profiling records (timing.*) only with --timing or --keys.
    """
    if as_csv and as_json:
        raise click.UsageError("--csv and --json exclude each other")
    patterns = _split(keys)
    with _reading(db, config) as reader:
        target = reader.resolve(run)
        runs = reader.chain(target) if chain else [target]
        if as_csv and len(patterns) == 1 and not any(c in patterns[0] for c in "*?["):
            # one key, the usual script's query: its records without a dict per row
            series = reader.series(target, patterns[0], chain=chain, superseded=with_superseded)
            if series and all(type(value) is float for _, _, value in series):
                # numbers only: the lines csv.writer writes (a float's repr, run ids unquoted),
                # formatted at twice its speed
                print_csv(["iteration", "run_id", patterns[0]], [])
                sys.stdout.write("".join([f"{i},{owner},{v!r}\n" for i, owner, v in series]))
                return
        rows = reader.timeline(target, patterns, chain=chain, superseded=with_superseded)
    present = {key for _, _, record in rows for key in record}
    columns = views.order_keys(present) if patterns else views.visible(present, timing)
    if "epochs_done" in columns:  # the loop's counter: beside the iteration, as an index
        columns = ["epochs_done", *(c for c in columns if c != "epochs_done")]
    if patterns and not columns:
        raise store.SQLiteLogError(f"run {target.run_id}: no key matches {', '.join(patterns)}")
    if as_json:
        payload = {
            "run": target.as_dict(),
            "chain": [r.run_id for r in runs],
            "rows": [
                {"iteration": i, "run_id": owner, "values": {c: record[c] for c in columns if c in record}}
                for i, owner, record in rows
            ],
        }
        click.echo(json.dumps(payload, indent=2, default=str))
        return
    if as_csv:
        csv_header = ["iteration", "run_id", *columns]
        print_csv(
            csv_header,
            [[i, owner, *[_csv_cell(record.get(c)) for c in columns]] for i, owner, record in rows],
        )
        return
    shown = [r.run_id[:8] for r in runs]
    click.echo(
        f"run {target.run_id} ({target.status})" + (f", chain: {' -> '.join(shown)}" if len(runs) > 1 else "")
    )
    if not rows:
        click.echo("no records")
        return
    header = ("iteration", *(("run",) if len(runs) > 1 else ()), *columns)
    table = [
        (
            str(iteration),
            *((owner[:8],) if len(runs) > 1 else ()),
            *(_cell(record[c]) if c in record else "" for c in columns),
        )
        for iteration, owner, record in rows
    ]
    print_table(header, table, numeric=range(len(header)), no_wrap=(0,))


@log_group.command(name="plot")
@click.argument("runs", nargs=-1, required=True)
@_db_options
@click.option(
    "--key",
    "keys",
    multiple=True,
    help="A key or glob pattern to plot (repeat; default: the losses and the monitored metrics).",
)
@click.option("--all", "every", is_flag=True, help="Plot every metric (not only losses and monitored ones).")
@click.option("--timing", is_flag=True, help="Also the profiling records (timing.*).")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    required=True,
    help="The file: .png, .svg, .pdf, or .html (a self-contained report with each run's config).",
)
@click.option(
    "--chain/--no-chain", default=True, help="Plot each run's whole resume chain (default) or only the run."
)
@click.option(
    "--smooth",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.0,
    show_default=True,
    help="Exponential smoothing weight (TensorBoard's); the raw values stay as faint lines.",
)
def plot_command(
    runs: tuple[str, ...],
    db: str | None,
    config: str | None,
    keys: tuple[str, ...],
    every: bool,
    timing: bool,
    output: str,
    chain: bool,
    smooth: float,
) -> None:
    """Plot keys of RUNS against the iteration: one panel per metric, train and valid together.

    Without --key: the losses and the metrics the run's config monitors (--all: every metric;
    --timing adds the profiling records).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise store.SQLiteLogError(
            "epochal log plot needs matplotlib: pip install matplotlib "
            "(from a clone of epochal: pip install './plugins/epochal-sqlite[plot]')"
        ) from None
    from epochal_sqlite import plot

    with _reading(db, config) as reader:
        targets = list({r.run_id: r for r in (reader.resolve(ref) for ref in runs)}.values())
        series = plot.read_series(reader, targets, _split(keys), chain, every, timing)
    plot.write(series, output, smooth)
    click.echo(f"wrote {output}")


@log_group.command(name="compare")
@click.argument("runs", nargs=-1, required=True)
@_db_options
@click.option(
    "--keys", "keys", multiple=True, help="Keys to compare (glob patterns; default: every common key)."
)
@click.option(
    "--maximize",
    multiple=True,
    help=f"Glob patterns of keys where higher is better (default: {', '.join(DEFAULT_MAXIMIZE)}).",
)
@click.option("--timing", is_flag=True, help="Also the profiling records (timing.*) without --keys.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--csv", "as_csv", is_flag=True, help="Print the table as CSV (full run ids).")
def compare_command(
    runs: tuple[str, ...],
    db: str | None,
    config: str | None,
    keys: tuple[str, ...],
    maximize: tuple[str, ...],
    timing: bool,
    as_json: bool,
    as_csv: bool,
) -> None:
    """Compare the final and best values of the numeric keys RUNS have in common.

    Best is the minimum, or the maximum for keys matching --maximize. Each run is read as its
    whole resume chain. The metrics come first; the profiling records (timing.*) only with
    --timing or --keys.
    """
    if len(runs) < 2:
        raise click.UsageError("compare needs at least two runs")
    if as_csv and as_json:
        raise click.UsageError("--csv and --json exclude each other")
    higher = reading.key_matcher(_split(maximize) or DEFAULT_MAXIMIZE)
    with _reading(db, config) as reader:
        targets = [reader.resolve(ref) for ref in runs]
        series = []
        for target in targets:
            values: dict[str, list[float]] = {}
            for _, _, record in reader.timeline(target, _split(keys)):
                for key, value in record.items():
                    number = reading.finite(value)
                    if number is not None:
                        values.setdefault(key, []).append(number)
            series.append(values)
    shared = set.intersection(*(set(s) for s in series))
    common = views.order_keys(shared) if keys else views.visible(shared, timing)
    if not common:
        raise store.SQLiteLogError(
            f"runs {', '.join(t.run_id[:12] for t in targets)} have no numeric key in common"
        )

    def best(key: str, values: list[float]) -> float | None:
        if "." not in key:  # the loop's and plugins' own records (epochs_done, lr): no better end
            return None
        return max(values) if higher(key) else min(values)

    result = {
        key: [{"final": s[key][-1], "best": best(key, s[key]), "n": len(s[key])} for s in series]
        for key in common
    }
    if as_json:
        click.echo(json.dumps({"runs": [t.run_id for t in targets], "keys": result}, indent=2))
        return
    names = [t.run_id if as_csv else t.run_id[:8] for t in targets]
    header = ("key", "best is", *(f"{n} final" for n in names), *(f"{n} best" for n in names))
    table = [
        (
            key,
            "-" if "." not in key else "max" if higher(key) else "min",
            *((v["final"] if as_csv else _cell(v["final"])) for v in entries),
            *(("" if v["best"] is None else v["best"] if as_csv else _cell(v["best"])) for v in entries),
        )
        for key, entries in result.items()
    ]
    if as_csv:
        print_csv(header, table)
        return
    print_table(header, table, numeric=range(2, len(header)))


# -- formatting ---------------------------------------------------------------------------------


def _split(values: Sequence[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def _csv_cell(value: Any) -> Any:
    if value is None or isinstance(value, (int, float, str)):
        return "" if value is None else value
    return json.dumps(value, default=str)


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
