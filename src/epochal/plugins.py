"""Loading, ordering and registering the plugins of one run.

:func:`load_plugins` decides which installed plugins this run uses (the run's order,
``disable``, ``autoload``, the environment), imports only those (:mod:`epochal.discovery`),
builds each from its ``[plugins.NAME]`` options, orders them (:mod:`epochal.ordering`, from what
they declare: :mod:`epochal.declarations`) and registers them with pluggy so that hooks run in
that order. :func:`compose` does the same for plugin objects given directly.

Environment:

``EPOCHAL_DISABLE_PLUGIN_AUTOLOAD=1``
    load only plugins named explicitly (the run's order, ``--plugins``, ``EPOCHAL_PLUGINS``).
``EPOCHAL_PLUGINS=a,b``
    names plugins to load in addition to the run's order (after it, in this order).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pluggy

from epochal._dispatch import Hooks, implementations
from epochal._options import check_options, convert_options
from epochal._registry import AddedSpecs, added_hookspecs, hook_names, new_plugin_manager, register, validate
from epochal.composite import CompositePlugin
from epochal.declarations import (
    FAILURE_POLICIES,
    RANKS,
    Declared,
    autoload_rule,
    check_dependencies,
    declared_rank,
    failure_policy,
    idle_hooks,
    own_options,
    plugin_autoload,
    plugin_phase,
    plugin_rank,
    read,
)
from epochal.discovery import (
    COMMANDS_GROUP,
    ENV_NO_AUTOLOAD,
    ENV_PLUGINS,
    GROUP,
    EntryPoint,
    PluginInfo,
    PluginLoadWarning,
    autoload_disabled,
    choose,
    declared_command,
    env_list,
    import_plugins,
    installed,
    mark_failed,
    register_commands,
)
from epochal.errors import PluginError, did_you_mean
from epochal.ordering import Unit, order_units
from epochal.triggers import TRIGGER_KEYS, Triggers, parse_triggers

__all__ = [
    "COMMANDS_GROUP",
    "ENV_NO_AUTOLOAD",
    "ENV_PLUGINS",
    "FAILURE_POLICIES",
    "GROUP",
    "RANKS",
    "EntryPoint",
    "PluginInfo",
    "PluginIsolatedWarning",
    "PluginLoadWarning",
    "PluginSet",
    "added_hookspecs",
    "autoload_disabled",
    "build",
    "check_dependencies",
    "choose",
    "compose",
    "declared_command",
    "env_list",
    "failure_policy",
    "idle_hooks",
    "installed",
    "load_plugins",
    "new_plugin_manager",
    "own_options",
    "plugin_phase",
    "plugin_rank",
    "register",
    "register_commands",
]


class PluginIsolatedWarning(RuntimeWarning):
    """A plugin with ``on_failure = "isolate"`` raised; the run goes on without it."""


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
        self.units: list[Unit] = []
        #: name → what the plugin declares (read once), for every plugin of the run.
        self.records: dict[str, Declared] = {}
        #: plugins of the run that run on rank 0 only, left out on this process (another rank).
        self.elsewhere: set[str] = set()

    def provider(self, name: str) -> str | None:
        """The plugin of the run that stands for the plugin *name*: that plugin, or the first
        that declares it ``provides`` *name* (None: none). The CLI names it where it would name
        a standard plugin (``provider("checkpoint")``)."""
        return next((n for n in self.plugins if n in self.records and name in self.records[n].provides), None)

    def check_dependencies(self) -> None:
        """Raise :class:`PluginError` if a plugin's ``requires`` or ``conflicts`` is not met."""
        check_dependencies(self.units, self.elsewhere)

    def _on_failure(self, error: BaseException, plugin: str, hook: str) -> bool:
        """Isolate *plugin* if its policy says so (True: the run goes on without it)."""
        if self.policies.get(plugin, "fatal") != "isolate" or not isinstance(error, Exception):
            return False
        self.isolated[plugin] = f"{hook}: {type(error).__name__}: {error}"
        where, left = f"hook {hook!r}", ""
        if hook == "state_dict":  # asked by a checkpoint: the others' states are saved
            where, left = "state_dict()", " (its state is left out of checkpoints)"
        warnings.warn(
            f"plugin {plugin!r} raised in {where}: {type(error).__name__}: {error}; "
            f"on_failure = isolate: it is unregistered and the run goes on without it{left}",
            PluginIsolatedWarning,
            stacklevel=2,
        )
        self.unregister(plugin)
        return True

    def isolate_failure(self, error: BaseException, plugin: str, where: str) -> bool:
        """Isolate *plugin*, which raised *error* in *where* (a hook, or ``state_dict``), if its
        policy says so; True: the run goes on without it."""
        return self._on_failure(error, plugin, where)

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
        the installed ones (listed in *order* or appended after it). Each is asked for, as a
        name in *order* is: one that fails to start (or declares ``autoload = False``) is not
        left out quietly.
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

    from_env = [n for n in env_list(ENV_PLUGINS) if n not in order]
    for name in explicit:
        if name not in known:
            raise unknown(
                name, "EPOCHAL_PLUGINS (the environment)" if name in from_env else "the plugin order"
            )
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
            infos[name].distribution = infos[name].version = None
            mark_failed(infos[name], conflicts[name])
            infos[name].status = "conflict"
    for name in extra:
        infos.setdefault(name, PluginInfo(name, entry_point=None))

    objects = import_plugins([n for n in selected if n not in extra], available, explicit_set, infos, exact)
    objects.update((n, extra[n]) for n in selected if n in extra)

    # a plugin the caller gave as an object (extra) is named too: it was asked for
    named_set = explicit_set | set(options) | set(extra)
    records = _records(selected, objects, named_set, infos)
    units: list[Unit] = []
    policies: dict[str, str] = {}
    triggers: dict[str, Triggers] = {}
    added = added_hookspecs({n: objects[n] for n in selected if n in records})
    for name in selected:
        if name not in records:
            continue  # failed to import, left out or replaced: said in its listing
        named = name in named_set
        table = options.get(name, {})
        own = records[name].options  # a plugin's own option of a trigger key's name wins
        shared = {k: v for k, v in table.items() if k in TRIGGER_KEYS and k not in own}
        plugin_options = {
            k: v for k, v in table.items() if k not in ("on_failure", "distribution") and k not in shared
        }
        try:
            plugin_triggers = parse_triggers(shared, f"[plugins.{name}]", PluginError)
            if plugin_triggers is not None:
                triggers[name] = plugin_triggers
            plugin = build(name, objects[name], plugin_options)
            unit = _unit(name, plugin, infos, disabled, records[name] if plugin is objects[name] else None)
            policies[name] = failure_policy(name, plugin, table, unit.records[name].on_failure)
            for member, member_plugin in unit.members:
                validate(member, member_plugin, added)
        except PluginError as error:
            if named:
                raise
            mark_failed(infos[name], str(error))
            continue
        except Exception as error:  # the plugin's own constructor failed
            message = f"plugin {name!r} failed to start: {type(error).__name__}: {error}"
            if named:
                raise PluginError(message) from error
            mark_failed(infos[name], message)
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

    ordered = order_units(units, [n for n in explicit if n in objects and n not in disabled])
    return _assemble(ordered, infos, policies, triggers, added)


