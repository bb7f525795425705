"""The selective checkpoint policy: which operators' outputs a checkpointed unit keeps, eagerly and under
torch.compile (part of :mod:`remat.rewrite`).

Note [Selective checkpointing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A selective unit (``h.3@ops2``) is checkpointed with a *policy*: the operators of its forward
whose outputs are kept (``saved_ops``, keys like ``aten.addmm.default#1``: the second ``addmm``
of the unit's forward). Kept outputs are cached in forward and handed back during the
recomputation instead of computing them again; every other operator runs again, as in plain
checkpointing. Megatron-LM's selective recomputation is one such policy (keep the matmuls,
recompute the attention core, softmax, dropout, norms); remat profiles several per unit, at
different memory levels (``remat.profile.units``: Note [Policy menus]), and the ILP picks at most one
option per unit. It uses ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` under
non-reentrant checkpoint with the RNG state preserved; the policy never keeps the output of an
operator that draws random numbers (``draws_random``), so every random operator runs again, in
order, from the restored RNG state and draws the same values (skipping one would shift the draws
of those after it; under torch.compile it keeps every one instead: Note [Random operators under compile]).
Operators are named by position, so the unit's operator sequence must be the
same at every step: remat offers selective options only for models it captured as a graph (fx or
export), not for those with data-dependent control flow (the ``hooks`` path). In-place ops and views are recomputed (they allocate nothing to keep), and
an output that a later operator of the unit modifies in place is never kept (the cache would
refuse it).

Note [Random operators under compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Left to torch, a random operator inside a checkpoint under torch.compile is recomputed: AOTAutograd's
partitioner wraps it in ``run_and_save_rng_state`` in the forward (the generator's state, then the operator)
and ``run_with_rng_state`` in the backward, and inductor runs both as fallback kernels on torch's generator
(torch 2.13, CPU, with or without ``fallback_random``; issue #36). Such a step draws other numbers than the
plain compiled step, and its recomputation is not bound to draw its forward's:
- inductor does not hold a wrapped operator's input to the layout eager gives it, as it does for the plain
  operator's fallback: a ``native_dropout`` after a convolution ran on the channels-last buffer of the
  convolution, and CPU dropout draws its mask in memory order, so the mask differed from the plain step's
  (a U-Net's loss 0.72287 against 0.72533). The backward's replay gets whatever layout the backward program
  chose: the same here, by no rule;
- inductor schedules a plain random kernel that reads no activation (``Dropout2d``'s ``bernoulli_`` on a
  fresh ``[batch, channels, 1, 1]`` tensor) early, with the others, and the wrapped one where it stands, so
  the draws came in another order (0.72289 against 0.72129).
So under compile remat's policy can keep (``CheckpointPolicy.MUST_SAVE``) the output of every operator that
draws random numbers inside a checkpointed unit, whole or selective: it runs once, lowered as in the plain
program, and nothing is drawn again. Its recomputation cannot draw differently, and the compiled planned step
draws what the plain compiled step draws as far as inductor schedules the two programs' random kernels alike
(tests/slow/test_compiled_dropout.py: whole and per block, ``fallback_random``; with inductor's defaults the
U-Net's plain program drew its masks in the order 1, 4, 5, 2, 3 and one plan's in order: Note [Compiled plans
are proved] in remat.check.compiled says what remat checks then). Keeping costs memory where the kept output is
the dropped-out activation (``fallback_random``, where ``native_dropout`` stays one kernel): on
benchmarks/plans/compiled.py's GPT every block checkpointed measured 37.44 MiB kept against 33.62 MiB by hand (torch's
replay; benchmarks/plans/compiled_least.py, whole steps with AdamW). So keeping is one of two programs (``random="keep"``,
``KEEP_RANDOM``), recomputing as torch does the other (``"recompute"``, ``RECOMPUTE_RANDOM``), and a plan for a
compiled loop takes the second only where its compiled step was proved to compute the plain compiled step's loss
and gradients and measured less (Note [Two programs per plan] in remat.solve.calibrated; ``Plan.compiled_random``).
Eager steps keep replaying from the restored generator state (Note [Selective checkpointing]), which draws exactly
the forward's numbers.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from typing import Callable, Iterable

import torch

from remat._compat import (TorchDispatchMode, argument, cacheable_context_fn, storage_key, storage_ref, tree_flatten,
                           written_arguments)
from remat.costs.unit_costs import op_key
from remat.errors import InvalidInputError


def draws_random(func, args: tuple, kwargs: dict) -> bool:
    """Whether operator ``func`` draws from the RNG with these arguments: it is tagged
    ``nondeterministic_seeded`` and is not an attention kernel called with ``dropout_p=0``."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    missing = object()
    p = argument(func, args, kwargs, "dropout_p", missing)
    return p is missing or p is None or float(p) != 0.0


