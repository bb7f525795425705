"""The memory of a program inductor generated, read from its wrapper code (no torch).

Note [Compiled programs]
~~~~~~~~~~~~~~~~~~~~~~~~
Inductor turns each graph it compiles into a Python wrapper (``def call(self, args)``) whose statements
say where every buffer is allocated and freed: ``bufN = empty_strided_cpu(...)`` (or ``_cuda``), an extern
kernel that returns new buffers (``extern_kernels.convolution(...)``, ``torch.ops.aten.X.default(...)``, one
of several outputs taken as ``bufN = bufM[i]``, or ``bufM[i][j]`` from a higher-order operator's; those never
taken, such as the activations of a dropout replayed for its mask, live until ``del bufM``), ``bufN = bufM;
del bufM  # reuse`` (the same memory, renamed), ``reinterpret_tensor(bufM, ...)`` (a view) and ``del bufN`` (freed once no name refers to it).
Its inputs come unpacked from ``args``; AOTAutograd names the parameters and the batch ``primals_*``: the
module holds those, so deleting them frees nothing, where a backward's saved activations and incoming
gradients are freed by their ``del``. Inductor's own estimate (``torch._inductor.memory``) plans in
scheduler nodes, before buffer reuse and extern kernels' outputs are placed; on the conv net of
tests/slow/test_inductor.py it missed a recomputed convolution's backward by 131 KiB (its outputs counted
after its input was freed). Walking the wrapper's statements gives what runs.

What extern kernels allocate inside themselves is not in the wrapper. Two such allocations were measured and
are added where a CPU wrapper calls them: ``native_dropout``'s float copy of its mask and the generator state a
dropout's replay holds (``_inside_bytes``). Others are not added: oneDNN's workspace for a convolution's
backward (12-30 KiB there), and anything outside the compiled graphs (the loss, the optimizer). The
calibration on measured plans absorbs those (Note [Compiled steps] in
remat.solve.calibrated). The sizes come from inductor's own buffers (``remat._compat.inductor_programs``).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

from remat.costs.unit_costs import Made, Profile
from remat.costs.wrapper_statements import (
    _ALLOC, _ARGS, _DEL, _ITEM, _RENAME, _VIEW, _inside_bytes, _returned_name, _split_top)


@dataclass(frozen=True)
class ProgramMemory:
    """The memory of one compiled graph's run (bytes): what it receives to free, its peak and what it returns."""

    #: bytes of the inputs the program frees (saved activations, incoming gradients): all but ``primals_*``
    inputs_bytes: int
    #: the most bytes allocated at once while it runs, those inputs included
    peak_bytes: int
    #: bytes of what it returns (its outputs: for a forward, the saved activations too)
    end_bytes: int
    #: per value it returns, in order: (an id of the storage behind it, its bytes); (-1, 0) for one it does not
    #: allocate (None, an input the module holds)
    returned: tuple[tuple[int, int], ...] = ()
    #: bytes of each input the module holds (``primals_*``) that it returns: for a forward, the inputs it saves
    #: for its backward (a block's input activation among them, or not where it saves a copy of it instead)
    returned_inputs: tuple[int, ...] = ()

    def outputs_only_bytes(self, outputs: int) -> int:
        """Of a forward's ``end_bytes``, those of its first ``outputs`` returned values (the block's outputs;
        AOTAutograd returns the saved tensors after them) that it does not also return as saved tensors."""
        saved = {s for s, _ in self.returned[outputs:]}
        return sum(dict((s, n) for s, n in self.returned[:outputs] if s >= 0 and s not in saved).values())

    @property
    def rise_bytes(self) -> int:
        """How far above its own inputs it goes (bytes)."""
        return self.peak_bytes - self.inputs_bytes


class UnreadableProgram(ValueError):
    """A wrapper whose statements this reader does not know."""


