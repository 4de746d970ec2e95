"""Capturing and restoring the global random number generators without pickle.

Python's ``random``, numpy's legacy global generator and, when torch has been imported,
torch's CPU generator. The states are JSON-able values and numpy arrays, and they round-trip
exactly, so a resumed run draws the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import random
import sys
from typing import Any


def capture() -> dict[str, Any]:
    """The current state of every global generator."""
    import numpy as np

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        # 625 words as one uint32 array: a checkpoint stores it as bytes, not as 6 KB of JSON
        "python": {"version": version, "state": np.array(internal, dtype=np.uint32), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": np.array(keys, copy=True),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if "torch" in sys.modules:
        from epochal._rng_torch import torch_rng_state

        state["torch"] = torch_rng_state()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every generator back in the state :func:`capture` returned."""
    import numpy as np

    py = state["python"]
    # a list of ints in states saved before it became an array (format 3, early format 4)
    words = np.asarray(py["state"], dtype=np.uint32).tolist()
    random.setstate((py["version"], tuple(words), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if state.get("torch") is not None:
        from epochal._rng_torch import set_torch_rng_state

        set_torch_rng_state(state["torch"])


def seed_all(seed: int) -> None:
    """Seed every global generator from *seed*."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
