"""The per-run call order: the user's order, the plugins' ``run_before``/``run_after``, their phases.

:func:`call_order` is a stable topological sort. The names the user listed keep their relative
order, and ``run_before``/``run_after`` must hold (hard constraints). Within them, the plugins
that declare a phase (``measure``, ``adjust``, ``decide``, ``save``, ``report``: see
:mod:`epochal.protocol`) are preferred in phase order, and every other plugin keeps its place in
the preferred order. So the standard plugins need not name each other, and an order the user
writes still wins. A cycle is one :class:`~epochal.errors.OrderError` that names every plugin in
it and where each constraint came from.

:func:`order_units` applies it to a run's plugins (:class:`Unit`: a plugin, or a composite with
its children), reading their declared ``run_before``, ``run_after`` and ``phase``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

from epochal.declarations import Unit
from epochal.errors import OrderError
from epochal.protocol import PHASES


def call_order(
    preferred: Sequence[str],
    explicit: Sequence[str],
    run_before: Mapping[str, Iterable[str]],
    run_after: Mapping[str, Iterable[str]],
    phases: Mapping[str, str] | None = None,
) -> list[str]:
    """Order *preferred* so that every constraint holds, changing it as little as possible.

    :param preferred: every unit to order, in the preferred order.
    :param explicit: the units the user listed, in the user's order (a subsequence of
        *preferred*): each must come before the next.
    :param run_before: unit → units it must run before (unknown names are ignored).
    :param run_after: unit → units it must run after (unknown names are ignored).
    :param phases: unit → its phase (one of :data:`epochal.protocol.PHASES`): the units with
        one that *explicit* does not list are preferred in phase order (in the places they hold
        in *preferred*); the others keep their places.
    """
    # the listed units keep their places (first, as listed): a phase only places the others
    listed = set(explicit)
    preferred = by_phase(preferred, {n: p for n, p in (phases or {}).items() if n not in listed})
    index = {name: i for i, name in enumerate(preferred)}
    why: dict[tuple[str, str], str] = {}

    def edge(a: str, b: str, reason: str) -> None:
        if a in index and b in index and a != b:
            why.setdefault((a, b), reason)

    for a, b in pairwise(explicit):
        edge(a, b, f"the run's order lists {a!r} before {b!r}")
    for name, others in run_before.items():
        for other in others:
            edge(name, other, f"{name!r} declares run_before {other!r}")
    for name, others in run_after.items():
        for other in others:
            edge(other, name, f"{name!r} declares run_after {other!r}")

    successors: dict[str, list[str]] = {name: [] for name in preferred}
    for a, b in why:
        successors[a].append(b)
    order = _kahn(preferred, successors, index)
    if len(order) < len(preferred):
        placed = set(order)
        cycle = _find_cycle([n for n in preferred if n not in placed], successors)
        steps = "; ".join(why[(a, b)] for a, b in pairwise(cycle))
        names = ", ".join(repr(n) for n in cycle[:-1])
        raise OrderError(f"plugin order cannot be satisfied: {names} form a cycle ({steps})")
    # A plugin that must run before another moves up to just before it, not further:
    # its priority is the earliest preferred position of itself and everything after it.
    priority = dict(index)
    for name in reversed(order):
        for nxt in successors[name]:
            priority[name] = min(priority[name], priority[nxt])
    return _kahn(preferred, successors, {n: (priority[n], index[n]) for n in preferred})


def by_phase(names: Sequence[str], phases: Mapping[str, str]) -> list[str]:
    """*names* with those that have a phase sorted by it (stably), in the places they held."""
    staged = sorted((PHASES.index(phases[n]), i) for i, n in enumerate(names) if n in phases)
    places = sorted(i for _, i in staged)
    order = list(names)
    for place, (_, i) in zip(places, staged, strict=True):
        order[place] = names[i]
    return order


def _kahn(nodes: Sequence[str], successors: Mapping[str, list[str]], key: Mapping[str, Any]) -> list[str]:
    """Topological order of *nodes*, taking the ready node with the smallest *key* first."""
    indegree = dict.fromkeys(nodes, 0)
    for targets in successors.values():
        for target in targets:
            indegree[target] += 1
    ready = [(key[n], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for nxt in successors[name]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                heapq.heappush(ready, (key[nxt], nxt))
    return order


def _find_cycle(nodes: list[str], successors: Mapping[str, list[str]]) -> list[str]:
    """A cycle among *nodes* (those a topological sort could not place), as [a, b, ..., a]."""
    remaining = set(nodes)
    path: list[str] = []
    position: dict[str, int] = {}
    node = nodes[0]
    while node not in position:
        position[node] = len(path)
        path.append(node)
        # Every remaining node has a remaining predecessor, so follow predecessors backwards.
        node = next(p for p in nodes if node in successors[p] and p in remaining)
    cycle = [*path[position[node] :], node]
    return list(reversed(cycle))


def order_units(units: list[Unit], explicit: list[str]) -> list[Unit]:
    """Sort the units by the run's order and the plugins' declared constraints."""
    owner: dict[str, str] = {}
    for unit in units:
        owner[unit.name] = unit.name
        for member, _ in unit.members:
            owner[member] = unit.name
    before: dict[str, list[str]] = {}
    after: dict[str, list[str]] = {}
    phases: dict[str, str] = {}
    for unit in units:
        phase = unit.records[unit.name].phase
        if phase is not None:
            phases[unit.name] = phase
        for name, _ in [(unit.name, unit.plugin), *unit.members]:
            record = unit.records[name]
            for target in record.run_before:
                if target in owner and owner[target] != unit.name:
                    before.setdefault(unit.name, []).append(owner[target])
            for target in record.run_after:
                if target in owner and owner[target] != unit.name:
                    after.setdefault(unit.name, []).append(owner[target])
    by_name = {unit.name: unit for unit in units}
    names = call_order([u.name for u in units], explicit, before, after, phases)
    return [by_name[name] for name in names]
