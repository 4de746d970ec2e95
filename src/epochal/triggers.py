"""Conditions that say when a plugin should act (Blocks' SimpleExtension triggers).

Each helper returns a predicate ``condition(loop) -> bool`` to test inside a hook::

    from epochal.triggers import every_n_batches

    class Snapshot:
        def __init__(self, every: int = 100):
            self.due = every_n_batches(every)

        @hookimpl
        def after_batch(self, loop):
            if self.due(loop):
                ...

Batch conditions read ``loop.iteration`` (training batches completed), epoch conditions
``loop.epoch`` (epochs completed), so they are meant for ``after_batch`` and ``after_epoch``
respectively and hold the same way after a resume. A value of 0 or None means "never".

The same conditions are also shared options of every plugin (:data:`TRIGGER_KEYS`, parsed
by :func:`parse_triggers`): the core gates the plugin's hooks with them, no plugin code needed.
There a key of 0 leaves the hooks ungated (the key's default), where the function of that name
given 0 is never true (a plugin's own "every 0 epochs": never, as the checkpoint's).
"""

from __future__ import annotations

import ast
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Condition = Callable[[Any], bool]


def _check(n: int | None, what: str) -> int:
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be a non-negative integer, not {n!r}")
    return n


def never(loop: Any) -> bool:
    """A condition that is never true."""
    return False


def every_n_batches(n: int | None) -> Condition:
    """True after every *n*-th training batch (``loop.iteration % n == 0``)."""
    n = _check(n, "every_n_batches")
    if not n:
        return never
    return lambda loop: loop.iteration > 0 and loop.iteration % n == 0


def every_n_epochs(n: int | None) -> Condition:
    """True after every *n*-th training epoch (``loop.epoch % n == 0``)."""
    n = _check(n, "every_n_epochs")
    if not n:
        return never
    return lambda loop: loop.epoch > 0 and loop.epoch % n == 0


def after_n_batches(n: int | None) -> Condition:
    """True once *n* training batches have completed (``loop.iteration >= n``)."""
    n = _check(n, "after_n_batches")
    if not n:
        return never
    return lambda loop: loop.iteration >= n


def after_n_epochs(n: int | None) -> Condition:
    """True once *n* training epochs have completed (``loop.epoch >= n``)."""
    n = _check(n, "after_n_epochs")
    if not n:
        return never
    return lambda loop: loop.epoch >= n


class every_n_seconds:  # noqa: N801 - used like the functions above
    """True when at least *seconds* of wall time passed since it was last true.

    It measures with ``time.monotonic``; the first call starts the clock and returns False.
    """

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if seconds is not None and (isinstance(seconds, bool) or seconds < 0):
            raise ValueError(f"every_n_seconds must be a non-negative number, not {seconds!r}")
        self.seconds = seconds or 0
        self._clock = clock
        self._last: float | None = None

    def __call__(self, loop: Any = None) -> bool:
        if not self.seconds:
            return False
        now = self._clock()
        if self._last is None:
            self._last = now
            return False
        if now - self._last >= self.seconds:
            self._last = now
            return True
        return False


# -- the shared trigger keys of every ``[plugins.NAME]`` table --------------------------------

#: The trigger keys every plugin's table accepts, and what each one expects.
TRIGGER_KEYS: dict[str, str] = {
    "every_n_batches": "a non-negative integer",
    "after_n_batches": "a non-negative integer",
    "every_n_epochs": "a non-negative integer",
    "after_n_epochs": "a non-negative integer",
    "before_first_epoch": "true or false",
    "on_resumption": "true or false",
    "after_training": "true or false",
    "when": 'a condition on the log ("valid.loss < 0.1") or "module:callable"',
}
#: Hooks gated by the batch counters and ``when`` (the counter is the batch being run):
#: ``before_optimizer_step`` runs inside its batch's step, so a plugin that keeps a gradient
#: norm there and writes it in ``after_batch`` sees both hooks gated alike.
BATCH_HOOKS = ("before_batch", "after_batch", "before_optimizer_step")
#: Hooks gated by the epoch counters and ``when`` (the counter is the epoch being run).
EPOCH_HOOKS = ("before_epoch", "after_epoch")
#: Hooks a boolean trigger key turns off (``false``): key → hook.
SWITCHED_HOOKS = {
    "before_first_epoch": "before_training",
    "on_resumption": "on_resumption",
    "after_training": "after_training",
}

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}
_MISSING = object()
#: names a condition may use that are not log keys: the loop's counters.
COUNTER_NAMES = ("epoch", "iteration")


