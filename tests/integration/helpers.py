"""Shared fixtures for the CPU integration tests: one profile per zoo model, reused."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

import remat
from remat.api import make_profile, split_inputs
from remat.api.source import profile_step
from remat.costs.unit_costs import Profile, parse_region
from remat.rewrite import parse_unit
from remat.solve import Planner
from zoo import ZOO


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


@dataclass
class Case:
    name: str
    factory: Callable[[], tuple[nn.Module, Any, Any]]
    profile: Profile
    planner: Planner
    #: the profile as memory alone gave it, before any timed step (Note [Memory before time] in remat.api)
    memory: Profile | None

    def fresh(self):
        model, inputs, loss_fn = self.factory()
        return model, inputs, loss_fn or remat.default_loss

    def budgets(self, fractions=(0.0, 0.35, 0.7)) -> list[int]:
        lo, hi = self.planner.min_peak_bytes, self.planner.baseline_peak_bytes
        return [int(lo + f * (hi - lo)) for f in fractions]


@functools.lru_cache(maxsize=None)
def case(name: str) -> Case:
    factory = ZOO[name]
    model, inputs, loss_fn = factory()
    args, kwargs = split_inputs(inputs)
    memory: list[Profile] = []
    profile = profile_step(model, args, kwargs, loss_fn=loss_fn or remat.default_loss,
                            optimizer=adam(model.parameters()), device=torch.device("cpu"),
                            memory_known=memory.append)
    return Case(name, factory, profile, Planner(profile), memory[0] if memory else None)


def descendant_calls(model: nn.Module, units, run) -> dict[str, int]:
    """How many times the first-called descendant module of each unit (the first child of a segment)
    runs during ``run()``.

    Recomputation runs a checkpointed unit's forward again from its start, so that first
    descendant runs twice per step; the unit's own hooks stay outside the checkpoint and
    cannot show it."""
    mods = dict(model.named_modules())
    first: dict[str, str] = {}
    order: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: order.append(n)) for n, m in mods.items() if n]
    with torch.no_grad():
        run(grad=False)
    for h in handles:
        h.remove()
    for u in units:
        container, seg = parse_unit(u)
        if (region := parse_region(u)) is not None:  # a region: the submodule call it starts at
            first[u] = f"{region[0]}.{region[1]}"
        elif seg is not None:  # a segment: its first child runs inside the checkpoint
            first[u] = f"{container}.{seg[0]}" if container else str(seg[0])
        else:
            first[u] = next(n for n in order if n.startswith(u + "."))
    counts = {u: 0 for u in units}
    handles = [mods[f].register_forward_pre_hook(lambda mod, a, u=u: counts.__setitem__(u, counts[u] + 1))
               for u, f in first.items()]
    run(grad=True)
    for h in handles:
        h.remove()
    return counts


def module_calls(model: nn.Module, names, inputs) -> dict[str, int]:
    """How many times each named module runs in one step (default loss, backward); gradients reset after."""
    counts = dict.fromkeys(names, 0)
    mods = dict(model.named_modules())
    handles = [mods[n].register_forward_pre_hook(lambda m, a, n=n: counts.__setitem__(n, counts[n] + 1))
               for n in names]
    try:
        remat.default_loss(model(*inputs)).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return counts


def step_runner(model, inputs, loss_fn):
    args, kwargs = split_inputs(inputs)

    def run(grad=True):
        out = model(*args, **kwargs)
        if grad:
            loss_fn(out).backward()
            model.zero_grad(set_to_none=True)
    return run


class DropoutUNet(nn.Module):
    """A small U-Net whose levels are ``level(Conv2d, BatchNorm2d, ReLU, <dropout>(0.1), Conv2d, ReLU)``, as many
    vision models are (issue #36: dropout inside checkpointed segments of these levels under torch.compile)."""

    def __init__(self, dropout: type = nn.Dropout2d, level: type = nn.Sequential) -> None:
        super().__init__()

        def make(cin, cout):
            return level(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), dropout(0.1),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())

        self.d1, self.d2, self.mid, self.u2, self.u1 = make(3, 8), make(8, 16), make(16, 16), make(32, 8), make(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(nn.functional.max_pool2d(a, 2))
        m = self.mid(nn.functional.max_pool2d(b, 2))
        u = self.u2(torch.cat([nn.functional.interpolate(m, scale_factor=2.0), b], 1))
        u = self.u1(torch.cat([nn.functional.interpolate(u, scale_factor=2.0), a], 1))
        return self.out(u)


def dropout_unet(dropout: type = nn.Dropout2d, level: type = nn.Sequential):
    """``(model, batch, loss_fn)``: :class:`DropoutUNet` on 4 random 32 x 32 images, per-pixel cross-entropy."""
    torch.manual_seed(0)
    model = DropoutUNet(dropout, level).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, 32, generator=g)
    y = torch.randint(0, 2, (4, 32, 32), generator=g)
    return model, x, lambda out: nn.functional.cross_entropy(out, y)


def _floor_mark(floor: tuple[int, int], feature: str, refusal_tested_in: str):
    """Skip below ``floor``, where remat refuses ``feature`` (its refusal is tested in ``refusal_tested_in``)."""
    from remat._compat import torch_release

    return pytest.mark.skipif(
        torch_release() < floor,
        reason=f"{feature} needs torch >= {floor[0]}.{floor[1]} (this is torch {torch.__version__}); the refusal is "
               f"tested in {refusal_tested_in}")


def _floors():
    from remat._compat import COMPILED_FLOOR, FAKE_WORLD_FLOOR

    return COMPILED_FLOOR, FAKE_WORLD_FLOOR


#: for tests of compiled steps: skipped on releases older than remat._compat.COMPILED_FLOOR, where remat refuses
#: to plan them (docs/limits.md)
needs_compiled_floor = _floor_mark(_floors()[0], "planning or running a checkpointed step under torch.compile",
                                   "tests/integration/test_torch_features.py")

#: for tests of modelled targets of several ranks (remat.target): skipped below remat._compat.FAKE_WORLD_FLOOR
needs_fake_world_floor = _floor_mark(_floors()[1], "planning a world of several ranks on torch's fake process group",
                                     "tests/integration/test_target.py")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``remat ARGV`` in this process: its exit code, standard output and standard error."""
    from remat.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
