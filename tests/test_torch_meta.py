"""Modules built on the meta device, and ``pretrained`` weights, on one process (issue 46).

On one process (and under DDP) a meta module is given memory whole when the model is made, then
initialised by each submodule's ``reset_parameters`` (torch's convention) or by the model's
``init_weights``; ``pretrained`` weights (safetensors, DCP) are then read into it. Under FSDP on
several processes each rank materialises its own shards instead: ``test_torch_fsdp.py``.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epochal.errors import ConfigError, EpochalError  # noqa: E402
from epochal.testing import epochal_command  # noqa: E402
from epochal.torch import TorchModel  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fsdp_mlp  # noqa: E402


def batch() -> tuple[np.ndarray, np.ndarray]:
    return fsdp_mlp.arrays(8, 0)


def states_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_meta_module_is_materialised_whole_on_one_process_as_its_init_would_draw(strategy: str) -> None:
    """to_empty, then every submodule's reset_parameters in the order of its registration: the
    numbers the module's own __init__ draws (nn.Linear's init is its reset_parameters)."""
    meta = fsdp_mlp.make_model(strategy, meta=True)
    host = fsdp_mlp.make_model(strategy)
    assert not any(t.is_meta for t in meta.raw_module.state_dict().values())
    assert states_equal(meta.raw_module, host.raw_module)
    # the optimizer made on the meta parameters holds the materialised ones (swapped in place)
    assert meta.optimizer is not None
    assert meta.optimizer.param_groups[0]["params"] == list(meta.raw_module.parameters())
    meta.train_step(batch())
    host.train_step(batch())
    assert states_equal(meta.raw_module, host.raw_module)


def test_tied_weights_stay_tied() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    with torch.device("meta"):
        net = Tied()
    TorchModel(net, torch.optim.SGD(net.parameters()), torch.nn.functional.cross_entropy, device="cpu")
    assert net.head.weight is net.embed.weight and not net.head.weight.is_meta
    assert len(list(net.parameters())) == 1


class Scale(torch.nn.Module):
    """A parameter of its own and no reset_parameters (as many a user's module)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(n))

    def forward(self, x: Any) -> Any:
        return x * self.gain


def test_tensors_already_on_the_host_keep_their_values_and_need_no_initialiser() -> None:
    """Only what is on the meta device is given memory and initialised (to_empty would give every
    tensor new memory): a head built on the host beside a meta body keeps its weights."""
    torch.manual_seed(0)
    with torch.device("meta"):
        body = torch.nn.Linear(3, 4)
    head = Scale(4)
    head.gain.data = torch.arange(4.0)
    net = torch.nn.Sequential(body, head)  # Scale has no reset_parameters: not needed, it is real
    make(net)
    assert torch.equal(net[1].gain, torch.arange(4.0))
    assert not net[0].weight.is_meta and net[0].weight.abs().max() > 0


def scaled(meta: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Sequential(Scale(4)))


def make(net: torch.nn.Module, **options: Any) -> TorchModel:
    return TorchModel(
        net, torch.optim.SGD(net.parameters()), torch.nn.functional.mse_loss, device="cpu", **options
    )


def test_a_meta_submodule_without_initialiser_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(ConfigError) as error:
        make(scaled())
    (line,) = str(error.value).splitlines()
    assert "module 'module' (its submodule '1.0'): Scale is on the meta device, holds gain" in line
    assert "no reset_parameters()" in line and "init_weights" in line


def test_init_weights_initialises_each_meta_module_in_place_of_reset_parameters() -> None:
    called: list[torch.nn.Module] = []

    def init(module: torch.nn.Module) -> None:
        called.append(module)
        for param in module.parameters():
            torch.nn.init.constant_(param, 0.5)

    net = scaled()
    make(net, init_weights=init)
    assert called == [net]
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in net.parameters())


def test_pretrained_safetensors_weights_need_no_initialiser_for_what_they_hold(tmp_path: Path) -> None:
    """The weights hold Scale's gain: only the Linear is initialised (its reset_parameters);
    the file's tensors are read after."""
    from safetensors.torch import save_file

    save_file({"1.0.gain": torch.arange(4.0)}, tmp_path / "gain.safetensors")
    net = scaled()
    make(net, pretrained=tmp_path / "gain.safetensors")
    assert torch.equal(net[1][0].gain, torch.arange(4.0))
    assert torch.equal(net[0].weight, scaled(meta=False)[0].weight)


