"""A custom target for the remat command line:

    remat tradeoff examples/custom_target.py:build
    remat plan examples/custom_target.py:build --budget 0.05 --out plan.json

The function takes no required arguments (``device=`` is passed when it accepts it) and returns
``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``. ``example_inputs`` is one
tensor, a tuple of positional arguments, or a dict of keyword arguments.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build(device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(64) for _ in range(6)], nn.Linear(64, 10)).to(device)
    x = torch.randn(256, 64, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    return model, x, lambda logits: F.cross_entropy(logits, y)
