"""Units named, checked and checkpointed in place (by name, or as a Plan says), and the checkpointing undone
(part of :mod:`remat.rewrite`)."""

from __future__ import annotations

from typing import Iterable

from torch import nn

from remat._compat import uncompiled
from remat.costs.unit_costs import SELECTIVE, is_selective, parse_region, parse_segment, region_name, segment_name
from remat.errors import InvalidInputError, PlanMismatchError
from remat.rewrite.eager import keep_compiled_nothing_eager
from remat.rewrite.forwards import CheckpointedForward, RegionForward, SegmentedForward, _RematForward, is_checkpointed
from remat.rewrite.offload import OffloadedForward, offload_modules
from remat.runtime.compiled import give_back
from remat.solve.plan import Plan


def parse_unit(name: str) -> tuple[str, tuple[int, int] | None]:
    """``"blocks[0:2]"`` -> ``("blocks", (0, 2))``; ``"h.3"`` and ``"h.3@ops2"`` -> ``("h.3", None)``."""
    name = name.partition(SELECTIVE)[0]
    seg = parse_segment(name)
    return (name, None) if seg is None else seg


def checkpointed_modules(model: nn.Module) -> list[str]:
    """The units remat has checkpointed in ``model`` (module names and segments), in module order."""
    out = []
    for name, m in uncompiled(model).named_modules():
        f = m.__dict__.get("forward")
        while isinstance(f, _RematForward):  # a whole Sequential around its segments: both
            out += [] if isinstance(f, OffloadedForward) else f.unit_names(name)
            f = f.previous
    return out


def offloaded_modules(model: nn.Module) -> list[str]:
    """The modules remat has offloaded in ``model`` (Note [Offloaded units]), in module order."""
    return [name for name, m in uncompiled(model).named_modules()
            if isinstance(m.__dict__.get("forward"), OffloadedForward)]


