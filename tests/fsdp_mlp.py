"""A small MLP with AdamW for the FSDP tests (``test_torch_fsdp.py``), imported by the processes.

``make_model(strategy=...)`` builds the same seeded module on every rank; ``make_data`` gives
a shuffled train stream and an evaluation stream of 17 examples (on 2 ranks, 2 batches of 8
on one, 1 on the other).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from epochal import hookimpl
from epochal.data import BatchStream
from epochal.torch import TorchModel

FEATURES, CLASSES = 6, 3


def write_config(
    directory: Path,
    strategy: str,
    *,
    epochs: int = 2,
    model: dict[str, Any] | None = None,
    checkpoint: str = 'export = "last"',
) -> Path:
    """*directory*/run.toml: this module's model under *strategy* (more ``[model]`` keys in
    *model*) and data on 2 gloo processes, the checkpoint plugin (its table's lines:
    *checkpoint*) and this module's recording plugin; this module copied beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__), directory / "fsdp_mlp.py")
    keys = "\n".join(f"{k} = {toml_value(v)}" for k, v in (model or {}).items())
    config = directory / "run.toml"
    config.write_text(
        f"""[loop]
max_epochs = {epochs}
seed = 0
run_dir = "run"

[distributed]
backend = "gloo"
timeout = 60

[model]
factory = "fsdp_mlp:make_model"
strategy = "{strategy}"
{keys}

[data]
factory = "fsdp_mlp:make_data"

[plugins]
order = ["checkpoint", "record"]
autoload = false

[plugins.checkpoint]
{checkpoint}

[plugins.record]
factory = "fsdp_mlp:Record"
""",
        encoding="utf-8",
    )
    return config


def toml_value(value: Any) -> str:
    """*value* in TOML (a dict as an inline table; JSON spells the rest as TOML does)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return x, y


def make_data(n_train: int = 64, n_valid: int = 17, batch_size: int = 8) -> dict[str, Any]:
    xt, yt = arrays(n_train, 1)
    xv, yv = arrays(n_valid, 2)
    return {
        "train": BatchStream(xt, yt, batch_size=batch_size, seed=0),
        "valid": BatchStream(xv, yv, batch_size=batch_size, shuffle=False),
    }


def make_model(
    strategy: Literal["ddp", "fsdp"] = "ddp",
    seed: int = 0,
    lr: float = 0.01,
    accumulate_grad_batches: int = 1,
    gradient_clip_val: float | None = None,
    precision: Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true"] = "32-true",
    empty: bool = False,
    meta: bool = False,
    pretrained: str | None = None,
    fsdp_options: dict[str, Any] | None = None,
) -> TorchModel:
    """Linear(6, 32) - Tanh - Linear(32, 32) - Tanh - Linear(32, 3), AdamW (``empty``: no
    parameters; ``meta``: built on the meta device)."""
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, 32), torch.nn.Tanh()]
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES)]
        module = torch.nn.Sequential(torch.nn.Flatten()) if empty else torch.nn.Sequential(*layers)
    params = list(module.parameters()) or [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return TorchModel(
        module,
        optimizer,
        torch.nn.functional.cross_entropy,
        {"accuracy": lambda out, y: (out.argmax(dim=1) == y).float().mean()},
        device="cpu",
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_clip_val=gradient_clip_val,
        strategy=strategy,
        pretrained=pretrained,
        fsdp_options=fsdp_options,
    )


class Record:
    """Writes ``record.json`` on rank 0 when training ends: every batch's loss (the mean over the
    ranks), the valid metrics, whether the module is sharded, the parameters when training
    started and ended, the optimizer's per-parameter state and the FSDP2 settings of each unit."""

    def __init__(self, path: str = "record.json") -> None:
        self.path = path
        self.losses: list[float] = []
        self.initial: dict[str, Any] = {}

    @hookimpl
    def before_training(self, loop: Any) -> None:
        state = loop.model.state_dict()  # every rank: a collective under FSDP
        self.initial = {k: np.asarray(v).tolist() for k, v in state.get("module", {}).items()}

    @hookimpl
    def after_batch(self, loop: Any, outputs: Any) -> None:
        loss = float(outputs["loss"])
        self.losses.append(loop.world.all_reduce([loss])[0] / loop.world.size)

    @hookimpl(trylast=True)
    def after_training(self, loop: Any) -> None:
        state = loop.model.state_dict()  # every rank: a collective under FSDP
        if not loop.world.is_zero:
            return
        record = {
            "losses": self.losses,
            "valid": {k: float(v) for k, v in loop.last_metrics.get("valid", {}).items()},
            "sharded": loop.model.sharded,
            "units": sum(1 for m in loop.model.raw_module.modules() if type(m).__name__.startswith("FSDP")),
            "fsdp": fsdp_settings(loop.model.raw_module),
            "initial": self.initial,
            "module": {k: np.asarray(v).tolist() for k, v in state["module"].items()},
            "optimizer": {
                pid: {k: np.asarray(v).tolist() for k, v in entry.items()}
                for pid, entry in state["optimizer"]["state"].items()
            },
            "steps": state["steps"],
        }
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)  # check-resume moves it into a new one
        with open(self.path, "w", encoding="utf-8") as out:
            json.dump(record, out)


def fsdp_settings(root: torch.nn.Module) -> dict[str, Any]:
    """Each FSDP unit's settings by its name, as FSDP2 holds them (its private state: FSDP2 has
    no getters): whether it reshards after forward, its offload policy, the units it prefetches."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): name or "<root>" for name, m in root.named_modules()}
    states = {id(m._get_fsdp_state()): names[id(m)] for m in root.modules() if isinstance(m, FSDPModule)}
    settings = {}
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        settings[names[id(module)]] = {
            "reshard_after_forward": group is not None and group.post_forward_mesh_info is not None,
            "offload": type(group.offload_policy).__name__ if group is not None else None,
            "forward_prefetch": [states[id(s)] for s in state._states_to_forward_prefetch],
            "backward_prefetch": [states[id(s)] for s in state._states_to_backward_prefetch],
        }
    return settings
