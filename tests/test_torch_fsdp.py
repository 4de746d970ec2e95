"""``TorchModel(strategy="fsdp")``: FSDP2 on 2 gloo processes through ``epochal run --nproc 2``.

The runs train the AdamW MLP of ``fsdp_mlp.py`` (copied beside each config) with its recording
plugin. FSDP's loss curve and weights are compared with DDP's on the same data: FSDP averages
gradients by a reduce-scatter, DDP by an all-reduce, and the two may add the ranks' values in
another order, so they are equal within float32 rounding (a tolerance, never bitwise by
contract; on 2 ranks they usually agree bitwise). Checkpoints keep the plain full format: an
FSDP checkpoint resumes under DDP and on one process, a DDP one under FSDP.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from epochal.errors import ConfigError  # noqa: E402
from epochal.torch import TorchModel  # noqa: E402
from epochal.torch.fsdp import shard_units  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fsdp_mlp  # noqa: E402

#: accumulation over 2 batches and a clipping threshold the MLP's gradients exceed (they are ~1).
TRAINING = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.25}


def write_run(
    directory: Path, strategy: str, *, epochs: int = 2, model: dict[str, Any] | None = None
) -> Path:
    return fsdp_mlp.write_config(directory, strategy, epochs=epochs, model=model)


def epochal(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "epochal", *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def record(directory: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((directory / "record.json").read_text())
    return result


def trained(directory: Path, strategy: str, *extra: str, **model: Any) -> dict[str, Any]:
    config = write_run(directory, strategy, model={**TRAINING, **model})
    done = epochal(directory, "run", str(config), "--nproc", "2", *extra)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return record(directory)


def assert_close_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(np.array(a[name]), np.array(b[name]), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The same config trained 2 epochs under FSDP and under DDP (4 batches per rank and epoch)."""
    out = {}
    for strategy in ("fsdp", "ddp"):
        directory = tmp_path_factory.mktemp(strategy)
        out[strategy] = (directory, trained(directory, strategy))
    return out


@pytest.mark.distributed
def test_fsdp_shards_the_module_and_trains_as_ddp_does(runs: Any) -> None:
    (_, fsdp), (_, ddp) = runs["fsdp"], runs["ddp"]
    assert fsdp["sharded"] is True and ddp["sharded"] is False
    assert fsdp["units"] == 4 and ddp["units"] == 0  # the 3 Linear layers, then the root
    assert fsdp["steps"] == ddp["steps"] == {"accumulated": 0, "optimizer_steps": 4}  # 8 batches / 2
    assert len(fsdp["losses"]) == 8
    assert fsdp["losses"][-1] < fsdp["losses"][0]  # it learns
    np.testing.assert_allclose(fsdp["losses"], ddp["losses"], rtol=1e-5, atol=1e-6)
    assert_close_weights(fsdp["module"], ddp["module"])
    # the optimizer's state is the same plain, full one (AdamW's moments of every parameter)
    assert fsdp["optimizer"].keys() == ddp["optimizer"].keys() == {str(i) for i in range(6)}
    for pid in fsdp["optimizer"]:
        assert_close_weights(fsdp["optimizer"][pid], ddp["optimizer"][pid])
    # evaluation on the sharded module (17 examples: shards of 2 and 1 batches) gives DDP's metrics
    assert fsdp["valid"] == pytest.approx(ddp["valid"], rel=1e-5)


