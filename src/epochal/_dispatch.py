"""Direct calls of the hook implementations pluggy holds, for hooks called on every batch.

pluggy stays the registry, the validator and the source of the call order; but a call through
``pm.hook.name(**kwargs)`` costs about 1 µs plus 0.3 µs per implementation (argument checks,
a list copy, ``_multicall``'s bookkeeping), ten times a direct call. For every hook this module
compiles a small function that calls the implementations in pluggy's order, each with only the
arguments it declares, exactly as ``_multicall`` would. A hook with no implementation compiles
to ``None`` so the loop skips it with one test. Hooks with wrappers keep pluggy's own call
(its multicall runs the wrappers), with each implementation guarded in the same way.

A plugin configured with trigger keys (:mod:`epochal.triggers`) has its implementations
compiled behind its gate (``if _g0(loop): f0(...)``); every other plugin compiles exactly as
without triggers, so the feature costs nothing to the plugins that do not use it.

When an implementation raises, the exception is annotated with the plugin and hook names
(``error.add_note`` and the attribute ``epochal_plugin``) and propagates unchanged.

A *timed* implementation (the ``timing`` plugin replaces each implementation by one) is a
function with an attribute ``epochal_timer = (original, cell)``: calling it calls *original* and
adds its wall time and one call to ``cell = [seconds, calls]``. A compiled caller does the same
inline, around *original*, without the wrapper's own call (a frame per implementation per batch);
pluggy's own calls still go through the wrapper.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from types import CodeType
from typing import TYPE_CHECKING, Any

import pluggy

from epochal import hookspecs

#: The argument names of every hook, in the specification's order.
HOOK_ARGS: dict[str, tuple[str, ...]] = {
    name: tuple(inspect.signature(fn).parameters)
    for name, fn in vars(hookspecs).items()
    if hasattr(fn, "epochal_spec")
}


def blame(error: BaseException, plugin: str, hook: str) -> None:
    """Record on *error* that *plugin*'s implementation of *hook* raised it (first one wins)."""
    if getattr(error, "epochal_plugin", None) is None:
        try:
            error.epochal_plugin = plugin  # type: ignore[attr-defined]
            error.epochal_hook = hook  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exceptions with __slots__
            return
        error.add_note(f"raised in hook {hook!r} of plugin {plugin!r}")


def implementations(pm: pluggy.PluginManager, hook: str) -> list[pluggy.HookImpl]:
    """The implementations of *hook* in the order pluggy calls them."""
    caller = getattr(pm.hook, hook, None)
    return list(reversed(caller.get_hookimpls())) if caller is not None else []


#: Called with (error, plugin, hook) when an implementation raises; True means "carry on".
FailureHandler = Callable[[BaseException, str, str], bool]
#: Called with (hook, loop or None, ((plugin, seconds), ...)) after every traced hook call.
Tracer = Callable[[str, Any, tuple[tuple[str, float], ...]], None]
#: Called with (plugin, hook): True (always call), False (never) or a condition on the loop.
Gate = Callable[[str, str], Any]
#: Called with (plugin, hook): True when the plugin declares the hook idle (a no-op this run).
Idle = Callable[[str, str], bool]


