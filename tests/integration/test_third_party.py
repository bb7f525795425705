"""Models remat did not grow up with (tests/integration/third_party.py): Hugging Face Qwen3, Gemma2,
Phi-3, GPT-NeoX, DistilBERT from tiny configs (skipped without transformers), and ConvNeXt
(channels-last), MobileNetV3-style squeeze-excitation and Swin window-attention structures.
The full sweep with figures is benchmarks/accuracy/third_party.py."""

from __future__ import annotations

import functools

import pytest
import torch

import remat
from helpers import adam
from remat.api import make_profile, plan_checked, prepare_hf_for_training, split_inputs
from remat.solve import Planner
from third_party import EXTRAS, HF, STRUCTURES, THIRD_PARTY

NAMES = list(HF) + list(STRUCTURES) + list(EXTRAS)
#: the optional library each extra model needs
NEEDS = {"peft-lora-qwen2": "peft", "diffusers-unet2d": "diffusers"}


def _model(name):
    if name in HF or name in EXTRAS:
        pytest.importorskip("transformers", reason="transformers not installed (pip install 'remat[hf]')")
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{NEEDS[name]} not installed (pip install {NEEDS[name]})")
    model, inputs, loss_fn = THIRD_PARTY[name]()
    prepare_hf_for_training(model)
    return model, inputs, loss_fn or remat.default_loss


@functools.lru_cache(maxsize=None)
def _planner(name: str) -> Planner:
    model, inputs, loss_fn = _model(name)
    a, k = split_inputs(inputs)
    return Planner(make_profile(model, inputs, loss_fn=loss_fn, optimizer=adam(model.parameters())), granularity="op")


def _measured(name, plan) -> tuple[int, bool]:
    model, inputs, loss_fn = _model(name)
    remat.apply_plan(model, plan)
    peak = remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adam, repeats=0).peak_bytes
    return peak, remat.check_equivalence(model, inputs, loss_fn=loss_fn).equal


@pytest.mark.parametrize("name", NAMES)
def test_hand_rule_budget_met_predicted_and_exact(name):
    """At the measured peak of "checkpoint every block": remat does not refuse it, its checked plan
    measures within it, is predicted within 3% and is gradient- and buffer-exact; remat's least peak is
    at most the hand rule's."""
    planner = _planner(name)
    every, exact = _measured(name, planner.every_nth_block(1))
    assert exact
    model, inputs, loss_fn = _model(name)
    a, k = split_inputs(inputs)
    plan = plan_checked(model, a, k, loss_fn, torch.device("cpu"), planner, every)
    assert plan.min_peak_bytes <= every
    peak, exact = _measured(name, plan)
    assert peak <= every and exact
    assert abs(plan.predicted_peak_bytes - peak) <= 0.03 * peak, (plan.checkpointed, plan.predicted_peak_bytes, peak)


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_forced_selective_options_of_the_first_block(name):
    """Every selective option of the first block (window attention with a position-index buffer,
    BatchNorm + squeeze-excitation, channels-last depthwise convolution) runs, is exact and is predicted
    within 5%."""
    planner = _planner(name)
    first = next(u for u in planner.model.units if "@ops" in u)
    options = [u for u in planner.model.units if u.startswith(first.partition("@")[0] + "@ops")]
    for unit in options:
        plan = planner.make_plan([unit], "forced")
        peak, exact = _measured(name, plan)
        assert exact, unit
        assert abs(plan.predicted_peak_bytes - peak) <= 0.05 * peak, (unit, plan.predicted_peak_bytes, peak)
