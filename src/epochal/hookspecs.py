"""Hook specifications: every stage of a training run a plugin can take part in.

A plugin implements any of these with ``@epochal.hookimpl`` on a function or method of the
same name. An implementation may declare any subset of a hook's arguments (they are passed by
name), so a hook that gains an argument keeps working with old plugins. A misspelled hook name
or argument is refused when the plugin is registered.

Implementations run in the per-run plugin order: the order the user writes is the order hooks
run (``epochal plugins --order`` prints it per hook). ``loop`` is the :class:`epochal.Loop`
running the training; see its documentation for ``loop.epoch``, ``loop.iteration``,
``loop.log``, ``loop.model``, ``loop.plugins``, ``loop.run_id`` and ``loop.request_stop``.
"""

# The arguments of these functions are their documentation: pluggy reads their names.

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal._markers import hookspec

if TYPE_CHECKING:
    import click

#: The :class:`epochal.Loop` running the training. Named, not imported: the loop imports the
#: plugin machinery, which imports these specifications (implementations annotate
#: ``loop: epochal.Loop``).
Loop = Any


# -- training ---------------------------------------------------------------------------------


@hookspec
def before_training(loop: Loop) -> None:
    """Called once when a run starts, before the first epoch (and before epoch-0 evaluation).

    On a resumed run the loop's state (counters, log, model, RNG, stream position and every
    plugin's ``load_state_dict``) has already been restored when this is called;
    ``loop.resumed`` is true and :func:`on_resumption` follows.

    :param loop: the training loop.

    The return value is ignored.
    """


@hookspec
def on_resumption(loop: Loop) -> None:
    """Called after :func:`before_training` when the run continues from a saved state.

    ``loop.resumed_from`` holds the ``run_id`` of the run the state was saved by, and
    ``loop.epoch``/``loop.iteration`` the counters it had reached.

    :param loop: the training loop.

    The return value is ignored.
    """


@hookspec(firstresult=True)
def resume_state(loop: Loop, resume: bool) -> Mapping[str, Any] | None:
    """Called before :func:`before_training` to ask for a state to start from.

    A checkpoint plugin returns a state previously produced by ``loop.state_dict()``; the loop
    loads it with ``loop.load_state_dict`` and the run continues from it. ``epochal run
    --resume`` is an error unless an installed plugin implements this hook.

    :param loop: the training loop (nothing has run yet).
    :param resume: true when the user asked to resume (``--resume``).

    Stops at the first non-None result. Return None to start afresh. The implementation that
    returns a state may set ``loop.resumed_source`` to where it came from (e.g. a checkpoint's
    path): ``epochal run`` names it in the line saying what the run resumed from.
    """


@hookspec
def best_model_state(loop: Loop, read: bool) -> Any:
    """Called when ``[loop] test_weights = "best"``: where the run's best model state is, and
    that state.

    A checkpoint plugin that ranks its saves by a monitored record answers; ``test_streams``
    are then evaluated with the best saved weights after training (Lightning's
    ``trainer.test(ckpt_path="best")``), and the model gets its last weights back after.

    :param loop: the training loop.
    :param read: false when asked before the first batch (answer without reading anything:
        can you give a best state?), true after training (give it).

    Return None when this plugin tracks no best (with ``read`` false) or saved none (with
    ``read`` true). Otherwise, with ``read`` false, a few words saying which state it will be
    (``"the checkpoint with the lowest valid.loss"``); with ``read`` true, a pair
    ``(model_state, where)``: a state for ``loop.model.load_state_dict`` and the words the
    log and the summary say it came from (``"checkpoint DIR (epoch 3, valid.loss=0.12)"``).
    More than one plugin answering is an error naming them.
    """


@hookspec
def before_epoch(loop: Loop) -> None:
    """Called at the start of every training epoch, before its first batch is read.

    ``loop.epoch`` is the number of epochs completed so far. Not called again when a run
    resumes in the middle of an epoch.

    :param loop: the training loop.

    The return value is ignored.
    """


