"""Every torch.optim optimizer that works on dense parameters, and the common LR schedulers: the
matrix of tests/integration/test_training_state.py and benchmarks/accuracy/training_state.py."""

from __future__ import annotations

import torch

#: every torch.optim optimizer that works on dense parameters, with a variant per implementation
OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=1e-2),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "SGD-fused": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "Adam-amsgrad-foreach": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True, foreach=True),
    "Adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "AdamW-forloop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-3),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-3),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-3),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "Adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "RMSprop-centered-momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-3),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-3),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
}

SCHEDULERS = {
    "none": None,
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=20, cycle_momentum="momentum" in o.defaults or "betas" in o.defaults),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)], milestones=[2]),
}
