"""Plugins with a misspelled hook name and a misspelled hook argument."""

from typing import Any

from epochal import hookimpl


class Typo:
    @hookimpl
    def before_training(self, loop: Any) -> None:
        pass

    @hookimpl
    def after_bach(self, loop: Any) -> None:
        pass


class BadArg:
    @hookimpl
    def after_batch(self, loop: Any, output: Any) -> None:
        pass
