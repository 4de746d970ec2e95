"""Each port against its original, on the CPU: the unmodified script of pytorch/examples (DCGAN
``--dataset fake``, VAE on an MNIST made here) or the plain PyTorch loop (a Hugging Face causal
LM), then the port through ``epochal run``, then the port killed with SIGKILL inside an epoch
and resumed with ``--resume``. The weights must be equal bitwise, every time.

torchvision needs the torch release it was built for (the CPU wheel of torch 2.13 has no
torchvision that loads beside it): ``tox -e ports`` installs a matching pair; elsewhere the
tests that need it are skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
PORTS = HERE.parent
ORIGINALS = PORTS / "originals"

pytestmark = pytest.mark.slow


def needs(module: str) -> None:
    try:
        __import__(module)
    except Exception as error:  # torchvision fails with RuntimeError beside a mismatched torch
        pytest.skip(f"{module} is not importable here ({type(error).__name__}): tox -e ports runs this")


def run(
    cwd: Path, *args: str, kill_at: int | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPOCHAL_", "PORTS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    if kill_at is not None:
        env["PORTS_KILL_AT"] = str(kill_at)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def port_config(directory: Path, name: str, **replace: str) -> Path:
    """*name*.toml of the ports, with a SIGKILL plugin after the checkpoint plugin and lines
    replaced (``key = ...`` lines by key, the first of each)."""
    lines = (PORTS / f"{name}.toml").read_text(encoding="utf-8").splitlines()
    for key, value in replace.items():
        at = next(i for i, line in enumerate(lines) if line.split("=")[0].strip() == key)
        lines[at] = f"{key} = {value}"
    lines += ["", "[plugins.kill]", 'factory = "killer:KillAt"']
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def straight_and_killed(base: Path, name: str, kill_at: int, **replace: str) -> list[Path]:
    """The port run straight, and killed after batch *kill_at* then resumed, each in a directory of
    its own under *base* (its working directory); those directories."""
    out = []
    for case in ("straight", "killed"):
        work = base / case
        work.mkdir(parents=True)
        config = port_config(work, name, **replace)
        if case == "straight":
            ok(run(work, "-m", "epochal", "run", str(config)))
        else:
            died = run(work, "-m", "epochal", "run", str(config), kill_at=kill_at)
            assert died.returncode != 0, died.stdout[-2000:]
            resumed = run(work, "-m", "epochal", "run", str(config), "--resume")
            ok(resumed)
        out.append(work)
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), f"{what}: {key}"


def exported(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    (path,) = run_dir.glob("version_*/checkpoints/last.safetensors")
    return load_file(path)


# -- DCGAN ----------------------------------------------------------------------------------------

DCGAN_ARGS = ["--dataset", "fake", "--manualSeed", "7", "--workers", "0", "--niter", "1"]
DCGAN_ARGS += ["--ngf", "8", "--ndf", "8", "--nz", "16"]


def test_dcgan_equals_the_original_script_straight_and_through_kill_9(tmp_path: Path) -> None:
    needs("torchvision")
    original = tmp_path / "original"
    original.mkdir()
    ok(run(original, str(ORIGINALS / "dcgan_main.py"), *DCGAN_ARGS, "--outf", "out"))
    # FakeData's 1000 images in batches of 64: 16 batches an epoch; batch 12 is inside it, and
    # the newest checkpoint then is batch 10's
    straight, killed = straight_and_killed(tmp_path, "dcgan", kill_at=12)
    for port in (straight, killed):
        for epoch in (0,):
            for net in ("G", "D"):
                name = f"net{net}_epoch_{epoch}.pth"
                assert_same(
                    torch.load(original / "out" / name),
                    torch.load(port / "runs" / "dcgan" / "samples" / name),
                    f"{port.parent.name} {name}",
                )


# -- VAE ------------------------------------------------------------------------------------------


def write_mnist(root: Path, train: int = 640, test: int = 256) -> None:
    """MNIST's four files in torchvision's raw layout (idx, big-endian headers), made of blurred
    random strokes: what ``datasets.MNIST(root)`` reads without downloading."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("t10k", test)):
        images = np.zeros((count, 28, 28), np.float32)
        for i in range(count):
            x, y = rng.integers(6, 22, size=2)
            images[i, max(0, y - 6) : y + 6, max(0, x - 2) : x + 2] = 1.0
        images = (255 * np.clip(images + 0.1 * rng.random(images.shape), 0, 1)).astype(np.uint8)
        labels = rng.integers(0, 10, count).astype(np.uint8)
        header = np.array([2051, count, 28, 28], dtype=">i4").tobytes()
        (raw / f"{split}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            np.array([2049, count], ">i4").tobytes() + labels.tobytes()
        )