class _NotLoggedError(Exception):
    """A name of the condition is not logged yet: the condition is false."""


def _is_flag(value: Any) -> bool:
    """Whether *value* is a true/false record (Python's or numpy's bool)."""
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def _lookup(loop: Any, key: str) -> Any:
    row = loop.log.current_row
    if key in row:
        return row[key]
    stream, dot, metric = key.partition(".")
    if dot and metric in loop.last_metrics.get(stream, {}):
        return loop.last_metrics[stream][metric]
    if key in COUNTER_NAMES:
        return getattr(loop, key)
    value = loop.log.last(key, _MISSING)
    if value is _MISSING:
        raise _NotLoggedError(key)
    if _is_flag(value):
        # A true/false record notifies of its own row (early_stopping's best_so_far is set only
        # where the value is a new best; Blocks' OnLogRecord reads the current row only): looking
        # back would keep it true for ever after. Outside the row that holds it, it is false.
        return False
    return value


class LogCondition:
    """A safe condition on the training log, e.g. ``"valid.loss < 0.1 and epoch >= 3"``.

    Parsed with :mod:`ast`; only comparisons, ``and``/``or``/``not``, numbers, strings,
    ``true``/``false`` and names (log keys such as ``loss`` or ``valid.accuracy``, and the
    counters ``epoch`` and ``iteration``) are allowed, and nothing is ever passed to ``eval``.
    A name is looked up in the current log row, then the stream's last evaluation, then the
    loop's counters, then the latest row that has it; while it is not logged yet the condition
    is false. A true/false record is the exception: it notifies of its own row (such as
    ``valid.loss.best_so_far``), so in any row that does not hold it, it reads as false.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.names: list[str] = []
        self._warned: set[str] = set()  # the names warned about as never logged
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as error:
            raise ValueError(f"condition {text!r} does not parse: {error.msg}") from None
        self._evaluate = self._compile(tree.body)

    def _name(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            inner = self._name(node.value)
            return f"{inner}.{node.attr}" if inner is not None else None
        return None

    def _compile(self, node: ast.expr) -> Callable[[Any], Any]:
        name = self._name(node)
        if name is not None:
            if name in ("true", "True"):
                return lambda loop: True
            if name in ("false", "False"):
                return lambda loop: False
            self.names.append(name)
            return lambda loop: _lookup(loop, name)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
            value = node.value
            return lambda loop: value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            operand = self._compile(node.operand)
            if isinstance(node.op, ast.Not):
                return lambda loop: not operand(loop)
            return lambda loop: -operand(loop)
        if isinstance(node, ast.BoolOp):
            parts = [self._compile(v) for v in node.values]
            if isinstance(node.op, ast.And):
                return lambda loop: all(p(loop) for p in parts)
            return lambda loop: any(p(loop) for p in parts)
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            first = self._compile(node.left)
            rest = [(_COMPARE[type(op)], self._compile(v)) for op, v in zip(node.ops, node.comparators)]

            def compare(loop: Any) -> bool:
                left = first(loop)
                for op, right_of in rest:
                    right = right_of(loop)
                    if not op(left, right):
                        return False
                    left = right
                return True

            return compare
        raise ValueError(
            f"condition {self.text!r}: {ast.unparse(node)!r} is not allowed (only comparisons, "
            "and/or/not, numbers, strings and log keys such as valid.loss)"
        )

    def __call__(self, loop: Any) -> bool:
        try:
            return bool(self._evaluate(loop))
        except _NotLoggedError as missing:
            self._warn_if_never_logged(loop, str(missing))
            return False
        except TypeError:  # e.g. comparing a string with a number: not true
            return False

    def _warn_if_never_logged(self, loop: Any, key: str) -> None:
        """Warn once when *key* is still not logged although it should be by now (its stream was
        evaluated, or an epoch ended): a misspelt key leaves the condition false for ever."""
        warned = self._warned
        stream = key.partition(".")[0]
        evaluated = stream in getattr(loop, "eval_streams", ())  # train.* records: after an epoch
        due = stream in loop.last_metrics if evaluated else loop.epoch > 0
        if key in warned or not due:
            return
        warned.add(key)
        import warnings

        from epochal.errors import did_you_mean

        records = [*loop.log.current_row]
        records += [f"{s}.{m}" for s, metrics in loop.last_metrics.items() for m in metrics]
        warnings.warn(
            f"when = {self.text!r}: {key!r} is not in the log{did_you_mean(key, records)}; the "
            "condition stays false until it is",
            UserWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        return f"LogCondition({self.text!r})"


def parse_condition(spec: str, where: str = "when") -> Condition:
    """A ``when`` value: ``"module:callable"`` (called with the loop) or a :class:`LogCondition`."""
    if re.fullmatch(r"\s*[A-Za-z_][\w.]*:[A-Za-z_][\w.]*\s*", spec):
        from epochal.imports import resolve

        return resolve(spec.strip(), where)
    return LogCondition(spec)


@dataclass
class Triggers:
    """The trigger keys of one plugin's table, and the gate they put on each hook."""

    every_n_batches: int = 0
    after_n_batches: int = 0
    every_n_epochs: int = 0
    after_n_epochs: int = 0
    before_first_epoch: bool = True
    on_resumption: bool = True
    after_training: bool = True
    when: Condition | None = None

    def gate(self, hook: str) -> Condition | bool:
        """``True``: *hook* always runs; ``False``: never; else a condition called with the loop.

        ``before_batch``, ``before_optimizer_step`` and ``before_epoch`` count the batch/epoch
        about to run or running (so ``every_n_batches = 10`` lets ``before_batch``,
        ``before_optimizer_step`` and ``after_batch`` of batches 10, 20, … run); ``after_batch``
        and ``after_epoch`` the ones just completed.
        """
        for key, switched in SWITCHED_HOOKS.items():
            if hook == switched:
                return bool(getattr(self, key))
        if hook in BATCH_HOOKS:
            every, after, counter = self.every_n_batches, self.after_n_batches, "iteration"
        elif hook in EPOCH_HOOKS:
            every, after, counter = self.every_n_epochs, self.after_n_epochs, "epoch"
        else:
            return True
        ahead = 1 if hook.startswith("before_") else 0
        tests: list[Condition] = []
        if every:
            tests.append(lambda loop: (getattr(loop, counter) + ahead) % every == 0)
        if after:
            tests.append(lambda loop: getattr(loop, counter) + ahead >= after)
        if self.when is not None:
            tests.append(self.when)
        if not tests:
            return True
        if len(tests) == 1:
            return tests[0]
        return lambda loop: all(test(loop) for test in tests)


