"""Small models covering what remat must handle; each factory returns (model, inputs, loss_fn)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remat.examples import make_gpt, make_unet


def gpt():
    """GPT-style decoder with dropout, attention + MLP blocks and a tied embedding/head."""
    return make_gpt(layers=3, batch_size=4, seq_len=16, d_model=32, heads=2, vocab=64, dropout=0.1)


def unet():
    """U-Net with BatchNorm: skip connections make the graph a DAG, not a chain."""
    return make_unet(batch_size=2, image_size=16, base=4, depth=2)


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, c: int = 8, n: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(c) for _ in range(n)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def resnet():
    """Residual CNN with BatchNorm (running statistics must not be updated twice)."""
    torch.manual_seed(0)
    model = ResNet().train()
    x = torch.randn(4, 3, 16, 16)
    y = torch.randint(0, 5, (4,))
    return model, (x,), lambda out: F.cross_entropy(out, y)


class Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class KwargsModel(nn.Module):
    """Keyword inputs, a dict output, and one module (``shared``) called twice."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.first = Mixer(d)
        self.shared = Mixer(d)
        self.last = Mixer(d)

    def forward(self, x, *, mask):
        h = self.inp(x) * mask
        h = self.shared(self.first(h))
        h = self.last(self.shared(h))
        return {"hidden": h, "loss": (h**2).mean()}


def kwargs_model():
    torch.manual_seed(0)
    model = KwargsModel().train()
    x = torch.randn(64, 12, 16)
    mask = (torch.rand(64, 12, 1) > 0.2).float()
    return model, {"x": x, "mask": mask}, None


class TiedAutoencoder(nn.Module):
    """Encoder and decoder share one weight (tied weights, counted once)."""

    def __init__(self, d: int = 24, h: int = 64) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Dropout(0.1), nn.Linear(h, h), nn.GELU())
        self.dec = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, d))
        self.dec[0].weight = self.enc[3].weight

    def forward(self, x):
        return self.dec(self.enc(x))


def tied():
    torch.manual_seed(0)
    model = TiedAutoencoder().train()
    x = torch.randn(512, 24)
    return model, (x,), lambda out: F.mse_loss(out, x)


class Branchy(nn.Module):
    """Data-dependent control flow: which layer runs depends on the values (fx and export fail)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = Mixer(d)
        self.b = Mixer(d)
        self.c = Mixer(d)

    def forward(self, x):
        # data-dependent on the input, not on dropout's draws, so that one step's memory is repeatable
        positive = x.mean() > 0
        x = self.a(x)
        if positive:
            x = self.b(x)
        else:
            x = self.b(x) * 2
        for _ in range(int(positive.item()) + 1):  # data-dependent loop count
            x = torch.tanh(x)
        return self.c(x)


def branchy():
    torch.manual_seed(0)
    model = Branchy().train()
    return model, (torch.randn(64, 10, 16),), None


ZOO = {
    "gpt": gpt,
    "unet": unet,
    "resnet": resnet,
    "kwargs": kwargs_model,
    "tied": tied,
    "branchy": branchy,
}
