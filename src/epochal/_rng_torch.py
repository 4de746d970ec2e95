"""Capture and restore torch's CPU (and CUDA) random number generators without requiring torch.

Used by the loop to make resumed runs exact for models that draw from torch's RNG (dropout,
random initialisation, samplers). The state is a numpy ``uint8`` array, so it is saved like any
other array. Torch is never imported here unless the run has imported it already or a state
needs restoring: a numpy-only run pays nothing.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np


def torch_rng_state() -> dict[str, Any] | None:
    """Return ``{"cpu": uint8 array}`` (and ``"cuda": [uint8 array per device]`` once CUDA is
    initialised: dropout on a GPU draws from those), or None if torch is not in use.

    "Not in use" means torch has not been imported by this process: its RNG cannot have been
    drawn from, and a process that imports it later starts from the same default state.
    """
    if "torch" not in sys.modules:
        return None
    torch = importlib.import_module("torch")
    state: dict[str, Any] = {"cpu": torch.get_rng_state().numpy().copy()}
    if torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
    return state


def set_torch_rng_state(state: Mapping[str, Any] | None) -> None:
    """Restore a state returned by :func:`torch_rng_state`; None does nothing.

    When torch is not installed the state is ignored: nothing in this process can draw from
    torch's RNG.

    :raises ValueError: if *state* is not ``{"cpu": 1-D uint8 array}``.
    """
    if state is None:
        return
    if "cpu" not in state or not set(state) <= {"cpu", "cuda"}:
        raise ValueError(f"torch RNG state must have the key 'cpu' (and 'cuda'), got {sorted(state)}")
    arrays = [("cpu", state["cpu"])]
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list):
        raise ValueError(f"torch RNG state 'cuda' must be a list, got {type(cuda).__name__}")
    arrays += [(f"cuda.{i}", a) for i, a in enumerate(cuda)]
    for where, array in arrays:
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
            raise ValueError(
                f"torch RNG state {where!r} must be a 1-D uint8 numpy array, got "
                f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}"
            )
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return
    torch.set_rng_state(torch.from_numpy(state["cpu"].copy()))
    if cuda and torch.cuda.is_available():
        for index, array in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.from_numpy(array.copy()), index)