def check_units(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that are not units of ``model`` (missing modules, bad segments)."""
    mods = dict(model.named_modules())
    bad = []
    for n in names:
        region = parse_region(n)
        if region is not None:
            if is_selective(n) or region[0] not in mods or isinstance(mods[region[0]], nn.Sequential):
                bad.append(n)
            continue
        container, seg = parse_unit(n)
        if is_selective(n) and seg is not None:
            bad.append(n)
            continue
        m = mods.get(container)
        if m is None:
            bad.append(n)
        elif seg is not None and (not isinstance(m, nn.Sequential) or not 0 <= seg[0] < seg[1] <= len(m)):
            bad.append(n)
    return bad


def checkpoint_modules(
    model: nn.Module,
    names: Iterable[str],
    *,
    preserve_rng_state: bool = True,
    mutated_buffers: dict[str, Iterable[str]] | None = None,
    saved_ops: dict[str, Iterable[str]] | None = None,
    random: str = "keep",
) -> None:
    """Checkpoint the named units of ``model`` in place (mutates ``model``).

    A selective unit (``h.3@ops2``) needs its policy in ``saved_ops``: the operators whose outputs
    it keeps (Note [Selective checkpointing]; ``Plan.saved_ops``).

    ``mutated_buffers`` maps a unit to the names (relative to its module, or for a segment to its
    Sequential) of the buffers its forward mutates (Note [Buffers replay]); units not in it replay
    all their buffers. Parameter names, ``state_dict`` keys, parameter identity and module hooks
    are unchanged. ``random``: under torch.compile, keep the outputs of random operators (``"keep"``, Note [Random
    operators under compile]) or ``"recompute"`` them (``Plan.compiled_random``)."""
    names = list(names)
    bad = check_units(model, names)
    if bad:
        raise PlanMismatchError(f"{type(model).__name__} has no unit named {bad}: name submodules by their "
                                "qualified names (model.named_modules()), segments as 'container[i:j]' and "
                                "regions as 'module[first_call:next_call]'")
    policies = saved_ops or {}
    missing = [n for n in names if is_selective(n) and n not in policies]
    if missing:
        raise InvalidInputError(f"selective units {missing} need their policy: pass saved_ops={{unit: operators "
                                "to keep}} (a Plan carries it in plan.saved_ops)")
    mods = dict(model.named_modules())
    mutated = mutated_buffers or {}
    segments: dict[str, list[tuple[int, int]]] = {}
    regions: dict[str, list[tuple[str, str | None]]] = {}
    for n in names:
        if (region := parse_region(n)) is not None:
            regions.setdefault(region[0], []).append(region[1:])
            continue
        container, seg = parse_unit(n)
        if seg is not None:
            segments.setdefault(container, []).append(seg)
    # regions first, like segments (Note [Regions] in remat.capture); all of them built, and so checked,
    # before any is installed
    region_forwards = {}
    for module, regs in regions.items():
        m = mods[module]
        if m.__dict__.get("forward") is not None:
            raise InvalidInputError(f"{module!r} already has a forward of its own on the instance "
                                    f"({type(m.__dict__['forward']).__name__}); cannot checkpoint regions of it "
                                    f"({[region_name(module, *r) for r in regs]}): call remove_checkpointing first")
        bufs = {r: (tuple(mutated[region_name(module, *r)]) if region_name(module, *r) in mutated else None)
                for r in regs}
        region_forwards[module] = RegionForward(m, regs, preserve_rng_state=preserve_rng_state, buffers=bufs,
                                                random=random)
        region_forwards[module].program()  # refuses a region the module's forward cannot be cut into
    for module, f in region_forwards.items():
        mods[module].forward = f
    # segments first: a Sequential checkpointed as a whole with segments nested inside (Note [Nested
    # checkpoints] in remat.costs.simulate) wraps its SegmentedForward
    for container, segs in segments.items():
        m = mods[container]
        if is_checkpointed(m):
            raise InvalidInputError(f"{container!r} is already checkpointed; cannot also checkpoint segments of "
                                    f"it ({segs}) around that: call remove_checkpointing first")
        bufs = {s: (tuple(mutated[segment_name(container, *s)]) if segment_name(container, *s) in mutated
                    else None) for s in segs}
        m.forward = SegmentedForward(m, segs, preserve_rng_state=preserve_rng_state, buffers=bufs, random=random)
    for n in names:
        container, seg = parse_unit(n)
        if parse_region(n) is not None:
            continue
        m = mods[container]
        if seg is None and not isinstance(m.__dict__.get("forward"), CheckpointedForward):
            bufs = tuple(mutated[n]) if n in mutated else None
            policy = n[len(container):]
            m.forward = CheckpointedForward(m, preserve_rng_state=preserve_rng_state, buffers=bufs,
                                            saved_ops=policies[n] if policy else None, policy=policy,
                                            random=random)
    keep_compiled_nothing_eager(model)


def checkpoint_plan(model: nn.Module, plan: Plan) -> None:
    """Checkpoint ``model`` in place as ``plan`` says: its units, with the buffers each replays and the
    policy of each selective unit, and under torch.compile what they do with random operators; and offload the units
    it offloads (Note [Offloaded units] in remat.rewrite.offload) (mutates ``model``; no compatibility check: see
    ``remat.apply_plan``)."""
    checkpoint_modules(model, plan.checkpointed, mutated_buffers=dict(plan.mutated_buffers),
                       saved_ops=dict(plan.saved_ops), random=plan.compiled_random)
    if plan.offloaded:
        offload_modules(model, plan.offloaded, plan.offloaded_ops, plan.offload_ahead)


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo remat's checkpointing everywhere in ``model`` (mutates it). Returns the units it undid."""
    undone = []
    for name, m in uncompiled(model).named_modules():
        f = m.__dict__.get("forward")
        while isinstance(f, _RematForward):
            if f.previous is not None:
                m.forward = f.previous
            else:
                del m.forward
            undone += f.unit_names(name)
            f = m.__dict__.get("forward")
        give_back(m)
    return undone
