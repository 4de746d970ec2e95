"""Models whose training step is the user's own, and the hand-written loops they must equal.

Imported by ``test_torch_own_step.py`` and, as factories named in TOML, by the processes of
``test_torch_own_step_cli.py``:

- a small GAN (generator and discriminator with BatchNorm, each its Adam), trained under manual
  optimization in the order of pytorch/examples' DCGAN: discriminator on real then on fake, its
  step, then the generator through the discriminator, its step;
- a causal language model that computes its own loss from ``labels`` in a dict batch (as a
  Hugging Face model does), trained under automatic optimization;
- a student distilled from a frozen teacher (a module no optimizer trains).

Each ``hand_*`` function trains the same thing in a plain PyTorch loop.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 (torch's own spelling)

from epochal import hookimpl
from epochal.data import BatchStream
from epochal.torch import TorchModel

NZ, FEATURES = 4, 6


# -- the GAN ----------------------------------------------------------------------------------


def gan_modules(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The generator and the discriminator, initialised from *seed* (the global generator untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        generator = nn.Sequential(
            nn.Linear(NZ, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, FEATURES), nn.Tanh()
        )
        discriminator = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.LeakyReLU(0.2),
            nn.Linear(16, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2),
            nn.Linear(8, 1), nn.Flatten(0), nn.Sigmoid(),  # no view returned (FSDP2 warns of those)
        )  # fmt: skip
    return generator, discriminator


def gan_optimizers(generator: nn.Module, discriminator: nn.Module, lr: float = 2e-3) -> dict[str, Any]:
    return {
        "generator": torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.5, 0.999)),
        "discriminator": torch.optim.Adam(discriminator.parameters(), lr=lr, betas=(0.5, 0.999)),
    }


def gan_losses(
    generator: nn.Module,
    discriminator: nn.Module,
    real: torch.Tensor,
    backward: Any,
    step: Any,
) -> dict[str, torch.Tensor]:
    """One batch of the DCGAN example's loop; *backward*/*step* are the loop's own."""
    discriminator.zero_grad()
    label = torch.full((real.shape[0],), 1.0)
    err_real = F.binary_cross_entropy(discriminator(real), label)
    backward(err_real)
    fake = generator(torch.randn(real.shape[0], NZ))
    label.fill_(0.0)
    err_fake = F.binary_cross_entropy(discriminator(fake.detach()), label)
    backward(err_fake)
    step("discriminator")
    generator.zero_grad()
    label.fill_(1.0)
    err_g = F.binary_cross_entropy(discriminator(fake), label)
    backward(err_g)
    step("generator")
    return {"loss_d": err_real + err_fake, "loss_g": err_g}


def gan_step(model: TorchModel, batch: Any) -> dict[str, torch.Tensor]:
    """The manual training step: the DCGAN loop's body, through the model's backward and steps."""
    real = batch[0] if isinstance(batch, (tuple, list)) else batch
    return gan_losses(
        model.modules["generator"], model.modules["discriminator"], real, model.backward, model.optimizer_step
    )


def gan_eval(model: TorchModel, batch: Any) -> dict[str, torch.Tensor]:
    """How well the discriminator tells real from generated examples."""
    real = batch[0] if isinstance(batch, (tuple, list)) else batch
    fake = model.modules["generator"](torch.randn(real.shape[0], NZ))
    scores = model.modules["discriminator"](torch.cat([real, fake]))
    labels = torch.cat([torch.ones(real.shape[0]), torch.zeros(real.shape[0])])
    return {"loss": F.binary_cross_entropy(scores, labels), "d_real": scores[: real.shape[0]].mean()}


def make_gan(
    seed: int = 0,
    lr: float = 2e-3,
    precision: str = "32-true",
    strategy: str = "ddp",
    automatic_optimization: Any = False,
    **options: Any,
) -> TorchModel:
    generator, discriminator = gan_modules(seed)
    return TorchModel(
        {"generator": generator, "discriminator": discriminator},
        gan_optimizers(generator, discriminator, lr),
        training_step=gan_step,
        validation_step=gan_eval,
        automatic_optimization=automatic_optimization,
        device="cpu",
        precision=precision,
        strategy=strategy,  # type: ignore[arg-type]
        **options,
    )


def real_examples(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centre = np.linspace(-0.5, 0.5, FEATURES, dtype=np.float32)
    return (centre + 0.1 * rng.standard_normal((n, FEATURES))).astype(np.float32)


def make_gan_data(n_train: int = 48, n_valid: int = 16, batch_size: int = 8) -> dict[str, Any]:
    return {
        "train": BatchStream(real_examples(n_train), batch_size=batch_size, shuffle=True, seed=3),
        "valid": BatchStream(real_examples(n_valid, seed=2), batch_size=batch_size),
    }


def hand_gan(batches: Iterable[torch.Tensor], seed: int = 0, lr: float = 2e-3) -> dict[str, nn.Module]:
    """The same GAN trained by a plain loop over *batches*: its modules by name."""
    generator, discriminator = gan_modules(seed)
    optimizers = gan_optimizers(generator, discriminator, lr)
    generator.train()
    discriminator.train()
    for real in batches:
        gan_losses(
            generator, discriminator, real, lambda loss: loss.backward(), lambda n: optimizers[n].step()
        )
    return {"generator": generator, "discriminator": discriminator}


# -- a causal language model with its own loss -------------------------------------------------


class TinyCausalLM(nn.Module):
    """Embedding, a GRU and a head; ``forward(input_ids, labels=None)`` returns an object with
    ``logits`` and, given labels, ``loss`` (labels shifted inside, as Hugging Face's causal LMs)."""

    def __init__(self, vocab: int = 17, width: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        hidden, _ = self.rnn(self.dropout(self.embed(input_ids)))
        logits = self.head(hidden)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        return type("Output", (), out)()


def lm_step(model: TorchModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return model.module(**batch).loss


def make_lm(seed: int = 0, **options: Any) -> TorchModel:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = TinyCausalLM()
    return TorchModel(
        net, torch.optim.AdamW(net.parameters(), lr=1e-2), training_step=lm_step, device="cpu", **options
    )


def token_batches(count: int, seed: int = 0, size: int = 4, length: int = 9) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 17, (size, length), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


# -- distillation from a frozen teacher ----------------------------------------------------------


def distill_step(model: TorchModel, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    with torch.no_grad():
        soft = model.modules["teacher"](x).softmax(-1)
    logits = model.modules["student"](x)
    hard = F.cross_entropy(logits, y)
    soft_loss = F.kl_div(logits.log_softmax(-1), soft, reduction="batchmean")
    return {"loss": 0.5 * hard + 0.5 * soft_loss, "hard": hard}


def distill_modules(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        teacher = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
        student = nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.2), nn.ReLU(), nn.Linear(4, 3))
    return teacher, student


# -- two modules under automatic optimization, with accumulation --------------------------------


def two_part_step(model: TorchModel, batch: Any) -> torch.Tensor:
    real = batch[0] if isinstance(batch, (tuple, list)) else batch
    code = model.modules["encoder"](real)
    return F.mse_loss(model.modules["decoder"](code), real)


def make_two_part(accumulate_grad_batches: int = 2, strategy: str = "ddp") -> TorchModel:
    """An autoencoder as two modules, each with its optimizer, one loss: automatic optimization."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        encoder, decoder = nn.Linear(FEATURES, 3), nn.Linear(3, FEATURES)
    return TorchModel(
        {"encoder": encoder, "decoder": decoder},
        {
            "encoder": torch.optim.SGD(encoder.parameters(), lr=0.1),
            "decoder": torch.optim.Adam(decoder.parameters()),
        },
        training_step=two_part_step,
        accumulate_grad_batches=accumulate_grad_batches,
        device="cpu",
        strategy=strategy,  # type: ignore[arg-type]
    )


class CountAllReduces:
    """Counts each DDP wrapper's all-reduces (a communication hook on each) into record.json's
    ``allreduces`` (by module name), with the optimizer steps."""

    def __init__(self, path: str = "allreduces.json") -> None:
        self.path = path
        self.counts: dict[str, int] = {}

    @hookimpl
    def before_training(self, loop: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        for name, wrapper in loop.model.parts.ddp.items():
            self.counts[name] = 0

            def counting(state, bucket, name=name):  # type: ignore[no-untyped-def]  # DDP reads annotations
                self.counts[name] += 1
                return allreduce_hook(state, bucket)

            wrapper.register_comm_hook(None, counting)

    @hookimpl
    def after_training(self, loop: Any) -> None:
        if loop.world.is_zero:
            record = {"allreduces": self.counts, "optimizer_steps": loop.model.optimizer_steps}
            Path(self.path).write_text(json.dumps(record), encoding="utf-8")


# -- a recording plugin for the processes ------------------------------------------------------


class Record:
    """Writes the final weights of every module (and the ranks' agreement) to record.json."""

    def __init__(self, path: str = "record.json") -> None:
        self.path = path

    @hookimpl
    def after_training(self, loop: Any) -> None:
        state = loop.model.state_dict()  # under FSDP a collective: every rank takes part
        if loop.world is not None and not loop.world.is_zero:
            return
        record = {
            "module": {
                k: np.asarray(v).tolist() for k, v in state["module"].items() if isinstance(v, np.ndarray)
            },
            "iteration": loop.iteration,
            "optimizer_steps": loop.model.optimizer_steps,
            "sharded": loop.model.sharded,
        }
        Path(self.path).write_text(json.dumps(record), encoding="utf-8")


def copy_beside(directory: Path) -> None:
    """Copy this module into *directory*, where a config's factories can import it."""
    shutil.copy(Path(__file__), directory / "own_step_models.py")


class KillAt:
    """Ends its process as ``kill -9`` does (SIGKILL, nothing more saved) after the batch whose
    ``loop.iteration`` is ``$OWN_STEP_KILL_AT`` (unset: never), once the plugins before it ran."""

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        import os
        import signal

        at = os.environ.get("OWN_STEP_KILL_AT")
        if at and loop.iteration == int(at):
            os.kill(os.getpid(), signal.SIGKILL)


def write_gan_config(
    directory: Path, *, strategy: str = "ddp", format: str = "single", epochs: int = 2
) -> Path:
    """*directory*/gan.toml: the GAN trained under manual optimization, a StepLR schedule per
    optimizer, checkpoints every 2 batches in *format*; this module copied beside it."""
    copy_beside(directory)
    config = directory / "gan.toml"
    config.write_text(
        f"""[loop]
max_epochs = {epochs}
seed = 0
run_dir = "run"

[distributed]
backend = "gloo"
timeout = 60

[model]
factory = "own_step_models:make_gan"
strategy = "{strategy}"

[data]
factory = "own_step_models:make_gan_data"

[plugins]
autoload = false
order = ["lr_scheduler", "checkpoint", "record", "kill"]

[plugins.lr_scheduler]
name = "StepLR"
interval = "batch"
step_size = 2
gamma = 0.8

[plugins.checkpoint]
every_n_batches = 2
format = "{format}"

[plugins.record]
factory = "own_step_models:Record"

[plugins.kill]
factory = "own_step_models:KillAt"
""",
        encoding="utf-8",
    )
    return config
