"""The PyTorch adapter: train a ``torch.nn.Module`` in an epochal loop (``epochal[torch]``).

:class:`TorchModel` wraps a module, an optimizer and a loss function into an object with the
model protocol of epochal (``train_step``, ``eval_step``, ``state_dict``, ``load_state_dict``).
Its state holds numpy arrays and plain Python values only, never tensors, so a checkpoint does
not need pickle or torch to be read, and restoring it is bitwise exact::

    model = TorchModel(net, torch.optim.Adam(net.parameters()), torch.nn.functional.cross_entropy,
                       metrics={"accuracy": accuracy})

Importing this module imports torch; the rest of epochal never does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["TorchModel"]


class TorchModel:
    """A ``torch.nn.Module`` with its optimizer and loss, as an epochal model.

    :param module: the network; it is called with the inputs of a batch.
    :param optimizer: the optimizer of the module's parameters.
    :param loss_fn: ``loss_fn(outputs, targets)`` returns the scalar loss tensor.
    :param metrics: optional ``{name: fn(outputs, targets)}`` of extra metrics, each returning a
        number (or a one-element tensor); they are computed without gradients.

    A batch is a pair ``(inputs, targets)`` of tensors or numpy arrays (converted with
    ``torch.from_numpy``, so without a copy). Each step returns ``{"loss": float, **metrics}``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.metrics = dict(metrics or {})

    def train_step(self, batch: Any) -> dict[str, float]:
        """Take one optimizer step on *batch* (the module in training mode)."""
        inputs, targets = _tensors(batch)
        self.module.train()
        self.optimizer.zero_grad()
        outputs = self.module(inputs)
        loss = self.loss_fn(outputs, targets)
        loss.backward()
        self.optimizer.step()
        return self._results(loss, outputs, targets)

    def eval_step(self, batch: Any) -> dict[str, float]:
        """Return the loss and metrics on *batch*, in eval mode and without gradients.

        The training mode of every submodule is restored afterwards.
        """
        inputs, targets = _tensors(batch)
        modes = [(m, m.training) for m in self.module.modules()]
        self.module.eval()
        try:
            with torch.no_grad():
                outputs = self.module(inputs)
                loss = self.loss_fn(outputs, targets)
        finally:
            for submodule, mode in modes:
                submodule.training = mode
        return self._results(loss, outputs, targets)

    def _results(self, loss: torch.Tensor, outputs: Any, targets: Any) -> dict[str, float]:
        results = {"loss": float(loss.detach())}
        if self.metrics:
            if isinstance(outputs, torch.Tensor):
                outputs = outputs.detach()
            with torch.no_grad():
                for name, fn in self.metrics.items():
                    results[name] = float(fn(outputs, targets))
        return results

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"module": {name: ndarray}, "optimizer": {"state", "param_groups"}}``.

        Tensors become numpy copies, tuples lists and the optimizer's per-parameter state keys
        strings, so the leaves are numpy arrays, numbers, strings, booleans and None.
        """
        optimizer = self.optimizer.state_dict()
        return {
            "module": {k: _to_plain(v, k) for k, v in self.module.state_dict().items()},
            "optimizer": {
                "state": {
                    str(pid): {k: _to_plain(v, f"state.{pid}.{k}") for k, v in s.items()}
                    for pid, s in optimizer["state"].items()
                },
                "param_groups": [
                    {k: _to_plain(v, f"param_groups.{i}.{k}") for k, v in group.items()}
                    for i, group in enumerate(optimizer["param_groups"])
                ],
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state returned by :meth:`state_dict`, bitwise.

        :raises ValueError: listing every missing or unexpected key and every shape or dtype
            mismatch, before anything is changed.
        """
        problems = _compare_keys("", {"module", "optimizer"}, state)
        if problems:
            raise ValueError("cannot load TorchModel state: " + "; ".join(problems))
        module_state = self.module.state_dict()
        problems += _compare("module.", module_state, state["module"])
        current = self.optimizer.state_dict()
        saved = state["optimizer"]
        optimizer_problems = _compare_keys("optimizer.", {"state", "param_groups"}, saved)
        problems += optimizer_problems or _check_optimizer(current, saved)
        if problems:
            raise ValueError("cannot load TorchModel state: " + "; ".join(problems))
        self.module.load_state_dict({k: _from_plain(v, module_state[k]) for k, v in state["module"].items()})
        self.optimizer.load_state_dict(
            {
                "state": {
                    int(pid): {k: _from_plain(v, None) for k, v in s.items()}
                    for pid, s in saved["state"].items()
                },
                "param_groups": [
                    {k: _from_plain(v, template.get(k)) for k, v in group.items()}
                    for group, template in zip(saved["param_groups"], current["param_groups"], strict=True)
                ],
            }
        )


