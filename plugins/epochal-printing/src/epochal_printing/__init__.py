"""The ``printing`` plugin: plain lines of every stream's metrics, for logs, CI and notebooks."""

from epochal_printing.plugin import Printing

__all__ = ["Printing"]
