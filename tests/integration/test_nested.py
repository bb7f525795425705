"""Nested plans: units checkpointed inside checkpointed units (Note [Nested checkpoints] in remat.costs.memory_rows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat
from helpers import module_calls
import remat.rewrite
from remat.api import make_profile
from remat.examples import make_gpt
from remat.rewrite import checkpoint_plan, remove_checkpointing
from remat.solve import Planner


@pytest.fixture(scope="module")
def gpt():
    model, inputs, _ = make_gpt(layers=4, dropout=0.1)
    profile = make_profile(model, inputs, optimizer=torch.optim.AdamW(model.parameters()))
    return model, inputs, profile


def test_nesting_lowers_the_least_peak_and_is_predicted(gpt):
    """Nested plans of module units reach below both the flat least peak and "every block", and the nested
    plan's peak, measured on a real step, is within 5% of its prediction (the simulator's, through every
    level). (With the blocks' regions, Note [Regions] in remat.capture, a flat plan reaches as low: the
    attention region's checkpoint drops what the block's would, its layer norm's output too.)"""
    model, inputs, profile = gpt
    modules = dataclasses.replace(profile, units=tuple(u for u in profile.units if not u.is_region))
    nested, flat = Planner(modules), Planner(modules, nesting=False)
    least = nested.least_memory()
    assert least.nested_in, "the least-memory plan nests nothing"
    assert all(outer in least.checkpointed for outer in least.nested_in.values())
    assert least.predicted_peak_bytes < flat.min_peak_bytes
    assert Planner(profile).min_peak_bytes <= min(least.predicted_peak_bytes, Planner(profile, nesting=False).min_peak_bytes)
    every = nested.every_nth_block(1)
    measured = {}
    for plan in (least, every):
        checkpoint_plan(model, plan)
        try:
            measured[plan.strategy] = remat.measure_step(model, inputs, repeats=1, warmup=0).peak_bytes
        finally:
            remove_checkpointing(model)
        # measure_step runs no optimizer: compare the step without its state
        predicted = plan.predicted_peak_bytes - profile.optimizer_state_bytes
        assert abs(predicted - measured[plan.strategy]) <= 0.05 * measured[plan.strategy]
    assert measured["ilp"] < measured["every_block"]
    with pytest.raises(remat.InvalidInputError, match="must not overlap"):  # a planner told not to nest
        flat.model.peak_bytes(least.checkpointed)


def test_nested_recomputation_is_exact_and_runs_at_both_levels(gpt):
    """Blocks checkpointed with their attention checkpointed inside: gradients and loss bitwise equal to
    the plain model's with dropout on; the block's first module runs twice per step (forward, the block's
    recomputation), the attention's first module three times (forward, inside the block's recomputation,
    and its own)."""
    model, inputs, profile = gpt
    planner = Planner(profile)
    units = ["h.1", "h.1.attn", "h.2", "h.2.mlp"]
    plan = planner.make_plan(units, "hand")
    assert plan.nested_in == {"h.1.attn": "h.1", "h.2.mlp": "h.2"}
    checkpoint_plan(model, plan)
    try:
        report = remat.check_equivalence(model, inputs)
        assert report.equal and len(report.max_abs_diff) > 50, str(report)
        assert max(report.max_abs_diff.values()) == 0.0
        counts = module_calls(model, ["h.1.ln_1", "h.1.attn.qkv", "h.2.ln_1", "h.2.mlp.fc", "h.0.ln_1"], inputs)
    finally:
        remove_checkpointing(model)
    # h.2.mlp ends its block: the block's recomputation stops early at the mlp's saved inputs (Note [Early
    # stop]), so the mlp runs in its forward and its own recomputation only
    assert counts == {"h.1.ln_1": 2, "h.1.attn.qkv": 3, "h.2.ln_1": 2, "h.2.mlp.fc": 2, "h.0.ln_1": 1}


def test_a_sequential_checkpointed_around_its_segments():
    """A Sequential checkpointed as a whole with segments of it checkpointed inside (one call installs both;
    remove_checkpointing undoes both): gradients and BatchNorm statistics exact, the segment's first layer
    runs three times."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), inner, torch.nn.Linear(8, 1)).train()
    x = torch.randn(16, 8)
    remat.rewrite.checkpoint_modules(model, ["1", "1[0:4]"])
    assert remat.checkpointed_modules(model) == ["1", "1[0:4]"]
    report = remat.check_equivalence(model, x)
    assert report.equal and max(report.max_abs_diff.values()) == 0.0, str(report)
    assert any(k.startswith("buffer:1.1.running") for k in report.max_abs_diff)
    calls = []
    handle = inner[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    model(x).sum().backward()
    handle.remove()
    assert len(calls) == 3
    assert remat.remove_checkpointing(model) == ["1", "1[0:4]"]
    assert remat.checkpointed_modules(model) == [] and "forward" not in inner.__dict__


def test_plans_list_units_in_forward_order(gpt):
    """Outer before inner, and a selective unit in its place (it came after the whole units before: a plan of
    h.1.mlp and h.0@ops1 listed h.1.mlp first, unlike checkpointed_modules)."""
    model, _, profile = gpt
    planner = Planner(profile, granularity="op")
    assert planner.make_plan(["h.2.mlp", "h.1", "h.2", "h.1.attn"], "x").checkpointed == \
        ("h.1", "h.1.attn", "h.2", "h.2.mlp")
    plan = planner.make_plan(["h.1.mlp", "h.0@ops1"], "x")
    assert plan.checkpointed == ("h.0@ops1", "h.1.mlp")
    checkpoint_plan(model, plan)
    try:
        assert remat.checkpointed_modules(model) == list(plan.checkpointed)
    finally:
        remove_checkpointing(model)


class _SelfAttentionBlock(torch.nn.Module):
    """A ViT-style block as users write it: ``nn.MultiheadAttention`` called as ``attn(y, y, y)``."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True, dropout=0.1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        y = self.ln(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(x)


def test_a_nested_unit_called_with_one_tensor_twice_recomputes_as_it_ran():
    """``nn.MultiheadAttention`` projects q, k and v with one product when they are one tensor (``query is key``)
    and with three when they are not. Checkpointed inside a checkpointed block, its inputs came back from torch's
    checkpoint as three tensors when the block's recomputation recomputed it, so its own recomputation took the
    other path and torch refused it (CheckpointError: "Recomputed values ... have different metadata"; an 8-block
    ViT-style model's least-memory plan nests such attention, and its check failed). Now each tensor the unit is
    given several times is handed to checkpoint once: exact, with dropout on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SelfAttentionBlock(), _SelfAttentionBlock()).train()
    x = torch.randn(2, 8, 32)
    remat.rewrite.checkpoint_modules(model, ["0", "0.attn", "1.attn"])
    try:
        report = remat.check_equivalence(model, x)
    finally:
        remat.remove_checkpointing(model)
    assert report.equal and max(report.max_abs_diff.values()) == 0.0, str(report)