@hookspec
def before_batch(loop: Loop, batch: Any) -> None:
    """Called for every training batch, after it was read and before ``model.train_step``.

    The stream's position is already past this batch: a ``loop.state_dict()`` taken here
    resumes after it, without training on it (save in ``after_batch``, as ``checkpoint`` does).

    :param loop: the training loop; ``loop.iteration`` counts the batches completed before
        this one.
    :param batch: the batch exactly as the train stream produced it.

    The return value is ignored.
    """


@hookspec
def after_batch(loop: Loop, batch: Any, outputs: Mapping[str, Any]) -> None:
    """Called for every training batch, after ``model.train_step`` returned.

    ``loop.iteration`` already counts this batch, so ``loop.log.current_row`` is the row of
    this batch. Calling ``loop.request_stop`` here ends training after this batch.

    :param loop: the training loop.
    :param batch: the batch the step was given.
    :param outputs: the mapping of metrics ``train_step`` returned.

    The return value is ignored.
    """


@hookspec
def before_optimizer_step(loop: Loop, optimizer: Any) -> None:
    """Called by a model between ``backward()`` and the optimizer's step, when it steps.

    :class:`epochal.torch.TorchModel` calls it once per step of each optimizer (a model with
    several optimizers: once for each, in turn): after the gradients of
    ``accumulate_grad_batches`` batches have been summed and unscaled (``16-mixed``), before
    they are clipped and applied; under manual optimization when the step calls
    ``model.optimizer_step(name)``. A plugin may read the gradients (``p.grad``) to log norms or
    detect anomalies, or change them in place. Models without an optimizer never call it.
    A plugin's trigger keys (``every_n_batches``, ...) gate it as they gate the batch being run.

    :param loop: the training loop (``loop.iteration`` counts the batches done before this one).
    :param optimizer: the optimizer about to step (``torch.optim.Optimizer``); its
        ``param_groups`` hold the parameters and their gradients.

    The return value is ignored.
    """


@hookspec
def after_epoch(loop: Loop) -> None:
    """Called after every completed training epoch and its evaluation.

    ``loop.epoch`` already counts this epoch. Not called for an epoch cut short by
    ``request_stop``, ``max_iterations`` or a second interrupt (``max_iterations`` reached on
    the epoch's last batch does not cut it short: the epoch finishes).

    :param loop: the training loop.

    The return value is ignored.
    """


@hookspec
def after_training(loop: Loop) -> None:
    """Called once when training ends without an exception.

    That is after the last epoch, after ``request_stop`` or ``max_iterations`` took effect, and
    after :func:`on_interrupt` on SIGINT/SIGTERM. ``loop.log.status["status"]`` says which
    (``"finished"`` or ``"interrupted"``) and ``loop.log.status["finish_reason"]`` why.
    Not called when the run fails: :func:`on_error` is called instead.

    :param loop: the training loop.

    The return value is ignored.
    """


# -- evaluation -------------------------------------------------------------------------------


@hookspec
def before_evaluation(loop: Loop, stream: str) -> None:
    """Called before an evaluation stream is iterated.

    Evaluation runs after each epoch (every ``[loop] eval_every_n_epochs``), or inside epochs
    after every n-th batch with ``[loop] eval_every_n_batches`` (then ``loop.in_epoch`` is true,
    and the batch's ``after_batch`` follows), before training when ``[loop] eval_at_start`` is
    set, once after training for ``[loop] test_streams``, and whenever a plugin calls
    ``loop.evaluate``.

    :param loop: the training loop.
    :param stream: the name of the evaluation stream (a key of the data factory's mapping).

    The return value is ignored.
    """


@hookspec
def after_eval_batch(loop: Loop, stream: str, batch: Any, outputs: Mapping[str, Any]) -> None:
    """Called after ``model.eval_step`` returned for a batch of an evaluation stream.

    :param loop: the training loop.
    :param stream: the name of the evaluation stream.
    :param batch: the batch that was evaluated.
    :param outputs: the mapping of metrics ``eval_step`` returned.

    The return value is ignored.
    """


@hookspec
def after_evaluation(loop: Loop, stream: str, metrics: Mapping[str, float]) -> None:
    """Called after an evaluation stream was exhausted.

    The loop has already written the metrics to the log as ``<stream>.<metric>``.

    :param loop: the training loop.
    :param stream: the name of the evaluation stream.
    :param metrics: each metric of ``eval_step`` averaged over the stream, weighted by batch
        size.

    The return value is ignored.
    """


