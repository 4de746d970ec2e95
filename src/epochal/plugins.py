"""Discovering, loading, ordering and registering plugins for one run.

Plugins are entry points of the ``epochal.plugins`` group. :func:`load_plugins` decides which
of them this run uses (the run's order, ``disable``, ``autoload``, the environment), imports
only those through stevedore, builds each from its ``[plugins.NAME]`` options, orders them
(:mod:`epochal.ordering`) and registers them with pluggy so that hooks run in that order.

Environment:

``EPOCHAL_DISABLE_PLUGIN_AUTOLOAD=1``
    load only plugins named explicitly (the run's order, ``--plugins``, ``EPOCHAL_PLUGINS``).
``EPOCHAL_PLUGINS=a,b``
    names plugins to load in addition to the run's order (after it, in this order).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pluggy

from epochal._dispatch import Hooks, implementations
from epochal._options import check_options, convert_options
from epochal._registry import AddedSpecs, added_hookspecs, hook_names, new_plugin_manager, register, validate
from epochal.composite import CompositePlugin
from epochal.errors import PluginError, did_you_mean
from epochal.ordering import call_order
from epochal.protocol import PHASES, declared
from epochal.triggers import TRIGGER_KEYS, Triggers, parse_triggers

GROUP = "epochal.plugins"
ENV_NO_AUTOLOAD = "EPOCHAL_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "EPOCHAL_PLUGINS"


class PluginLoadWarning(UserWarning):
    """An autoloaded plugin failed to import or to start; the run goes on without it."""


class PluginIsolatedWarning(RuntimeWarning):
    """A plugin with ``on_failure = "isolate"`` raised; the run goes on without it."""


@dataclass
class PluginInfo:
    """What ``epochal plugins`` reports about one plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    status: str = "available"  # loaded | disabled | failed | available
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    position: int | None = None
    parent: str | None = None
    #: every distribution offering this name when there are several (``distribution version (ep)``).
    offered_by: list[str] = field(default_factory=list)
    #: where it runs on several processes: ``all`` ranks or rank ``zero`` only (None: not loaded).
    rank: str | None = None
    #: False: it loads only when a run names it (its class attribute ``autoload``); None: not
    #: imported (disabled, failed, or not selected with autoloading off).
    autoload: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The info as a JSON-able dict."""
        return dict(vars(self))


@dataclass
class EntryPoint:
    """An installed entry point of the ``epochal.plugins`` group and its distribution."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    #: other distributions' entry points of the same name (a conflict unless the run chooses).
    rivals: list[EntryPoint] = field(default_factory=list)
    #: the importlib entry point, to load exactly this one when the name has rivals.
    source: Any = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        """``distribution version (name = value)``."""
        return f"{self.distribution} {self.version or ''}".rstrip() + f" ({self.name} = {self.value})"


