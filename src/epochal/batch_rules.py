"""How many examples a batch holds, and whether it is empty: one rule per batch type.

The loop asks once per batch (:func:`empty_rule`, chosen when the batch type changes) and the
evaluation and the monitor count examples with :func:`batch_size`; a rule is chosen once per type
and cached, so the per-batch cost is a dict lookup and the rule (no ``isinstance`` against ABCs,
no raised and caught ``TypeError``). ``epochal.data.batch_size`` is the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

_ndarray = np.ndarray


def batch_size(batch: Any) -> int:
    """Return the number of examples in *batch*.

    The leading dimension of the first array or tensor found depth-first: a tuple or list
    counts its first element, a mapping its first value, and so on into nested tuples, lists
    and mappings (``{"inputs": (x, flag), "targets": y}`` counts ``len(x)``); an array or tensor
    counts its leading dimension (a 0-d one counts 1); a list of plain values (numbers,
    strings) its length, and so does a nested tuple of them, where a top-level tuple of them is
    one example ``(x, y)``; an empty batch 0; any other sized object its length,
    anything else 1.
    Called once per batch: the rule for a type is chosen once and cached (no ``isinstance``
    against ABCs, no raised and caught ``TypeError`` per batch).
    """
    kind = type(batch)
    # the usual batches inlined (each call costs as much as the rule): an array, a tuple or a
    # list of arrays, a dict of arrays; the same answers as their rules below
    if kind is _ndarray:
        return len(batch) if batch.ndim else 1
    if kind is tuple or kind is list:
        if not batch:
            return 0
        first = batch[0]
        if type(first) is _ndarray:
            return len(first) if first.ndim else 1
        return len(batch) if kind is list and type(first) in _PLAIN else _len_or_1(first)
    if kind is dict:
        for key in batch:  # the first value (cheaper than a values() view)
            first = batch[key]
            if type(first) is _ndarray:
                return len(first) if first.ndim else 1
            return _len_or_1(first)
        return 0
    rule = _RULES.get(kind)
    if rule is None:
        rule = _RULES[kind] = _rule_for(kind)
    return rule(batch)


def _array_size(batch: Any) -> int:
    return len(batch) if batch.ndim else 1


def _shape_size(batch: Any) -> int:
    # a tensor's shape[0] is read in C; its len() is a Python method (4x the cost, per batch)
    return batch.shape[0] if batch.ndim else 1


#: values of which a top-level list is a batch (token ids, texts): it counts them. A tuple of
#: them is one example, ``(x, y)``.
_PLAIN = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _sequence_size(batch: Any) -> int:
    if not batch:
        return 0
    return len(batch) if isinstance(batch, list) and type(batch[0]) in _PLAIN else _len_or_1(batch[0])


def _mapping_size(batch: Any) -> int:
    for value in batch.values():
        return _len_or_1(value)
    return 0


def _one(batch: Any) -> int:
    return 1


def _len_or_1(obj: Any) -> int:
    rule = _ITEM_RULES.get(type(obj))
    if rule is None:
        rule = _ITEM_RULES[type(obj)] = _rule_for(type(obj), item=True)
    return rule(obj)


def _sized(obj: Any) -> int:
    try:
        return len(obj)
    except TypeError:  # a __len__ that refuses (a 0-d tensor)
        return 1


def _nested(obj: Any) -> bool:
    """Whether *obj* is followed depth-first: an array, a tensor, a tuple, a list or a mapping."""
    return isinstance(obj, (tuple, list, Mapping)) or hasattr(type(obj), "ndim")


def _nested_sequence_size(item: Any) -> int:
    # (x, flag) inside a batch counts x's examples; a list of numbers or strings its length
    if not item:
        return 0
    return _len_or_1(item[0]) if _nested(item[0]) else len(item)


def _nested_mapping_size(item: Any) -> int:
    for value in item.values():
        return _len_or_1(value) if _nested(value) else len(item)
    return 0


def _rule_for(kind: type, item: bool = False) -> Callable[[Any], int]:
    if hasattr(kind, "__len__") and hasattr(kind, "ndim"):  # numpy arrays, tensors: 0-d counts 1
        return _shape_size if hasattr(kind, "shape") else _array_size
    if issubclass(kind, (tuple, list)):
        return _nested_sequence_size if item else _sequence_size
    if issubclass(kind, Mapping):
        return _nested_mapping_size if item else _mapping_size
    return _sized if hasattr(kind, "__len__") else _one


_RULES: dict[type, Callable[[Any], int]] = {}
_ITEM_RULES: dict[type, Callable[[Any], int]] = {}


def empty_rule(kind: type) -> Callable[[Any], bool] | None:
    """A predicate telling whether a batch of type *kind* is empty (``batch_size(batch) == 0``).

    None for a type whose batches always count 1 (no ``len``): the loop then checks nothing. The
    loop asks once per batch type, so the usual batches (a tuple or dict of numpy arrays, an
    array) cost one call and no dispatch per batch.
    """
    rule = _EMPTY_RULES.get(kind, _MISSING)
    if rule is _MISSING:
        size = _rule_for(kind)
        if size is _one:
            rule = None
        elif size is _sequence_size:
            rule = _sequence_empty
        elif size is _mapping_size:
            rule = _mapping_empty
        elif kind is np.ndarray:
            rule = _ndarray_empty
        else:
            rule = _empty_by_size(size)
        _EMPTY_RULES[kind] = rule
    return rule


def _ndarray_empty(batch: np.ndarray) -> bool:
    try:
        return len(batch) == 0
    except TypeError:  # 0-d: one example
        return False


def _sequence_empty(batch: Any, _ndarray: Any = np.ndarray) -> bool:
    if not batch:
        return True
    first = batch[0]
    if type(first) is _ndarray:  # the common case, without a dispatch
        try:
            return len(first) == 0
        except TypeError:  # 0-d: one example
            return False
    if type(batch) is list and type(first) in _PLAIN:  # plain values (cheap for a tuple batch)
        return False
    return _len_or_1(first) == 0


def _mapping_empty(batch: Any, _ndarray: Any = np.ndarray) -> bool:
    for key in batch:  # the first value (cheaper than a values() view)
        first = batch[key]
        if type(first) is _ndarray:
            try:
                return len(first) == 0
            except TypeError:
                return False
        return _len_or_1(first) == 0
    return True


def _empty_by_size(size: Callable[[Any], int]) -> Callable[[Any], bool]:
    def empty(batch: Any) -> bool:
        return size(batch) == 0

    return empty


_MISSING: Any = object()
_EMPTY_RULES: dict[type, Callable[[Any], bool] | None] = {}
