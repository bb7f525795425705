"""What the CUDA caching allocator's own figures say of one training step (no torch).

In: the allocator's statistics around a step (:class:`AllocatorReading`) or its history of allocations and frees
(:class:`AllocatorEvent`, e.g. read from ``torch.cuda.memory._snapshot()`` by :func:`events_from_snapshot`). Out:
the step's peak as the budget means it (:func:`step_peak_bytes`, :func:`events_peak_bytes`). The CUDA meter
(:class:`remat.runtime.meters.StepMeter`) feeds the first from the live allocator; tests feed both by hand or
from a recorded history.

Note [The budget on CUDA is absolute]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A budget on CUDA is what ``torch.cuda.max_memory_allocated`` reads during the user's next training steps: every
block the step holds, as the allocator counts it, and what the libraries keep there for the process's life.
The meter used to read ``max_memory_allocated`` less *everything* on the device before the step that was not a
parameter, buffer or input counted at its storage size (``_base``). On the H200 that left out 65 MiB exactly
(68,157,440 bytes) of the 1B Llama's training steps after ``optimize_checkpointing`` (checked 25,727,874,048
bytes, the user's steps 25,796,031,488; ``../shared/gpu/``), two causes, both on the device before the check
and both there during every later step:

* cuBLAS's workspaces, 2 x 32 MiB = 67,108,864 bytes: one per thread that multiplies (the step's and autograd's),
  allocated at each thread's first product during profiling and never freed (Note [cuBLAS workspaces] in
  remat.target.workspace). The 1B Llama's recorded history (``llama1b_none.snapshot.pickle.gz``) holds exactly
  two blocks from its first step to its end: 33,554,432 bytes at the first forward product (rotary embedding,
  main thread) and 33,554,432 at the first backward product (no Python frame: autograd's thread).
* 1 MiB = 1,048,576 bytes of the tied embedding's block: its storage is 525,336,576 bytes (501 MiB, 128,256 x
  2,048 in bfloat16), its segment 526,385,152 (rounded up to 2 MiB), and the allocator splits a large block only
  when more than 1 MiB would remain, so the block, and ``allocated_bytes``, is 1 MiB larger than the storage all
  along. The plain step's measured peak (34,470,885,376, ``oracle.json``) is that history's own peak of requested
  sizes rounded to 512 bytes (34,469,836,800) plus exactly that 1,048,576. The meter counted the parameters at
  their storage sizes, so the 1 MiB was in ``_base`` and left out. (``tests/unit/test_allocator_reading.py`` reads
  both causes from the history.)

(The optimizer is predicted beside the step, the same in both readings: not a cause. The previous step's loss,
which the loop holds through the next forward, is 512 bytes and counted by neither.)

So on CUDA the step's reading is the allocator's peak less only what is on the device that the user's steps will
not hold: ``allocated_at_start - state - workspaces`` (remat's own scratch: snapshots of buffers it restores,
the model copy of ``measure_step``; and other tensors of the caller's, which are not the step's). The state is
counted as the allocator counts its blocks (the 1 MiB above), and the libraries' workspaces are counted as held
by the step from its start, as in the user's steps that follow (:func:`step_peak_bytes`). Anything a library
allocates inside an operator during the step (cuDNN's convolution workspace: 7,059,355 bytes at the plain U-Net's
peak, on autograd's thread, inside ``convolution_backward``) is in the allocator's peak: no dispatch-level meter
sees it, the allocator does (:func:`events_peak_bytes` on that history counts it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from remat.costs.allocator import round_size
from remat.errors import InvalidInputError

#: the bytes a request occupies as the allocator counts it, rounded to 512 (a large block left unsplit may hold up to
#: 1 MiB more, which a history of requested sizes does not say): the allocator model's rounding
block_bytes = round_size


@dataclass(frozen=True)
class AllocatorReading:
    """The allocator's statistics around one step on one device (bytes, as ``torch.cuda.memory_stats`` counts:
    whole blocks)."""

    #: ``allocated_bytes.all.current`` when the step started
    allocated_at_start_bytes: int
    #: ``allocated_bytes.all.peak`` over the step (the peak reset at its start)
    peak_allocated_bytes: int
    #: the blocks of what the step holds all along (parameters, buffers, the batch, the optimizer's state where it
    #: exists), as the allocator counts them
    state_bytes: int
    #: the libraries' workspaces on the device when the step started, held for the process's life (cuBLAS's)
    workspace_bytes: int

    @property
    def scratch_bytes(self) -> int:
        """What was on the device at the start that the user's steps do not hold (remat's own, the caller's other
        tensors): left out of the step's reading."""
        return max(self.allocated_at_start_bytes - self.state_bytes - self.workspace_bytes, 0)


