"""The statements of a wrapper inductor generated, read one at a time (no torch).

In: the text of a wrapper's ``call(self, args)`` (Note [Compiled programs] in remat.costs.compiled_memory):
its statements and the values it returns. Out: the patterns of the statements that allocate, rename, view and
free buffers, the names of returned values, and what a CPU kernel call allocates inside itself (bytes);
``remat.costs.compiled_memory`` walks a program with them (and re-exports them).
"""

from __future__ import annotations

import re

_ARGS = re.compile(r"^\s+(.*) = args$", re.M)
_ITEM = re.compile(r"^\s+(\w+) = (\w+)((?:\[\d+\])+)$", re.M)  # (nested: a higher-order op's outputs, buf[1][0])
_ALLOC = re.compile(r"^(\w+) = (empty_strided_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(")
_RENAME = re.compile(r"^(\w+) = (\w+)$")
_VIEW = re.compile(r"^(\w+) = reinterpret_tensor\((\w+),")
_DEL = re.compile(r"^del (\w+(?:, *\w+)*)$")

_DROPOUT = re.compile(r"torch\.ops\.aten\.native_dropout\.default,\s*(?:reinterpret_tensor\()?(\w+)")
_RNG_STATE = re.compile(r"torch\.ops\.higher_order\.run_with_rng_state\((\w+),")


def _inside_bytes(call: str, nbytes) -> int:  # noqa: ANN001 - nbytes: a buffer's bytes by name
    """What a call of a CPU wrapper allocates inside itself, beyond its outputs, while it runs (bytes), for the
    kernels measured: ``native_dropout`` on CPU makes a float copy of its mask, the size of its input (512 KiB
    for an 8 x 128 x 128 float input, by the profiler's allocator events), and a higher-order operator that
    replays a dropout with an RNG state saved (``run_with_rng_state``, a checkpointed region's) holds a copy of
    the generator's state while it runs (the CPU generator's: 5,056 bytes). 0 for any other call."""
    inside = 0
    if d := _DROPOUT.search(call):
        inside += nbytes(d.group(1))
    if r := _RNG_STATE.search(call):
        inside += nbytes(r.group(1))
    return inside


def _split_top(text: str) -> list[str]:
    """The comma-separated values of ``text`` at the top level (not inside a call's parentheses)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [v for v in (*out, cur.strip()) if v]


def _returned_name(value: str) -> str:
    """The buffer a returned value refers to: ``buf3``, or ``bufM`` of ``reinterpret_tensor(bufM, ...)``."""
    m = re.match(r"(?:reinterpret_tensor\()?(\w+)", value)
    return m.group(1) if m else ""