class PolicyNames:
    """Note [Operators named alike under compile]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A selective policy names the operators it keeps by overload and call count within the unit
    (``aten.addmm.default#1``), counted where the recorder sees the eager forward and again where the policy
    runs: eagerly, or under torch.compile, where it sees the operators AOTAutograd traces. The two sequences
    differ in one way that matters (checked on the built-in GPT and a Hugging Face Llama block, CPU, torch
    2.13): eager CPU dropout runs ``empty_like``, ``bernoulli_``, ``div_`` and ``mul.Tensor`` (input times
    mask), compile runs one ``native_dropout``. So the mask's product would shift every later ``mul.Tensor``'s
    count, and a policy keeping it would keep nothing under compile. The product of a random operator's
    output (its ``mul``) is therefore not named and never kept: it is part of the random operator, which is
    recomputed anyway. (Views differ too, ``_unsafe_view`` for ``view``; they allocate nothing and are never
    kept. Other decompositions are not known to differ; a policy whose operators compile does not run keeps
    fewer, and the compiled step's memory is measured either way: Note [Compiled steps].)

    The mask is known by its storage, through a weak reference: a storage's key alone (its address) passes
    to a tensor made after the mask is freed, whose product would then go unnamed too, and the count of
    every later ``mul.Tensor`` would depend on where the allocator put things, so differ between the forward
    and the recomputation (on torch 2.8, which asks the policy in both, HF Llama's attention dropout made
    the recomputation ask for a kept output the forward had not kept: "Trying to backward an extra time").

    One instance counts one pass over a unit's forward: ``key`` names each operator call in order."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        #: storages written by random operators in place (the eager dropout's mask), by key
        self.noise: dict[int, weakref.ref] = {}

    def key(self, func, args: tuple, kwargs: dict) -> str | None:
        """This call's name, or None for the product of a random operator's output (not named, never kept)."""
        if draws_random(func, args, kwargs):
            self.noise.update((storage_key(t), storage_ref(t))
                              for t in tree_flatten(written_arguments(func, args, kwargs))[0]
                              if isinstance(t, torch.Tensor))
        elif self.noise and func is torch.ops.aten.mul.Tensor and any(
                isinstance(t, torch.Tensor) and self._is_noise(t) for t in args):
            return None
        name = str(func)
        k = self.counts[name]
        self.counts[name] = k + 1
        return op_key(name, k)

    def _is_noise(self, t: torch.Tensor) -> bool:
        ref = self.noise.get(storage_key(t))
        return ref is not None and ref() is not None


class OutputNames(TorchDispatchMode):
    """While active, names each storage the operators of one call of a unit's forward make by the operator that
    made it, as a selective policy names operators (:class:`PolicyNames`): what an offloaded part moves (Note
    [Offloaded parts] in remat.costs.offload). A storage is known by a weak reference as well as its key, so a
    later storage at a freed one's address is not taken for it."""

    def __init__(self) -> None:
        super().__init__()
        self.names = PolicyNames()
        self.made: dict[int, tuple[str, weakref.ref]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = self.names.key(func, args, kwargs)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and self.name_of(t) is None:
                if key is not None:
                    self.made[storage_key(t)] = (key, storage_ref(t))
        return out

    def name_of(self, t: torch.Tensor) -> str | None:
        """The operator of this call that made ``t``'s storage, or None (made before the call, or unnamed)."""
        entry = self.made.get(storage_key(t))
        return entry[0] if entry is not None and entry[1]() is not None else None


def keep_ops_contexts(saved_ops: tuple[str, ...], keep_random: bool = False):
    """The ``context_fn`` of a selective checkpoint, bound as ``functools.partial(keep_ops_contexts, saved_ops)``:
    keep the outputs of the operators in ``saved_ops`` (``"aten.addmm.default#1"``: the 2nd call of that
    overload in the unit's forward), recompute the rest; with ``keep_random`` (under torch.compile) also keep
    every random operator's output (Note [Random operators under compile]). Each call (one per checkpointed call of the unit,
    or one per trace under torch.compile) counts its operators from 0 (Note [Under torch.compile])."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep, names = frozenset(saved_ops), defaultdict(PolicyNames)

    def policy(ctx, func, *args, **kwargs):
        # older torch versions also ask the policy during the recomputation (ctx.is_recompute), which
        # must count its operators from 0 again; torch 2.13 asks only in forward
        key = names[bool(getattr(ctx, "is_recompute", False))].key(func, args, kwargs)
        if draws_random(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE if keep_random else CheckpointPolicy.PREFER_RECOMPUTE
        if key in keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _policy_code() -> str:
    """A digest of the code that decides what a policy keeps (it keys compiled policies in AOTAutograd's cache)."""
    import hashlib
    import inspect

    code = "".join(inspect.getsource(f) for f in (keep_ops_contexts, PolicyNames, draws_random))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


_POLICY_CODE = _policy_code()


def compiled_policy(saved_ops: tuple[str, ...], random: str = "keep") -> Callable:
    """The ``context_fn`` under torch.compile: keep ``saved_ops``, and with ``random="keep"`` every random
    operator's output (Note [Random operators under compile]; ``"recompute"``: they run again in backward, as
    torch's own checkpoint has them, for a plan proved so: ``Plan.compiled_random``), keyed for AOTAutograd's
    cache by what it keeps and the code deciding it (``remat._compat.cacheable_context_fn``). Made when a forward
    is installed, not while Dynamo traces it."""
    if random not in RANDOM_CHOICES:
        raise InvalidInputError(f"random operators under compile are kept or recomputed: {RANDOM_CHOICES}, not {random!r}")
    return cacheable_context_fn(functools.partial(keep_ops_contexts, saved_ops, random == "keep"),
                                f"remat-policy:{_POLICY_CODE}:{','.join(saved_ops)}:{random}-random")


#: what a checkpointed unit may do with random operators' outputs under torch.compile (``Plan.compiled_random``)
RANDOM_CHOICES = ("keep", "recompute")
#: the policy of whole units, segments and regions under torch.compile: every random operator's output kept
KEEP_RANDOM = compiled_policy(())
#: the same, random operators recomputed (a plan whose compiled step was proved so)
RECOMPUTE_RANDOM = compiled_policy((), "recompute")


def unit_policy(saved_ops: tuple[str, ...] | None, random: str) -> Callable:
    """The compiled policy of one checkpointed unit (``saved_ops`` None: a whole unit)."""
    if not saved_ops:
        return RECOMPUTE_RANDOM if random == "recompute" else KEEP_RANDOM
    return compiled_policy(saved_ops, random)


def keep_ops(saved_ops: Iterable[str]) -> Callable:
    """The ``context_fn`` that keeps ``saved_ops`` (a function, as torch.compile requires)."""
    return functools.partial(keep_ops_contexts, tuple(saved_ops))