def _records(
    selected: Sequence[str], objects: Mapping[str, object], named: set[str], infos: dict[str, PluginInfo]
) -> dict[str, Declared]:
    """What each plugin of *selected* that loads declares (read once), by name.

    Left out, said in its listing: a plugin that loads only when named and is not (it is
    ``available``), one whose declaration is invalid or breaks the autoload rule (a named one
    is an error instead), and one that another replaces (``provides``). Of the plugins that
    provide one name (the plugin of that name included), the one the run names wins; when it
    names none, the one that declares it provides the name wins over the plugin of that name
    (installed to replace it). Two named, or two declared and none named, are one error.
    """
    records: dict[str, Declared] = {}
    for name in selected:
        if name not in objects:
            continue
        try:
            if name not in named and not plugin_autoload(name, objects[name]):
                info = infos[name]  # it asks to be loaded only when named (bundles)
                info.status, info.autoload, info.rank = "available", False, declared_rank(objects[name])
                continue
            record = read(name, objects[name])
            # installing a plugin must not change what a run trains: one that says it decides
            # and autoloads is left out unless the run names it
            broken = None if name in named else autoload_rule(record)
        except PluginError as error:
            if name in named:
                raise
            mark_failed(infos[name], str(error))  # never loaded unasked on a declaration unread
            continue
        infos[name].autoload = record.autoload
        if broken is not None:
            mark_failed(infos[name], broken)
            continue
        records[name] = record
    roles: dict[str, list[str]] = {}
    for name, record in records.items():
        for role in record.provides:
            roles.setdefault(role, []).append(name)
    for role, names in roles.items():
        if len(names) < 2:
            continue
        chosen = [n for n in names if n in named] or [n for n in names if n != role]
        if len(chosen) > 1:
            listed = " and ".join(repr(n) for n in chosen)
            message = (
                f"plugins {listed} each provide {role!r}: one runs; name it in [plugins] order or "
                f"--plugins, or disable the others ([plugins] disable = [{chosen[-1]!r}])"
            )
            if any(n in named for n in chosen):
                raise PluginError(message)
            for name in names:  # none asked for: neither runs, as rival distributions of a name
                records.pop(name, None)
                mark_failed(infos[name], message)
                infos[name].status = "conflict"
            continue
        for name in names:
            if name != chosen[0] and name in records:
                del records[name]
                infos[name].status = "replaced"
                infos[name].error = f"replaced by plugin {chosen[0]!r}, which provides {role!r}"
    return records