def compile_hook(
    pm: pluggy.PluginManager,
    hook: str,
    on_failure: FailureHandler | None = None,
    tracer: Tracer | None = None,
    gate: Gate | None = None,
    idle: Idle | None = None,
) -> Callable[..., Any] | None:
    """A function taking the hook's arguments positionally and calling every implementation.

    Returns None when the hook has no implementation. An exception from an implementation is
    annotated with the plugin and hook; then *on_failure* may swallow it (the remaining
    implementations still run) or it propagates. With a *tracer*, every call is timed. *gate*
    says, per plugin, whether and when its implementation is called (the trigger keys). *idle*
    says which implementations their plugin declares no-ops for this run: they are left out
    (through pluggy, where a hook has wrappers, they are called as usual).
    """
    impls = implementations(pm, hook)
    if idle is not None:
        impls = [i for i in impls if i.hookwrapper or i.wrapper or not idle(i.plugin_name, hook)]
    args = HOOK_ARGS.get(hook, ())
    gates: dict[int, Any] = {}
    gated = False
    if gate is not None and "loop" in args:
        kept: list[pluggy.HookImpl] = []
        for impl in impls:
            condition = gate(impl.plugin_name, hook)
            gated = gated or condition is not True
            if condition is False:
                continue
            if condition is not True:
                gates[len(kept)] = condition
            kept.append(impl)
        impls = kept
    if not impls:
        return None
    if any(impl.hookwrapper or impl.wrapper for impl in implementations(pm, hook)):
        if gated:
            from epochal.errors import PluginError

            raise PluginError(
                f"hook {hook!r} has a wrapper implementation, and trigger keys cannot gate a hook "
                "with wrappers: remove the trigger keys of the plugins implementing it"
            )
        return _through_pluggy(pm, hook, args, on_failure)
    plugins = [impl.plugin_name for impl in impls]

    def failed(error: BaseException, k: int) -> bool:
        if getattr(error, "epochal_plugin", plugins[k]) != plugins[k]:
            return False  # another plugin's (its state_dict, a nested hook): its own policy held
        blame(error, plugins[k], hook)
        return on_failure is not None and on_failure(error, plugins[k], hook)

    namespace: dict[str, Any] = {"_failed": failed, "_trace": tracer, "_clock": time.perf_counter}
    lines = [f"def {hook}({', '.join(args)}):"]
    if tracer is not None:
        lines.append("    _t = _clock()")
    #: whether _e holds the clock read just after the previous implementation (a timed one):
    #: the next timed implementation starts from it, one clock read instead of two.
    chained = False
    for k, impl in enumerate(impls):
        function = impl.function
        timer = getattr(function, "epochal_timer", None)
        if timer is not None:  # timed inline: see the module's docstring
            function, namespace[f"_c{k}"] = timer
        namespace[f"f{k}"] = function
        call = f"f{k}({', '.join(impl.argnames)})"
        gated = k in gates
        if timer is not None:
            # the timing wrapper's operations, in a try/finally of its own
            body = [
                "_s = _e" if chained and not gated else "_s = _clock()",
                "try:",
                f"    {call}",
                "finally:",
                "    _e = _clock()",
                f"    _c{k}[0] += _e - _s",
                f"    _c{k}[1] += 1",
            ]
        else:
            body = [call]
        if gated:
            namespace[f"_g{k}"] = gates[k]
            if timer is not None:
                body = [f"if _g{k}(loop):", *("    " + line for line in body)]
            else:
                body = [f"_g{k}(loop) and {call}"]
        chained = timer is not None and not gated and tracer is None
        # A try block costs nothing in CPython 3.11+ until something is raised.
        lines += [
            "    try:",
            *("        " + line for line in body),
            "    except BaseException as e:",
            f"        if not _failed(e, {k}):",
            "            raise",
        ]
        if chained:  # the failure's handling is not the next implementation's time
            lines.append("        _e = _clock()")
        if tracer is not None:
            lines.append(f"    _t{k} = _clock()")
    if tracer is not None:
        spans = ", ".join(
            f"({name!r}, _t{k} - {'_t' if k == 0 else f'_t{k - 1}'})" for k, name in enumerate(plugins)
        )
        loop = "loop" if "loop" in args else "None"
        lines.append(f"    _trace({hook!r}, {loop}, ({spans},))")
    exec(_compiled("\n".join(lines)), namespace)
    caller: Callable[..., Any] = namespace[hook]
    return caller


