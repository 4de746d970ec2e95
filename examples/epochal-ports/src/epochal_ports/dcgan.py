"""pytorch/examples' DCGAN (``dcgan/main.py``) as an epochal model: two modules, two optimizers,
manual optimization in the script's order.

The script's loop body is :meth:`DCGAN.training_step`, line for line: the discriminator on a
real batch then on a generated one (``model.backward`` for ``errD.backward()``), its step, the
generator through the discriminator, its step; every 100 batches the script's sample images.
``[model]``'s keys are the script's options. Run it (``--dataset fake``, the script's defaults
but for the sizes)::

    epochal run examples/epochal-ports/dcgan.toml

It matches ``python dcgan_main.py --dataset fake --manualSeed 7 --workers 0 ...`` bitwise
(tests/test_ports.py), and through ``kill -9`` and ``--resume``: the weights come from the same
random numbers drawn in the same order. That needs the script's own seeding: the factory seeds
Python's and torch's generators as the script does (``[loop] seed`` left out: epochal would
seed again when training starts) and ``[loop] shard_order = "torch"`` lets the DataLoader draw
each epoch's order from torch's global generator, as it does in the script.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from epochal import hookimpl
from epochal.torch import TorchModel

__all__ = ["DCGAN", "Discriminator", "EpochWeights", "Generator", "make_data", "make_model", "weights_init"]


def weights_init(m: nn.Module) -> None:
    """The script's custom initialisation of convolutions and batch norms."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)  # type: ignore[arg-type]
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)  # type: ignore[arg-type]
        torch.nn.init.zeros_(m.bias)  # type: ignore[arg-type]


class Generator(nn.Module):
    """The script's generator: ``nz`` noise → ``nc`` × 64 × 64 images."""

    def __init__(self, nz: int, ngf: int, nc: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    """The script's discriminator: an image's probability of being real."""

    def __init__(self, nc: int, ndf: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input).view(-1, 1).squeeze(1)


class DCGAN(TorchModel):
    """The generator and the discriminator, trained as the script trains them."""

    automatic_optimization = False

    def __init__(self, fixed_noise: torch.Tensor, outf: str | None, **parts: Any) -> None:
        super().__init__(**parts)
        self.criterion = nn.BCELoss()
        self.fixed_noise = fixed_noise
        self.outf = outf

    def training_step(self, batch: Any) -> dict[str, Any]:
        netG, netD = self.modules["generator"], self.modules["discriminator"]  # noqa: N806
        nz = self.fixed_noise.shape[1]
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = batch[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), 1, dtype=real_cpu.dtype, device=real_cpu.device)
        output = netD(real_cpu)
        errD_real = self.criterion(output, label)  # noqa: N806
        self.backward(errD_real)
        D_x = output.mean()  # noqa: N806
        noise = torch.randn(batch_size, nz, 1, 1, device=real_cpu.device)
        fake = netG(noise)
        label.fill_(0)
        output = netD(fake.detach())
        errD_fake = self.criterion(output, label)  # noqa: N806
        self.backward(errD_fake)
        D_G_z1 = output.mean()  # noqa: N806
        errD = errD_real + errD_fake  # noqa: N806
        self.optimizer_step("discriminator")
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(1)  # fake labels are real for generator cost
        output = netD(fake)
        errG = self.criterion(output, label)  # noqa: N806
        self.backward(errG)
        D_G_z2 = output.mean()  # noqa: N806
        self.optimizer_step("generator")
        if self.loop.batch_in_epoch % 100 == 0:
            # the script's samples: a generator forward in training mode (its batch norms'
            # running statistics move), whether the images are written or not
            fake = netG(self.fixed_noise)
            self._save_images(real_cpu, fake.detach())
        return {"loss_d": errD, "loss_g": errG, "d_x": D_x, "d_g_z1": D_G_z1, "d_g_z2": D_G_z2}

    def _save_images(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        world = self.loop.world
        if self.outf is None or (world is not None and not world.is_zero):
            return
        import torchvision.utils as vutils

        vutils.save_image(real, f"{self.outf}/real_samples.png", normalize=True)
        vutils.save_image(fake, f"{self.outf}/fake_samples_epoch_{self.loop.epoch:03d}.png", normalize=True)


def make_model(
    manual_seed: int,
    nz: int = 100,
    ngf: int = 64,
    ndf: int = 64,
    nc: int = 3,
    lr: float = 0.0002,
    beta1: float = 0.5,
    batch_size: int = 64,
    outf: str | None = None,
    **options: Any,
) -> DCGAN:
    """The script's set-up, in its order of random draws: seeds, the generator and its
    initialisation, the discriminator and its, the fixed noise, the two Adams. *options* go to
    :class:`~epochal.torch.TorchModel` (``device``, ``precision``, ``strategy``...)."""
    random.seed(manual_seed)
    torch.manual_seed(manual_seed)
    netG = Generator(nz, ngf, nc)  # noqa: N806
    netG.apply(weights_init)
    netD = Discriminator(nc, ndf)  # noqa: N806
    netD.apply(weights_init)
    fixed_noise = torch.randn(batch_size, nz, 1, 1)
    optimizers = {
        "discriminator": torch.optim.Adam(netD.parameters(), lr=lr, betas=(beta1, 0.999)),
        "generator": torch.optim.Adam(netG.parameters(), lr=lr, betas=(beta1, 0.999)),
    }
    if outf is not None:
        Path(outf).mkdir(parents=True, exist_ok=True)
    return DCGAN(
        fixed_noise,
        outf,
        module={"generator": netG, "discriminator": netD},
        optimizer=optimizers,
        **options,
    )


def make_data(
    image_size: int = 64, batch_size: int = 64, workers: int = 2, size: int = 1000
) -> dict[str, Any]:
    """The script's ``--dataset fake``: torchvision's FakeData in a shuffling DataLoader."""
    import torchvision.datasets as dset
    import torchvision.transforms as transforms

    dataset = dset.FakeData(
        size=size, image_size=(3, image_size, image_size), transform=transforms.ToTensor()
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
    return {"train": loader}


class EpochWeights:
    """The script's checkpointing: ``netG_epoch_N.pth`` and ``netD_epoch_N.pth`` (``torch.save``
    of each module's ``state_dict``) in *outf* after every epoch (epoch 0 first); rank 0 only."""

    rank = "zero"

    def __init__(self, outf: str = ".") -> None:
        self.outf = outf

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        Path(self.outf).mkdir(parents=True, exist_ok=True)
        for name, letter in (("generator", "G"), ("discriminator", "D")):
            state = loop.model.modules[name].state_dict()
            torch.save(state, f"{self.outf}/net{letter}_epoch_{loop.epoch - 1}.pth")
