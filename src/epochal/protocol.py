"""The plugin protocol in code: every attribute the core reads from a plugin, with its meaning.

A plugin is any object (an instance, a class, a module) with ``@epochal.hookimpl`` functions.
Besides its hooks it may *declare* how the core treats it, with class (or module) attributes;
:class:`Declarations` lists every one the core reads, with its type and default, and
:func:`declared` is the one place that reads them. The standard plugins annotate theirs with
these types (``phase: ClassVar[Phase] = "decide"``), so mypy checks them; a third-party plugin may
do the same. A plugin that keeps state across a resume follows :class:`Stateful`. The option
types with constraints (``PositiveInt``, ...) are here for plugins to annotate their options
with: the one validator checks them and ``epochal schema`` shows them; :func:`checked_options`
makes a plugin's constructor check them when it is called from Python, with the messages a run
configuration gets.

Phases order the plugins without naming each other: within a hook, every plugin of an earlier
phase runs before every plugin of a later one. ``measure`` writes the records of a batch or an
epoch (``monitor``); ``adjust`` changes the training from them (``lr_scheduler``); ``decide``
stops it (``early_stopping``, ``finish_after``); ``save`` keeps the state (``checkpoint``: after
every decision, so that a resumed run holds them); ``report`` sends the records out (progress,
printing, the SQLite log, TensorBoard, MLflow). A plugin without a phase keeps its place in the
run's order; ``run_before``/``run_after`` remain for the rare constraint a phase cannot say.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol, TypedDict, get_args, runtime_checkable

from annotated_types import Ge, Gt, Le, Lt

from epochal._options import (
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seed,
    checked_options,
)

__all__ = [
    "DEFAULTS",
    "PHASES",
    "Declarations",
    "FailurePolicy",
    "Ge",
    "Gt",
    "Le",
    "Lt",
    "NonEmptyStr",
    "NonNegativeFloat",
    "NonNegativeInt",
    "Phase",
    "PositiveFloat",
    "PositiveInt",
    "Rank",
    "Seed",
    "Stateful",
    "checked_options",
    "declared",
]

#: where a plugin runs on several processes.
Rank = Literal["all", "zero"]
#: the stage of an epoch's work a plugin belongs to (see the module's documentation).
Phase = Literal["measure", "adjust", "decide", "save", "report"]
#: what an exception in a plugin's hook does.
FailurePolicy = Literal["fatal", "isolate"]
#: the phases in call order.
PHASES: tuple[str, ...] = get_args(Phase)


class Declarations(TypedDict, total=False):
    """Every attribute the core reads from a plugin (class or module attributes), all optional."""

    #: ``"all"`` (default): every rank runs it; ``"zero"``: rank 0 only (not even registered on
    #: the others). Anything that writes, prints or talks to a service once per run is ``"zero"``.
    rank: Rank
    #: the plugin's stage in every hook's call order (None, the default: no phase). Like ``rank``,
    #: read from the class (or module): an instance attribute of that name means nothing.
    phase: Phase | None
    #: plugins this one must run before / after in every hook (names; unknown names are ignored).
    run_before: Iterable[str]
    run_after: Iterable[str]
    #: plugins that must be part of the run with this one / must not be.
    requires: Iterable[str]
    conflicts: Iterable[str]
    #: the standard plugins it replaces (``"checkpoint"``): when both are installed, it runs
    #: instead of the plugin of that name, unless the run names that one; the CLI's advice and
    #: ``--profile`` name it where they would name the standard plugin.
    provides: str | Iterable[str]
    #: the options that say where it writes (a directory, a file, a URL): ``("dir",)``; ``()``
    #: when it writes nowhere but under ``loop.run_dir`` (or nowhere). ``epochal check-resume``
    #: moves them into its temporary directories, and refuses a plugin that saves checkpoints
    #: (``resume_state``, ``latest_checkpoint``, ``check_fresh_run``) without the declaration.
    writes_to: Iterable[str] | None
    #: ``"fatal"`` (default): an exception in its hooks ends the run; ``"isolate"``: it is
    #: reported once and the plugin is left out of the rest of the run.
    on_failure: FailurePolicy
    #: False: the plugin loads only when the run names it (a table, ``order``, ``--plugins``).
    #: Plugins that change what is trained, or send data elsewhere, say False.
    autoload: bool
    #: hooks its options make no-ops: the loop leaves them out of its compiled callers.
    idle_hooks: Iterable[str]
    #: False: its state differs between two identical runs (wall-clock times):
    #: ``epochal check-resume`` leaves it out.
    deterministic: bool
    #: the version of the state its ``state_dict`` returns (default 1); a checkpoint with
    #: another version goes through its ``migrate_state(state, version)`` first.
    state_version: int
    #: a module or class of ``@epochal.hookspec`` functions: hooks this plugin adds.
    epochal_hookspecs: Any
    #: ``refine_schema(table) -> table``: the JSON Schema of the plugin's table, made from its
    #: annotations, refined where they cannot say everything (a ``**options`` plugin whose keys
    #: depend on another option: ``lr_scheduler``'s scheduler arguments). ``epochal schema``
    #: calls it; a failure leaves the table as the annotations make it.
    refine_schema: Any


#: the value of a declaration a plugin does not make.
DEFAULTS: Declarations = {
    "rank": "all",
    "phase": None,
    "run_before": (),
    "run_after": (),
    "requires": (),
    "conflicts": (),
    "provides": (),
    "writes_to": None,
    "on_failure": "fatal",
    "autoload": True,
    "idle_hooks": frozenset(),
    "deterministic": True,
    "state_version": 1,
    "epochal_hookspecs": None,
    "refine_schema": None,
}


def declared(plugin: object, name: str, default: Any = None) -> Any:
    """The declaration *name* of *plugin* (a key of :class:`Declarations`), else its default.

    *default* replaces the protocol's default (a composite's child inherits its parent's).
    """
    fallback = DEFAULTS[name] if default is None else default  # type: ignore[literal-required]
    value = getattr(plugin, name, fallback)
    return fallback if value is None and name not in ("phase", "epochal_hookspecs") else value


@runtime_checkable
class Stateful(Protocol):
    """A plugin whose state is saved in checkpoints and restored on a resume.

    ``state_dict`` returns numpy arrays, numbers, strings, lists, dicts and None;
    ``load_state_dict`` gets it back. A fresh run does not call ``load_state_dict``: the plugin
    starts its state afresh in ``before_training`` unless ``loop.resumed``.
    """

    def state_dict(self) -> Mapping[str, Any]:
        """The plugin's state."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state returned by :meth:`state_dict`."""