def _call_body(source: str) -> tuple[str, re.Match[str], list[str], dict[str, list[str]]]:
    """The wrapper ``source`` from its ``call(self, args)`` on, its ``... = args`` statement, the names of its inputs
    and, per multi-output kernel's result, the names its outputs are taken as (``bufN = bufM[i]``). Raises
    UnreadableProgram where the source has no ``call(self, args)`` or does not unpack its args."""
    start = source.find("    def call(self, args):")
    if start < 0:
        raise UnreadableProgram("no 'def call(self, args)' in the wrapper")
    body = source[start:]
    m = _ARGS.search(body)
    if m is None:
        raise UnreadableProgram("the wrapper does not unpack its args")
    inputs = [n.strip() for n in m.group(1).split(",") if n.strip()]
    items: dict[str, list[str]] = {}
    for it in _ITEM.finditer(body):
        items.setdefault(it.group(2), []).append(it.group(1))
    return body, m, inputs, items


class _Buffers:
    """The storages of a wrapper while it runs: which names refer to each, its bytes, and the bytes alive."""

    def __init__(self) -> None:
        self.storage_of: dict[str, int] = {}  # name -> storage id
        self.nbytes: list[int] = []  # storage id -> bytes
        self.names_on: list[int] = []  # storage id -> names referring to it
        self.held: set[int] = set()  # storages the program cannot free (primals_*)
        self.live = 0

    def storage(self, n: int) -> int:
        self.nbytes.append(n)
        self.names_on.append(0)
        return len(self.nbytes) - 1

    def bind(self, name: str, s: int) -> None:
        if name in self.storage_of:
            self.drop(name)
        self.storage_of[name] = s
        self.names_on[s] += 1

    def drop(self, name: str) -> None:
        s = self.storage_of.pop(name, None)
        if s is None:
            return
        self.names_on[s] -= 1
        if self.names_on[s] == 0 and s not in self.held:
            self.live -= self.nbytes[s]


def program_memory(source: str, sizes: dict[str, int | None]) -> ProgramMemory:
    """The memory of the wrapper ``source`` when it runs (Note [Compiled programs]); ``sizes``: bytes of
    each buffer and input by name. Raises UnreadableProgram where the source has no ``call(self, args)``
    or allocates a buffer of unknown size."""
    body, m, inputs, items = _call_body(source)
    buffers = _Buffers()
    storage_of, nbytes, held = buffers.storage_of, buffers.nbytes, buffers.held
    storage, bind, drop = buffers.storage, buffers.bind, buffers.drop
    pending: dict[str, int] = {}  # outputs of a multi-output kernel, allocated at its call

    def size(name: str) -> int:
        if sizes.get(name) is None:
            raise UnreadableProgram(f"no size for {name}")
        return int(sizes[name])

    inputs_bytes = 0
    for name in inputs:
        s = storage(sizes.get(name) or 0)  # (an input of unknown size counts as none: made elsewhere)
        bind(name, s)
        if name.startswith("primals_"):
            held.add(s)
        else:
            inputs_bytes += nbytes[s]
    buffers.live = peak = inputs_bytes
    cpu = "empty_strided_cpu" in body or "cpp_fused_" in body
    returned: set[int] = set()
    slots: list[int] = []
    held_returned: tuple[int, ...] = ()
    for line in body[m.end():].splitlines():
        text = line.strip()
        if text.startswith("return "):  # what is not returned is freed as ``call`` returns (its locals)
            slots = [storage_of.get(_returned_name(v), -1) for v in _split_top(text[len("return "):].strip().strip("()"))]
            held_returned = tuple(nbytes[s] for s in slots if s in held)
            slots = [-1 if s in held else s for s in slots]
            returned = {s for s in slots if s >= 0}
            break
        for stmt in (s.strip() for s in text.split("#", 1)[0].split(";")):
            if not stmt or stmt.startswith(("#", "assert_", "return")):
                continue
            if d := _DEL.match(stmt):
                for name in d.group(1).split(","):
                    drop(name.strip())
            elif (r := _RENAME.match(stmt)) and r.group(2) in storage_of:  # reuse: the same memory
                bind(r.group(1), storage_of[r.group(2)])
            elif (v := _VIEW.match(stmt)) and v.group(2) in storage_of:
                bind(v.group(1), storage_of[v.group(2)])
            elif (i := _ITEM.match(" " + stmt)) and i.group(1) in pending:
                bind(i.group(1), pending.pop(i.group(1)))
            elif a := _ALLOC.match(stmt):
                name = a.group(1)
                if name in items:  # a multi-output kernel allocates all its outputs during the call
                    named = 0
                    for out in items[name]:
                        pending[out] = storage(size(out))
                        named += nbytes[pending[out]]
                    # (and those the program never names, freed with the kernel's result: its size, all outputs)
                    rest = max((sizes.get(name) or 0) - named, 0)
                    buffers.live += named + rest
                    bind(name, storage(rest))
                else:
                    bind(name, storage(size(name)))
                    buffers.live += nbytes[storage_of[name]]
                peak = max(peak, buffers.live + (_inside_bytes(stmt, lambda n: nbytes[storage_of[n]] if n in storage_of
                                                               else sizes.get(n) or 0) if cpu else 0))
    return ProgramMemory(inputs_bytes=inputs_bytes, peak_bytes=peak, end_bytes=sum(nbytes[s] for s in returned),
                         returned=tuple((s, nbytes[s] if s >= 0 else 0) for s in slots), returned_inputs=held_returned)


