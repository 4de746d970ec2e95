"""Arrays a model made for one ``state_dict`` call alone, which a snapshot need not copy again.

An asynchronous checkpoint copies every array of a state before training goes on, because a
model's ``state_dict`` may hand out views of its live memory (as torch's ``state_dict`` and
:class:`~epochal.torch.TorchModel`'s do for CPU tensors): those change at the next step. An
array the model made for that call alone (a GPU tensor's copy on the host, a non-contiguous
tensor made contiguous) changes with nothing. A model marks such an array with
:func:`private`, and the checkpoint plugin writes it as it is, so that a GPU tensor is copied
once (to the host) on every save, asynchronous ones included. The mark promises that nothing
but the state holds or writes the array's memory: never mark an array the model keeps.

The marks are held weakly: an array that is freed is forgotten.
"""

from __future__ import annotations

import weakref
from typing import Any, TypeVar

__all__ = ["is_private", "private"]

_T = TypeVar("_T")

#: id → array, for the arrays marked and still alive (numpy arrays are not hashable: keyed by id,
#: and an entry goes when its array does, before the id can be reused).
_marked: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def private(array: _T) -> _T:
    """Mark *array* (a numpy array made for one state alone) as nobody else's; return it."""
    _marked[id(array)] = array
    return array


def is_private(array: Any) -> bool:
    """Whether *array* was marked with :func:`private` (and is the very object marked)."""
    marked = _marked.get(id(array))
    return marked is not None and marked is array