def installed() -> dict[str, EntryPoint]:
    """Every installed plugin entry point by name, without importing any plugin.

    When two distributions provide the same name, the first found is returned with the others
    in its ``rivals``: a run must choose one (``[plugins.NAME] distribution = "..."``, see
    :func:`choose`).
    """
    found: dict[str, EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        entry = EntryPoint(
            ep.name,
            ep.value,
            dist.metadata["Name"] if dist is not None else None,
            dist.version if dist is not None else None,
            source=ep,
        )
        first = found.get(ep.name)
        if first is None:
            found[ep.name] = entry
        elif (first.value, first.distribution) != (entry.value, entry.distribution) and all(
            (r.value, r.distribution) != (entry.value, entry.distribution) for r in first.rivals
        ):
            first.rivals.append(entry)
    return found


def _normal(distribution: str | None) -> str:
    return re.sub(r"[-_.]+", "-", distribution or "").lower()


def choose(ep: EntryPoint, wanted: Any) -> EntryPoint:
    """The entry point of plugin *ep.name* that a run may use.

    :param wanted: the ``[plugins.NAME] distribution`` option (None: not given).
    :raises PluginError: when *wanted* names no distribution offering the name, or when several
        distributions offer it and *wanted* is not given (naming each of them).
    """
    offers = [ep, *ep.rivals]
    if wanted is not None:
        picked = [o for o in offers if _normal(o.distribution) == _normal(str(wanted))]
        if not picked:
            raise PluginError(
                f"[plugins.{ep.name}] distribution = {wanted!r}: plugin {ep.name!r} is offered by "
                f"{'; '.join(o.describe() for o in offers)}, not by {wanted!r}"
            )
        return replace(picked[0], rivals=[])
    if ep.rivals:
        raise PluginError(
            f"plugin name {ep.name!r} is offered by {len(offers)} distributions: "
            f"{'; '.join(o.describe() for o in offers)}; name the one this run uses with "
            f'[plugins.{ep.name}] distribution = "{ep.distribution}" (or uninstall the other)'
        )
    return ep


def env_list(name: str) -> list[str]:
    """A comma-separated list from environment variable *name* (empty when unset)."""
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def autoload_disabled() -> bool:
    """Whether ``EPOCHAL_DISABLE_PLUGIN_AUTOLOAD`` is set to a true value."""
    return os.environ.get(ENV_NO_AUTOLOAD, "").strip().lower() not in ("", "0", "false", "no")


@dataclass
class _Unit:
    """A top-level plugin (or composite) to order, with its children expanded."""

    name: str
    plugin: object
    members: list[tuple[str, object]]


FAILURE_POLICIES = ("fatal", "isolate")
#: where a plugin runs on several processes (its class attribute ``rank``).
RANKS = ("all", "zero")


def plugin_rank(name: str, plugin: object, parent: object = None) -> str:
    """Where *plugin* runs on several processes: ``all`` ranks (default) or rank ``zero`` only.

    It is read from the plugin's class (or module), so an instance attribute that happens to be
    called ``rank`` means nothing here. A composite's children run where the composite does
    unless they say otherwise.
    """
    rank = _declared_rank(plugin)
    if rank is None:
        rank = _declared_rank(parent) if parent is not None else None
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


def failure_policy(name: str, plugin: object, options: Mapping[str, Any]) -> str:
    """A plugin's ``on_failure`` policy: its ``[plugins.NAME]`` option, else its class's, else fatal."""
    policy = options.get("on_failure", declared(plugin, "on_failure"))
    if policy not in FAILURE_POLICIES:
        raise PluginError(
            f"[plugins.{name}]: on_failure must be one of {', '.join(FAILURE_POLICIES)}, not {policy!r}"
        )
    return str(policy)


class PluginSet:
    """The plugins of one run, registered in call order, and their hook callers."""

    def __init__(
        self,
        pm: pluggy.PluginManager,
        plugins: dict[str, object],
        infos: list[PluginInfo],
        policies: Mapping[str, str] | None = None,
        triggers: Mapping[str, Triggers] | None = None,
    ):
        self.pm = pm
        #: name → plugin instance, in call order (composite children as ``parent/child``).
        self.plugins = plugins
        #: every discovered plugin, loaded or not, for listings.
        self.infos = infos
        #: name → ``fatal`` or ``isolate``: what an exception raised by the plugin's hooks does.
        self.policies = dict(policies or {})
        #: plugins isolated during the run: name → "hook: error".
        self.isolated: dict[str, str] = {}
        #: name → the trigger keys of its table (plugins without any are absent: no cost).
        self.triggers: dict[str, Triggers] = dict(triggers or {})
        #: compiled callers of every hook (None where nothing implements a hook).
        self.hooks = Hooks(pm, self._on_failure, self._gate, self._idle)
        self.units: list[_Unit] = []
        #: plugins of the run that run on rank 0 only, left out on this process (another rank).
        self.elsewhere: set[str] = set()

    def check_dependencies(self) -> None:
        """Raise :class:`PluginError` if a plugin's ``requires`` or ``conflicts`` is not met."""
        check_dependencies(self.units, self.elsewhere)

    def _on_failure(self, error: BaseException, plugin: str, hook: str) -> bool:
        """Isolate *plugin* if its policy says so (True: the run goes on without it)."""
        if self.policies.get(plugin, "fatal") != "isolate" or not isinstance(error, Exception):
            return False
        self.isolated[plugin] = f"{hook}: {type(error).__name__}: {error}"
        warnings.warn(
            f"plugin {plugin!r} raised in hook {hook!r}: {type(error).__name__}: {error}; "
            "on_failure = isolate: it is unregistered and the run goes on without it",
            PluginIsolatedWarning,
            stacklevel=2,
        )
        self.unregister(plugin)
        return True

    @property
    def hook(self) -> Any:
        """pluggy's hook callers: ``loop.plugin_set.hook.NAME(**kwargs)`` calls a hook that a
        plugin added (``epochal_hookspecs``) and returns the list of non-None results."""
        return self.pm.hook

    def _gate(self, plugin: str, hook: str) -> Any:
        """The trigger gate on *plugin*'s *hook*: True (none), False (never) or a condition."""
        triggers = self.triggers.get(plugin)
        return True if triggers is None else triggers.gate(hook)

    def _idle(self, plugin: str, hook: str) -> bool:
        """Whether *plugin* declares *hook* a no-op for this run (its ``idle_hooks``)."""
        declared = idle_hooks(plugin, self.plugins.get(plugin))
        unknown = sorted(name for name in declared if not hasattr(self.pm.hook, name))
        if unknown:
            raise PluginError(
                f"plugin {plugin!r} declares idle_hooks {unknown} that are not hooks"
                f"{did_you_mean(unknown[0], [h for h in vars(self.pm.hook) if not h.startswith('_')])}"
            )
        return hook in declared

    def call_order(self, hook: str) -> list[str]:
        """The names of the plugins implementing *hook*, in the order they are called."""
        return [impl.plugin_name for impl in implementations(self.pm, hook)]

    def implements(self, hook: str) -> bool:
        """Whether any plugin of the run implements *hook*."""
        return getattr(self.hooks, hook) is not None

    def unregister(self, name: str) -> None:
        """Remove a plugin from the run (its hooks are no longer called)."""
        plugin = self.plugins.pop(name, None)
        if plugin is not None and self.pm.is_registered(plugin):
            self.pm.unregister(plugin)
            self.hooks.rebuild()


def load_plugins(
    order: Sequence[str] = (),
    disable: Iterable[str] = (),
    autoload: bool = True,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    extra: Mapping[str, object] | None = None,
) -> PluginSet:
    """Build the plugin set of a run.

    :param order: plugin names in the order their hooks must run; other plugins follow.
    :param disable: plugin names (or ``parent/child`` names) to leave out of this run.
    :param autoload: also load every other installed plugin, after *order*, sorted by name,
        except those whose class says ``autoload = False`` (plugins that change what is
        trained or send data elsewhere): they load only when named, in *order*,
        ``EPOCHAL_PLUGINS`` or *options*.
    :param options: ``name → keyword arguments`` for each plugin's factory.
    :param extra: plugin objects given directly (not installed), by name; they are ordered with
        the installed ones (listed in *order* or appended after it).
    :raises PluginError: for an unknown name, a plugin named explicitly that fails to load,
        bad options, an ordering cycle or a failed registration.
    """
    options = dict(options or {})
    extra = dict(extra or {})
    disabled = set(disable)
    explicit = list(dict.fromkeys([*order, *env_list(ENV_PLUGINS)]))
    autoload = autoload and not autoload_disabled()
    available = installed()
    known = set(available) | set(extra)
    conflicts: dict[str, str] = {}  # names offered by several distributions, none chosen
    exact: set[str] = set()  # names chosen among several: loaded by their own entry point
    offered: dict[str, list[str]] = {}
    for name, ep in list(available.items()):
        if ep.rivals:
            offered[name] = [o.describe() for o in (ep, *ep.rivals)]
        wanted = options.get(name, {}).get("distribution")
        try:
            available[name] = choose(ep, wanted)
        except PluginError as error:
            if name not in disabled and (wanted is not None or name in explicit):
                raise
            conflicts[name] = str(error)
            continue
        if ep.rivals:
            exact.add(name)

    def unknown(name: str, what: str) -> PluginError:
        choices = sorted(known)
        return PluginError(
            f"unknown plugin {name!r} in {what}{did_you_mean(name, choices)}; "
            f"installed: {', '.join(choices) or 'none'}"
        )

    for name in explicit:
        if name not in known:
            raise unknown(name, "the plugin order")
    for name in disabled:
        if name.split("/")[0] not in known:
            raise unknown(name, "disable")
    for name in options:
        if name.split("/")[0] not in known:
            raise unknown(name, "[plugins.NAME] options")

    selected = [n for n in explicit if n not in disabled]
    if autoload:
        selected += sorted(n for n in known if n not in disabled and n not in selected and n not in conflicts)
    else:
        selected += [n for n in extra if n not in disabled and n not in selected]
    explicit_set = set(explicit)

    infos: dict[str, PluginInfo] = {}
    for name, ep in available.items():
        infos[name] = PluginInfo(
            name, ep.distribution, ep.version, ep.value, offered_by=offered.get(name, [])
        )
        if name in disabled:
            infos[name].status = "disabled"
        elif name in conflicts:  # never imported: either could be an impostor
            infos[name].distribution = None
            _fail(infos[name], conflicts[name])
            infos[name].status = "conflict"
    for name in extra:
        infos.setdefault(name, PluginInfo(name, entry_point=None))

    objects = _import([n for n in selected if n not in extra], available, explicit_set, infos, exact)
    objects.update((n, extra[n]) for n in selected if n in extra)

    units: list[_Unit] = []
    policies: dict[str, str] = {}
    triggers: dict[str, Triggers] = {}
    added = added_hookspecs({n: objects[n] for n in selected if n in objects})
    for name in selected:
        if name not in objects:
            continue  # failed to import, reported already
        named = name in explicit_set or name in options
        infos[name].autoload = declared(objects[name], "autoload") is not False
        if not named and not infos[name].autoload:
            infos[name].status = "available"  # it asks to be loaded only when named (bundles)
            infos[name].rank = _declared_rank(objects[name])
            continue
        table = options.get(name, {})
        own = own_options(objects[name])  # a plugin's own option of a trigger key's name wins
        shared = {k: v for k, v in table.items() if k in TRIGGER_KEYS and k not in own}
        plugin_options = {
            k: v for k, v in table.items() if k not in ("on_failure", "distribution") and k not in shared
        }
        try:
            plugin_triggers = parse_triggers(shared, f"[plugins.{name}]", PluginError)
            if plugin_triggers is not None:
                triggers[name] = plugin_triggers
            plugin = build(name, objects[name], plugin_options)
            policies[name] = failure_policy(name, plugin, options.get(name, {}))
            unit = _unit(name, plugin, infos, disabled)
            for member, member_plugin in unit.members:
                validate(member, member_plugin, added)
        except PluginError as error:
            if named:
                raise
            _fail(infos[name], str(error))
            continue
        except Exception as error:  # the plugin's own constructor failed
            message = f"plugin {name!r} failed to start: {type(error).__name__}: {error}"
            if named:
                raise PluginError(message) from error
            _fail(infos[name], message)
            continue
        units.append(unit)

    for name in disabled:
        if "/" in name and name not in infos:
            parent = name.split("/")[0]
            children = [i.name for i in infos.values() if i.parent == parent]
            raise PluginError(
                f"unknown plugin {name!r} in disable{did_you_mean(name, children)}; "
                f"children of {parent!r}: {', '.join(children) or 'none'}"
            )

    ordered = _order(units, [n for n in explicit if n in objects and n not in disabled])
    return _assemble(ordered, infos, policies, triggers, added)


def compose(plugins: Mapping[str, object], disable: Iterable[str] = ()) -> PluginSet:
    """Build a plugin set from plugin objects given by name (the Python API, no discovery).

    The mapping's order is the run's order; ``run_before``/``run_after`` are honoured and
    composite plugins expand into their children.
    """
    disabled = set(disable)
    infos = {name: PluginInfo(name) for name in plugins}
    units = [_unit(name, plugin, infos, disabled) for name, plugin in plugins.items() if name not in disabled]
    policies = {unit.name: failure_policy(unit.name, unit.plugin, {}) for unit in units}
    members = {name: p for unit in units for name, p in [(unit.name, unit.plugin), *unit.members]}
    added = added_hookspecs(members)
    return _assemble(_order(units, list(plugins)), infos, policies, added=added)


def _unit(name: str, plugin: object, infos: dict[str, PluginInfo], disabled: set[str]) -> _Unit:
    """The unit ordering sees for *plugin*: itself, or its children if it is a composite."""
    members: list[tuple[str, object]] = []
    if not isinstance(plugin, CompositePlugin) or hook_names(plugin):
        members.append((name, plugin))
    if isinstance(plugin, CompositePlugin):
        for child, child_plugin in plugin.plugins.items():
            full = f"{name}/{child}"
            info = infos[name]
            infos[full] = PluginInfo(full, info.distribution, info.version, parent=name)
            if full in disabled:
                infos[full].status = "disabled"
            else:
                members.append((full, child_plugin))
    return _Unit(name, plugin, members)


def _assemble(
    units: list[_Unit],
    infos: dict[str, PluginInfo],
    policies: Mapping[str, str],
    triggers: Mapping[str, Triggers] | None = None,
    added: AddedSpecs | None = None,
) -> PluginSet:
    """Register the ordered units with a new pluggy manager (knowing the *added* hooks)."""
    triggers = dict(triggers or {})
    for unit in units:  # a composite's children share its triggers
        if unit.name in triggers:
            for member, _ in unit.members:
                triggers.setdefault(member, triggers[unit.name])
    pm = new_plugin_manager(added)
    plugins: dict[str, object] = {}
    member_policies: dict[str, str] = {}
    here = _this_rank()
    elsewhere: set[str] = set()
    for unit in units:
        kept = []
        for member, member_plugin in unit.members:
            where = plugin_rank(member, member_plugin, unit.plugin if member != unit.name else None)
            infos[member].rank = where
            if where == "zero" and here != 0:
                elsewhere.add(member)
            else:
                kept.append((member, member_plugin))
        if elsewhere.issuperset(m for m, _ in unit.members):
            elsewhere.add(unit.name)
        plugins.update(kept)
        for member, member_plugin in kept:
            # a composite's children follow the composite's policy unless they declare their own
            member_policies[member] = declared(member_plugin, "on_failure", policies.get(unit.name, "fatal"))
        if unit.name in policies:
            member_policies[unit.name] = policies[unit.name]
    for name, plugin in reversed(plugins.items()):  # pluggy calls the last registered first
        register(pm, name, plugin, added)
    for position, name in enumerate(plugins):
        info = infos[name]
        info.status, info.position = "loaded", position
        info.hooks = sorted(hook_names(plugins[name]))
    for name in elsewhere & set(infos):
        infos[name].status = "rank 0 only"
    listing = sorted(infos.values(), key=lambda i: (i.position is None, i.position or 0, i.name))
    plugin_set = PluginSet(pm, plugins, listing, member_policies, triggers)
    plugin_set.units = [
        _Unit(u.name, u.plugin, [(m, p) for m, p in u.members if m not in elsewhere])
        for u in units
        if u.name not in elsewhere
    ]
    plugin_set.elsewhere = elsewhere
    return plugin_set


def _declared_rank(plugin: object) -> Any:
    """The ``rank`` attribute of *plugin*'s class, or of the module/class that is the plugin."""
    owner = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
    return getattr(owner, "rank", None)  # declared by the class: not protocol.declared's default


def _this_rank() -> int:
    """This process's rank among the run's processes (0 alone)."""
    from epochal.distributed.world import current_world

    return current_world().rank


def check_dependencies(units: Sequence[_Unit], elsewhere: Iterable[str] = ()) -> None:
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
            for needed in declared(plugin, "requires"):
                if needed not in loaded:
                    problems.append(
                        f"plugin {name!r} requires plugin {needed!r}, which is not loaded in this run: "
                        f"add {needed!r} to [plugins] order (and install it), or disable {name!r}"
                    )
            for other in declared(plugin, "conflicts"):
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


def build(name: str, obj: object, options: Mapping[str, Any]) -> object:
    """Turn an entry point's object into a plugin instance using its options.

    A class or factory function is called with the options as keyword arguments; a module (or
    any other object) is the plugin itself and takes no options.
    """
    if inspect.isclass(obj) or inspect.isfunction(obj):
        options = convert_options(obj, options, f"[plugins.{name}]")
        check_options(name, obj, options, shared=list(TRIGGER_KEYS))
        return obj(**options)
    if options:
        raise PluginError(
            f"[plugins.{name}]: plugin {name!r} is a module and takes no options (got {', '.join(options)})"
        )
    return obj


def _fail(info: PluginInfo, message: str) -> None:
    info.status, info.error = "failed", message
    warnings.warn(message + "; the run goes on without it", PluginLoadWarning, stacklevel=3)


def _import(
    names: list[str],
    available: Mapping[str, EntryPoint],
    explicit: set[str],
    infos: dict[str, PluginInfo],
    exact: Iterable[str] = (),
) -> dict[str, object]:
    """Import the entry points *names* through stevedore, isolating failures.

    A name in *exact* (chosen among several distributions) is loaded from its own entry point
    only: stevedore would import every entry point of that name, the rival's too.
    """
    if not names:
        return {}
    from stevedore import NamedExtensionManager  # imported only when a plugin is loaded

    exact = set(exact)
    failures: dict[str, BaseException] = {}
    chosen: dict[str, object] = {}
    for name in [n for n in names if n in exact]:
        try:
            chosen[name] = available[name].source.load()
        except Exception as problem:
            failures[name] = problem
    names = [n for n in names if n not in exact] + [n for n in names if n in exact]

    def on_failure(_manager: object, entry_point: Any, error: BaseException) -> None:
        failures[entry_point.name] = error

    manager: NamedExtensionManager[Any] = NamedExtensionManager(
        GROUP,
        names=[n for n in names if n not in exact],
        name_order=True,
        invoke_on_load=False,
        on_load_failure_callback=on_failure,
        on_missing_entrypoints_callback=lambda missing: None,
    )
    loaded: dict[str, object] = {ext.name: ext.plugin for ext in manager.extensions if ext.name not in exact}
    loaded.update(chosen)
    for name in names:
        if name in loaded:
            continue
        ep = available[name]
        error = failures.get(name)
        detail = f"{type(error).__name__}: {error}" if error else "not found by stevedore"
        message = (
            f"plugin {name!r} (entry point {name} = {ep.value!r} of distribution "
            f"{ep.distribution}) failed to load: {detail}"
        )
        if name in explicit:
            raise PluginError(message)
        _fail(infos[name], message)
    return loaded


def _order(units: list[_Unit], explicit: list[str]) -> list[_Unit]:
    """Sort the units by the run's order and the plugins' declared constraints."""
    owner: dict[str, str] = {}
    for unit in units:
        owner[unit.name] = unit.name
        for member, _ in unit.members:
            owner[member] = unit.name
    before: dict[str, list[str]] = {}
    after: dict[str, list[str]] = {}
    phases: dict[str, str] = {}
    for unit in units:
        phase = plugin_phase(unit.name, unit.plugin)
        if phase is not None:
            phases[unit.name] = phase
        for plugin in [unit.plugin, *(p for _, p in unit.members)]:
            for target in declared(plugin, "run_before"):
                if target in owner and owner[target] != unit.name:
                    before.setdefault(unit.name, []).append(owner[target])
            for target in declared(plugin, "run_after"):
                if target in owner and owner[target] != unit.name:
                    after.setdefault(unit.name, []).append(owner[target])
    by_name = {unit.name: unit for unit in units}
    names = call_order([u.name for u in units], explicit, before, after, phases)
    return [by_name[name] for name in names]


#: entry points naming the command objects ``register_commands`` adds, by command name.
COMMANDS_GROUP = "epochal.commands"


def declared_command(name: str) -> Any | None:
    """The click command *name* as a plugin distribution declares it in the entry-point group
    ``epochal.commands`` (``log = "mydist.commands:log_group"``), importing only that
    module; None when no distribution or several declare it, when autoloading is off (then
    only the plugins in ``EPOCHAL_PLUGINS`` may add commands), or when it cannot be loaded (the
    caller then asks every plugin's ``register_commands``, which reports why)."""
    if autoload_disabled():
        return None
    found = [ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP) if ep.name == name]
    if len({ep.value for ep in found}) != 1:
        return None
    try:
        command = found[0].load()
    except Exception:  # reported by the full path
        return None
    import click

    return command if isinstance(command, click.Command) and command.name == name else None


