"""Plans ranked by what is measured (issue #56), on models written as their users write them (run by hand, alone).

    python benchmarks/plans/ranking.py [--models vit,resnet,mlp16] [--repeats 5] [--device cuda]
                                 [--out benchmarks/results/ranking-cpu.md]

Issue #56 asks that where checkpointing every block meets the budget, the plan remat chooses is never measured
slower than every block (on a model outside the repository a segment plan, at a budget just above every block's
peak, had measured 1.3x every block's overhead). For each model here (defined in this file, as a user's project
would: a ViT-style model whose blocks sit in an ``nn.Sequential`` and call ``nn.MultiheadAttention(y, y, y)``, a
ResNet-style conv net with BatchNorm, its bottlenecks in an ``nn.Sequential``, and 16 residual MLP blocks in one
``nn.Sequential``, where the plans just above every block's peak are segments, the issue's case),
``remat.optimize_checkpointing`` is called as a user calls it (a fresh copy of the model each time, AdamW) at budgets of every block's measured peak x
1.00, 1.02, 1.05, 1.10 and halfway to no checkpointing. Then every distinct plan returned, every block and no
checkpointing are measured side by side in one process: whole training steps with AdamW, 2 x --repeats rounds of
one step per plan in a shuffled order after a warm-up (remat.check.steps.measure_plans), so that each round is a
paired comparison.

Columns: the budget; what remat returned (its units, and whether a hand rule replaced the ILP's plan: Note [Plans
timed beside the hand rules] in remat.api.hand_rules, with the passes and seconds the comparison timed,
``Plan.rules_timing_passes`` and ``rules_timing_s``); its measured peak; predicted and measured step (median);
overhead over no checkpointing, measured, for it and for every block; the paired difference remat less every block,
median and quartiles. "slower" only where even the lower quartile is above 0 (benchmarks/plans/selective.py's test).
Also each plan's predicted step time against its measured one.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

import remat
from remat.check.steps import measure_plans


class ViTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """Patch embedding, 8 blocks of width 256 in an nn.Sequential, mean-pooled head (16 x 256 tokens)."""

    def __init__(self, d: int = 256, depth: int = 8, heads: int = 4, patch: int = 8, classes: int = 100) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, d, patch, patch)
        self.blocks = nn.Sequential(*[ViTBlock(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))


class Bottleneck(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c // 4, 1, bias=False), nn.BatchNorm2d(c // 4), nn.ReLU(),
                                  nn.Conv2d(c // 4, c // 4, 3, padding=1, bias=False), nn.BatchNorm2d(c // 4),
                                  nn.ReLU(), nn.Conv2d(c // 4, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return torch.relu(x + self.body(x))


class ResNet(nn.Module):
    """A stem and 8 bottlenecks of 128 channels at 32 x 32 in an nn.Sequential, pooled head (batch 16)."""

    def __init__(self, c: int = 128, depth: int = 8, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.stages = nn.Sequential(*[Bottleneck(c) for _ in range(depth)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


def _deep_mlp(device: str):
    """16 residual MLP blocks of width 256 in one nn.Sequential with the input and output layers, 64 x 128 tokens:
    where remat's plans just above every block's peak are segments of two blocks (Note [Segments])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), *[MLPBlock(256) for _ in range(16)], nn.Linear(256, 10))
    x = torch.randn(64, 128, 64).to(device)
    y = torch.randint(0, 10, (64, 128)).to(device)
    return model.to(device), x, lambda out: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def _classifier(model: nn.Module, shape: tuple[int, ...], device: str):
    torch.manual_seed(0)
    x = torch.randn(*shape).to(device)
    y = torch.randint(0, 100, (shape[0],)).to(device)
    return model.to(device), x, lambda out: nn.functional.cross_entropy(out, y)


