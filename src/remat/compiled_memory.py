"""The memory of a program inductor generated, read from its wrapper code (no torch).

Note [Compiled programs]
~~~~~~~~~~~~~~~~~~~~~~~~
Inductor turns each graph it compiles into a Python wrapper (``def call(self, args)``) whose statements
say where every buffer is allocated and freed: ``bufN = empty_strided_cpu(...)`` (or ``_cuda``), an extern
kernel that returns new buffers (``extern_kernels.convolution(...)``, ``torch.ops.aten.X.default(...)``, one
of several outputs taken as ``bufN = bufM[i]``, or ``bufM[i][j]`` from a higher-order operator's), ``bufN = bufM; del bufM  # reuse`` (the same memory,
renamed), ``reinterpret_tensor(bufM, ...)`` (a view) and ``del bufN`` (freed once no name refers to it).
Its inputs come unpacked from ``args``; AOTAutograd names the parameters and the batch ``primals_*``: the
module holds those, so deleting them frees nothing, where a backward's saved activations and incoming
gradients are freed by their ``del``. Inductor's own estimate (``torch._inductor.memory``) plans in
scheduler nodes, before buffer reuse and extern kernels' outputs are placed; on the conv net of
tests/slow/test_inductor.py it missed a recomputed convolution's backward by 131 KiB (its outputs counted
after its input was freed). Walking the wrapper's statements gives what runs.

What this does not see: memory extern kernels allocate inside themselves (oneDNN's workspace for a
convolution's backward: 12-30 KiB there) and anything outside the compiled graphs (the loss, the
optimizer): the calibration on measured plans absorbs those (Note [Compiled steps] in
remat.solve.calibrated). The sizes come from inductor's own buffers (``remat._compat.inductor_programs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ARGS = re.compile(r"^\s+(.*) = args$", re.M)
_ITEM = re.compile(r"^\s+(\w+) = (\w+)((?:\[\d+\])+)$", re.M)  # (nested: a higher-order op's outputs, buf[1][0])
_ALLOC = re.compile(r"^(\w+) = (empty_strided_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(")
_RENAME = re.compile(r"^(\w+) = (\w+)$")
_VIEW = re.compile(r"^(\w+) = reinterpret_tensor\((\w+),")
_DEL = re.compile(r"^del (\w+(?:, *\w+)*)$")


@dataclass(frozen=True)
class ProgramMemory:
    """The memory of one compiled graph's run (bytes): what it receives to free, its peak and what it returns."""

    #: bytes of the inputs the program frees (saved activations, incoming gradients): all but ``primals_*``
    inputs_bytes: int
    #: the most bytes allocated at once while it runs, those inputs included
    peak_bytes: int
    #: bytes of what it returns (its outputs: for a forward, the saved activations too)
    end_bytes: int

    @property
    def rise_bytes(self) -> int:
        """How far above its own inputs it goes (bytes)."""
        return self.peak_bytes - self.inputs_bytes


class UnreadableProgram(ValueError):
    """A wrapper whose statements this reader does not know."""


def program_memory(source: str, sizes: dict[str, int | None]) -> ProgramMemory:
    """The memory of the wrapper ``source`` when it runs (Note [Compiled programs]); ``sizes``: bytes of
    each buffer and input by name. Raises UnreadableProgram where the source has no ``call(self, args)``
    or allocates a buffer of unknown size."""
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

    storage_of: dict[str, int] = {}  # name -> storage id
    nbytes: list[int] = []  # storage id -> bytes
    names_on: list[int] = []  # storage id -> names referring to it
    held: set[int] = set()  # storages the program cannot free (primals_*)
    pending: dict[str, int] = {}  # outputs of a multi-output kernel, allocated at its call
    live = 0

    def size(name: str) -> int:
        if sizes.get(name) is None:
            raise UnreadableProgram(f"no size for {name}")
        return int(sizes[name])

    def storage(n: int) -> int:
        nbytes.append(n)
        names_on.append(0)
        return len(nbytes) - 1

    def bind(name: str, s: int) -> None:
        if name in storage_of:
            drop(name)
        storage_of[name] = s
        names_on[s] += 1

    def drop(name: str) -> None:
        nonlocal live
        s = storage_of.pop(name, None)
        if s is None:
            return
        names_on[s] -= 1
        if names_on[s] == 0 and s not in held:
            live -= nbytes[s]

    inputs_bytes = 0
    for name in inputs:
        s = storage(sizes.get(name) or 0)  # (an input of unknown size counts as none: made elsewhere)
        bind(name, s)
        if name.startswith("primals_"):
            held.add(s)
        else:
            inputs_bytes += nbytes[s]
    live = peak = inputs_bytes
    returned: set[int] = set()
    for line in body[m.end():].splitlines():
        text = line.strip()
        if text.startswith("return "):  # what is not returned is freed as ``call`` returns (its locals)
            returned = {storage_of[n] for n in re.findall(r"\w+", text) if n in storage_of} - held
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
                    for out in items[name]:
                        pending[out] = storage(size(out))
                        live += nbytes[pending[out]]
                    bind(name, storage(0))
                else:
                    bind(name, storage(size(name)))
                    live += nbytes[storage_of[name]]
                peak = max(peak, live)
    return ProgramMemory(inputs_bytes=inputs_bytes, peak_bytes=peak, end_bytes=sum(nbytes[s] for s in returned))


def step_rise_bytes(forward: ProgramMemory, backward: ProgramMemory) -> int:
    """The compiled part of a training step's peak (bytes), above what is allocated when it begins: the
    forward's peak, or what the forward leaves (its outputs: the saved activations) plus how far the
    backward rises above its inputs, whichever is higher."""
    return max(forward.peak_bytes, forward.end_bytes + backward.rise_bytes)


def step_program_bytes(programs: list[tuple[str, dict[str, int | None]]]) -> int | None:
    """:func:`step_rise_bytes` of a training step compiled as one forward and one backward graph (a whole model
    compiled without graph breaks), from the two programs inductor generated for it, in the order compiled
    (the backward's inputs include the incoming gradients, ``tangents_*``); None for any other set of
    programs (blocks compiled one by one, graph breaks, a wrapper this reader does not know): the step's
    peak then also depends on what runs between them."""
    if len(programs) != 2:
        return None
    (fw_source, fw_sizes), (bw_source, bw_sizes) = programs
    fw_args, bw_args = _ARGS.search(fw_source), _ARGS.search(bw_source)
    if fw_args is None or bw_args is None or "tangents_" in fw_args.group(1) or "tangents_" not in bw_args.group(1):
        return None
    try:
        return step_rise_bytes(program_memory(fw_source, fw_sizes), program_memory(bw_source, bw_sizes))
    except UnreadableProgram:
        return None
