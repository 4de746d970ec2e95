"""pytorch/examples' VAE (``vae/main.py``) as an epochal model: a loss that needs the module's
intermediate outputs (the reconstruction, ``mu`` and ``logvar``), batches whose targets are
never used.

:func:`vae_step` is the script's ``train`` loop body (its loss summed over the batch, as the
script back-propagates it); evaluation runs the same step (TorchModel's default without a
``validation_step``: no gradients, eval mode), whose mean per example is the script's
``Test set loss``; :class:`Samples` draws and decodes the script's 64 samples after every
epoch. Run it on MNIST (the script's ``../data``)::

    epochal run examples/epochal-ports/vae.toml

It matches ``python vae_main.py --no-accel --epochs 2`` bitwise (tests/test_ports.py), through
``kill -9`` and ``--resume`` too: the factory seeds torch as the script does (no ``[loop]
seed``) and ``[loop] shard_order = "torch"`` lets both DataLoaders draw from torch's global
generator as in the script, between the noise the model draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 (the script's spelling)

from epochal import hookimpl
from epochal.torch import TorchModel

__all__ = ["VAE", "Samples", "loss_function", "make_data", "make_model", "vae_step"]


class VAE(nn.Module):
    """The script's variational autoencoder of 28 × 28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(
    recon_x: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor
) -> torch.Tensor:
    """Reconstruction + KL divergence losses summed over all elements and batch (the script's)."""
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def vae_step(model: TorchModel, batch: Any) -> dict[str, torch.Tensor]:
    """The loss the script back-propagates (summed over the batch); logged per example."""
    data, _ = batch
    recon_batch, mu, logvar = model.module(data)
    loss = loss_function(recon_batch, data, mu, logvar)
    return {"loss": loss, "loss_per_example": loss.detach() / len(data)}


def make_model(seed: int = 1, lr: float = 1e-3, **options: Any) -> TorchModel:
    """The script's model and Adam after ``torch.manual_seed(seed)``; *options* go to TorchModel."""
    torch.manual_seed(seed)
    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return TorchModel(model, optimizer, training_step=vae_step, **options)


def make_data(root: str = "../data", batch_size: int = 128) -> dict[str, Any]:
    """The script's MNIST loaders (``root`` must hold MNIST: this factory downloads nothing)."""
    from torchvision import datasets, transforms

    train = datasets.MNIST(root, train=True, download=False, transform=transforms.ToTensor())
    test = datasets.MNIST(root, train=False, transform=transforms.ToTensor())
    return {
        "train": torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True),
        "test": torch.utils.data.DataLoader(test, batch_size=batch_size, shuffle=False),
    }


class Samples:
    """After each epoch's evaluation, the script's 64 samples: noise drawn from torch's global
    generator and decoded; written as ``results/sample_N.png`` (N from 1) when *results* is set."""

    def __init__(self, results: str | None = "results") -> None:
        self.results = results

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        module = loop.model.module
        with torch.no_grad():
            sample = torch.randn(64, 20).to(loop.model.device)
            sample = module.decode(sample).cpu()
        if self.results is not None and (loop.world is None or loop.world.is_zero):
            from torchvision.utils import save_image

            Path(self.results).mkdir(parents=True, exist_ok=True)
            save_image(sample.view(64, 1, 28, 28), f"{self.results}/sample_{loop.epoch}.png")
