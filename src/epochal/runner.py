"""Building and running a loop from a run configuration (what ``epochal run`` does)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epochal import _rng
from epochal._options import check_options
from epochal.config import blame, call_factory, factory_arguments, loop_options, name_the_file, plugins_for
from epochal.errors import ConfigError, PluginError
from epochal.loop import Loop
from epochal.plugins import PluginSet


def _check_dependencies(config: Mapping[str, Any], plugin_set: PluginSet) -> None:
    """The plugins' requires/conflicts, an error naming the configuration's file."""
    try:
        plugin_set.check_dependencies()
    except PluginError as error:
        named = name_the_file(config, error)
        if named is error:
            raise
        raise named from None


def join_world(config: Mapping[str, Any]) -> None:
    """Under a launcher (torchrun, ``--nproc``), join the process group before the plugins and
    the model are built (rank-0 plugins are left out on the other ranks)."""
    from epochal.distributed import init_from_env, launched

    if launched():
        init_from_env(**dict(config.get("distributed", {})))


def build_loop(
    config: Mapping[str, Any],
    order: Sequence[str] | None = None,
    disable: Sequence[str] = (),
    resume: bool | str = False,
) -> Loop:
    """Load the plugins, seed every generator from ``[loop] seed``, call the model and data
    factories and make the loop."""
    seed = config.get("loop", {}).get("seed")  # checked with [loop] (epochal.Loop's annotations)
    join_world(config)
    plugin_set = plugins_for(config, order, disable)
    _check_dependencies(config, plugin_set)
    if resume and not plugin_set.implements("resume_state"):
        raise ConfigError(
            "--resume needs a plugin that restores checkpoints, and none is loaded "
            "(from a clone of epochal: pip install plugins/epochal-checkpoint; "
            "and do not leave 'checkpoint' out)"
        )
    # as Lightning's seed_everything does, before anything draws: a factory's random init is the
    # same on every run, and on every rank (the replicas start equal, which fully_shard needs;
    # DDP would broadcast rank 0's anyway). The loop seeds again at the start of a fresh run.
    with _rng.seeded(seed):
        model = call_factory(config, "model")
        data = call_factory(config, "data")
    return Loop(model, data, plugins=plugin_set, resume=resume, config=config, **loop_options(config))


def check_run(
    config: Mapping[str, Any], order: Sequence[str] | None = None, disable: Sequence[str] = ()
) -> PluginSet:
    """Every check a run of *config* makes before its first batch, without training.

    Checks the ``[loop]`` options that need no data (``min_epochs`` against ``max_epochs``...),
    loads and orders the plugins with their options (requires/conflicts included) and imports
    the model and data factories, checking their arguments without calling them. What needs the
    model or the data (the streams that ``test_streams``, ``eval_every_n_epochs`` and trigger
    conditions name; ``test_weights = "best"``) is checked when a run starts, before its first
    batch.
    """
    from epochal.config import source_of
    from epochal.stopping import check_minimum

    loop = config.get("loop", {})
    check_minimum(
        loop.get("min_epochs", 0),
        loop.get("min_steps", 0),
        (loop.get("max_epochs"), loop.get("max_iterations")),
        f"{source_of(config)}: [loop]",
    )
    plugin_set = plugins_for(config, order, disable)
    _check_dependencies(config, plugin_set)
    for section in ("model", "data"):
        factory, arguments = factory_arguments(config, section)
        try:
            check_options(factory.__name__, factory, arguments, where=f"[{section}]", error=ConfigError)
        except ConfigError as error:
            raise blame(config, error) from None
    return plugin_set
