"""One checkpointed call: a unit's forward under non-reentrant checkpoint, its buffers replayed in the
recomputation, or under torch.compile with the compiled policy (part of :mod:`remat.rewrite`).

Note [Buffers replay]
~~~~~~~~~~~~~~~~~~~~~
Recomputation runs the forward a second time, so a module that updates buffers in its
forward (BatchNorm's running statistics, counters) would update them twice and, worse,
recompute with the already-updated values. The wrapper snapshots the buffers the unit
mutates before the first forward; during recomputation it sets them back to that snapshot
and, afterwards, to the values the first forward left. Plain and checkpointed steps then
end with identical buffers. Which buffers a unit mutates is measured while profiling
(``Plan.mutated_buffers``, an entry per checkpointed unit: a unit that mutates none replays none);
when unknown (a unit checkpointed by hand), every buffer of the unit is snapshotted. In a selective
unit the replay's clones and copies run outside the dispatch modes (selective checkpointing's cache
refuses, during the recomputation, operators the forward did not run: the crash of a selective unit
on a module that merely owned a read-only buffer).

Note [Under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Dynamo turns ``checkpoint`` into a higher-order operator whose body must be free of Python side effects,
and accepts as ``context_fn`` only a function or a ``functools.partial``. So when the installed forward
runs under compilation (``torch.compiler.is_compiling()``: the whole model compiled, or each block after
checkpointing, torchtitan's order) it calls ``checkpoint`` on the module's own forward: no call counter,
no buffer replay, and the selective policy as ``functools.partial(keep_ops_contexts, saved_ops)``, which
counts operators afresh on each call (each trace). Compile needs no replay: the recomputation is part of
the compiled backward graph, a pure function of the forward's inputs, and buffer updates are applied once,
in the forward graph. Random operators are the exception: under compile remat keeps their outputs, or recomputes
them where the plan was proved so (Note [Random operators under compile]; the installed forward's policy).
What compile keeps is decided by its partitioner from these tags. It traces some operators otherwise than
eager does (dropout as one ``native_dropout`` where eager CPU runs four operators); selective policies name
operators so that they keep the same ones under compile (Note [Operators named alike under compile]), and
plans for a compiled loop are measured on compiled steps (Note [Compiled steps] in remat.solve.calibrated).

Note [One tensor, one input]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Non-reentrant checkpoint saves its positional tensors as saved tensors (``_NoopSaveInputs``) and the recomputation
runs on what unpacking them gives. Inside another unit's recomputation each save is answered by a tensor of its own,
so a unit called with one tensor in several places (``attn(y, y, y)``) was recomputed with three tensors where its
forward had one. Code that asks ``query is key`` then takes another path: ``nn.MultiheadAttention`` projects q, k
and v with one product for one tensor and with three otherwise, so a nested plan of a ViT-style block and its
attention recomputed other operators than it saved and torch refused it (CheckpointError, "Recomputed values ...
have different metadata"; tests/integration/test_nested.py). So a tensor given more than once is handed to checkpoint
once, and the call is rebuilt from it, the same object in every place it had, in the forward and in every
recomputation. (Under torch.compile dynamo follows the objects itself: not needed there.)
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from remat._compat import outside_dispatch_modes
from remat.rewrite.policy import KEEP_RANDOM, keep_ops


def _checkpointed_call(fn: Callable, args: tuple, kwargs: dict, buffers: list[torch.Tensor],
                       preserve_rng_state: bool, timer, saved_ops: tuple[str, ...] | None = None,
                       compiled: Callable | None = None) -> object:
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint, replaying ``buffers`` (Note [Buffers replay]);
    under torch.compile with the policy ``compiled`` (:func:`unit_policy`; None, a forward pickled before it had
    one: ``KEEP_RANDOM``)."""
    if torch.compiler.is_compiling():  # Note [Under torch.compile], Note [Random operators under compile]
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                          context_fn=compiled if compiled is not None else KEEP_RANDOM, **kwargs)
    options = {} if saved_ops is None else {"context_fn": keep_ops(saved_ops)}
    before = [b.detach().clone() for b in buffers]
    calls = 0
    # a selective recomputation runs under its cache's dispatch mode, which refuses operators the forward
    # did not run: the replay's clones and copies must not reach it (Note [Buffers replay])
    unseen = outside_dispatch_modes if saved_ops is not None else contextlib.nullcontext

    def replay(*a, **kw):
        if not buffers:
            return fn(*a, **kw)
        with torch.no_grad(), unseen():
            after = [b.detach().clone() for b in buffers]
            for b, v in zip(buffers, before):
                b.copy_(v)
        try:
            return fn(*a, **kw)
        finally:
            with torch.no_grad(), unseen():
                for b, v in zip(buffers, after):
                    b.copy_(v)

    def run(*a, **kw):
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*a, **kw)
        if timer is not None:
            with timer():
                return replay(*a, **kw)
        return replay(*a, **kw)

    unique, rebuild = _once_each(args)  # Note [One tensor, one input]
    if rebuild is not None:
        return checkpoint(lambda *u, **kw: run(*rebuild(u), **kw), *unique, use_reentrant=False,
                          preserve_rng_state=preserve_rng_state, **options, **kwargs)
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **options, **kwargs)


def _once_each(args: tuple) -> tuple[tuple, Callable[[tuple], tuple] | None]:
    """Note [One tensor, one input]: ``args`` with each tensor once (the other arguments in place) and how to rebuild
    ``args`` from them, or ``args`` and None where no tensor appears twice."""
    first: dict[int, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            first.setdefault(id(a), i)
    slots = [first[id(a)] if isinstance(a, torch.Tensor) else i for i, a in enumerate(args)]
    if slots == list(range(len(args))):
        return args, None
    kept = sorted(set(slots))
    unique = tuple(args[i] for i in kept)
    where = [kept.index(s) for s in slots]
    return unique, lambda u: tuple(u[w] for w in where)
