"""Candidate units: the modules that ran, segments of each ``nn.Sequential``, and selective policy menus.

Note [Segments]
~~~~~~~~~~~~~~~
Besides submodules, a unit can be a run of consecutive children of an ``nn.Sequential``
(``blocks[0:4]``), checkpointed as one piece like ``checkpoint_sequential``: it keeps only the
run's input, where checkpointing each child keeps every child's input. Segments are costed
from the same recording (their children are hooked too), and compete in the ILP with the
modules they overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from remat.capture import unit_parent
from remat.costs.unit_costs import SELECTIVE, UnitCost, region_name, segment_name
from remat.costs.effects import UnitSpec
from remat.costs.recording import Recording
from remat.solve import chen_segments


def segments(n: int, container_is_unit: bool) -> list[tuple[int, int]]:
    """Candidate segments of a Sequential with ``n`` children (Note [Segments]): every run of two or
    more children up to 12 children, else runs of each length aligned at multiples of it; always
    Chen's sqrt(n) segments; never the whole container when it is a unit itself."""
    out: set[tuple[int, int]] = set()
    if n <= 12:
        out = {(i, j) for i in range(n) for j in range(i + 2, n + 1)}
    else:
        for size in range(2, n):
            out |= {(i, min(i + size, n)) for i in range(0, n, size) if min(i + size, n) - i >= 2}
    out |= set(chen_segments(n))
    if container_is_unit:
        out.discard((0, n))
    return sorted(out)


def module_and_segment_specs(rec: Recording, ran: Sequence[str],
                             sequentials: Mapping[str, Sequence[str]]) -> list[UnitSpec]:
    """Module units that ran (in forward order), then the segments of each Sequential that ran once with
    its children back to back (Note [Segments])."""
    specs = [UnitSpec(u, (u,), unit_parent(u, ran), u + ".") for u in ran]
    for container, children in sequentials.items():
        if container and rec.calls.get(container, 0) != 1:
            continue
        if any(rec.calls.get(c, 0) != 1 for c in children):
            continue
        if any(rec.first_span(b)[0] != rec.first_span(a)[1] + 1 for a, b in zip(children, children[1:])):
            continue
        parent = container if container in ran else unit_parent(container, ran)
        scope = container + "." if container else ""
        for i, j in segments(len(children), container in ran):
            specs.append(UnitSpec(segment_name(container, i, j), tuple(children[i:j]), parent, scope))
    return specs


def region_specs(rec: Recording, ran: Sequence[str], cuts: Mapping[str, Sequence[str]],
                 calls: Mapping[str, Sequence[str]]) -> list[UnitSpec]:
    """The regions (Note [Regions] in remat.capture) of each module unit that ran once with its cut
    submodules called once each: every stretch between two cut points, or from one to the end, except the
    whole forward (the module unit itself)."""
    specs = []
    for module, called in cuts.items():
        inner = calls[module]
        if module not in ran or rec.calls.get(module, 0) != 1 or any(rec.calls.get(c, 0) != 1 for c in inner):
            continue
        begin, finish = rec.first_span(module)
        starts = [rec.first_span(c)[0] for c in called]
        if starts != sorted(starts) or not begin <= starts[0]:
            continue  # not run in the traced order
        bounds = [*zip(called, starts), (None, finish + 1)]
        for i, (a, a_start) in enumerate(bounds[:-1]):
            for b, b_start in bounds[i + 1:]:
                if (a_start, b_start - 1) == (begin, finish) or b_start - 1 < a_start:
                    continue
                members = tuple(c for c in inner if a_start <= rec.first_span(c)[0] < b_start)
                name = region_name(module, a[len(module) + 1:], None if b is None else b[len(module) + 1:])
                specs.append(UnitSpec(name, members, module, module + ".", region=(a_start, b_start - 1)))
    return specs


#: operators whose outputs the hand policy keeps (by overload packet name): matrix products,
#: attention kernels, convolutions (Megatron-LM's "selective recomputation"), and the collectives that close a
#: tensor-parallel block's attention or MLP (the Rowwise all_reduce; reduce_scatter under sequence parallelism,
#: which torchtitan's op-level policy saves too), so that its recomputation communicates nothing (Note
#: [Recomputed communication] in remat.costs.effects); one of the policies remat profiles per unit
SAVED_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
    "all_reduce", "reduce_scatter_tensor",
})

#: Note [Policy menus]: the shares of a unit's keepable bytes at which its greedy policies stop
POLICY_BYTE_SHARES = (0.25, 0.5, 0.75, 1.0)