def step_peak_bytes(reading: AllocatorReading) -> int:
    """The step's peak as the budget means it (Note [The budget on CUDA is absolute]): the allocator's peak less
    the scratch on the device at the start (bytes)."""
    return reading.peak_allocated_bytes - reading.scratch_bytes


def live_bytes(reading: AllocatorReading, allocated_now_bytes: int) -> int:
    """Bytes of the step alive now, on the same count as :func:`step_peak_bytes`."""
    return allocated_now_bytes - reading.scratch_bytes


@dataclass(frozen=True)
class AllocatorEvent:
    """One allocation or free in the allocator's history."""

    #: "alloc" or "free"
    action: str
    #: the block's address
    addr: int
    #: the block's bytes as the allocator counts them
    nbytes: int


def events_peak_bytes(events: Iterable[AllocatorEvent], held_bytes: int = 0) -> int:
    """The largest total of ``held_bytes`` (alive before the first event and all along: the state, the workspaces)
    and the blocks the events allocate and have not freed (bytes). A free of a block the events did not allocate
    (allocated before them) is not counted."""
    live: dict[int, int] = {}
    now = peak = held_bytes
    for e in events:
        if e.action == "alloc":
            live[e.addr] = e.nbytes
            now += e.nbytes
            peak = max(peak, now)
        elif e.action == "free":
            now -= live.pop(e.addr, 0)
        else:
            raise InvalidInputError(f"unknown allocator action {e.action!r} at address {e.addr}: 'alloc' or 'free'")
    return peak


def events_from_snapshot(snapshot: Mapping, device: int = 0) -> list[AllocatorEvent]:
    """A history recorded by ``torch.cuda.memory._record_memory_history`` and read by
    ``torch.cuda.memory._snapshot()`` (a plain dict; pickled, it loads without torch) as events: ``alloc`` and
    ``free_requested`` (where ``allocated_bytes`` drops; ``free_completed`` may come later, when the block's other
    streams are done), each block at its requested size rounded to 512 (:func:`block_bytes`)."""
    out = []
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            out.append(AllocatorEvent("alloc", int(e["addr"]), block_bytes(int(e["size"]))))
        elif e["action"] == "free_requested":
            out.append(AllocatorEvent("free", int(e["addr"]), block_bytes(int(e["size"]))))
    return out


def active_blocks(segments: Iterable[Mapping], device: int = 0) -> dict[int, int]:
    """The blocks handed out now, by address, each with its bytes as the allocator counts them, from the segments
    ``torch.cuda.memory_snapshot()`` lists (a segment's blocks in address order from the segment's address)."""
    out = {}
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        addr = int(seg["address"])
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[addr] = int(b["size"])
            addr += int(b["size"])
    return out


def blocks_alive_outside(snapshot: Mapping, device: int = 0) -> list[int]:
    """The bytes of each block alive when the snapshot was taken that its history did not allocate: what was on
    the device before recording began and stayed (a library's workspaces)."""
    made = {int(e["addr"]) for e in snapshot["device_traces"][device] if e["action"] == "alloc"}
    return [nbytes for addr, nbytes in active_blocks(snapshot["segments"], device).items() if addr not in made]
