"""Does a saved :class:`~epochal.torch.TorchModel` state fit this model? Checked before loading.

The module's state must match key for key, shape for shape and dtype for dtype. The optimizer's
must have the same parameter groups with as many parameters each, and its per-parameter state
(``exp_avg``, ``momentum_buffer``, ``square_avg``, ...) must belong to known parameters with
shapes that fit them: equal, or broadcastable to the parameter (factored second moments), or
0-d (``step``). A fresh optimizer has no per-parameter state before its first step, so the saved
one is checked against the parameters rather than against the live state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from epochal.torch.state import plain_dtype_and_shape

__all__ = ["check_module", "check_optimizer", "check_steps", "compare_keys"]


def compare_keys(prefix: str, expected: Any, given: Any, missing_ok: bool = False) -> list[str]:
    """Missing and unexpected keys of *given* against *expected*, sorted, with *prefix*."""
    if not isinstance(given, Mapping):
        return [f"{prefix.rstrip('.') or 'state'} must be a mapping, got {type(given).__name__}"]
    problems = []
    if (missing := set(expected) - set(given)) and not missing_ok:
        problems.append(f"missing keys {sorted(prefix + str(k) for k in missing)}")
    if unexpected := set(given) - set(expected):
        problems.append(f"unexpected keys {sorted(prefix + str(k) for k in unexpected)}")
    return problems


def check_module(prefix: str, expected: Mapping[str, Any], given: Any) -> list[str]:
    """Compare the keys, and the shapes and dtypes of *expected*'s tensors, with *given*."""
    problems = compare_keys(prefix, expected, given)
    if not isinstance(given, Mapping):
        return problems
    for key in sorted(expected.keys() & given.keys()):
        want, value = expected[key], given[key]
        if not isinstance(want, torch.Tensor):
            continue
        found = plain_dtype_and_shape(value)
        if found is None:
            problems.append(f"{prefix}{key}: expected a tensor's array, got {type(value).__name__}")
            continue
        dtype, shape = found
        if shape != tuple(want.shape):
            problems.append(f"{prefix}{key}: shape {list(shape)} != expected {list(want.shape)}")
        expected_dtype = str(want.dtype).removeprefix("torch.")
        if dtype != expected_dtype:
            problems.append(f"{prefix}{key}: dtype {dtype} != expected {expected_dtype}")
    return problems


def _fits(shape: tuple[int, ...], param: tuple[int, ...], total: int) -> bool:
    if len(shape) == 0 or shape == param:
        return True
    if len(shape) != len(param):  # a flat vector over every parameter (L-BFGS) or a scalar
        return len(shape) == 1 and shape[0] in (1, total)
    return all(s in (1, p) for s, p in zip(shape, param))


def check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, prefix: str = "optimizer.") -> list[str]:
    """Problems of a saved optimizer state (``{"state", "param_groups"}``) for *optimizer*,
    each named with *prefix* (``optimizer.``, or ``optimizers.NAME.`` for one of several)."""
    problems = compare_keys(prefix, {"state", "param_groups"}, saved)
    if problems:
        return problems
    current = optimizer.state_dict()
    groups, saved_groups = current["param_groups"], saved["param_groups"]
    if not isinstance(saved_groups, list):
        return [f"{prefix}param_groups must be a list, got {type(saved_groups).__name__}"]
    if len(saved_groups) != len(groups):
        return [f"{prefix}param_groups: {len(saved_groups)} groups != expected {len(groups)}"]
    for i, (group, saved_group) in enumerate(zip(groups, saved_groups, strict=True)):
        # A hyperparameter missing from a saved group is one a newer torch added: the optimizer
        # fills in its default, as torch's own load_state_dict does. An unexpected one means
        # another kind of optimizer (or a scheduler's key, such as initial_lr: allowed).
        known = set(group) | {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"}
        problems += compare_keys(f"{prefix}param_groups.{i}.", known, saved_group, missing_ok=True)
        if problems:
            continue
        if not isinstance(saved_group.get("params"), list):
            problems.append(f"{prefix}param_groups.{i}: 'params' must be a list of ids")
        elif len(saved_group["params"]) != len(group["params"]):
            problems.append(
                f"{prefix}param_groups.{i}: {len(saved_group['params'])} parameters "
                f"!= expected {len(group['params'])}"
            )
    if problems:
        return problems
    if not isinstance(saved["state"], Mapping):
        return [f"{prefix}state must be a mapping"]
    # Saved parameter ids are positions in the groups' order; map them onto the live parameters.
    params: dict[str, torch.Tensor] = {}
    for saved_group, live_group in zip(saved_groups, optimizer.param_groups, strict=True):
        for pid, param in zip(saved_group["params"], live_group["params"], strict=True):
            params[str(pid)] = param
    if unknown := set(map(str, saved["state"])) - set(params):
        problems.append(f"{prefix}state: unknown parameter ids {sorted(unknown)}")
    total = sum(p.numel() for p in params.values())  # what a flat state (L-BFGS) spans
    for pid in sorted(set(map(str, saved["state"])) & set(params), key=_natural):
        entry = saved["state"][pid]
        if not isinstance(entry, Mapping):
            problems.append(f"{prefix}state.{pid} must be a mapping, got {type(entry).__name__}")
            continue
        shape = tuple(params[pid].shape)
        for key in sorted(entry):
            found = plain_dtype_and_shape(entry[key])
            if found is not None and not _fits(found[1], shape, total):
                problems.append(
                    f"{prefix}state.{pid}.{key}: shape {list(found[1])} does not fit "
                    f"parameter {pid} of shape {list(shape)}"
                )
    return problems


def _natural(key: str) -> tuple[int, str]:
    return (int(key), "") if key.isdigit() else (1 << 62, key)


def check_steps(steps: Any, window: int, sharded: bool, processes: int) -> list[str]:
    """Every reason the saved ``steps`` (the accumulation window's position) cannot continue
    here: *window* batches per optimizer step, under FSDP (*sharded*), on *processes* ranks."""
    problems: list[str] = []
    accumulated = steps.get("accumulated") if isinstance(steps, Mapping) else None
    if isinstance(accumulated, bool) or not isinstance(accumulated, int) or accumulated < 0:
        problems.append(f"steps.accumulated must be a non-negative integer, not {accumulated!r}")
    elif accumulated >= window:
        problems.append(
            f"steps.accumulated: saved {accumulated} batches into an accumulation window, but "
            f"accumulate_grad_batches is {window}"
        )
    elif accumulated and sharded:
        problems.append(
            f"steps: saved inside a gradient accumulation window ({accumulated} batches), which "
            "strategy 'fsdp' cannot continue; resume with strategy 'ddp' or from a checkpoint "
            "saved at an optimizer step"
        )
    elif (
        isinstance(steps, Mapping)
        and "left_out" in steps
        and (
            isinstance(steps["left_out"], bool)
            or not isinstance(steps["left_out"], int)
            or steps["left_out"] < 0
        )
    ):
        problems.append(f"steps.left_out must be a non-negative integer, not {steps['left_out']!r}")
    elif accumulated:
        saved = len(steps["rank_grads"]) if isinstance(steps.get("rank_grads"), list) else 1
        if saved != processes:
            problems.append(
                f"steps: saved inside a gradient accumulation window on {saved} process(es), "
                f"whose gradients are each process's own; resume on {saved} process(es), or "
                "from a checkpoint saved at an optimizer step"
            )
    return problems