MODELS = {
    "vit": lambda device: _classifier(ViT(), (16, 3, 128, 128), device),
    "resnet": lambda device: _classifier(ResNet(), (16, 3, 64, 64), device),
    "mlp16": _deep_mlp,
}
FACTORS = (1.00, 1.02, 1.05, 1.10)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def run(name: str, repeats: int, say, device: str = "cpu") -> None:
    torch.manual_seed(0)
    model, x, loss = MODELS[name](device)
    planner = remat.Planner(remat.make_profile(model, x, loss_fn=loss, optimizer=adamw(model.parameters())))
    every, none = planner.every_nth_block(1), planner.no_checkpointing()
    first = measure_plans(model, x, [every, none], loss_fn=loss, optimizer_factory=adamw, repeats=0, warmup=0)
    every_b, none_b = first[0].peak_bytes, first[1].peak_bytes
    budgets = [("every block x %.2f" % f, int(every_b * f)) for f in FACTORS]
    budgets.append(("halfway to none", (every_b + none_b) // 2))
    returned = []
    for label, b in budgets:
        m = copy.deepcopy(model)
        plan = remat.optimize_checkpointing(m, b / 2**30, x, loss_fn=loss, optimizer=adamw(m.parameters()))
        timed = plan.rules_timing_passes > 0  # Note [Plans timed beside the hand rules]: passes run beside a rule
        replaced = timed and plan.strategy not in ("ilp", "ilp-op")
        returned.append((label, b, plan, replaced, timed))
    plans = {p.choices: p for _, _, p, _, _ in returned}
    plans.setdefault(every.choices, every)
    plans.setdefault(none.choices, none)
    keys = list(plans)
    readings = dict(zip(keys, measure_plans(model, x, [plans[k] for k in keys], loss_fn=loss, optimizer_factory=adamw,
                                            warmup_s=2.0, repeats=repeats)))
    plain, ev = readings[none.choices], readings[every.choices]
    say(f"\n**{name}** (every block measured {every_b / 2**20:.1f} MiB, {ev.step_time_s * 1e3:.0f} ms a step; no "
        f"checkpointing {none_b / 2**20:.1f} MiB, {plain.step_time_s * 1e3:.0f} ms)\n")
    say("| budget | MiB | remat returned | peak MiB (measured) | step ms (predicted / measured) | overhead: remat / "
        "every block (measured) | remat - every block, paired ms: median [quartiles] | |")
    say("|---|---:|---|---:|---:|---:|---:|---|")
    for label, b, plan, replaced, timed in returned:
        r = readings[plan.choices]
        pairs = [a - e for a, e in zip(r.step_times_s, ev.step_times_s)]
        q1, _, q3 = statistics.quantiles(pairs, n=4)
        what = (f"{plan.strategy}, {len(plan.checkpointed)} units" +
                (" (every block in place of the ILP's plan, timed" if replaced else
                 " (timed beside every block: kept" if timed else "") +
                (f", {plan.rules_timing_passes} passes, {plan.rules_timing_s:.1f} s)" if timed else ""))
        verdict = "slower" if q1 > 0 else "same plan" if plan.choices == every.choices else ""
        say(f"| {label} | {b / 2**20:.1f} | {what} | {r.peak_bytes / 2**20:.1f} | "
            f"{plan.predicted_step_time_s * 1e3:.0f} / {r.step_time_s * 1e3:.0f} | "
            f"{(r.step_time_s - plain.step_time_s) * 1e3:.0f} / {(ev.step_time_s - plain.step_time_s) * 1e3:.0f} | "
            f"{statistics.median(pairs) * 1e3:+.0f} [{q1 * 1e3:+.0f}, {q3 * 1e3:+.0f}] | {verdict} |")
    errors = {k: plans[k].predicted_step_time_s / readings[k].step_time_s - 1 for k in keys}
    say("\npredicted against measured step time: " + ", ".join(
        f"{plans[k].strategy} ({len(k)} units) {errors[k]:+.1%}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=5, help="2 x repeats paired rounds (default 5)")
    ap.add_argument("--device", default="cpu", help="where the models train: cpu (default) or cuda")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    where = (torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else
             f"{platform.processor() or 'CPU'}, {torch.get_num_threads()} threads")
    say(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {where}; every figure measured "
        f"here but those marked predicted")
    for name in a.models.split(","):
        run(name, a.repeats, say, a.device)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
