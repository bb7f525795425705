"""The CUDA side of offloading (remat.runtime.host_copies) where it does not need a GPU: its bookkeeping of copies
that complete, driven by events that say when (no GPU here: Note [Offload streams])."""

from remat.runtime.host_copies import CudaCopies


class _Event:
    """An event that completes after ``pending`` queries."""

    def __init__(self, pending: int) -> None:
        self.pending = pending

    def query(self) -> bool:
        self.pending -= 1
        return self.pending < 0


def _copies() -> CudaCopies:
    copies = object.__new__(CudaCopies)  # no stream: only the bookkeeping runs
    copies._pending, copies._events = [], {}
    return copies


def test_a_buffer_whose_copy_completes_between_two_looks_still_goes_back_to_its_pool():
    """An event that completes while the pending copies are looked at (here: between its first and second query)
    runs its callback once, at the next look; asked twice in one look, it was dropped, and its host buffer never
    came back to the pool."""
    copies, ran = _copies(), []
    copies._pending = [(_Event(1), lambda: ran.append("first")), (_Event(0), lambda: ran.append("second")),
                       (_Event(3), lambda: ran.append("late"))]
    copies._retire()
    assert ran == ["second"] and len(copies._pending) == 2
    copies._retire()
    assert ran == ["second", "first"] and len(copies._pending) == 1
    copies._retire()
    copies._retire()
    assert ran == ["second", "first", "late"] and copies._pending == []
