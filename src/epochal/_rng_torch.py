"""Capture and restore torch's CPU random number generator without requiring torch.

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


def torch_rng_state() -> dict[str, np.ndarray] | None:
    """Return ``{"cpu": uint8 array}``, torch's CPU RNG state, or None if torch is not in use.

    "Not in use" means torch has not been imported by this process: its RNG cannot have been
    drawn from, and a process that imports it later starts from the same default state.
    """
    if "torch" not in sys.modules:
        return None
    torch = importlib.import_module("torch")
    return {"cpu": torch.get_rng_state().numpy().copy()}


def set_torch_rng_state(state: Mapping[str, Any] | None) -> None:
    """Restore a state returned by :func:`torch_rng_state`; None does nothing.

    When torch is not installed the state is ignored: nothing in this process can draw from
    torch's RNG.

    :raises ValueError: if *state* is not ``{"cpu": 1-D uint8 array}``.
    """
    if state is None:
        return
    if set(state) != {"cpu"}:
        raise ValueError(f"torch RNG state must have the single key 'cpu', got {sorted(state)}")
    cpu = state["cpu"]
    if not isinstance(cpu, np.ndarray) or cpu.dtype != np.uint8 or cpu.ndim != 1:
        raise ValueError(
            "torch RNG state 'cpu' must be a 1-D uint8 numpy array, got "
            f"{getattr(cpu, 'dtype', type(cpu).__name__)} {getattr(cpu, 'shape', '')}"
        )
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return
    torch.set_rng_state(torch.from_numpy(cpu.copy()))
