"""A local plugin for check-resume's tests (copied beside a test's config): it changes its state
in ``after_epoch``, which the epoch's checkpoint holds only when it runs before ``checkpoint``."""

from __future__ import annotations

from typing import Any

from epochal import hookimpl


class EpochCounter:
    """Counts epoch ends."""

    def __init__(self) -> None:
        self.epochs = 0

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self.epochs += 1

    def state_dict(self) -> dict[str, int]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epochs = state["epochs"]
