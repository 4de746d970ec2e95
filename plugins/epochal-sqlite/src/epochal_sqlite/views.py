"""Which keys the ``epochal log`` views show by default, and in which order.

A run's log holds its metrics (``train.loss``, ``valid.accuracy``), a few records of the loop and
the plugins (``epochs_done``, ``lr``, ``valid.loss.best``) and, with the timing plugin, dozens
of profiling records (``timing.train_step``, ``timing.plugin.monitor.after_batch``). A person
reading ``log show`` or ``log compare`` wants the metrics first and the profiling records only
when asked (``--timing``); ``log plot`` without ``--key`` draws the losses and the monitored
metrics, not one panel per key (issue 29: 45 panels, a 9240-pixel-tall PNG).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from epochal_sqlite.reader import key_matcher

__all__ = ["PROFILING", "RUNNING", "monitored", "order_keys", "plot_keys", "visible"]

#: glob patterns of the profiling records, out of the default views (``--timing`` shows them).
PROFILING = ("timing.*",)
#: the suffix of a running record: ``train.loss.running`` is ``train.loss`` every n steps.
RUNNING = ".running"

_is_profiling = key_matcher(PROFILING)


def _rank(key: str) -> tuple[int, bool, str, bool]:
    stream, dot, metric = key.partition(".")
    if _is_profiling(key):
        return 4, False, key, False
    if not dot:
        return 3, False, key, False  # the loop's and plugins' own records: epochs_done, lr
    # a running record (monitor's per-step train.loss.running) right after its epoch record
    epoch_key = key.removesuffix(RUNNING)
    return (1 if "loss" in metric else 2), stream != "train", epoch_key, epoch_key != key


def order_keys(keys: Iterable[str]) -> list[str]:
    """*keys* losses first, then the other metrics (``train.*`` before the other streams' in
    each; a running record ``train.loss.running`` right after ``train.loss``), then the other
    records, then the profiling ones; alphabetical otherwise."""
    return sorted(set(keys), key=_rank)


def visible(keys: Iterable[str], timing: bool) -> list[str]:
    """*keys* in :func:`order_keys`' order, without the profiling records unless *timing*."""
    return [key for key in order_keys(keys) if timing or not _is_profiling(key)]


def monitored(config: Any) -> list[str]:
    """The log keys a run's configuration monitors: every ``monitor`` of its plugin tables
    (early stopping's, the checkpoint's ranking, a scheduler's)."""
    plugins = config.get("plugins") if isinstance(config, Mapping) else None
    if not isinstance(plugins, Mapping):
        return []
    found = []
    for table in plugins.values():
        if isinstance(table, Mapping) and isinstance(table.get("monitor"), str):
            found.append(table["monitor"])
    return list(dict.fromkeys(found))


def plot_keys(available: Iterable[str], config: Any, timing: bool) -> list[str]:
    """What ``log plot`` draws without ``--key``: the losses (``*.loss``, ``*_loss``) and the
    monitored metrics of *available*, each with its running record (``train.loss.running``, the
    per-step curve); every visible key when there is none of either."""
    keys = visible(available, timing)
    wanted = set(monitored(config))

    def chosen_key(key: str) -> bool:
        key = key.removesuffix(RUNNING)
        return "loss" in key.rpartition(".")[2] or key in wanted

    chosen = [k for k in keys if chosen_key(k)]
    if timing:
        chosen += [k for k in keys if _is_profiling(k) and k not in chosen]
    return chosen or keys
