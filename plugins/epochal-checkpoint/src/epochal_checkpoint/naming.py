"""Checkpoint names with metrics: the ``filename`` template of the ``checkpoint`` plugin.

``filename = "{epoch}-{valid.loss:.3f}"`` names a checkpoint ``ckpt-e0003-i000069_3-0.412``: the
``ckpt-e<epoch>-i<iteration>`` prefix stays (listing, ``latest``, pruning and ``-vN`` suffixes
read it; the save order is the manifests' sequence), and the formatted template follows an
underscore. A field is ``epoch``, ``iteration`` or a training-log key (the most recent value in
the log at the save, as ``monitor`` reads it), with an optional format spec (``:.3f``, ``:03d``).

The template is parsed with :class:`string.Formatter` (so ``valid.loss`` is one name, not an
attribute), and checked when the plugin is built: a positional field (``{}``), a conversion
(``!r``), a format spec that formats neither an int nor a float, or a character a file name
cannot hold is refused with one line. Whether a key is logged can only be known at the first save
(the log fills as the run goes): a key still missing then is refused with one line, except the
key of an evaluation stream that has not been evaluated yet, written ``none`` until it is.
"""

from __future__ import annotations

import difflib
import math
import re
import shlex
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epochal.errors import ConfigError

__all__ = ["MAX_TAG", "TAG_CHARS", "Template"]

#: the characters a formatted name may hold; any other one in a logged value becomes ``_``.
TAG_CHARS = "A-Za-z0-9._=+-"
_BAD = re.compile(f"[^{TAG_CHARS}]")
#: the longest formatted part of a name (file systems allow 255 bytes for the whole name).
MAX_TAG = 160
#: what a field reads besides the log: the loop's counters.
COUNTERS = ("epoch", "iteration")
#: a value whose evaluation stream has not run yet.
PENDING = "none"


@dataclass(frozen=True)
class _Field:
    literal: str
    key: str | None
    spec: str


class Template:
    """A parsed ``filename`` template; :meth:`format` gives a checkpoint's name suffix.

    :raises ConfigError: one line naming ``where`` and the culprit, for a template that cannot
        make a file name whatever is logged.
    """

    def __init__(self, template: str, where: str) -> None:
        self.template, self.where = template, where
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as error:
            raise ConfigError(f"{where} filename {template!r}: {error}") from None
        fields: list[_Field] = []
        for literal, key, spec, conversion in parsed:
            if key is not None:
                if not key or key.isdigit():
                    raise ConfigError(
                        f"{where} filename {template!r}: a field must name a log key, epoch or "
                        "iteration (e.g. {valid.loss:.3f}), not a position"
                    )
                if conversion:
                    raise ConfigError(f"{where} filename {template!r}: no conversion (!{conversion}) here")
                if "{" in (spec or ""):
                    raise ConfigError(f"{where} filename {template!r}: no nested field in {key}'s format")
                _check_spec(template, key, spec or "", where)
            bad = _BAD.search(literal)
            if bad:
                raise ConfigError(
                    f"{where} filename {template!r}: {bad.group()!r} cannot be part of a checkpoint "
                    f"name (use letters, digits and {TAG_CHARS[9:]})"
                )
            fields.append(_Field(literal, key, spec or ""))
        self.fields = fields
        #: the log keys the template reads (not the counters).
        self.keys = [f.key for f in fields if f.key is not None and f.key not in COUNTERS]

    def format(
        self,
        counters: Mapping[str, int],
        value: Callable[[str], Any],
        streams: Mapping[str, bool],
        logged: Callable[[], list[str]],
    ) -> str:
        """The name suffix for the current save.

        :param counters: ``epoch`` and ``iteration``.
        :param value: the most recent logged value of a key (None: not logged).
        :param streams: evaluation stream name → whether it has been evaluated (logged) yet.
        :param logged: every key logged so far (for the error's hint).
        :raises ConfigError: at the first save, for a key that is not logged and belongs to no
            evaluation stream still to come.
        """
        parts: list[str] = []
        for field in self.fields:
            parts.append(field.literal)
            if field.key is None:
                continue
            found = counters[field.key] if field.key in COUNTERS else value(field.key)
            if found is None:
                stream = field.key.partition(".")[0]
                if streams.get(stream) is False:  # its evaluation still to come
                    parts.append(PENDING)
                    continue
                self._missing(field.key, counters, logged())
            parts.append(_format_value(found, field.spec))
        return _BAD.sub("_", "".join(parts))[:MAX_TAG]

    def _missing(self, key: str, counters: Mapping[str, int], logged: list[str]) -> None:
        match = difflib.get_close_matches(key, logged, n=1, cutoff=0.5)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise ConfigError(
            f"{self.where} filename {self.template!r}: {key!r} is not in the training log at the save "
            f"after epoch {counters['epoch']}, iteration {counters['iteration']}{hint}; logged: "
            f"{', '.join(logged) or 'nothing yet'}"
        )


def _check_spec(template: str, key: str, spec: str, where: str) -> None:
    for sample in (1.5, 1):
        try:
            format(sample, spec)
            return
        except (ValueError, TypeError):
            continue
    raise ConfigError(f"{where} filename {template!r}: {spec!r} is not a format spec of a number ({key})")


def _format_value(value: Any, spec: str) -> str:
    try:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return format(value, spec)
    except (ValueError, TypeError):  # an int spec on a float value, a string value...
        try:
            return format(float(value), spec)
        except (ValueError, TypeError):
            return str(value)


def fresh_run_refusal(directory: str, found: list[str], command: Sequence[str], elsewhere: str) -> str | None:
    """Why a fresh run may not start in *directory*, which holds the checkpoints *found* of an
    earlier run (None: it holds none): the ways on, *command* + ``--resume`` or *elsewhere*."""
    if not found:
        return None
    again = shlex.join([*command, "--resume"]) if command else "--resume"
    return (
        f"checkpoint directory {directory!r} already holds {len(found)} checkpoint(s) of an "
        f"earlier run (newest: {found[-1]}). To continue that run: {again}. To start afresh: "
        f"choose another directory ({elsewhere}) or delete that one."
    )