def policy_menu(rec: Recording, start: int, end: int) -> list[frozenset[int]]:
    """Note [Policy menus]
    ~~~~~~~~~~~~~~~~~~~~~~
    The selective policies remat offers for one unit, as sets of forward operators (timeline
    indices) whose outputs are kept. Recomputing with a policy runs every operator it does not keep
    (``torch.utils.checkpoint``'s selective mode reruns the whole forward and hands back the kept
    outputs), so against checkpointing the whole unit, keeping operator ``i`` costs the bytes of its
    new storages until the recomputation and saves its time: a knapsack per unit. The menu is its
    greedy frontier: operators ranked by the work saved per byte kept, cut where the kept operators
    reach each share of the keepable bytes in POLICY_BYTE_SHARES; plus the hand policy of the field
    (keep the matrix products, attention kernels, convolutions and tensor-parallel collectives: SAVED_OPS). The ILP then costs each
    option exactly, with measured times, against the whole-step memory model, and picks at most one
    option per unit.

    The menu is made of what does not change from run to run, so that the same model and batch get the
    same options in every run (two runs of a Llama under the Trainer gave two 8-unit plans): the rank is
    FLOPs per byte (torch.utils.flop_counter: matrix products and attention first), then bytes (the
    smaller first), then the position in the forward; measured times, which move by a few percent per
    run, are not read. Operators without a FLOP formula (elementwise, norms, softmax) are memory-bound,
    their time about proportional to their bytes, so ranking them by size loses little against ranking
    by measured time per byte. (The ILP still costs the options with measured times: plans of nearly
    equal cost can still swap between runs.)

    An operator is keepable when it creates storage (views and in-place ops allocate nothing), does
    not draw random numbers (Note [Selective checkpointing]: skipping a draw would shift the ones
    after it), and no operator modifies its output in place later in the forward (the cache refuses
    mutated entries). Only operators up to ``end``, the last one the recomputation runs (Note [Early
    stop]), are worth keeping."""
    written = {w.storage for w in rec.writes if w.storage is not None}
    ops: list[tuple[int, int, int]] = []  # (index, bytes created, FLOPs)
    for i in range(start, end + 1):
        op = rec.forward_ops[i]
        new = [s for s in op.created if s is not None]
        if not new or op.random or not op.named or any(s in written for s in new):
            continue
        ops.append((i, sum(rec.storages[s].nbytes for s in new), op.flops))
    if len(ops) < 2:
        return []
    ranked = sorted(ops, key=lambda o: (-o[2] / max(o[1], 1), o[1], o[0]))
    total = sum(b for _, b, _ in ops)
    menu: list[frozenset[int]] = []
    for share in POLICY_BYTE_SHARES:
        acc, kept = 0, []
        for i, b, _ in ranked:
            if kept and acc + b > share * total:
                break
            kept.append(i)
            acc += b
        menu.append(frozenset(kept))
    menu.append(frozenset(i for i, _, _ in ops if rec.forward_ops[i].name.split(".")[1] in SAVED_OPS))
    out: list[frozenset[int]] = []
    for keep in sorted(menu, key=lambda k: (-sum(b for i, b, _ in ops if i in k), sorted(k))):
        if keep and keep not in out:
            out.append(keep)
    return out


def op_keys(rec: Recording, start: int, keep: frozenset[int]) -> tuple[str, ...]:
    """The rewrite's names of forward operators ``keep`` of a unit starting at ``start``: the overload and
    its call count within the unit (``aten.addmm.default#1``)."""
    names = rec.op_names(start, max(keep))
    return tuple(names[i] for i in sorted(keep) if i in names)


def selective_specs(rec: Recording, costs: Sequence[UnitCost]) -> list[UnitSpec]:
    """The selective options (Note [Policy menus]) of every module unit among ``costs`` that may be
    checkpointed, frees something, and runs once."""
    specs = []
    for c in costs:
        if c.is_segment or c.excluded is not None or not c.drops or c.calls > 1:
            continue
        end = c.forward_end if c.recompute_end is None else c.recompute_end
        for k, keep in enumerate(policy_menu(rec, c.forward_start, end), start=1):
            specs.append(UnitSpec(f"{c.name}{SELECTIVE}{k}", (c.name,), c.parent, c.name + ".", keep=keep,
                                  saved_ops=op_keys(rec, c.forward_start, keep)))
    return specs