#: every FSDP option at once (the units are named by their class's full name).
FSDP_OPTIONS = {
    "wrap_policy": ["torch.nn.modules.linear.Linear"],
    "reshard_after_forward": False,
    "forward_prefetch": 1,
    "backward_prefetch": 1,
    "cpu_offload": True,
}


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_options_reach_every_unit_and_train_as_ddp_does(runs: Any, tmp_path: Path) -> None:
    """Each unit holds the options (FSDP2's state) and the run still ends where DDP's does."""
    options = trained(tmp_path, "fsdp", fsdp_options=FSDP_OPTIONS)
    unit = {"reshard_after_forward": False, "offload": "CPUOffloadPolicy"}
    assert options["fsdp"] == {
        "<root>": {
            "reshard_after_forward": False,
            "offload": None,
            "forward_prefetch": [],
            "backward_prefetch": [],
        },
        "0": {**unit, "forward_prefetch": ["2"], "backward_prefetch": []},
        "2": {**unit, "forward_prefetch": ["4"], "backward_prefetch": ["0"]},
        "4": {**unit, "forward_prefetch": [], "backward_prefetch": ["2"]},
    }
    default = {
        "reshard_after_forward": True,
        "offload": "OffloadPolicy",
        "forward_prefetch": [],
        "backward_prefetch": [],
    }
    assert runs["fsdp"][1]["fsdp"]["2"] == default
    _, ddp = runs["ddp"]
    np.testing.assert_allclose(options["losses"], ddp["losses"], rtol=1e-5, atol=1e-6)
    assert_close_weights(options["module"], ddp["module"])


@pytest.fixture(scope="module")
def meta_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The MLP built on the meta device, trained 2 epochs under FSDP."""
    directory = tmp_path_factory.mktemp("meta")
    return directory, trained(directory, "fsdp", meta=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_meta_module_under_fsdp_initialises_each_shard_on_its_rank(meta_run: Any) -> None:
    """reset_parameters on each rank's shards: nn.Linear's bounds (1/sqrt(fan_in)), and the two
    ranks' rows differ (DTensor's CPU random ops draw on each rank alone: the ranks draw from
    generators of their own)."""
    _, meta = meta_run
    assert meta["sharded"] is True and meta["units"] == 4
    for layer, fan_in in (("0", fsdp_mlp.FEATURES), ("2", 32), ("4", 32)):
        for kind in ("weight", "bias"):
            values = np.array(meta["initial"][f"{layer}.{kind}"])
            assert 0.5 / fan_in**0.5 < np.abs(values).max() <= 1 / fan_in**0.5, (layer, kind)
    first = np.array(meta["initial"]["0.weight"])  # 32 rows: rank 0 holds 0-15, rank 1 16-31
    assert not np.allclose(first[:16], first[16:])
    assert meta["losses"][-1] < meta["losses"][0]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_meta_module_resumes_from_its_checkpoint_into_its_shards(meta_run: Any, tmp_path: Path) -> None:
    directory, straight = meta_run
    resumed = trained(tmp_path, "fsdp", "--resume", str(first_epoch_checkpoint(directory)), meta=True)
    assert_close_weights(resumed["module"], straight["module"])
    np.testing.assert_allclose(resumed["losses"], straight["losses"][4:], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["safetensors", "dcp"])
def test_pretrained_weights_load_into_the_shards_of_a_meta_module(
    runs: Any, tmp_path: Path, kind: str
) -> None:
    """The host-built MLP's weights as a safetensors file (each rank reads its rows into its
    shards) or a DCP checkpoint of one process (DCP reshards it): the meta FSDP run starts
    bitwise where the DDP run (built on the host) starts, and trains as it."""
    host = fsdp_mlp.make_model()
    weights = tmp_path / "init"
    if kind == "safetensors":
        from safetensors.torch import save_file

        weights = weights.with_suffix(".safetensors")
        save_file(host.raw_module.state_dict(), weights)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(host.sharded_state_dict(), checkpoint_id=str(weights), no_dist=True)
    meta = trained(tmp_path, "fsdp", meta=True, pretrained=str(weights))
    _, ddp = runs["ddp"]
    assert meta["initial"] == ddp["initial"]
    np.testing.assert_allclose(meta["losses"], ddp["losses"], rtol=1e-5, atol=1e-6)
    assert_close_weights(meta["module"], ddp["module"])


@pytest.mark.distributed
def test_the_weights_exported_at_the_end_of_an_fsdp_run_are_the_full_ones(runs: Any) -> None:
    """Rank 0 alone exports ``last.safetensors`` after the final save: the state gathered for
    that save serves it (no collective on one rank)."""
    from safetensors.numpy import load_file

    directory, fsdp = runs["fsdp"]
    exported = load_file(directory / "run" / "version_0" / "checkpoints" / "last.safetensors")
    assert {k: v.tolist() for k, v in exported.items()} == fsdp["module"]


@pytest.mark.distributed
def test_clipping_acts_on_the_sharded_gradients(runs: Any, tmp_path: Path) -> None:
    """With a threshold never reached the same run ends elsewhere: the threshold was reached, and applied
    to the FSDP gradients as to DDP's (the test above)."""
    _, fsdp = runs["fsdp"]
    unclipped = trained(tmp_path, "fsdp", gradient_clip_val=1e3)
    assert not np.allclose(np.array(unclipped["module"]["0.weight"]), np.array(fsdp["module"]["0.weight"]))