def step_rise_bytes(forward: ProgramMemory, backward: ProgramMemory) -> int:
    """The compiled part of a training step's peak (bytes), above what is allocated when it begins: the
    forward's peak, or what the forward leaves (its outputs: the saved activations) plus how far the
    backward rises above its inputs, whichever is higher."""
    return max(forward.peak_bytes, forward.end_bytes + backward.rise_bytes)


def step_program_bytes(programs: Sequence[tuple[str, dict[str, int | None]] | None]) -> int | None:
    """:func:`step_rise_bytes` of a training step compiled as one forward and one backward graph (a whole model
    compiled without graph breaks), from the two programs inductor generated for it, in the order run
    (``remat._compat.inductor_programs``; the backward's inputs include the incoming gradients,
    ``tangents_*``); None for any other set of programs (blocks compiled one by one, graph breaks, a wrapper
    this reader does not know, one of unknown sizes): the step's
    peak then also depends on what runs between them (:func:`composed_step_bytes` reads blocks compiled one by
    one)."""
    if len(programs) != 2 or None in programs:
        return None
    (fw_source, fw_sizes), (bw_source, bw_sizes) = programs
    fw_args, bw_args = _ARGS.search(fw_source), _ARGS.search(bw_source)
    if fw_args is None or bw_args is None or "tangents_" in fw_args.group(1) or "tangents_" not in bw_args.group(1):
        return None
    try:
        return step_rise_bytes(program_memory(fw_source, fw_sizes), program_memory(bw_source, bw_sizes))
    except UnreadableProgram:
        return None


# Note [Blocks compiled one by one]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Blocks compiled in place (``block.compile()``: torchtitan's order, checkpoint then compile) run as one
# forward and one backward program each, and the code between them (an embedding, a head, the loss, the
# optimizer) runs eagerly. The step's memory is then the eager step's with each block's part replaced by its
# programs': the profile's timeline of the plain eager step (``Profile.live_bytes``) gives the code between
# them, and each block's forward and backward are taken from their programs:
#
# * while the block's forward runs: the memory before it (``before_bytes`` at its first operator) plus the
#   forward program's peak;
# * from its end to the block's backward: what the eager forward made that outlives it (``UnitCost.made``:
#   its saved tensors and its output) is replaced by what the compiled forward returns: the tensors it
#   saves (which may be copies of its inputs in another layout: a convolution's channels-last input) until the
#   block's backward, and its output as long as something outside the block holds it. Eager code holding it
#   (a linear layer that saves its input) holds it in the compiled step too, until the block's backward where
#   that code's backward has run; another compiled block holds it only if its forward saves an input of that
#   size (``ProgramMemory.returned_inputs``), else it is freed once that block's forward has run (a
#   convolution block saves a channels-last copy of its input, not the input);
# * while the block's backward runs: the memory before it, so changed, plus how far its backward program
#   rises above its inputs.
#
# Units checkpointed inside the blocks change only their programs; the plain eager timeline serves every plan
# whose units are all inside compiled blocks (others: None, and the eager-peak interpolation predicts). On
# tests/slow/test_inductor.py's models, compiled per block, this reproduced the measured compiled peak to the
# byte on 6 of 6 plans of the 2-block GPT, 11 of 11 of benchmarks/plans/compiled.py's 4-block GPT (selective and
# nested plans among them) and 6 of 8 of the conv net, before any calibration. The other two measured 21 KB
# (1.8%) above it: oneDNN's workspace for a recomputed convolution's backward, which no wrapper shows (Note
# [Compiled programs]). The calibration on measured plans (Note [Compiled steps] in remat.solve.calibrated)
# takes up such offsets where they are alike across plans.


