"""epochal.private_arrays: the mark a model puts on arrays made for one state alone."""

from __future__ import annotations

import gc

import numpy as np

from epochal import private_arrays
from epochal.private_arrays import is_private, private


def test_only_the_very_array_marked_is_private() -> None:
    array = private(np.arange(4.0))
    assert is_private(array)
    assert not is_private(array.view()) and not is_private(array[1:]) and not is_private(array.copy())
    assert not is_private(np.arange(4.0)) and not is_private([0.0, 1.0]) and not is_private(None)


def test_a_freed_array_is_forgotten() -> None:
    gc.collect()
    before = len(private_arrays._marked)
    array = private(np.zeros(3))
    assert len(private_arrays._marked) == before + 1
    del array
    gc.collect()
    assert len(private_arrays._marked) == before