def first_epoch_checkpoint(directory: Path) -> Path:
    (found,) = (directory / "run" / "version_0" / "checkpoints").glob("ckpt-e0001-i000004*")
    return found


@pytest.mark.distributed
@pytest.mark.parametrize(("saved", "resumed"), [("fsdp", "ddp"), ("ddp", "fsdp")])
def test_a_checkpoint_resumes_under_the_other_strategy(
    runs: Any, tmp_path: Path, saved: str, resumed: str
) -> None:
    """Epoch 1 saved under one strategy, epoch 2 trained under the other: the straight run's end."""
    directory, straight = runs[saved]
    resumed_record = trained(tmp_path, resumed, "--resume", str(first_epoch_checkpoint(directory)))
    assert resumed_record["sharded"] is (resumed == "fsdp")
    assert_close_weights(resumed_record["module"], straight["module"])
    np.testing.assert_allclose(resumed_record["losses"], straight["losses"][4:], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_an_fsdp_checkpoint_loads_on_one_process(runs: Any) -> None:
    """Under FSDP the checkpoint plugin's format "auto" writes sharded checkpoints (every rank its
    shards, through DCP); one process reads them whole (DCP reshards), bitwise."""
    from epochal_checkpoint import load_latest

    directory, fsdp = runs["fsdp"]
    state, _ = load_latest(directory / "run" / "version_0" / "checkpoints")
    one = fsdp_mlp.make_model(**TRAINING)
    assert one.check_state(state["model"]) == []
    one.load_state_dict(state["model"])
    trained_weights = {k: v.tolist() for k, v in one.raw_module.state_dict().items()}
    assert trained_weights == fsdp["module"]  # bitwise: the same plain arrays
    assert one.optimizer_steps == 4
    assert set(state["model"]) == {"dcp", "steps"}  # sharded: the tensors are DCP's files
    ddp_state, _ = load_latest(runs["ddp"][0] / "run" / "version_0" / "checkpoints")
    assert set(ddp_state["model"]) == {"module", "optimizer", "steps"}  # DDP: one data.bin


def structure(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: structure(v) for k, v in value.items()}
    if isinstance(value, list):
        return [structure(v) for v in value]
    if isinstance(value, np.ndarray):
        return (value.shape, str(value.dtype))
    return type(value).__name__


@pytest.mark.distributed
def test_check_resume_passes_under_fsdp_with_bf16_mixed_and_sharded_saves_written_in_the_background(
    tmp_path: Path,
) -> None:
    """Stopped after batch 6 (mid-epoch 2, at an optimizer step), resumed: bitwise the straight
    run, with bf16-mixed and async_save (every rank's shards are staged in host memory and
    written by its own thread). One check-resume for both: it is five runs of two processes."""
    config = write_run(tmp_path, "fsdp", model={**TRAINING, "precision": "bf16-mixed"})
    background = ("--set", "plugins.checkpoint.async_save=true")
    done = epochal(tmp_path, "check-resume", str(config), "--nproc", "2", "--at", "6", *background)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "ok: interrupted after batch 6 of 8 and resumed" in done.stdout
    assert "written synchronously" not in done.stderr


@pytest.mark.distributed
def test_fsdp_with_windows_across_epoch_ends_defers_epoch_saves_and_ends_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    """3-batch windows, 4 batches per rank and epoch: the epoch-1 save waits for the optimizer
    step at batch 6; the final save at batch 8 leaves its 2-batch window out, and says so."""
    config = write_run(tmp_path, "fsdp", model={"accumulate_grad_batches": 3})
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "the epoch save due at iteration 4 came inside a gradient accumulation window" in done.stderr
    assert "leaves the window out (2 of 3 batches" in done.stderr
    saved = sorted(p.name for p in (tmp_path / "run").glob("*/checkpoints/ckpt-*"))
    assert saved == ["ckpt-e0001-i000006", "ckpt-e0002-i000008"], saved
    longer = epochal(tmp_path, "run", str(config), "--nproc", "2", "--resume", "--set", "loop.max_epochs=3")
    assert longer.returncode == 0, longer.stdout[-3000:] + longer.stderr[-5000:]
    assert "left out: training continues with a new window" in longer.stderr


# -- one process, bad input -----------------------------------------------------------------


def test_an_unknown_strategy_gets_the_validators_line(tmp_path: Path) -> None:
    config = write_run(tmp_path, "fsdq")
    done = epochal(tmp_path, "run", str(config))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "strategy" in line and "fsdq" in line and "Traceback" not in done.stderr
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="strategy"):  # TorchModel itself validates it too
        TorchModel(net, torch.optim.SGD(net.parameters()), torch.nn.functional.mse_loss, strategy="zero3")  # type: ignore[arg-type]


