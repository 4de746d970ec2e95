"""Every Python recipe in docs/ runs, and the ones that promise a behaviour keep it.

The ```python blocks of a page run in order in one namespace (as a reader pastes them into one
session), in a fresh directory, after a short prelude that supplies what the page assumes
(``model``, ``data``, ``MyNet``...). A block that is an excerpt rather than a recipe (a
generated wrapper, an indented method, a fragment with ``...``) carries an
``<!-- illustration -->`` line right before its fence. Afterwards a page's checks assert what
its text promises.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(?P<before>[^\n]*)\n(?P<indent> *)```python\n(?P<code>.*?)\n(?P=indent)```", re.S)
ILLUSTRATION = "<!-- illustration -->"


def blocks(page: Path) -> list[tuple[int, str, bool]]:
    """(line, code, is an illustration) of every ```python block of *page*."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code"))
        code = textwrap.dedent(match.group("code"))
        found.append((line, code, match.group("before").strip() == ILLUSTRATION))
    return found


TINY = """
from epochal.examples.tiny import TinyModel, tiny_data
model, data = TinyModel(), tiny_data()
m1, m2 = TinyModel(seed=1), TinyModel(seed=2)
"""

#: what a page assumes, run before its blocks.
PRELUDES: dict[str, str] = {
    "api.md": "",  # its block is whole (it used the guide's LossGuard without defining it)
    "migrating.md": "",
    "plugins/checkpoint.md": """
import torch
from epochal.torch import TorchModel
torch.manual_seed(0)
net = torch.nn.Linear(4, 3)
model = TorchModel(net, torch.optim.Adam(net.parameters()), torch.nn.functional.cross_entropy, device="cpu")
batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(4)]
data = {"train": batches, "valid": batches[:2]}
""",
    "plugins/earlystop.md": TINY,
    "plugins/sqlite.md": TINY
    + """
from epochal import Loop
from epochal_sqlite import SQLiteLog
Loop(model, data, plugins={"sqlite_log": SQLiteLog()}, max_epochs=2, run_dir="runs/digits").run()
""",
    "pytorch.md": "",  # its first block is whole: it runs as a reader pastes it
    "writing-plugins.md": "",
}


def check_api(ns: dict[str, Any], out: str) -> None:
    assert set(ns["loop"].last_metrics["valid"]) >= {"loss", "accuracy"}
    assert "{'loss': 0.3206, 'accuracy': 0.9359}" in out  # what the page says it prints (issue 47)


def check_checkpoint(ns: dict[str, Any], out: str) -> None:
    state, info = ns["state"], ns["info"]
    assert info.path.parent == Path("runs/x/checkpoints").resolve() or info.path.parent.name == "checkpoints"
    assert state["epoch"] >= 1


def check_earlystop(ns: dict[str, Any], out: str) -> None:
    assert ns["es"].best_epoch is not None


def check_sqlite(ns: dict[str, Any], out: str) -> None:
    assert "valid.loss" in out


def check_pytorch(ns: dict[str, Any], out: str) -> None:
    """``make_model`` trains; ``GradNorm`` logs a norm in the row of each batch that stepped the
    optimizer (with accumulation, every second batch), as a value equal to the gradients' norm."""
    import torch

    from epochal import Loop, hookimpl
    from epochal.torch import TorchModel

    model = ns["make_model"](device="cpu", accumulate_grad_batches=2)
    assert isinstance(model, TorchModel)
    torch.manual_seed(0)
    batches = [(torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))) for _ in range(6)]
    seen: list[float] = []

    class Witness:  # the norm the optimizer saw, computed independently
        run_after = ("grad_norm",)

        @hookimpl
        def before_optimizer_step(self, optimizer: Any) -> None:
            grads = [
                p.grad.flatten() for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
            seen.append(float(torch.cat(grads).norm()))

    loop = Loop(
        model, {"train": batches}, plugins={"grad_norm": ns["GradNorm"](), "witness": Witness()}, max_epochs=1
    )
    log = loop.run()
    logged = {i: float(row["grad_norm"]) for i, row in log.rows() if "grad_norm" in row}
    assert sorted(logged) == [2, 4, 6]  # the stepping batches' rows, not the ones before them
    assert [logged[i] for i in (2, 4, 6)] == pytest.approx(seen, rel=1e-5)
    # the first block trains the MLP on digits (it learns), the own steps train and evaluate
    assert ns["loop"].last_metrics["valid"]["accuracy"] > 0.5
    assert ns["lm_loop"].model.optimizer_steps == 16 and "loss" in ns["lm_loop"].last_metrics["valid"]
    gan = ns["gan_loop"].model
    assert gan.optimizer_steps == 16 and gan.stepped_optimizers == {"generator", "discriminator"}
    assert "d_real" in ns["gan_loop"].last_metrics["valid"]


def check_writing_plugins(ns: dict[str, Any], out: str) -> None:
    """The guard stops a run whose loss exceeds its limit; the all-rank alarm stops on one process
    too; the composite builds its three children."""
    from epochal import Loop
    from epochal.examples.tiny import TinyModel, tiny_data

    log = Loop(
        TinyModel(), tiny_data(), plugins={"loss_guard": ns["LossGuard"](limit=0.0)}, max_epochs=3
    ).run()
    assert log.status["finish_reason"].startswith("loss_guard")
    log = Loop(
        TinyModel(), tiny_data(), plugins={"alarm": ns["GradNormAlarm"](limit=0.0)}, max_epochs=3
    ).run()
    assert log.status["epochs_done"] == 1 and "mean loss" in log.status["finish_reason"]
    assert sorted(ns["Guarded"]().plugins) == ["guard", "save", "stop"]


def check_migrating(ns: dict[str, Any], out: str) -> None:
    """The Keras ``fit(x, y, validation_data=...)`` factory gives streams a loop trains on."""
    from epochal import Loop
    from epochal.examples.tiny import TinyModel

    data = ns["make_streams"](batch_size=32)
    assert sorted(data) == ["train", "valid"] and len(data["train"]) == 8 and len(data["valid"]) == 2
    x, y = next(iter(data["train"]))
    assert x.shape == (32, 8) and y.shape == (32,)
    first = [batch[1].tolist() for batch in data["valid"]]
    assert first == [batch[1].tolist() for batch in data["valid"]]  # not shuffled
    model = TinyModel(features=8)
    log = Loop(model, ns["make_streams"](), max_epochs=2).run()  # fresh streams (those above were read)
    assert log.status["epochs_done"] == 2 and [i for i, _ in log.history("valid.loss")] == [8, 16]
    # the Keras-like and Ignite-like steps of your own learn the regression (their valid loss
    # falls far below the data's variance, 5.25)
    for name in ("keras_loop", "ignite_loop"):
        loop = ns[name]
        assert loop.model.optimizer_steps == 30, name  # 6 batches x 5 epochs
        assert loop.last_metrics["valid"]["loss"] < 0.5, name


CHECKS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "api.md": check_api,
    "migrating.md": check_migrating,
    "plugins/checkpoint.md": check_checkpoint,
    "plugins/earlystop.md": check_earlystop,
    "plugins/sqlite.md": check_sqlite,
    "pytorch.md": check_pytorch,
    "writing-plugins.md": check_writing_plugins,
}

PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if any(not i for *_, i in blocks(p)))


def test_every_recipe_page_is_run():
    """A page with a runnable block needs a prelude and checks here (or its blocks marked)."""
    assert sorted(PAGES) == sorted(PRELUDES), "add the page to PRELUDES/CHECKS, or mark its excerpts"


@pytest.mark.parametrize("page", PAGES)
def test_recipes_of_a_page_run(page, tmp_path, monkeypatch, capsys):
    for module in (
        ("torch", "torchmetrics", "safetensors")
        if page in ("pytorch.md", "plugins/checkpoint.md", "migrating.md")
        else ()
    ):
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": f"docs_{page.replace('/', '_').removesuffix('.md')}"}
    exec(compile(textwrap.dedent(PRELUDES[page]), f"prelude of {page}", "exec"), namespace)
    for line, code, illustration in blocks(DOCS / page):
        if not illustration:
            exec(compile(code, f"docs/{page}:{line}", "exec"), namespace)
    CHECKS[page](namespace, capsys.readouterr().out)