# -- interruption and failure -----------------------------------------------------------------


@hookspec
def on_interrupt(loop: Loop, signum: int) -> None:
    """Called when training stopped because of a signal, before :func:`after_training`.

    The first SIGINT lets the current epoch finish; a second SIGINT, or a SIGTERM, lets only the
    current batch finish. Then this hook runs, so a plugin can save what it needs, then
    :func:`after_training`. A third SIGINT raises ``KeyboardInterrupt`` at once.

    :param loop: the training loop, at a batch boundary and in a consistent state.
    :param signum: the number of the last signal received (``signal.SIGINT`` or
        ``signal.SIGTERM``).

    The return value is ignored.
    """


@hookspec
def on_error(loop: Loop, error: BaseException) -> None:
    """Called when a training step, an evaluation step or a hook raised an exception.

    Every plugin's implementation is called, each on its own: one that raises is reported and
    the others still run. The original exception is re-raised afterwards. ``loop.error_plugin``
    names the plugin whose hook raised (None when the model or data raised); an exception raised
    by a hook also carries the attributes ``epochal_plugin`` and ``epochal_hook``.

    :param loop: the training loop; its state may be inconsistent (mid-batch).
    :param error: the exception that ended the run.

    The return value is ignored.
    """


# -- the run as a whole: the summary, the launcher, the command line -------------------------


@hookspec
def run_summary(loop: Loop) -> Sequence[str] | None:
    """Called once when ``epochal run`` ends (after :func:`after_training`, on rank 0 only), for
    the lines a plugin adds to the end-of-run summary: where it saved, how to resume or plot.

    Every plugin's implementation is called, each on its own: one that raises or returns
    something other than strings is reported in one warning naming it, and the other plugins'
    lines are still printed. The CLI prints each line after ``epochal: ``.

    :param loop: the training loop, after training (``loop.log.status`` says how it ended;
        ``loop.command`` is the command that continues the run once ``--resume`` is appended:
        the command line that started it without ``--resume``, where a ``max_epochs`` or
        ``max_iterations`` the run reached is left out or raised, so that the resume trains on;
        under torchrun, torchrun's command).

    Return the lines (without a trailing newline), or None for none.
    """


@hookspec
def latest_checkpoint(run_dir: Path | None) -> str | None:
    """Called by ``epochal run --resume`` (and ``--resume auto``) for each run directory of the
    configuration, newest first, to find the run to continue; and by ``epochal run --nproc N``
    after a worker died, to name the checkpoint to resume from in its one-line error (in the
    launcher's process, with the plugins built from the run's configuration: no loop there).

    :param run_dir: a run's own directory (``version_N`` under ``[loop] run_dir``; the
        ``[loop] run_dir`` itself for a run made before run directories; None when the
        configuration has none).

    Return the path of the newest complete checkpoint of this run, or None when there is none
    (or none of yours). Two plugins answering with different paths is an error naming both.
    """


@hookspec
def check_fresh_run(run_dir: Path | None, command: Sequence[str]) -> str | None:
    """Called by ``epochal run`` before a run that does not resume (no ``--resume``), on one
    process or in the launcher of several, before the first batch and before anything is written.

    A fresh run's directory is new, so only files a plugin keeps elsewhere (a directory set in
    its options, shared by the config's runs) can hold an earlier run's: it refuses to mix them,
    with a message saying what it found and how to go on (``--resume`` to continue, another
    directory to start afresh).

    :param run_dir: the run's own new directory (``version_N`` under ``[loop] run_dir``; None
        when the configuration has none).
    :param command: the command line of this run, without ``--resume`` (as ``loop.command``).

    Return None to let the run start, or the message refusing it (the run then stops with that
    message and exit status 2).
    """


# -- command line -----------------------------------------------------------------------------


@hookspec
def register_commands(cli: click.Group) -> None:
    """Called when the ``epochal`` command starts, to let a plugin add subcommands.

    Every installed plugin that is not disabled by ``EPOCHAL_DISABLE_PLUGIN_AUTOLOAD`` is asked.

    :param cli: the ``epochal`` click group; add commands with ``@cli.command()`` or
        ``cli.add_command``.

    The return value is ignored.
    """
