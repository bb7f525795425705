"""remat never touches the user's training state (issue: an LR scheduler made profiling step the
user's optimizer), and predicts the optimizer state a real step creates."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import remat
from remat.profile.optimizer import optimizer_costs
from remat.runtime.measure import tensor_bytes
from optimizers import OPTIMIZERS, SCHEDULERS


def mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    with torch.random.fork_rng():  # the global RNG state is part of what the tests compare
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(dropout),
                                             nn.Linear(128, 32)) for _ in range(4)])


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def batch() -> torch.Tensor:
    return torch.randn(512, 32, generator=torch.Generator().manual_seed(1))


def training_state(model: nn.Module, opt: torch.optim.Optimizer, sched) -> dict:
    """Everything remat must leave as it was, copied."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "param_ids": [id(p) for p in model.parameters()],
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "grad_ids": [id(p.grad) for p in model.parameters()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "training": [m.training for m in model.modules()],
        "opt": copy.deepcopy(opt.state_dict()),
        "opt_step_attr": opt.__dict__.get("step"),
        "opt_called": opt.__dict__.get("_opt_called"),
        "sched": None if sched is None else copy.deepcopy(sched.state_dict()),
        "lrs": [g["lr"] for g in opt.param_groups],
        "rng": torch.get_rng_state(),
    }


def assert_same_state(a: dict, b: dict) -> None:
    assert a["param_ids"] == b["param_ids"] and a["grad_ids"] == b["grad_ids"]
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), f"parameter {n} changed"
        ga, gb = a["grads"][n], b["grads"][n]
        assert (ga is None and gb is None) or torch.equal(ga, gb), f"gradient of {n} changed"
    assert a["requires_grad"] == b["requires_grad"]
    assert all(torch.equal(a["buffers"][n], b["buffers"][n]) for n in a["buffers"])
    assert a["training"] == b["training"]
    assert_equal_nested(a["opt"], b["opt"], "optimizer state_dict")
    assert a["opt_step_attr"] is b["opt_step_attr"] and a["opt_called"] == b["opt_called"]
    assert_equal_nested(a["sched"], b["sched"], "scheduler state_dict")
    assert a["lrs"] == b["lrs"]
    assert torch.equal(a["rng"], b["rng"]), "global RNG state changed"


def assert_equal_nested(x, y, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            assert_equal_nested(x[k], y[k], f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (p, q) in enumerate(zip(x, y)):
            assert_equal_nested(p, q, f"{where}[{i}]")
    elif callable(x):
        assert callable(y), where  # scheduler lambdas are compared by presence
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"


def real_state_bytes(make_opt, model: nn.Module, x: torch.Tensor, make_sched=None) -> int:
    """Optimizer state bytes after two real steps of a fresh optimizer (and scheduler: OneCycleLR sets
    SGD's momentum, which creates momentum buffers) on a copy of the model."""
    m = copy.deepcopy(model)
    opt = make_opt(m.parameters())
    sched = make_sched(opt) if make_sched else None
    for _ in range(2):
        loss(m(x)).backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
    return tensor_bytes([t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)],
                        torch.device("cpu"))


def start_run(model, make_opt, make_sched, x, start: str):
    """The optimizer and scheduler of a ``"fresh"`` run, or of a ``"resumed"`` one (see ``resumed``)."""
    if start == "resumed":
        return resumed(model, make_opt, make_sched, x)
    opt = make_opt(model.parameters())
    return opt, make_sched(opt) if make_sched else None


def resumed(model, make_opt, make_sched, x):
    """A run that has trained a step (scheduler stepped), with gradients of the next step in place."""
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    loss(model(x)).backward()
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    loss(model(x)).backward()
    return opt, sched


@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("start", ["fresh", "resumed"])
def test_optimizer_accounting_touches_nothing_and_predicts_real_state(opt_name, sched_name, start):
    """The optimizer accounting (the only part of profiling that deals with the optimizer) on every
    optimizer x scheduler x fresh/resumed: nothing changes, and the predicted state bytes equal the
    state two real steps create."""
    model, x = mlp(), batch()
    make_opt, make_sched = OPTIMIZERS[opt_name], SCHEDULERS[sched_name]
    opt, sched = start_run(model, make_opt, make_sched, x, start)
    before = training_state(model, opt, sched)
    cost = optimizer_costs(opt, torch.device("cpu"))
    assert_same_state(before, training_state(model, opt, sched))
    assert cost.state_bytes == real_state_bytes(make_opt, mlp(), x, make_sched), opt_name
    assert cost.label == type(opt).__name__


def test_global_optimizer_hooks_do_not_fire():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    calls = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(o))
    try:
        optimizer_costs(opt, torch.device("cpu"))
        assert calls == []
        opt.step()
        assert calls == [opt]  # the user's hook is still registered and fires on their steps
    finally:
        handle.remove()