def test_vae_equals_the_original_script_straight_and_through_kill_9(tmp_path: Path) -> None:
    needs("torchvision")
    write_mnist(tmp_path / "data")
    original = tmp_path / "original"
    (original / "results").mkdir(parents=True)
    shutil.copy(ORIGINALS / "vae_main.py", original / "main.py")
    # the script, unmodified, run as __main__; its model read from its globals afterwards
    harness = (
        "import runpy, sys, torch; "
        "sys.argv = ['main.py', '--no-accel', '--epochs', '2', '--batch-size', '64']; "
        "g = runpy.run_path('main.py', run_name='__main__'); torch.save(g['model'].state_dict(), 'final.pt')"
    )
    ok(run(original, "-c", harness))
    reference = torch.load(original / "final.pt")
    # 640 examples in batches of 64: 10 batches an epoch; batch 14 is inside the second epoch
    data = f'"{tmp_path / "data"}"'
    for port in straight_and_killed(
        tmp_path / "port", "vae", kill_at=14, root=data, batch_size="64", every_n_batches="3"
    ):
        assert_same(reference, exported(port / "runs" / "vae"), f"{port.parent.name}")
        assert (port / "results" / "sample_2.png").exists()


# -- a Hugging Face causal LM ---------------------------------------------------------------------


def test_a_transformers_causal_lm_equals_the_plain_loop_straight_and_through_kill_9(tmp_path: Path) -> None:
    needs("transformers")
    # the plain loop in a process of its own, as the port's runs (the same threads: a reduction
    # over another number of threads adds in another order)
    plain = tmp_path / "plain"
    plain.mkdir()
    ok(
        run(
            plain,
            "-c",
            "import torch; from epochal_ports.causal_lm import plain_loop; "
            "torch.save(plain_loop(epochs=2, accumulate=2, clip=1.0).state_dict(), 'final.pt')",
        )
    )
    reference = {k: v for k, v in torch.load(plain / "final.pt").items() if not k.endswith(".attn.bias")}
    # 96 sequences in batches of 8: 12 batches an epoch; batch 17 is inside the second epoch
    for port in straight_and_killed(tmp_path, "causal_lm", kill_at=17):
        weights = exported(port / "runs" / "causal_lm")
        assert_same({k: reference[k] for k in weights}, weights, port.name)
        assert set(reference) - set(weights) <= {"lm_head.weight"}  # tied to the token embedding


# -- FSDP2 ----------------------------------------------------------------------------------------


def syntax(path: Path) -> str:
    """The syntax tree of a module's code (its docstring left out)."""
    import ast

    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return "\n".join(ast.dump(node) for node in body)


def test_the_fsdp2_port_uses_the_examples_model_file() -> None:
    assert syntax(PORTS / "src" / "epochal_ports" / "fsdp2_model.py") == syntax(ORIGINALS / "fsdp2_model.py")


def test_the_fsdp2_ports_meta_model_initialises_every_block_on_one_process() -> None:
    """The example's ``Transformer.reset_parameters`` misses the blocks; every submodule's own
    initialises them all: the weights the Transformer built on the host draws."""
    from epochal_ports.fsdp2 import make_model
    from epochal_ports.fsdp2_model import ModelArgs, Transformer

    port = make_model(device="cpu")
    torch.manual_seed(0)
    host = Transformer(ModelArgs(n_layers=10, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0))
    for name, value in host.state_dict().items():
        assert torch.equal(port.raw_module.state_dict()[name], value), name


@pytest.mark.distributed
def test_the_fsdp2_port_from_the_same_weights_ends_where_the_examples_loop_does(tmp_path: Path) -> None:
    """Both on 2 gloo processes, with explicit prefetching, started from the same safetensors
    weights (the example's loop through its DTensor-API load, the port through ``pretrained``):
    the final weights are equal bitwise."""
    from epochal_ports.fsdp2_model import ModelArgs, Transformer
    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    host = Transformer(ModelArgs(n_layers=10, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0))
    weights = tmp_path / "weights.safetensors"
    save_file(host.state_dict(), weights)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    plain = HERE / "fsdp2_plain.py"
    ok(run(tmp_path, *launcher, str(plain), str(weights), "plain.safetensors", "--explicit-prefetching"))
    config = tmp_path / "fsdp2.toml"
    text = (PORTS / "fsdp2.toml").read_text(encoding="utf-8")
    config.write_text(text.replace('device = "cpu"', f'device = "cpu"\npretrained = "{weights}"'), "utf-8")
    ok(run(tmp_path, "-m", "epochal", "run", str(config), "--nproc", "2"))
    expected = load_file(tmp_path / "plain.safetensors")
    (exported,) = (tmp_path / "runs" / "fsdp2").glob("version_*/checkpoints/last.safetensors")
    got = load_file(exported)
    assert got.keys() == expected.keys()
    assert not torch.equal(got["output.weight"], host.state_dict()["output.weight"])  # trained
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
