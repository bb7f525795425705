"""Real architectures (Hugging Face transformers from configs, offline; a torchvision-style ResNet):
budgets met, predictions within 5%, gradients identical, sensible units; HF specifics, autocast and
frozen parameters. Skipped with a reason when transformers is not installed."""

from __future__ import annotations

import functools

import pytest
import torch

import remat
from remat.api import make_profile, plan_checked, split_inputs
from remat.solve import Planner

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install 'remat[hf]')")

from real_models import REAL  # noqa: E402

adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731

# the units a user would pick by hand: decoder/encoder layers, their attention and MLP, ResNet blocks
LAYER_WORDS = ("layers.", ".h.", "layer.", "block.", "layer1", "layer2", "layer3", "layer4")


@functools.lru_cache(maxsize=None)
def profiled(name: str):
    model, inputs, loss_fn = REAL[name]()
    args, kwargs = split_inputs(inputs)
    profile = make_profile(model, inputs, loss_fn=loss_fn or remat.default_loss,
                           optimizer=adam(model.parameters()))
    return profile, Planner(profile)


def applied_and_checked(name: str, plan):
    """A fresh ``name`` model with ``plan`` applied, after checking its measured peak (within 5% of the
    prediction) and its gradients (exact). Returns (model, inputs, loss_fn)."""
    model, inputs, loss_fn = REAL[name]()
    loss_fn = loss_fn or remat.default_loss
    remat.apply_plan(model, plan)
    measured = remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adam, repeats=0)
    assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes, \
        (plan.checkpointed, plan.predicted_peak_bytes, measured.peak_bytes)
    report = remat.check_equivalence(model, inputs, loss_fn=loss_fn)
    assert report.equal, (plan.checkpointed, str(report))
    return model, inputs, loss_fn


@pytest.mark.parametrize("name", list(REAL))
def test_real_model(name):
    profile, planner = profiled(name)
    candidates = [u.name for u in profile.candidates()]
    assert any(w in u for u in candidates for w in LAYER_WORDS), candidates
    assert all(not u.endswith(("proj", "fc", "dense", "query", "key", "value", "wi", "wo")) for u in candidates)
    if name in ("gpt2", "llama", "mixtral", "bert", "vit", "t5"):
        assert profile.capture_path in ("export", "hooks")  # fx cannot trace current HF models
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    assert lo < hi
    # at the least predicted peak a prediction a few percent low cannot be rescued by checking (the
    # checked plan is then, rightly, infeasible); 15% of the way up leaves room for it
    for frac in (0.15, 0.5):
        budget = int(lo + frac * (hi - lo))
        model, inputs, loss_fn = applied_and_checked(name, planner.plan_for_budget(budget))
        # the checked plan (what optimize_checkpointing returns) meets the budget when measured
        remat.remove_checkpointing(model)
        args, kwargs = split_inputs(inputs)
        checked = plan_checked(model, args, kwargs, loss_fn, torch.device("cpu"), planner, budget)
        remat.apply_plan(model, checked)
        assert remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adam,
                                  repeats=0).peak_bytes <= budget


def test_use_cache_and_own_gradient_checkpointing_are_taken_over():
    model, inputs, _ = REAL["llama"]()
    model.config.use_cache = True
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    _, planner = profiled("llama")
    plan = remat.optimize_checkpointing(model, planner.min_peak_bytes * 1.2 / 2**30, inputs,
                                        optimizer=adam(model.parameters()))
    assert any("use_cache = False" in n for n in plan.notes)
    assert any("took over from the model's own gradient checkpointing" in n for n in plan.notes)
    assert model.config.use_cache is False and not model.is_gradient_checkpointing
    assert remat.check_equivalence(model, inputs).equal


def test_failure_gives_back_use_cache_and_gradient_checkpointing():
    model, inputs, _ = REAL["llama"]()
    model.config.use_cache = True
    model.gradient_checkpointing_enable()
    with pytest.raises(remat.InfeasibleBudgetError):
        remat.optimize_checkpointing(model, 1e-6, inputs)
    assert model.config.use_cache is True and model.is_gradient_checkpointing
    with pytest.raises(remat.InvalidInputError, match="use_cache=True"):
        remat.optimize_checkpointing(model, 1.0, {**inputs, "use_cache": True})


def test_autocast_bf16_profiled_and_checkpointed_under_the_same_state():
    model, inputs, _ = REAL["llama"]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        args, kwargs = split_inputs(inputs)
        profile = make_profile(model, inputs, loss_fn=remat.default_loss, optimizer=adam(model.parameters()))
        assert "autocast is on" in " ".join(profile.notes)
        planner = Planner(profile)
        budget = planner.min_peak_bytes + (planner.baseline_peak_bytes - planner.min_peak_bytes) // 3
        plan = remat.optimize_checkpointing(model, budget / 2**30, inputs, optimizer=adam(model.parameters()))
        assert plan.checkpointed
        measured = remat.measure_step(model, inputs, optimizer_factory=adam, repeats=0)
        assert measured.peak_bytes <= budget
        assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes
        report = remat.check_equivalence(model, inputs)
    assert report.equal, str(report)
    assert report.max_abs_diff["loss"] == 0.0