@dataclass(frozen=True)
class EagerBlock:
    """The eager side of a block compiled on its own (Note [Blocks compiled one by one]): where its forward
    and backward run in the plain eager step's timeline and what its forward makes that outlives it."""

    name: str
    forward_start: int
    forward_end: int
    #: the backward operators of the block: from the first that reads a tensor it saved to the last
    backward_start: int
    backward_end: int
    made: tuple[Made, ...]


def tangents(source: str) -> int | None:
    """How many incoming gradients (``tangents_*``) the wrapper ``source`` takes: 0 for a forward; None where
    it does not unpack its args."""
    m = _ARGS.search(source)
    return None if m is None else sum(1 for a in m.group(1).split(",") if a.strip().startswith("tangents_"))


def eager_blocks(profile: Profile, blocks: Sequence[str], checkpointed: Sequence[str]) -> list[EagerBlock] | None:
    """The eager side of ``blocks`` (compiled one by one) in ``profile``, by their forwards' order; None where
    the composition does not apply: a block that is not a unit of the profile, runs more than once, or whose
    backward is not found, or a checkpointed unit outside every block (its effect on the eager code is not
    the plain timeline's)."""
    units = {u.name: u for u in profile.units}
    out = []
    for name in blocks:
        u = units.get(name)
        if u is None or u.later_calls or u.recompute_at is None or u.backward_end is None:
            return None
        out.append(EagerBlock(name, u.forward_start, u.forward_end, u.recompute_at, u.backward_end, u.made))
    for name in checkpointed:
        u = units.get(name)
        if u is None or not any(b.forward_start <= u.forward_start and u.forward_end <= b.forward_end for b in out):
            return None
    return sorted(out, key=lambda b: b.forward_start)


