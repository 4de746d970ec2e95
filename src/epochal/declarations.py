"""What a plugin declares about itself, read and checked: where it runs, its phase, whether it
autoloads, its idle hooks, its failure policy, the plugins it requires, conflicts with or
provides, where it writes, and its options.

:func:`read` reads them all once into one typed record, :class:`Declared`, that the loader, the
ordering, the checks, the listing and the loop read; each field's reader below names the plugin
and the bad value in one :class:`~epochal.errors.PluginError`. :mod:`epochal.protocol`
documents every declaration.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epochal.errors import PluginError
from epochal.protocol import PHASES, declared

FAILURE_POLICIES = ("fatal", "isolate")


@dataclass(frozen=True)
class Declared:
    """Everything one plugin object declares, read and checked once (:func:`read`)."""

    name: str
    #: ``"all"``, ``"zero"``, or None: not declared (a composite's child then runs where its
    #: parent does; a plugin alone, on every rank).
    rank: str | None
    phase: str | None
    autoload: bool
    #: its own name and the names it declares it stands in for.
    provides: tuple[str, ...]
    #: the options naming where it writes (None: not declared).
    writes_to: tuple[str, ...] | None
    run_before: tuple[str, ...]
    run_after: tuple[str, ...]
    requires: tuple[str, ...]
    conflicts: tuple[str, ...]
    #: its ``on_failure`` (None: not declared: its parent's, else ``fatal``).
    on_failure: str | None
    deterministic: bool
    #: the keyword arguments its class or factory takes.
    options: frozenset[str]


def read(name: str, plugin: object) -> Declared:
    """Every declaration of *plugin* (a class, a module or an instance), checked.

    :raises PluginError: for the first that is not valid, naming the plugin and the value.
    """
    rank = declared_rank(plugin)
    if rank is not None and rank not in RANKS:
        plugin_rank(name, plugin)  # raises, naming the value
    policy = getattr(plugin, "on_failure", None)
    if policy is not None and policy not in FAILURE_POLICIES:
        failure_policy(name, plugin, {})  # raises, naming the value
    return Declared(
        name=name,
        rank=rank,
        phase=plugin_phase(name, plugin),
        autoload=plugin_autoload(name, plugin),
        provides=provided(name, plugin),
        writes_to=writes_to(name, plugin),
        run_before=plugin_names(name, plugin, "run_before"),
        run_after=plugin_names(name, plugin, "run_after"),
        requires=plugin_names(name, plugin, "requires"),
        conflicts=plugin_names(name, plugin, "conflicts"),
        on_failure=policy,
        deterministic=declared(plugin, "deterministic") is not False,
        options=frozenset(_options_of(plugin)),
    )


def _options_of(plugin: object) -> set[str]:
    """The options of the class or factory *plugin* is, or is an instance of (none: a module)."""
    if inspect.ismodule(plugin):
        return set()
    return own_options(plugin if inspect.isclass(plugin) or inspect.isfunction(plugin) else type(plugin))


#: where a plugin runs on several processes (its class attribute ``rank``).
RANKS = ("all", "zero")


def plugin_rank(name: str, plugin: object, parent: object = None) -> str:
    """Where *plugin* runs on several processes: ``all`` ranks (default) or rank ``zero`` only.

    It is read from the plugin's class (or module), so an instance attribute that happens to be
    called ``rank`` means nothing here. A composite's children run where the composite does
    unless they say otherwise.
    """
    rank = declared_rank(plugin)
    if rank is None:
        rank = declared_rank(parent) if parent is not None else None
    rank = "all" if rank is None else rank
    if rank not in RANKS:
        raise PluginError(
            f"plugin {name!r} declares rank = {rank!r}; a plugin runs on 'all' ranks or on rank 'zero' only"
        )
    return str(rank)


def plugin_phase(name: str, plugin: object) -> str | None:
    """*plugin*'s declared phase (None: none), checked against :data:`epochal.protocol.PHASES`.

    Read from the plugin's class (or module), as ``rank`` is: an instance attribute that happens
    to be called ``phase`` means nothing here.
    """
    owner = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
    phase = declared(owner, "phase")
    if phase is not None and phase not in PHASES:
        raise PluginError(
            f"plugin {name!r} declares phase = {phase!r}; the phases, in call order: {', '.join(PHASES)}"
        )
    return None if phase is None else str(phase)


def idle_hooks(name: str, plugin: object) -> frozenset[str]:
    """The hooks *plugin* declares no-ops for this run: its ``idle_hooks`` attribute (a
    collection of hook names, read whenever the hook callers are built), empty by default.

    A plugin whose options make a per-batch hook do nothing (a checkpoint saved only at epoch
    ends has nothing to do after a batch) says so once, and the loop does not call it: a call
    that does nothing still costs ~0.1 µs per batch, and ~0.3 under ``timing``.
    """
    names = declared(plugin, "idle_hooks")
    try:
        hooks = frozenset(names) if not isinstance(names, (str, bytes)) else None
    except TypeError:
        hooks = None
    if hooks is None or not all(isinstance(hook, str) for hook in hooks):
        raise PluginError(f"plugin {name!r} declares idle_hooks = {names!r}; it must be a set of hook names")
    return hooks


def plugin_autoload(name: str, plugin: object) -> bool:
    """Whether *plugin* loads without being named (its ``autoload`` declaration, default True).

    :raises PluginError: a value other than True or False (``"false"`` would autoload a plugin
        that asked not to: installing it would change what a run trains).
    """
    autoload = declared(plugin, "autoload")
    if autoload is None:
        return True
    if not isinstance(autoload, bool):
        raise PluginError(
            f"plugin {name!r} declares autoload = {autoload!r}; it must be True (load it unless "
            "disabled) or False (only when a run names it)"
        )
    return autoload


#: the phases whose plugins change what is trained: they may not autoload (the autoload rule).
DECIDING_PHASES = ("adjust", "decide")


def autoload_rule(record: Declared) -> str | None:
    """What breaks the autoload rule in a plugin's declarations (None: nothing).

    A plugin that changes what is trained (its phase is ``adjust`` or ``decide``: it changes the
    learning rate, stops the run) declares ``autoload = False``: installed, it would otherwise
    run in every run of every configuration. What a declaration cannot show (a plugin without a
    phase that calls ``loop.request_stop``) :func:`epochal.testing.check_autoload_rule` finds
    by running it.
    """
    name, phase = record.name, record.phase
    if phase in DECIDING_PHASES and record.autoload:
        return (
            f"plugin {name!r} declares phase = {phase!r} (it changes what is trained) without "
            "autoload = False: the autoload rule says such a plugin runs only when a run names it "
            f"(declare autoload = False; name it in [plugins] order, --plugins or a [plugins.{name}] table)"
        )
    return None


def failure_policy(name: str, plugin: object, options: Mapping[str, Any], default: Any = None) -> str:
    """A plugin's ``on_failure`` policy: its ``[plugins.NAME]`` option, else its declaration
    (*default* when given: its record's), else fatal."""
    policy = options.get("on_failure", declared(plugin, "on_failure") if default is None else default)
    if policy not in FAILURE_POLICIES:
        raise PluginError(
            f"[plugins.{name}]: on_failure must be one of {', '.join(FAILURE_POLICIES)}, not {policy!r}"
        )
    return str(policy)


def declared_rank(plugin: object) -> Any:
    """The ``rank`` attribute of *plugin*'s class, or of the module/class that is the plugin."""
    owner = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
    return getattr(owner, "rank", None)  # declared by the class: not protocol.declared's default


def plugin_names(name: str, plugin: object, key: str) -> tuple[str, ...]:
    """The plugin names *plugin* declares as *key* (``run_before``, ``run_after``,
    ``requires``, ``conflicts``): a collection of names, empty by default.

    :raises PluginError: a bare string (``run_after = "monitor"`` would be read letter by
        letter) or anything else that is not a collection of names.
    """
    names = declared(plugin, key)
    try:
        found = tuple(names) if not isinstance(names, (str, bytes)) else None
    except TypeError:
        found = None
    if found is None or not all(isinstance(other, str) for other in found):
        hint = f" (write ({names!r},))" if isinstance(names, str) else ""
        raise PluginError(
            f"plugin {name!r} declares {key} = {names!r}; it must be a tuple of plugin names{hint}"
        )
    return found


def provided(name: str, plugin: object) -> tuple[str, ...]:
    """The plugins *plugin* stands in for: its own name and its ``provides`` declaration (a
    plugin name, or a tuple of them: ``provides = "checkpoint"`` for a checkpoint plugin of
    one's own). Read from its class (or module), as ``rank`` is.

    :raises PluginError: a value that is no plugin name nor a tuple of them.
    """
    owner = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
    names = getattr(owner, "provides", ())
    if isinstance(names, str):
        names = (names,)
    try:
        found = tuple(names)
    except TypeError:
        found = None
    if found is None or not all(isinstance(other, str) and other for other in found):
        raise PluginError(
            f"plugin {name!r} declares provides = {names!r}; it must be a plugin name or a tuple of them"
        )
    return tuple(dict.fromkeys((name, *found)))


def writes_to(name: str, plugin: object) -> tuple[str, ...] | None:
    """The options that say where *plugin* writes (its ``writes_to`` declaration: option names,
    ``()`` when it writes only under the run directory or nowhere), or None when it does not
    say. Read from its class (or module), as ``rank`` is.

    :raises PluginError: a value that is no tuple of option names.
    """
    owner = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
    names = getattr(owner, "writes_to", None)
    if names is None:
        return None
    try:
        found = tuple(names) if not isinstance(names, (str, bytes)) else None
    except TypeError:
        found = None
    if found is None or not all(isinstance(option, str) and option for option in found):
        hint = f" (write ({names!r},))" if isinstance(names, str) else ""
        raise PluginError(
            f"plugin {name!r} declares writes_to = {names!r}; it must be a tuple of its option names{hint}"
        )
    return found


@dataclass
class Unit:
    """A top-level plugin (or composite) to order, with its children expanded, and what each
    declares (read once: :func:`epochal.declarations.read`)."""

    name: str
    plugin: object
    members: list[tuple[str, object]]
    records: dict[str, Declared] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, plugin in [(self.name, self.plugin), *self.members]:
            if name not in self.records:
                self.records[name] = read(name, plugin)


def check_dependencies(units: Sequence[Unit], elsewhere: Iterable[str] = ()) -> None:
    """Raise :class:`PluginError` for a missing ``requires`` or a present ``conflicts``.

    A plugin declares ``requires = ("monitor",)`` and ``conflicts = ("other",)`` as class
    attributes; a name is satisfied by a loaded plugin of that name or a composite child
    ``parent/name``. Names in *elsewhere* (rank-0 plugins, on another rank) count as loaded.
    """
    loaded = {name for unit in units for name, _ in unit.members} | {unit.name for unit in units}
    loaded |= set(elsewhere)
    loaded |= {name.split("/", 1)[1] for name in loaded if "/" in name}
    problems = []
    for unit in units:
        for name, plugin in [(unit.name, unit.plugin), *unit.members]:
            record = unit.records.get(name) or read(name, plugin)
            for needed in record.requires:
                if needed not in loaded:
                    problems.append(
                        f"plugin {name!r} requires plugin {needed!r}, which is not loaded in this run: "
                        f"add {needed!r} to [plugins] order (and install it), or disable {name!r}"
                    )
            for other in record.conflicts:
                if other in loaded and other != name:
                    problems.append(
                        f"plugin {name!r} conflicts with plugin {other!r}: disable one of them "
                        f"([plugins] disable = [{other!r}])"
                    )
    if problems:
        raise PluginError("; ".join(dict.fromkeys(problems)))


def own_options(obj: object) -> set[str]:
    """The keyword arguments a plugin's class or factory takes (empty for a module)."""
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return set()
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