def test_fsdp_with_16_mixed_or_ddp_options_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"'fsdp' with precision '16-mixed'.*bf16-mixed"):
        fsdp_mlp.make_model("fsdp", precision="16-mixed")
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"'fsdp' takes no ddp_options \(given: static_graph\)"):
        TorchModel(
            net, torch.optim.SGD(net.parameters()), torch.nn.functional.mse_loss,
            ddp_options={"static_graph": True}, strategy="fsdp",
        )  # fmt: skip


def test_a_ddp_option_ddp_does_not_take_is_refused_on_one_process_already(tmp_path: Path) -> None:
    net = torch.nn.Linear(2, 2)
    expected = r"DistributedDataParallel has no argument 'static_grap' \(did you mean 'static_graph'\?\)"
    with pytest.raises(ConfigError, match=expected):
        TorchModel(
            net,
            torch.optim.SGD(net.parameters()),
            torch.nn.functional.mse_loss,
            ddp_options={"static_grap": True},
        )
    TorchModel(
        net,
        torch.optim.SGD(net.parameters()),
        torch.nn.functional.mse_loss,
        ddp_options={"static_graph": True},
    )
    # through the CLI: one line, exit 2, before a run on several processes would show it
    example = Path(__file__).resolve().parents[1] / "examples" / "digits_torch.toml"
    config = tmp_path / "digits_torch.toml"
    config.write_text(example.read_text())
    done = epochal(tmp_path, "run", str(config), "--set", "model.ddp_options={bogus_opt=1}")
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert "DistributedDataParallel has no argument 'bogus_opt'" in line and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_an_optimizer_over_a_tensor_of_no_module_is_refused_when_the_model_is_made() -> None:
    """The module has no parameters, so its optimizer holds a tensor of no module: DDP would
    not average its gradients and FSDP cannot shard it; refused on one process already."""
    with pytest.raises(ConfigError, match=r"optimizer 'optimizer' holds a tensor of shape \[1\] that is no "):
        fsdp_mlp.make_model("fsdp", empty=True)