def test_pretrained_weights_load_from_a_directory_of_files_and_into_a_module_on_the_host(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    host = fsdp_mlp.make_model(seed=1).raw_module.state_dict()
    save_file({k: v for k, v in host.items() if k.startswith("0.")}, tmp_path / "model-1.safetensors")
    save_file({k: v for k, v in host.items() if not k.startswith("0.")}, tmp_path / "model-2.safetensors")
    for meta in (True, False):
        model = fsdp_mlp.make_model(meta=meta, pretrained=str(tmp_path))
        assert all(torch.equal(v, host[k]) for k, v in model.raw_module.state_dict().items())


def test_pretrained_weights_of_several_modules_are_named_by_module(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with torch.device("meta"):
        nets = {"student": torch.nn.Linear(2, 2), "teacher": torch.nn.Linear(2, 2)}
    save_file({"teacher.weight": torch.eye(2), "teacher.bias": torch.ones(2)}, tmp_path / "t.safetensors")
    model = TorchModel(
        nets,
        {"student": torch.optim.SGD(nets["student"].parameters())},
        training_step=lambda model, batch: model.modules["student"](batch).sum(),
        device="cpu",
        pretrained=str(tmp_path / "t.safetensors"),
    )
    assert torch.equal(model.modules["teacher"].weight, torch.eye(2))
    assert not model.modules["student"].weight.is_meta


def test_pretrained_weights_load_from_a_dcp_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    saved = fsdp_mlp.make_model(seed=3)
    dcp.save(saved.sharded_state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model = fsdp_mlp.make_model(meta=True, pretrained=str(tmp_path / "dcp"))
    assert states_equal(model.raw_module, saved.raw_module)
    assert model.optimizer is not None and not model.optimizer.state  # the weights only: a fresh optimizer


W, A, B = "w.safetensors", "a.safetensors", "b.safetensors"


@pytest.mark.parametrize(
    ("files", "given", "expected"),
    [
        ({W: {"9.weight": [2]}}, W, r"holds '9.weight', which the model has not"),
        ({W: {"0.weight": [6, 32]}}, W, r"'0.weight' has shape \[6, 32\] in w.+ the model's \[32, 6\]"),
        ({A: {"0.bias": [32]}, B: {"0.bias": [32]}}, ".", r"'0.bias' is in a.safetensors and in b.safet"),
        ({}, "missing.safetensors", r"not a .safetensors file.*\(the path does not exist\)"),
        ({}, ".", r"the directory holds no .safetensors file"),
        ({"w.txt": None}, "w.txt", r"not a .safetensors file, a directory of them"),
    ],
)
def test_pretrained_weights_that_do_not_fit_are_refused_in_one_line_when_the_model_is_made(
    tmp_path: Path, files: dict[str, Any], given: str, expected: str
) -> None:
    from safetensors.torch import save_file

    for name, tensors in files.items():
        if tensors is None:
            (tmp_path / name).write_text("weights")
        else:
            save_file({k: torch.zeros(shape) for k, shape in tensors.items()}, tmp_path / name)
    with pytest.raises(ConfigError) as error:
        fsdp_mlp.make_model(meta=True, pretrained=str(tmp_path / given))
    (line,) = str(error.value).splitlines()
    assert line.startswith(f"TorchModel pretrained {str(tmp_path / given)!r}:")
    assert re.search(expected, line), line


def test_a_dcp_checkpoint_that_does_not_fit_is_one_error_naming_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    net = torch.nn.Linear(2, 2)
    dcp.save({"model": net.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(EpochalError) as error:
        fsdp_mlp.make_model(meta=True, pretrained=str(tmp_path / "dcp"))
    (line,) = str(error.value).splitlines()
    assert str(tmp_path / "dcp") in line and "Missing key in checkpoint state_dict: model.0.weight" in line


def test_options_of_the_wrong_type_are_refused_by_the_validator() -> None:
    with pytest.raises(ConfigError, match=r"^TorchModel: init_weights must be Callable.* not 'init'$"):
        make(scaled(), init_weights="init")
    with pytest.raises(ConfigError, match=r"^TorchModel: pretrained must be str \| Path \| None, not 3$"):
        make(scaled(), pretrained=3)


@pytest.mark.slow
def test_the_cli_says_which_meta_module_has_no_initialiser_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "meta_factory.py").write_text(
        textwrap.dedent(
            """
            import torch
            from epochal.torch import TorchModel

            class Scale(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.gain = torch.nn.Parameter(torch.ones(3))

            def make_model():
                with torch.device("meta"):
                    net = torch.nn.Sequential(torch.nn.Linear(3, 3), Scale())
                return TorchModel(net, torch.optim.SGD(net.parameters()), torch.nn.functional.mse_loss)
            """
        )
    )
    config = fsdp_mlp.write_config(tmp_path, "ddp")
    config.write_text(config.read_text().replace("fsdp_mlp:make_model", "meta_factory:make_model"))
    config.write_text(config.read_text().replace('strategy = "ddp"\n', ""))
    done = epochal_command("run", str(config), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert "(its submodule '1'): Scale is on the meta device" in line and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
