"""Seeding, capturing and restoring the global random number generators without pickle.

Python's ``random``, numpy's legacy global generator and, when torch has been imported,
torch's CPU generator. The states are JSON-able values and numpy arrays, and they round-trip
exactly, so a resumed run draws the same numbers as an uninterrupted one. :func:`seeded`
seeds them before a run's model and data factories are called, torch included when a factory
imports it only then.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import random
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
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


class _SeedTorchOnImport(importlib.abc.MetaPathFinder):
    """Seeds torch as soon as it is imported: a factory that imports torch in its body draws
    from a seeded generator too, and a run that never imports torch does not pay for it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once; and find_spec below must not come back here
        spec = importlib.util.find_spec("torch")
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        seed = self.seed

        def exec_and_seed(module: ModuleType) -> None:
            exec_module(module)
            module.manual_seed(seed)

        # this loader object belongs to this one spec: shadowing its method changes no other import
        loader.exec_module = exec_and_seed  # type: ignore[method-assign]
        return spec


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Seed every global generator from *seed* (None: leave them) for the block; torch is
    seeded now if it is imported, else when the block imports it."""
    if seed is None:
        yield
        return
    seed_all(seed)
    if "torch" in sys.modules:
        yield
        return
    finder = _SeedTorchOnImport(seed)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