def _through_pluggy(
    pm: pluggy.PluginManager, hook: str, args: tuple[str, ...], on_failure: FailureHandler | None
) -> Callable[..., Any]:
    """A caller of *hook*, which has wrappers, through pluggy's own multicall, each implementation
    guarded as the compiled callers guard theirs: its exceptions blamed on its plugin and given
    to *on_failure* (an isolated plugin's part of the call is skipped, the others still run)."""
    caller = getattr(pm.hook, hook)
    guarded = [_guarded(impl, hook, on_failure) for impl in caller.get_hookimpls()]

    def through_pluggy(*values: Any) -> Any:
        # pluggy's call, as pm.hook.NAME(**kwargs) makes it, with the guarded implementations
        return pm._hookexec(hook, guarded, dict(zip(args, values)), False)

    return through_pluggy


def _guarded(impl: pluggy.HookImpl, hook: str, on_failure: FailureHandler | None) -> pluggy.HookImpl:
    """A copy of *impl* whose exceptions are blamed on its plugin and offered to *on_failure*.

    A wrapper's generator is guarded around every step pluggy drives (``yield from`` passes on
    what pluggy sends and throws); an exception thrown into it from an inner implementation,
    already blamed on that one, passes through untouched.
    """
    plugin, function = impl.plugin_name, impl.function

    def handled(error: BaseException) -> bool:
        if getattr(error, "epochal_plugin", plugin) != plugin:
            return False  # another implementation's, on its way out through this wrapper
        blame(error, plugin, hook)
        return on_failure is not None and on_failure(error, plugin, hook)

    if impl.wrapper or impl.hookwrapper:

        def guarded(*values: Any) -> Any:
            steps: Any = function(*values)  # the wrapper's generator
            try:
                return (yield from steps)
            except BaseException as error:
                if not handled(error):
                    raise
                return None

    else:

        def guarded(*values: Any) -> Any:
            try:
                return function(*values)
            except BaseException as error:
                if not handled(error):
                    raise
                return None

    # functools.wraps: pluggy reads the arguments to pass from the signature it exposes
    return pluggy.HookImpl(impl.plugin, plugin, functools.wraps(function)(guarded), impl.opts)


@functools.lru_cache(maxsize=1024)
def _compiled(source: str) -> CodeType:
    """*source* compiled once: the hooks are recompiled at every rebuild (a plugin set, the timing
    plugin wrapping and unwrapping them), and compiling is ~100x the cost of running the code."""
    return compile(source, "<epochal hook caller>", "exec")


def each_implementation(
    pm: pluggy.PluginManager, hook: str, **kwargs: Any
) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Yield ``(plugin_name, call)`` for every implementation, to call them one by one."""
    for impl in implementations(pm, hook):
        yield impl.plugin_name, functools.partial(impl.function, *[kwargs[n] for n in impl.argnames])


class Hooks:
    """The compiled hook callers of a plugin manager; call :meth:`rebuild` after (un)registering.

    Each hook is an attribute: ``hooks.after_batch`` is None or a function taking the hook's
    arguments positionally.
    """

    def __init__(
        self,
        pm: pluggy.PluginManager,
        on_failure: FailureHandler | None = None,
        gate: Gate | None = None,
        idle: Idle | None = None,
    ) -> None:
        self._pm = pm
        self._on_failure = on_failure
        self._gate = gate
        self._idle = idle
        self.tracer: Tracer | None = None
        self.rebuild()

    def rebuild(self) -> None:
        """Recompile every hook from the implementations currently registered."""
        for hook in HOOK_ARGS:
            caller = compile_hook(self._pm, hook, self._on_failure, self.tracer, self._gate, self._idle)
            setattr(self, hook, caller)

    def trace(self, tracer: Tracer | None) -> None:
        """Time every hook call and report it to *tracer* (None: stop tracing)."""
        self.tracer = tracer
        self.rebuild()

    if TYPE_CHECKING:  # for type checkers only: a real __getattr__ would make every
        # ``hooks.after_batch`` read in the loop's hot path unspecialized (3x slower in 3.11)

        def __getattr__(self, hook: str) -> Callable[..., Any] | None: ...
