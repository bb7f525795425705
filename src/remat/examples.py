"""Built-in example models, small enough to profile in seconds on a laptop CPU.

Each ``make_*`` returns ``(model, example_inputs, loss_fn)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = self.attn_drop(att) @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-style decoder (nanoGPT's shape): token + position embeddings, pre-norm blocks, tied head."""

    def __init__(self, vocab: int = 512, seq_len: int = 64, d_model: int = 128, n_layers: int = 4,
                 n_heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(d_model, n_heads, dropout) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_gpt(*, layers: int = 4, batch_size: int = 8, seq_len: int = 64, d_model: int = 128,
             heads: int = 4, vocab: int = 512, dropout: float = 0.1, device: str | torch.device = "cpu",
             seed: int = 0):
    """A GPT-style decoder with dropout and a batch of token ids; the model returns the LM loss."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(vocab, seq_len, d_model, layers, heads, dropout).to(device).train()
    idx = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    targets = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    return model, (idx, targets), None


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class UNet(nn.Module):
    """A U-Net: an encoder of conv blocks, a bottleneck, and a decoder fed by skip connections (a DAG)."""

    def __init__(self, channels: int = 3, base: int = 16, depth: int = 3, classes: int = 2) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = channels
        for w in widths[:-1]:
            self.down.append(ConvBlock(cin, w))
            cin = w
        self.bottleneck = ConvBlock(widths[-2], widths[-1])
        self.upconv = nn.ModuleList()
        self.up = nn.ModuleList()
        for w_hi, w in zip(reversed(widths[1:]), reversed(widths[:-1])):
            self.upconv.append(nn.ConvTranspose2d(w_hi, w, 2, stride=2))
            self.up.append(ConvBlock(2 * w, w))
        self.out = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for upconv, block in zip(self.upconv, self.up):
            x = upconv(x)
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)


def make_unet(*, batch_size: int = 4, image_size: int = 64, base: int = 16, depth: int = 3,
              device: str | torch.device = "cpu", seed: int = 0):
    """A U-Net with BatchNorm on random images; the loss is per-pixel cross-entropy."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UNet(3, base, depth, 2).to(device).train()
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g).to(device)
    y = torch.randint(0, 2, (batch_size, image_size, image_size), generator=g).to(device)
    return model, (x,), lambda out: F.cross_entropy(out, y)


EXAMPLES = {"gpt": make_gpt, "unet": make_unet}