class _BlockPart:  # one block's replacement, from the end of its forward to its backward
    """A block's part in :func:`composed_step_bytes` (Note [Blocks compiled one by one]): ``forward``, each block's
    forward program; ``outputs``, how many outputs each block's forward returns; ``owner``, the blocks by name;
    ``n``, the timeline's length."""

    def __init__(self, b: EagerBlock, forward: dict[str, ProgramMemory], outputs: dict[str, int],
                 owner: dict[str, EagerBlock], n: int) -> None:
        fw = forward[b.name]
        self.b = b
        self.out_only = fw.outputs_only_bytes(outputs[b.name])
        self.saved = fw.end_bytes - self.out_only
        frees = sorted((m.free_index if m.free_index is not None else n, m.nbytes) for m in b.made)
        self.free_at = [f for f, _ in frees]
        self.alive_from = [0] * (len(frees) + 1)  # bytes of frees[i:], the eager made alive past frees[i - 1]
        for i in range(len(frees) - 1, -1, -1):
            self.alive_from[i] = self.alive_from[i + 1] + frees[i][1]
        # how long the compiled output lives: held by what outside the block holds the eager one
        self.until, self.at_backward = b.forward_end, False
        for m in b.made:
            if not m.output:
                continue
            if m.free_index is None:
                self.until, self.at_backward = n, True
            if m.used_until is not None:
                self.until = max(self.until, m.used_until)
            for stack, unpacked in m.saved_outside:
                other = next((owner[s] for s in stack if s in owner and s != b.name), None)
                if other is None:  # eager code: until its backward has run, before this block's
                    self.until = max(self.until, b.backward_start - 1)
                    self.at_backward |= unpacked is None or unpacked >= b.backward_start
                elif m.nbytes in forward[other.name].returned_inputs:  # saved by the other block
                    self.until = max(self.until, other.backward_end)
                    self.at_backward |= other.backward_end >= b.backward_start
                else:
                    self.until = max(self.until, other.forward_end)

    def eager(self, t: int) -> int:
        """Bytes of what the block's eager forward made still alive after operator ``t``."""
        return self.alive_from[bisect.bisect_right(self.free_at, t)]

    def delta(self, t: int, at_backward: bool = False) -> int:
        b = self.b
        if at_backward:  # (just before its first backward operator: what the plain step freed then is gone)
            return self.saved + (self.out_only if self.at_backward else 0) - self.eager(b.backward_start)
        if not b.forward_end < t < b.backward_start:
            return 0
        return self.saved + (self.out_only if t <= self.until else 0) - self.eager(t)


def composed_step_bytes(profile: Profile, blocks: Sequence[EagerBlock],
                        calls: Sequence[tuple[str, dict[str, int | None]] | None]) -> int | None:
    """The peak (bytes) of a step whose ``blocks`` run compiled one by one and the rest eagerly (Note [Blocks
    compiled one by one]): the plain eager step of ``profile`` with each block's part replaced by its
    programs. ``calls``: the programs that ran in the step, in the order run (``remat._compat.inductor_programs``).
    None where they are not one forward per block, in the blocks' order, then one backward per
    block, in their backwards' order, or one cannot be read."""
    if not blocks or any(c is None for c in calls) or len(calls) != 2 * len(blocks):
        return None
    kinds = [tangents(source) for source, _ in calls]
    if any(k is None for k in kinds) or any(kinds[: len(blocks)]) or not all(kinds[len(blocks):]):
        return None
    try:
        progs = [program_memory(source, sizes) for source, sizes in calls]
    except UnreadableProgram:
        return None
    forward = dict(zip((b.name for b in blocks), progs[: len(blocks)]))
    by_backward = sorted(blocks, key=lambda b: b.backward_start)
    backward = dict(zip((b.name for b in by_backward), progs[len(blocks):]))
    outputs = dict(zip((b.name for b in by_backward), kinds[len(blocks):]))

    fixed, live = profile.fixed_bytes, profile.live_bytes
    n = len(live)
    if n == 0 or any(not (0 <= b.forward_start <= b.forward_end < b.backward_start <= b.backward_end < n)
                     for b in blocks):
        return None
    before = profile.before_bytes or (0, *live[:-1])
    owner = {b.name: b for b in blocks}

    parts = [_BlockPart(b, forward, outputs, owner, n) for b in blocks]
    inside = [False] * n
    for b in blocks:
        for t in (*range(b.forward_start, b.forward_end + 1), *range(b.backward_start, b.backward_end + 1)):
            inside[t] = True
    peak = max((fixed + live[t] + sum(p.delta(t) for p in parts) for t in range(n) if not inside[t]), default=0)
    for p in parts:
        b = p.b
        peak = max(peak, fixed + before[b.forward_start] + sum(q.delta(b.forward_start) for q in parts)
                   + forward[b.name].peak_bytes)
        peak = max(peak, fixed + before[b.backward_start] + backward[b.name].rise_bytes
                   + sum(q.delta(b.backward_start, at_backward=q is p) for q in parts))
    after = live[-1] if profile.after_backward_bytes is None else profile.after_backward_bytes
    return max(peak, fixed + after + profile.optimizer_step_bytes)
