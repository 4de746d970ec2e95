"""The exceptions epochal raises for bad input.

Every error a user can cause by configuration or by installing a broken plugin is an
:class:`EpochalError`; the CLI prints its message alone (no traceback) and exits with status 2.
"""

from __future__ import annotations

from collections.abc import Iterable


class EpochalError(Exception):
    """Base class of the errors that are the user's to fix (bad config, bad plugin, bad input)."""

    exit_code = 2


class ConfigError(EpochalError):
    """The run configuration (TOML file, ``--set``, plugin options) is invalid."""


class StreamStateError(EpochalError, ValueError):
    """A stream's saved state does not fit the stream it is loaded into (other data, another
    batch size, other workers): the message names the stream."""


class PluginError(EpochalError):
    """A plugin cannot be found, imported, configured, ordered or registered."""


class OrderError(PluginError):
    """The requested call order cannot be satisfied (a cycle or a contradiction)."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest of *choices*, or ``""``."""
    import difflib  # only when a name is wrong: not on every start

    match = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def option_error(plugin: str, option: str, message: str) -> PluginError:
    """The one shape of a plugin's error about its options, for what annotations cannot say (two
    options that contradict each other, a value the plugin cannot use): ``[plugins.NAME] option:
    message``. Types and ranges are the validator's (:mod:`epochal.protocol`'s annotations)."""
    return PluginError(f"[plugins.{plugin}] {option}: {message}")