def parse_triggers(
    table: Mapping[str, Any], where: str, error: type[Exception] = ValueError
) -> Triggers | None:
    """The :class:`Triggers` of a ``[plugins.NAME]`` table (None when it has no trigger key).

    :raises error: naming *where* and the key, for a value of the wrong type, a condition that
        does not parse or a predicate that does not import.
    """
    keys = [key for key in table if key in TRIGGER_KEYS]
    if not keys:
        return None
    triggers = Triggers()
    for key in keys:
        value = table[key]
        if key == "when":
            if not isinstance(value, str):
                raise error(f"{where} when: must be {TRIGGER_KEYS[key]}, not {value!r}")
            try:
                triggers.when = parse_condition(value, f"{where} when")
            except ValueError as problem:
                raise error(f"{where} when: {problem}") from None
            except Exception as problem:  # the predicate does not import
                raise error(str(problem)) from None
            continue
        expected_bool = key in SWITCHED_HOOKS
        ok = (
            isinstance(value, bool)
            if expected_bool
            else isinstance(value, int) and not isinstance(value, bool) and value >= 0
        )
        if not ok:
            raise error(f"{where} {key}: must be {TRIGGER_KEYS[key]}, not {value!r}")
        setattr(triggers, key, value)
    return triggers


def check_condition_streams(triggers: Mapping[str, Triggers], streams: list[str], source: str | None) -> None:
    """A ``when`` condition naming ``STREAM.key`` must name a stream of the run (*streams*).

    :raises ConfigError: naming the plugin's table and the key, with the run's streams.
    """
    from epochal.errors import ConfigError, did_you_mean

    evaluated = [stream for stream in streams if stream != "train"]
    for name, plugin_triggers in triggers.items():
        condition = plugin_triggers.when
        if not isinstance(condition, LogCondition) or "/" in name:
            continue
        for key in condition.names:
            stream, dot, _ = key.partition(".")
            if key in COUNTER_NAMES or not dot or stream in streams:
                continue
            where = f"{source}: " if source else ""
            raise ConfigError(
                f"{where}[plugins.{name}] when: {key!r} names no logged key: there is no stream "
                f"{stream!r}{did_you_mean(stream, evaluated)} (keys are KEY for a training "
                f"output, STREAM.KEY for an evaluation; streams: {', '.join(streams)})"
            )