def _tensors(batch: Any) -> tuple[Any, Any]:
    inputs, targets = batch
    if isinstance(inputs, np.ndarray):
        inputs = torch.from_numpy(inputs)
    if isinstance(targets, np.ndarray):
        targets = torch.from_numpy(targets)
    return inputs, targets


def _to_plain(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        try:
            return value.detach().cpu().numpy().copy()
        except TypeError as error:  # e.g. bfloat16, which numpy lacks
            raise TypeError(f"cannot convert {where} to a numpy array: {error}") from None
    if isinstance(value, (tuple, list)):
        return [_to_plain(v, where) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_plain(v, f"{where}.{k}") for k, v in value.items()}
    return value


def _from_plain(value: Any, template: Any) -> Any:
    """Undo :func:`_to_plain`, restoring the tuples and tensors of *template* where it has them."""
    if isinstance(value, np.ndarray):
        tensor = torch.from_numpy(np.array(value, copy=True))  # never alias the caller's array
        if isinstance(template, torch.Tensor):
            tensor = tensor.to(template.device)
        return tensor
    if isinstance(value, list) and isinstance(template, tuple):
        return tuple(_from_plain(v, t) for v, t in zip(value, template, strict=False))
    return value


def _compare_keys(prefix: str, expected: Any, given: Any, missing_ok: bool = False) -> list[str]:
    if not isinstance(given, Mapping):
        return [f"{prefix or 'state'} must be a mapping, got {type(given).__name__}"]
    problems = []
    if (missing := set(expected) - set(given)) and not missing_ok:
        problems.append(f"missing keys {sorted(prefix + str(k) for k in missing)}")
    if unexpected := set(given) - set(expected):
        problems.append(f"unexpected keys {sorted(prefix + str(k) for k in unexpected)}")
    return problems


def _compare(prefix: str, expected: Mapping[str, Any], given: Any) -> list[str]:
    """Compare keys, and the shapes and dtypes of the tensors of *expected*, with *given*."""
    problems = _compare_keys(prefix, expected, given)
    if problems and not isinstance(given, Mapping):
        return problems
    for key in sorted(expected.keys() & given.keys()):
        want, value = expected[key], given[key]
        if not isinstance(want, torch.Tensor):
            continue
        if not isinstance(value, np.ndarray):
            problems.append(f"{prefix}{key}: expected a numpy array, got {type(value).__name__}")
            continue
        if tuple(value.shape) != tuple(want.shape):
            problems.append(f"{prefix}{key}: shape {value.shape} != expected {tuple(want.shape)}")
        if _torch_dtype(value.dtype) != want.dtype:
            expected_dtype = str(want.dtype).removeprefix("torch.")
            problems.append(f"{prefix}{key}: dtype {value.dtype} != expected {expected_dtype}")
    return problems


def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype | None:
    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype
    except TypeError:  # a dtype torch has no equivalent of
        return None


def _check_optimizer(current: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    groups, saved_groups = current["param_groups"], saved["param_groups"]
    if not isinstance(saved_groups, list):
        return [f"optimizer.param_groups must be a list, got {type(saved_groups).__name__}"]
    if len(saved_groups) != len(groups):
        return [f"optimizer.param_groups: {len(saved_groups)} groups != expected {len(groups)}"]
    problems = []
    for i, (group, saved_group) in enumerate(zip(groups, saved_groups, strict=True)):
        # A hyperparameter missing from a saved group is one a newer torch added: the optimizer
        # fills in its default, as torch's own load_state_dict does. An unexpected one means
        # another kind of optimizer.
        problems += _compare_keys(f"optimizer.param_groups.{i}.", group, saved_group, missing_ok=True)
        if problems:
            continue
        if not isinstance(saved_group.get("params"), list):
            problems.append(f"optimizer.param_groups.{i}: 'params' must be a list of ids")
        elif len(saved_group["params"]) != len(group["params"]):
            problems.append(
                f"optimizer.param_groups.{i}: {len(saved_group['params'])} parameters "
                f"!= expected {len(group['params'])}"
            )
    if problems:
        return problems
    param_ids = {str(p) for g in saved_groups for p in g["params"]}
    if not isinstance(saved["state"], Mapping):
        return ["optimizer.state must be a mapping"]
    if unknown := set(saved["state"]) - param_ids:
        problems.append(f"optimizer.state: unknown parameter ids {sorted(map(str, unknown))}")
    for pid, param_state in current["state"].items():  # already stepped: compare with it
        if str(pid) in saved["state"]:
            problems += _compare(f"optimizer.state.{pid}.", param_state, saved["state"][str(pid)])
    return problems