@pytest.mark.parametrize("opt_name,sched_name", [("AdamW", "StepLR"), ("SGD-momentum", "OneCycleLR"),
                                                 ("Adam", "LambdaLR")])
def test_optimize_checkpointing_with_scheduler_leaves_the_run_bit_identical(opt_name, sched_name):
    """The issue's report: a resumed run with a scheduler, then optimize_checkpointing. Everything is as
    before, and training goes on exactly as a twin that never saw remat (dropout on)."""
    make_opt, make_sched = OPTIMIZERS[opt_name], SCHEDULERS[sched_name]
    x = batch()
    runs = []
    for use_remat in (False, True):
        model = mlp(dropout=0.1)
        torch.manual_seed(5)
        opt, sched = resumed(model, make_opt, make_sched, x)
        forwards, opt_steps = [], []
        # on the root, which no plan puts inside a checkpoint (hooks of modules inside a checkpointed unit run
        # again when it is recomputed, as with torch.utils.checkpoint itself)
        model.register_forward_hook(lambda m, a, o: forwards.append(1))
        opt.register_step_post_hook(lambda o, a, k: opt_steps.append(1))
        if use_remat:
            before = training_state(model, opt, sched)
            probe = remat.optimize_checkpointing(model, 1.0, x, loss_fn=loss, optimizer=opt, check=False)
            assert_same_state(before, training_state(model, opt, sched))
            budget = (probe.min_peak_bytes + probe.baseline_peak_bytes) // 2
            remat.remove_checkpointing(model)
            plan = remat.optimize_checkpointing(model, budget / 2**30, x, loss_fn=loss, optimizer=opt)
            assert plan.checkpointed
            expected_state = real_state_bytes(make_opt, mlp(), x, make_sched)
            assert plan.breakdown.optimizer_state_bytes == expected_state
            after = training_state(model, opt, sched)
            assert_same_state(before, after)
            assert remat.check_equivalence(model, x, loss_fn=loss).equal
            remat.measure_step(model, x, loss_fn=loss, optimizer_factory=make_opt, repeats=0)
            assert_same_state(before, training_state(model, opt, sched))
            assert opt_steps == []  # remat never stepped the user's optimizer (its step hooks never fired)
        forwards.clear()
        for _ in range(3):  # the run goes on
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss(model(x)).backward()
        assert opt_steps == [1, 1, 1] and forwards == [1, 1, 1]  # the user's hooks fire, once per call
        runs.append((model, opt))
    (plain, opt_p), (ckpt, opt_c) = runs
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(a.grad, b.grad), n
    assert_equal_nested(opt_p.state_dict(), opt_c.state_dict(), "optimizer state after training")


def test_unsupported_optimizer_is_a_clear_remat_error():
    model, x = mlp(), batch()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(remat.UnsupportedError, match="LBFGS.*optimizer=None"):
        remat.optimize_checkpointing(model, 1.0, x, optimizer=opt)
    assert remat.checkpointed_modules(model) == []


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason=f"torch {torch.__version__} has no torch.optim.Muon")
def test_muon_on_matrices():
    """Muon (matrices only) in its usual set-up: Muon for the 2-D weights, AdamW for the rest."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.GELU(), nn.Linear(64, 32, bias=False))
    x = batch()
    opt = torch.optim.Muon(model.parameters(), lr=1e-2)
    before = training_state(model, opt, None)
    cost = optimizer_costs(opt, torch.device("cpu"))
    assert_same_state(before, training_state(model, opt, None))
    assert cost.state_bytes == real_state_bytes(lambda p: torch.optim.Muon(p, lr=1e-2), model, x) > 0
