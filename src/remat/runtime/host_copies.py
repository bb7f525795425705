"""Where offloaded activations go and how they are copied (Note [Offloaded units] in remat.rewrite.offload): the
decision of the copy path from a saved tensor's device (:func:`copy_path`, Note [Pinned at first run] in
remat.rewrite.offload), the pool of host buffers, and the copies between a GPU and pinned host memory on a side
stream (:class:`CudaCopies`). Nothing else in remat touches streams or events for offloading.

Note [Offload streams]
~~~~~~~~~~~~~~~~~~~~~~
A copy out (device to host) waits for the compute stream (the tensor was just produced there), runs on the side
stream, and marks the device storage used by the side stream (``record_stream``): when the step drops it, the
caching allocator counts it freed and hands its block to another tensor only once the copy has completed.
(Holding the device tensor in Python until a later copy finds its event done, as torchtune's
``OffloadActivations`` does with its ``fwd_stash``, would keep the last offloaded unit's storages until the
backward's first copy back: no later copy out comes to release them, and the offload would free nothing there.)
A copy back (host to device) runs on the side stream too, into a tensor allocated on the compute stream, and the compute stream waits
for its event before the tensor is used (:meth:`CudaCopies.wait`); ``record_stream`` tells the allocator the
side stream used it. A host buffer goes back to the pool only once the copy that reads it has completed
(:meth:`CudaCopies.after`). Written from torch's stream semantics and torchtune's offloader; run on an H200
(2026-12-04: torchtitan's Llama with one layer offloaded, the plan applied after materializing, 447-451 ms a step),
not traced there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class CudaCopies:
    """Device-to-host and host-to-device copies on one side stream of ``device``, with the events that order them
    against the compute stream (Note [Offload streams])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        #: callbacks (a host buffer going back to its pool) run once their event completes
        self._pending: list[tuple[torch.cuda.Event, Callable[[], None]]] = []
        self._events: dict[int, torch.cuda.Event] = {}

    def _retire(self) -> None:
        """Run the callbacks of completed copies: each event asked once (asked twice, one that completed between
        the asks would be neither run nor kept, and its host buffer never come back)."""
        pending, done = [], []
        for e, f in self._pending:
            if e.query():
                done.append(f)
            else:
                pending.append((e, f))
        self._pending = pending
        for f in done:
            f()

    def to_host(self, host: torch.Tensor, t: torch.Tensor) -> None:
        self._retire()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # its block is not reused before the copy has read it

    def to_device(self, out: torch.Tensor, host: torch.Tensor) -> None:
        self._retire()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # ``out`` was allocated there
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        out.record_stream(self.stream)
        self._events[id(out)] = event

    def wait(self, out: torch.Tensor) -> None:
        self._retire()
        event = self._events.pop(id(out), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def after(self, out: torch.Tensor, then: Callable[[], None]) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self._pending.append((event, then))


_SIZE_CLASS = 64 * 1024


def _size_class(nbytes: int) -> int:
    return max(_SIZE_CLASS, 1 << (nbytes - 1).bit_length())


@dataclass(frozen=True)
class CopyPath:
    """How an offloaded unit's copies run on the device its saved tensors are on (Note [Pinned at first run]):
    ``pinned``: host buffers in page-locked memory; ``side_stream``: copies asynchronous on a stream of their own,
    ordered by events (:class:`remat.runtime.host_copies.CudaCopies`); neither: a synchronous ``copy_``."""

    device: str
    pinned: bool
    side_stream: bool


def copy_path(device: torch.device) -> CopyPath:
    """The decision of Note [Pinned at first run], from the device of a tensor a unit saves: on a CUDA device
    (ROCm's too) pinned buffers and a side stream; on the CPU plain copies (its memory *is* the host's). Another
    accelerator is refused (:class:`~remat.errors.UnsupportedError`): remat offloads from CUDA devices only, and
    would otherwise copy from pageable memory there."""
    if device.type == "cuda":
        return CopyPath(str(device), pinned=True, side_stream=True)
    if device.type == "cpu":
        return CopyPath(str(device), pinned=False, side_stream=False)
    from remat.errors import UnsupportedError

    raise UnsupportedError(f"an offloaded unit saved a tensor on {device}: remat offloads activations from CUDA "
                           "GPUs (pinned host buffers, a side stream) and runs the mechanism on the CPU, not from "
                           f"{device.type!r}. Checkpoint that unit instead (a plan made with offload=False)")


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host buffer of ``nbytes`` (``uint8``), page-locked where ``pinned`` (the seam tests replace: a CPU build
    cannot pin)."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)


def side_stream(device: torch.device) -> CudaCopies:
    """The side-stream copies for ``device`` (:class:`CudaCopies`)."""
    return CudaCopies(device)


class HostPool:
    """Host buffers (``uint8``) kept across steps by size class; pinned where the device is a GPU. ``held_bytes``:
    what the pool holds now (host memory an offloading plan costs); ``peak_in_use_bytes``: the most it lent at
    once."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}
        self.held_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        #: buffers allocated (a buffer lent again is not counted)
        self.allocations = 0
        self._all: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        size = _size_class(nbytes)
        free = self._free.get(size)
        if free:
            buf = free.pop()
        else:
            buf = _host_buffer(size, self.pin_memory)
            self.held_bytes += size
            self.allocations += 1
            self._all.append(buf)
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel()
        self._free.setdefault(buf.numel(), []).append(buf)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, lent or free (a meter of device memory leaves them out)."""
        return list(self._all)

    def release(self) -> None:
        """Let every free buffer go (the next step allocates afresh)."""
        for bufs in self._free.values():
            self.held_bytes -= sum(b.numel() for b in bufs)
            freed = {id(b) for b in bufs}
            self._all = [b for b in self._all if id(b) not in freed]
        self._free.clear()