@pytest.mark.distributed
def test_an_optimizer_over_a_tensor_of_no_module_stops_two_processes_in_one_line(tmp_path: Path) -> None:
    config = write_run(tmp_path, "fsdp", model={"empty": True})
    done = epochal(tmp_path, "run", str(config), "--nproc", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "TorchModel optimizer 'optimizer' holds a tensor" in line and "no parameter of the module" in line
    assert not (tmp_path / "run").exists()  # nothing written


def test_fsdp_on_one_process_trains_the_module_unsharded() -> None:
    model = fsdp_mlp.make_model("fsdp", accumulate_grad_batches=1)
    model.distribute(types.SimpleNamespace(size=1, rank=0, local_rank=0, backend=None, is_zero=True))
    assert not model.sharded and model.strategy == "fsdp"
    x, y = fsdp_mlp.arrays(8, 0)
    before = model.raw_module[0].weight.detach().clone()
    model.train_step((x, y))
    assert not torch.equal(before, model.raw_module[0].weight)


def test_the_wrapping_policy_enters_module_lists() -> None:
    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
            self.act = torch.nn.ReLU()
            self.head = torch.nn.Linear(4, 2)

    net = Blocks()
    assert shard_units(net) == [net.embed, *net.layers, net.head]


def test_fsdp_options_are_refused_in_one_line_where_they_cannot_work() -> None:
    with pytest.raises(
        ConfigError, match=r"^TorchModel strategy 'ddp' takes no fsdp_options \(given: cpu_off"
    ):
        fsdp_mlp.make_model("ddp", fsdp_options={"cpu_offload": True})
    with pytest.raises(ConfigError, match=r"unknown key 'reshard' \(did you mean 'reshard_after_forward'"):
        fsdp_mlp.make_model("fsdp", fsdp_options={"reshard": False})
    with pytest.raises(
        ConfigError, match=r"^TorchModel fsdp_options: forward_prefetch must be int ≥ 1, not str"
    ):
        fsdp_mlp.make_model("fsdp", fsdp_options={"forward_prefetch": "2"})
    expected = (
        r"wrap_policy names 'Linea', which no submodule of the module 'module' is \(did you mean 'Linear'"
    )
    with pytest.raises(ConfigError, match=expected):
        fsdp_mlp.make_model("fsdp", fsdp_options={"wrap_policy": ["Linear", "Linea"]})

    def nothing(module: torch.nn.Module) -> bool:
        return False

    with pytest.raises(ConfigError, match=r"wrap_policy 'nothing' selects no submodule of the module 'modu"):
        fsdp_mlp.make_model("fsdp", fsdp_options={"wrap_policy": nothing})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "options", "expected"),
    [
        ("fsdp", {"wrap_policy": ["Block"]}, "wrap_policy names 'Block', which no submodule of the module"),
        (
            "ddp",
            {"reshard_after_forward": False},
            "'ddp' takes no fsdp_options (given: reshard_after_forward)",
        ),
    ],
)
def test_the_cli_refuses_fsdp_options_in_one_line(
    tmp_path: Path, strategy: str, options: Any, expected: str
) -> None:
    config = write_run(tmp_path, strategy, model={"fsdp_options": options})
    done = epochal(tmp_path, "run", str(config))
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert expected in line and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_wrap_policy_selects_units_by_class_name_class_or_function_innermost_included() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)

    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), Block(), Block(), torch.nn.Linear(4, 2))
    blocks = [net[1], net[2]]
    assert shard_units(net, ["Block"]) == blocks
    assert shard_units(net, [Block]) == blocks
    assert shard_units(net, lambda m: isinstance(m, Block)) == blocks
    # nested units: in the order of registration (FSDP2 shards them innermost first)
    assert shard_units(net, ["Block", "torch.nn.modules.linear.Linear"]) == [
        net[1], net[1].inner, net[2], net[2].inner, net[3]
    ]  # fmt: skip


@pytest.fixture
def one_rank_group() -> Any:
    """A process group of one rank in this process: FSDP2 shards over it as over several (the
    2-process behaviour is the CLI tests' above; this one reaches what they cannot cheaply)."""
    dist = torch.distributed
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield types.SimpleNamespace(size=1, rank=0, local_rank=0, backend="gloo", is_zero=True)
    finally:
        dist.destroy_process_group()


def sharded_model(world: Any, **options: Any) -> TorchModel:
    from epochal.torch.fsdp import Sharded

    model = fsdp_mlp.make_model("fsdp", **options)
    model._sharded = Sharded(
        model.raw_module,
        {"module": model.raw_module},
        model.optimizers,
        world,
        model.device,
        "32-true",
        model.fsdp_options,
    )
    model.world = world
    return model


def unsharded_at_each_forward(model: TorchModel) -> list[str]:
    """Which of the 3 Linear units hold their gathered parameters ("U") or their shards ("S")
    when each unit's forward starts, over one training batch."""
    from torch.distributed.tensor import DTensor

    units = [model.raw_module[i] for i in (0, 2, 4)]
    seen: list[str] = []

    def look(module: torch.nn.Module, inputs: Any) -> None:
        seen.append("".join("S" if isinstance(u.weight, DTensor) else "U" for u in units))

    handles = [unit.register_forward_pre_hook(look) for unit in units]
    model.train_step(fsdp_mlp.arrays(8, 0))
    for handle in handles:
        handle.remove()
    return seen