def compose(plugins: Mapping[str, object], disable: Iterable[str] = ()) -> PluginSet:
    """Build a plugin set from plugin objects given by name (the Python API, no discovery).

    The mapping's order is the run's order; ``run_before``/``run_after`` are honoured and
    composite plugins expand into their children.
    """
    disabled = set(disable)
    for name, plugin in plugins.items():
        _check_object(name, plugin)
    infos = {name: PluginInfo(name) for name in plugins}
    units = [_unit(name, plugin, infos, disabled) for name, plugin in plugins.items() if name not in disabled]
    policies = {u.name: failure_policy(u.name, u.plugin, {}, u.records[u.name].on_failure) for u in units}
    members = {name: p for unit in units for name, p in [(unit.name, unit.plugin), *unit.members]}
    added = added_hookspecs(members)
    return _assemble(order_units(units, list(plugins)), infos, policies, added=added)


def _check_object(name: str, plugin: object) -> None:
    """Refuse what cannot be a plugin object: a class (its hooks would be called unbound), None,
    a number or a string; and a name that is empty or holds ``/`` (a composite child's).

    :raises PluginError: naming the plugin.
    """
    if not name or "/" in name:
        raise PluginError(f"invalid plugin name {name!r}: must be non-empty, no '/' (a composite child's)")
    if isinstance(plugin, type):
        raise PluginError(
            f"plugin {name!r} is the class {plugin.__name__}, not a plugin object: give an instance "
            f"({plugin.__name__}()), or load_plugins(extra=...), which builds a class"
        )
    if plugin is None or isinstance(plugin, (bool, int, float, complex, str, bytes)):
        raise PluginError(f"plugin {name!r} is {plugin!r}, not a plugin object (an instance or a module)")


def _unit(
    name: str,
    plugin: object,
    infos: dict[str, PluginInfo],
    disabled: set[str],
    record: Declared | None = None,
) -> Unit:
    """The unit ordering sees for *plugin*: itself, or its children if it is a composite.
    *record*: what *plugin* declares, read already (an object given as it is, not built)."""
    return Unit(name, plugin, _members(name, plugin, infos, disabled), {name: record} if record else {})


def _members(
    name: str, plugin: object, infos: dict[str, PluginInfo], disabled: set[str]
) -> list[tuple[str, object]]:
    """*plugin* (where it implements hooks or is no composite) and its children, depth first: a
    composite inside a composite expands too (``outer/inner/child``)."""
    members: list[tuple[str, object]] = []
    if not isinstance(plugin, CompositePlugin) or hook_names(plugin):
        members.append((name, plugin))
    if isinstance(plugin, CompositePlugin):
        info = infos[name]
        for child, child_plugin in plugin.plugins.items():
            full = f"{name}/{child}"
            infos[full] = PluginInfo(full, info.distribution, info.version, parent=name)
            if full in disabled:
                infos[full].status = "disabled"
            else:
                members += _members(full, child_plugin, infos, disabled)
    return members


def _assemble(
    units: list[Unit],
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
        own = unit.records[unit.name]
        for member, member_plugin in unit.members:
            record = unit.records[member]
            # a composite's children run where the composite does unless they say otherwise
            where = record.rank or (own.rank if member != unit.name else None) or "all"
            infos[member].rank = where
            if where == "zero" and here != 0:
                elsewhere.add(member)
            else:
                kept.append((member, member_plugin))
        if elsewhere.issuperset(m for m, _ in unit.members):
            elsewhere.add(unit.name)
        plugins.update(kept)
        for member, _ in kept:
            # a composite's children follow the composite's policy unless they declare their own
            member_policies[member] = unit.records[member].on_failure or policies.get(unit.name, "fatal")
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
        Unit(u.name, u.plugin, [(m, p) for m, p in u.members if m not in elsewhere], u.records)
        for u in units
        if u.name not in elsewhere
    ]
    plugin_set.records = {name: record for unit in units for name, record in unit.records.items()}
    plugin_set.elsewhere = elsewhere
    return plugin_set


def _this_rank() -> int:
    """This process's rank among the run's processes (0 alone)."""
    from epochal.distributed.world import current_world

    return current_world().rank


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
