"""Where the planner's knowledge of a step comes from: one interface, :class:`CostSource`, and its implementation
for a step measured on this machine, :class:`MeasuredHere`.

Note [Where costs come from]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What the planner needs from the machine is a step's recording, per-unit times and the optimizer's costs (one
:class:`~remat.costs.unit_costs.Profile`, the frozen hand-off to the cost model and the solver) and, for the plan
it picks, a peak checked where the step can run. A :class:`CostSource` answers both: ``profile`` gives the Profile,
``choose`` gives the plan for the budget, checked as far as the source can. :class:`MeasuredHere` records the step
on fake tensors, times it and checks plans on real steps of this machine; :class:`remat.target.ModelledTarget`
models a device and a world that are not here (issue #39: the step recorded on fake tensors in the target's world,
plans checked by replaying the CUDA caching allocator) with the same two methods, and the cost model, the solver
and the rewriter are the same. :func:`remat.optimize_checkpointing` runs the steps around them (snapshot, rewrite, notes).

In: a :class:`~remat.api.request.Request`. Out: a Profile, then a Plan with its notes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from remat.api.checking import checked_reading, least_checked
from remat.api.compiled import proved_compiled, ranks_reading
from remat.api.hand_rules import fastest_checked
from remat.api.inputs import loop_grads, stage
from remat.check.compiled import CompiledComparison
from remat.capture import ModelGraph
from remat.costs.unit_costs import Profile
from remat.profile import captured_profile
from remat.runtime.distributed import Wrapping, steps_checked
from remat.runtime.measure import LossFn
from remat.solve import Planner
from remat.solve.calibrated import plan_compiled
from remat.solve.plan import Plan

if TYPE_CHECKING:
    from remat.api.request import Request


class CostSource(Protocol):
    """Where a step's costs come from (Note [Where costs come from])."""

    def describe(self) -> str:
        """Where the figures come from, for the plan's notes and errors (e.g. "measured on this machine")."""
        ...

    def profile(self, req: Request) -> Profile:
        """The step's Profile: its recording, per-unit times and optimizer costs."""
        ...

    def choose(self, req: Request, planner: Planner, profile: Profile) -> tuple[Plan, tuple[str, ...]]:
        """The plan for ``req``'s budget over ``planner``, checked as far as this source can, with its notes."""
        ...


def profile_step(
    model: nn.Module, args: tuple, kwargs: dict, *, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None,
    device: torch.device, output_alive: bool = True, wrapping: Wrapping | None = None,
    graph: ModelGraph | None = None, memory_known: Callable[[Profile], None] | None = None,
) -> Profile:
    """The step captured and profiled on this machine (:func:`remat.profile.captured_profile`), an exception sorted
    into the user's failure or remat's (Note [Whose failure] in remat.api.inputs)."""
    return captured_profile(model, args, kwargs, loss_fn=loss_fn, optimizer=optimizer, device=device,
                            output_alive=output_alive, wrapping=wrapping, graph=graph, memory_known=memory_known,
                            staged=lambda: stage("profile", model, args, kwargs, loss_fn))



class MeasuredHere:
    """The step recorded, timed and checked on this machine: what remat has always done. Made once per call
    (it keeps the peaks checked while profiling, Note [Memory before time])."""

    def __init__(self) -> None:
        self.first: _MemoryFirst | None = None

    def describe(self) -> str:
        return "measured on this machine"

    def profile(self, req: Request) -> Profile:
        self.first = _MemoryFirst(req)
        return profile_step(req.model, req.args, req.kwargs, loss_fn=req.loss_fn, optimizer=req.optimizer,
                             device=req.device, output_alive=req.output_alive, wrapping=req.wrapping,
                             memory_known=self.first if req.loop is None else None)

    def choose(self, req: Request, planner: Planner, profile: Profile) -> tuple[Plan, tuple[str, ...]]:
        return _choose(req, planner, profile, self.first if self.first is not None else _MemoryFirst(req))


class _MemoryFirst:
    """Note [Memory before time]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Whether a budget is below the least peak is a question of memory, which the recording answers before
    any timed step runs; a refusal after timing cost 16 training steps' time at GPT-2-small size (issue
    #23). So profiling hands the profile as memory alone gives it (every recompute 0 s) to this hook
    first: a budget under its least predicted peak is refused there, with the checked least (the
    least-memory plan of that profile, or every block where lower: :func:`least_checked`), in the time
    of the recording, one plain forward and one or two checked steps. Without times, the least-memory
    plan is one of the plans of least predicted peak, not necessarily the one the timed profile picks, and
    two such plans can measure a few hundred bytes apart: so the full check, before it refuses a budget,
    also checks this plan (``more_fallbacks`` of :func:`plan_checked`), and a budget equal to a figure
    either path reported gets a plan. Peaks checked here are not measured again."""

    def __init__(self, req: Request) -> None:
        self.req = req
        #: checked peaks by plan
        self.checked: dict[tuple[str, ...], int] = {}
        #: the planner over the profile as memory alone gave it
        self.by_memory: list[Planner] = []

    def __call__(self, memory: Profile) -> None:
        req = self.req
        memory = loop_grads(memory, req.grad_accumulation, req.zero_grad_after_forward)
        planner = req.planner(memory)
        self.by_memory.append(planner)
        if req.budget_bytes >= planner.min_peak_bytes:
            return
        if not req.check:
            raise planner.infeasible(req.budget_bytes)
        with stage("check", req.model, req.args, req.kwargs, req.loss_fn):
            promise = least_checked(req.model, req.args, req.kwargs, req.loss_fn, req.device, planner,
                                    req.budget_bytes, ranks=req.ranks, checked=self.checked)
        if req.budget_bytes < promise:
            raise planner.infeasible(req.budget_bytes, least_bytes=promise,
                                     steps=max(steps_checked(req.model, req.device), 1))

    def least(self, planner: Planner) -> list[Plan]:
        """The least-memory plan as memory alone chooses it (its units, timed by the full profile's planner)."""
        if not self.by_memory:
            return []
        return [planner.make_plan(self.by_memory[0].least_memory().checkpointed, "least-memory")]


def _choose(req: Request, planner: Planner, profile: Profile, first: _MemoryFirst) -> tuple[Plan, tuple[str, ...]]:
    """The plan for the budget: checked on compiled steps and proved (a compiled loop), checked on real steps, or
    as predicted (``check=False``); one for every rank. Returns it with its notes."""
    model, args, kwargs, loss_fn, device, ranks = req.model, req.args, req.kwargs, req.loss_fn, req.device, req.ranks
    notes: tuple[str, ...] = ()
    if req.check and req.loop is not None:
        loop = req.loop
        compare = CompiledComparison(loop) if ranks is None else None
        with stage("check", model, args, kwargs, loss_fn):
            plan = plan_compiled(
                planner, req.budget_bytes, lambda p: ranks_reading(ranks, checked_reading(
                    model, p, args, kwargs, loss_fn, device, profile, loop, compare=compare)),
                agree=ranks.broadcast if ranks is not None else (lambda p: p), loop=str(loop),
                proved=compare.proved if compare is not None else None)
            notes += (proved_compiled(model, plan, args, kwargs, loss_fn, loop, compare),)
    elif req.check:
        with stage("check", model, args, kwargs, loss_fn):
            plan = fastest_checked(model, args, kwargs, loss_fn, device, planner, req.budget_bytes, ranks=ranks,
                                   checked=first.checked, more_fallbacks=lambda: first.least(planner))
    else:
        plan = planner.plan_for_budget(req.budget_bytes)
        plan = ranks.broadcast(plan) if ranks is not None else plan
    return plan, notes