def test_reshard_after_forward_false_keeps_each_unit_gathered_until_its_backward_also_after_evaluation(
    one_rank_group: Any,
) -> None:
    default = sharded_model(one_rank_group)
    assert unsharded_at_each_forward(default) == ["USS", "SUS", "SSU"]
    kept = sharded_model(one_rank_group, fsdp_options={"reshard_after_forward": False})
    assert unsharded_at_each_forward(kept) == ["USS", "UUS", "UUU"]
    kept.begin_evaluation("valid")  # gathers everything, then back to the training settings
    kept.eval_step(fsdp_mlp.arrays(8, 1))
    kept.end_evaluation("valid")
    assert unsharded_at_each_forward(kept) == ["USS", "UUS", "UUU"]


def test_a_sharded_state_round_trips_and_a_state_inside_a_window_leaves_it_out(one_rank_group: Any) -> None:
    model = sharded_model(one_rank_group, accumulate_grad_batches=2)
    assert model.sharded
    params = list(model.raw_module.parameters())
    assert all(type(p).__name__ == "DTensor" for p in params)
    assert [p for group in model.optimizer.param_groups for p in group["params"]] == params  # re-pointed
    batch = fsdp_mlp.arrays(8, 0)
    assert model.state_exact
    model.train_step(batch)
    assert not model.state_exact  # a checkpoint plugin defers its periodic saves
    with pytest.warns(RuntimeWarning, match=r"strategy 'fsdp': a state taken inside a gradient accumulation"):
        inside = model.state_dict()
    assert inside["steps"] == {"accumulated": 0, "optimizer_steps": 0, "left_out": 1}
    model.train_step(batch)  # the window closes: an optimizer step
    assert model.state_exact
    state = copy.deepcopy(model.state_dict())
    one = fsdp_mlp.make_model(accumulate_grad_batches=2)
    assert structure(state) == structure(copy.deepcopy(_stepped(one, batch)))
    mid = {**state, "steps": {"accumulated": 1, "optimizer_steps": 1}}
    (problem,) = model.check_state(mid)
    assert "accumulation window" in problem and "strategy 'fsdp' cannot continue" in problem
    model.train_step(batch)
    model.train_step(batch)
    model.load_state_dict(state)
    again = model.state_dict()
    for key, value in state["module"].items():
        assert np.array_equal(again["module"][key], value), key
    for pid, entry in state["optimizer"]["state"].items():
        for key, value in entry.items():
            assert np.array_equal(again["optimizer"]["state"][pid][key], value), (pid, key)
    assert again["steps"] == {"accumulated": 0, "optimizer_steps": 1}


def test_a_state_taken_before_the_first_step_leaves_the_optimizer_fresh(one_rank_group: Any) -> None:
    """DCP's get_optimizer_state_dict steps an optimizer that has no state yet (at lr 0) to make
    one: AdamW would count that step and train differently from a run that took no state."""
    model = sharded_model(one_rank_group)
    state = model.state_dict()
    assert state["optimizer"]["state"] == {}
    assert model.optimizer is not None and not model.optimizer.state
    model.train_step(fsdp_mlp.arrays(8, 0))
    assert [float(s["step"]) for s in model.optimizer.state.values()] == [1.0] * 6


def _stepped(model: TorchModel, batch: Any) -> dict[str, Any]:
    model.train_step(batch)
    model.train_step(batch)
    return model.state_dict()


def test_a_sharded_state_may_name_a_url_with_its_stores_options() -> None:
    model = fsdp_mlp.make_model()
    assert (
        model.check_state({"dcp": "s3://bucket/run/ckpt-e0001-i000004", "dcp_storage": {"anon": False}}) == []
    )
    problems = model.check_state({"dcp": "s3://bucket/run/ckpt-e0001-i000004", "dcp_storage": "anon"})
    assert problems == ["dcp_storage must be a table of the URL's filesystem options"]
