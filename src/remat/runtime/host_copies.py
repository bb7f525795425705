"""Copies between a GPU and pinned host memory on a side stream: the CUDA-specific part of offloaded units (Note
[Offloaded units] in remat.rewrite.offload). Nothing else in remat touches streams or events for offloading.

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
(:meth:`CudaCopies.after`). Written from torch's stream semantics and torchtune's offloader; not run on a GPU
here (no GPU was lent to this project when it was written).
"""

from __future__ import annotations

from collections.abc import Callable

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