def register_commands(cli: Any) -> None:
    """Let installed plugins add subcommands to the ``epochal`` click group *cli*.

    Every installed plugin is asked (only those in ``EPOCHAL_PLUGINS`` when autoload is
    disabled). A plugin that fails to import or whose hook raises is reported as a warning and
    the other plugins' commands are still added.
    """
    from epochal._dispatch import each_implementation

    available = installed()
    names = env_list(ENV_PLUGINS) if autoload_disabled() else sorted(available)
    names = [name for name in names if name in available and not available[name].rivals]
    infos = {name: PluginInfo(name, available[name].distribution) for name in names}
    imported = _import(names, available, set(), infos)
    try:
        added = added_hookspecs(imported)
    except PluginError as error:
        warnings.warn(str(error), PluginLoadWarning, stacklevel=2)
        added = {}
    pm = new_plugin_manager(added)
    for name, obj in imported.items():
        if "register_commands" not in hook_names(obj):
            continue
        try:
            impl = inspect.getattr_static(obj, "register_commands")
            if inspect.isclass(obj) and not isinstance(impl, (staticmethod, classmethod)):
                obj = obj()  # an instance method: the class must build with its defaults
            register(pm, name, obj, added)
        except Exception as error:
            _fail(infos[name], f"plugin {name!r} cannot add commands: {error}")
    for name, call in each_implementation(pm, "register_commands", cli=cli):
        try:
            call()
        except Exception as error:
            _fail(infos[name], f"plugin {name!r} raised in register_commands: {error!r}")