def test_frozen_parameters_lora_style():
    """Only the attention's q and v projections train (as LoRA targets them): no gradients or
    optimizer state are counted for the rest, and the trainable gradients match."""
    model, inputs, _ = REAL["llama"]()
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith(("q_proj.weight", "v_proj.weight")))
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    args, kwargs = split_inputs(inputs)
    profile = make_profile(model, inputs, loss_fn=remat.default_loss,
                           optimizer=adam(trainable))
    assert profile.grads_bytes == trainable_bytes
    # Adam: two moments per trainable element (plus a 4-byte step counter per tensor on CPU)
    assert 2 * trainable_bytes <= profile.optimizer_state_bytes <= 2 * trainable_bytes + 8 * len(trainable)
    planner = Planner(profile)
    budget = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
    plan = remat.optimize_checkpointing(model, budget / 2**30, inputs, optimizer=adam(trainable))
    assert plan.checkpointed and plan.breakdown.grads_bytes <= trainable_bytes
    measured = remat.measure_step(model, inputs, optimizer_factory=lambda ps: adam(p for p in ps if p.requires_grad),
                                  repeats=0)
    assert measured.peak_bytes <= budget
    report = remat.check_equivalence(model, inputs)
    assert report.equal, str(report)
    assert {n for n in report.max_abs_diff if n.startswith("grad:")} == {
        f"grad:{n}" for n, p in model.named_parameters() if p.requires_grad}


def test_t5_decoder_cache_is_turned_off_too():
    """T5 gives its decoder stack its own config copy with use_cache=True: its cross-attention cached keys
    and values on the first call, so a checkpointed EncDecAttention saved fewer tensors when recomputed
    (CheckpointError) and torch.export failed. remat turns off use_cache on every config, notes it and
    gives it back; T5 is now captured as a graph."""
    profile, _ = profiled("t5")
    assert profile.capture_path == "export"
    model, inputs, loss_fn = REAL["t5"]()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    assert model.decoder.config is not model.config and model.decoder.config.use_cache and model.config.use_cache
    unit = "decoder.block.0.layer.1.EncDecAttention"
    plan = remat.optimize_checkpointing(model, 1e3, inputs, loss_fn=loss_fn, check=False)
    assert not any(c.use_cache for c in configs.values())
    assert any("sub-configs" in n for n in plan.notes)
    remat.rewrite.checkpoint_modules(model, [unit])
    assert remat.check_equivalence(model, inputs, loss_fn=loss_fn).equal


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "bert"])
def test_real_model_selective_options(name):
    """Every policy on the menu of the first layer of each transformer (HF attention kernels, GQA,
    mixture-of-experts routing, attention dropout) predicted within 5% and gradient-exact."""
    profile, _ = profiled(name)
    planner = Planner(profile, granularity="op")
    layer = next(u.name for u in profile.candidates()
                 if "@" not in u.name and u.name.endswith(("layers.0", "h.0", "layer.0", "block.0")))
    names = [u.name for u in profile.candidates() if u.name.startswith(layer + "@ops")]
    assert names, f"{layer} has no selective options"
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    plans = [planner.make_plan([n], "hand") for n in names] + [planner.plan_for_budget(int(lo + 0.5 * (hi - lo)))]
    for plan in plans:
        applied_and_checked(name, plan)


def _amp_loop_peak(model, inputs, plan=None) -> int:
    """Peak of one step of the usual AMP loop, measured independently of remat's step helpers:
    ``with autocast(): loss = model(**batch).loss``, then ``loss.backward()`` and the optimizer step
    outside it (exiting the region clears the autocast cache of bf16 weight copies)."""
    from remat.runtime.measure import StorageTracker, tensor_bytes

    if plan is not None:
        remat.apply_plan(model, plan)
    opt = adam(model.parameters())
    args, kwargs = split_inputs(inputs)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*args, **kwargs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer state
    state = [*model.parameters(), *model.buffers(), *(t for st in opt.state.values() for t in st.values()),
             *(v for v in kwargs.values() if isinstance(v, torch.Tensor))]
    with StorageTracker("cpu", ignore=state) as tracker:
        step()
    return tensor_bytes(state, torch.device("cpu")) + tracker.peak_bytes


def test_autocast_predicted_for_the_amp_loop():
    """The AMP loop runs backward outside autocast, where the cache of bf16 weight copies is gone: remat
    clears that cache before its own backward, so its prediction is the AMP loop's (it ran ~5% high when
    the cache lived through backward)."""
    model, inputs, _ = REAL["llama"]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        args, kwargs = split_inputs(inputs)
        profile = make_profile(model, inputs, loss_fn=remat.default_loss, optimizer=adam(model.parameters()))
    planner = Planner(profile)
    for plan in (planner.no_checkpointing(), planner.least_memory()):
        fresh, inputs, _ = REAL["llama"]()
        remat.api.prepare_hf_for_training(fresh)
        measured = _amp_loop_peak(fresh, inputs, plan)
        assert abs(plan.predicted_peak_bytes - measured) <= 0.03 * measured, (plan.checkpointed, measured)


def test_units_found_inside_an_autocast_wrapped_forward():
    """accelerate's mixed precision replaces ``model.forward`` by an autocast-wrapped one; export then puts
    the whole forward in a higher-order operator's subgraph, and remat found no units in it (a Trainer
    with ``bf16=True`` got no plan below the no-checkpointing peak)."""
    from remat.capture import capture
    from remat.examples import make_gpt

    model, inputs, _ = make_gpt(layers=2, batch_size=2, seq_len=8, d_model=16, heads=2, vocab=32)
    plain = capture(model, inputs, {})
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    wrapped = capture(model, inputs, {})
    assert wrapped.capture_path == "export"  # fx cannot trace through the autocast decorator
    assert wrapped.units == plain.units and len(plain.units) == 6
