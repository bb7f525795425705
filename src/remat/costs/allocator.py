"""A torch-free replay of PyTorch's CUDA caching allocator: the peak *allocated* and *reserved* bytes of a step.

A GPU runs out of the caching allocator's reserved memory (its segments), not of live bytes. :func:`replay`
runs :class:`Alloc` / :class:`Free` events (:func:`events_of` makes them from a recording's storages) through
the allocator's rules and reports what ``torch.cuda.max_memory_allocated`` (sum of rounded block sizes),
``max_memory_reserved`` (sum of segment sizes) and ``requested_bytes.all.peak`` would show. Rules read from
``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.4/2.5, settings in
``CUDAAllocatorConfig``) and checked against later versions (``AcceleratorAllocatorConfig``, same defaults):

- ``round_size``: under 512 bytes to 512, else up to a multiple of 512.
- Pools small (rounded size <= 1 MiB) and large; a new segment (``get_allocation_size``) is 2 MiB for a small
  request, 20 MiB for a large one under 10 MiB, else the request rounded up to a multiple of 2 MiB.
- ``get_free_block``: best fit (the smallest cached block >= the request, ties to the lower address); with
  ``max_split_size``, a request under it takes no block at or over it, one at or over it none 20 MiB larger.
- ``should_split``: small pool when >= 512 bytes remain; large pool when the request is under
  ``max_split_size`` and > 1 MiB remains (expandable segments: >= 512 bytes in both).
- ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours in the segment.
  Pools are per stream: a cached block is reused only by the stream that allocated it (``BlockComparator``).
- Out of memory (``capacity_bytes``): release oversize cached blocks (``release_available_cached_blocks``),
  then every cached segment with no block in use (``release_cached_blocks``: all pools, streams) and retry;
  if it still does not fit, the replay stops and reports it (:class:`OutOfMemory`), as torch raises there.
- ``expandable_segments:True``: a segment per pool and stream, mapped on demand in pages of 2 MiB (small) or
  20 MiB (large) at the lowest address where free and unmapped space in a row hold the request
  (``find_expandable_block``, ``map_block``): reserved is the page-rounded high-water mark of the addresses
  in use (nothing moves: a freed hole serves only what fits in it). Best fit skips to blocks that cannot
  grow (``expandable_size``); out of memory unmaps the whole free pages (``unmap_block``).

Not modelled: ``garbage_collection_threshold``; ``roundup_power2_divisions``; non-default
``max_non_split_rounding_mb``; CUDA graph and ``MemPool`` pools; ``record_stream`` (a block freed while another
stream uses it is cached once that stream's events complete; here at once); ``set_per_process_memory_fraction``
(capacity is what the driver gives, checked per cudaMalloc or mapping); ``empty_cache``; the finite virtual
range of an expandable segment; ``release_available_cached_blocks`` with expandable segments. Segments get
addresses in creation order (best-fit ties go to the older one); memory held before the events is not counted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from remat.errors import InvalidInputError

MIN_BLOCK_BYTES = 512  #: kMinBlockSize: every block is a multiple of it
SMALL_SIZE_BYTES = 1 << 20  #: kSmallSize: the largest (rounded) request of the small pool
SMALL_BUFFER_BYTES = 2 << 20  #: kSmallBuffer: a small pool segment; the page of an expandable small pool
LARGE_BUFFER_BYTES = 20 << 20  #: kLargeBuffer: the segment of a 1-10 MiB request; an expandable large page
MIN_LARGE_ALLOC_BYTES = 10 << 20  #: kMinLargeAlloc: from here a request gets a segment of its own size
ROUND_LARGE_BYTES = 2 << 20  #: kRoundLarge: such a segment is a multiple of it


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options modelled, and the memory available; defaults are torch's."""
    expandable_segments: bool = False  #: ``expandable_segments:True``
    max_split_size_bytes: int | None = None  #: ``max_split_size_mb`` in bytes (whole MiB over 20); None: unlimited
    capacity_bytes: int | None = None  #: device memory the allocator can get (from cudaMalloc, mappings); None: all

    def __post_init__(self) -> None:
        mss, cap = self.max_split_size_bytes, self.capacity_bytes
        if mss is not None and (mss <= LARGE_BUFFER_BYTES or mss % (1 << 20)) or cap is not None and cap < 0:
            raise InvalidInputError(f"{self}: max_split_size_bytes takes a whole number of MiB over 20 MiB (as "
                                    "torch's max_split_size_mb), capacity_bytes a byte count >= 0")


@dataclass(frozen=True)
class Alloc:
    """Allocate ``nbytes`` (what the storage asks for) under ``handle``, on ``stream``."""
    handle: int
    nbytes: int
    stream: int = 0


@dataclass(frozen=True)
class Free:
    """Free what was allocated under ``handle``."""
    handle: int


Event = Alloc | Free


@dataclass(frozen=True)
class OutOfMemory:
    """The first request that did not fit in ``capacity_bytes``, even after the cache was released."""
    event_index: int  #: the position of its :class:`Alloc` among the events
    request: Alloc
    segment_bytes: int  #: the segment it needed (``get_allocation_size``: torch's "Tried to allocate")
    allocated_bytes: int  #: allocated when it failed (after the cache was released)
    reserved_bytes: int  #: reserved when it failed (after the cache was released)


@dataclass(frozen=True)
class AllocatorPeaks:
    """What :func:`replay` found; with an ``oom``, the figures cover the events before it."""
    allocated_peak_bytes: int  #: peak sum of allocated (rounded) block sizes: ``torch.cuda.max_memory_allocated``
    reserved_peak_bytes: int  #: peak sum of segment sizes (mapped pages): ``torch.cuda.max_memory_reserved``
    requested_peak_bytes: int  #: peak sum of the requested (unrounded) sizes: ``requested_bytes.all.peak``
    segments: int  #: device allocations (``num_device_alloc``): cudaMalloc calls, or expandable page mappings
    allocated_end_bytes: int  #: allocated after the last event
    reserved_end_bytes: int  #: reserved after the last event
    oom: OutOfMemory | None = None


def round_size(nbytes: int) -> int:
    """The block size torch gives a request of ``nbytes`` (``round_size``)."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def allocation_size(size: int) -> int:
    """The segment torch asks the driver for when no cached block fits a block of ``size`` bytes."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Block:
    """A piece of a segment, allocated or cached; in an expandable segment, an unmapped piece is address space
    with no memory behind it. ``prev``/``next`` link the pieces of one segment in address order."""
    __slots__ = ("addr", "size", "small", "stream", "base", "mapped", "allocated", "requested", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool, stream: int, base: int | None, mapped: bool = True):
        self.addr, self.size, self.small, self.stream, self.mapped = addr, size, small, stream, mapped
        self.base = base  # the expandable segment's address; None: a cudaMalloc segment
        self.allocated, self.requested = False, 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def piece(self, addr: int, size: int, mapped: bool = True) -> _Block:
        """A new block of the same segment (not linked yet)."""
        return _Block(addr, size, self.small, self.stream, self.base, mapped)

    def reach(self) -> int:
        """``expandable_size``: the size plus the unmapped space right after it."""
        return self.size + (self.next.size if self.next is not None and not self.next.mapped else 0)


def _splice(before: _Block | None, block: _Block, after: _Block | None) -> None:
    """Link ``block`` between two neighbours (``Block::splice``)."""
    block.prev, block.next = before, after
    if before is not None:
        before.next = block
    if after is not None:
        after.prev = block


class _Pool:
    """The cached blocks of one pool (small or large) on one stream: torch's ``BlockPool`` for one stream.
    ``keys`` is sorted by (size, address): best fit is the first at or over (request, -1). ``unmapped`` holds
    the unmapped pieces of expandable segments by address."""
    def __init__(self, small: bool, stream: int) -> None:
        self.small, self.stream = small, stream
        self.keys: list[tuple[int, int, _Block]] = []  # (size, address) are unique: blocks are never compared
        self.unmapped: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        bisect.insort(self.keys, (block.size, block.addr, block))

    def remove(self, block: _Block) -> None:
        del self.keys[bisect.bisect_left(self.keys, (block.size, block.addr))]


class _Allocator:
    """One device's caching allocator: its state and rules (methods named after torch's functions)."""
    def __init__(self, config: AllocatorConfig) -> None:
        self.config = config
        self.pools: dict[tuple[bool, int], _Pool] = {}
        self.allocated = self.reserved = self.requested = self.device_allocs = 0
        self.allocated_peak = self.reserved_peak = self.requested_peak = 0
        self.next_addr = 0  # segments get increasing addresses

    def malloc(self, nbytes: int, stream: int) -> _Block | None:
        """A block for ``nbytes`` on ``stream``, or None when out of memory."""
        size = round_size(nbytes)
        key = (size <= SMALL_SIZE_BYTES, stream)
        pool = self.pools.get(key) or self.pools.setdefault(key, _Pool(*key))
        block = (self.get_free_block(pool, size) or self.alloc_block(pool, size)
                 or self.release_available_cached_blocks(pool, size) and self.alloc_block(pool, size)
                 or self.release_cached_blocks() and self.alloc_block(pool, size))
        if not block:
            return None
        if self.should_split(block, size):
            _splice(block, rest := block.piece(block.addr + size, block.size - size), block.next)
            block.size = size
            pool.add(rest)
        block.allocated, block.requested = True, nbytes
        self.allocated += block.size
        self.requested += nbytes
        self.allocated_peak, self.requested_peak = (max(self.allocated_peak, self.allocated),
                                                    max(self.requested_peak, self.requested))
        return block

    def free(self, block: _Block) -> None:
        """``free_block``: back to its pool, merged with its free neighbours."""
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = self.pools[(block.small, block.stream)]
        for neighbour in (block.prev, block.next):
            self.try_merge(block, neighbour, pool)
        pool.add(block)

    def try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """``try_merge_blocks``: ``dst`` (in no set) absorbs ``src`` if that is free and mapped alike."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool.remove(src) if src.mapped else pool.unmapped.pop(src.addr)
        if dst.prev is src:
            dst.addr = src.addr
            _splice(src.prev, dst, dst.next)
        else:
            _splice(dst.prev, dst, src.next)
        dst.size += src.size

    def get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        if self.config.expandable_segments:  # skip to a later block that can grow less
            while i + 1 < len(pool.keys) and pool.keys[i + 1][2].reach() < pool.keys[i][2].reach():
                i += 1
        block, mss = pool.keys[i][2], self.config.max_split_size_bytes
        if mss is not None and (size < mss <= block.size or size >= mss and block.size >= size + LARGE_BUFFER_BYTES):
            return None
        pool.remove(block)
        return block

    def should_split(self, block: _Block, size: int) -> bool:
        remaining, mss = block.size - size, self.config.max_split_size_bytes
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return (mss is None or size < mss) and remaining > SMALL_SIZE_BYTES

    def reserve(self, nbytes: int) -> bool:
        """Get ``nbytes`` more from the driver, unless that passes the capacity."""
        if self.config.capacity_bytes is not None and self.reserved + nbytes > self.config.capacity_bytes:
            return False
        self.reserved += nbytes
        self.reserved_peak, self.device_allocs = max(self.reserved_peak, self.reserved), self.device_allocs + 1
        return True

    def alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        """A new segment (cudaMalloc), or newly mapped pages with expandable segments; None if they do not fit."""
        if self.config.expandable_segments:
            return self.try_allocate_expandable_block(pool, size)
        nbytes = allocation_size(size)
        if not self.reserve(nbytes):
            return None
        self.next_addr += nbytes
        return _Block(self.next_addr - nbytes, nbytes, pool.small, pool.stream, None)

    def release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """With ``max_split_size``: cudaFree the smallest oversize cached block that covers the request, else the
        oversize ones from the largest down until they add up to it."""
        mss = self.config.max_split_size_bytes
        if mss is None or self.config.expandable_segments:
            return False
        key = max(size, mss)
        i = bisect.bisect_left(pool.keys, (key, -1))
        victims = [pool.keys[i][2]] if i < len(pool.keys) else [b for _, _, b in reversed(pool.keys) if b.size >= mss]
        released = 0
        for block in victims:
            if released < key:
                pool.remove(block)
                self.reserved, released = self.reserved - block.size, released + block.size
        return released >= key

    def release_cached_blocks(self) -> bool:
        """Free every cached segment with no block in use; in expandable segments, unmap the whole free pages."""
        for pool in self.pools.values():
            to_unmap = []
            for i in reversed(range(len(pool.keys))):
                block = pool.keys[i][2]
                if block.base is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:  # release_block: cudaFree the segment
                    pool.remove(block)
                    self.reserved -= block.size
            for block in to_unmap:
                self.unmap_block(pool, block)
                if not block.mapped and block.prev is None and block.next is None:
                    del pool.unmapped[block.addr]  # release_expandable_segment
        return True

    def try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        block = self.find_expandable_block(pool, size)
        if not block.mapped and not self.map_block(pool, block, min(block.size, size)):
            return None
        while block.size < size:  # a free block followed by unmapped space: map what it lacks
            after = block.next
            if after is None or not self.map_block(pool, after, min(size - block.size, after.size)):
                return None
            block = after
        pool.remove(block)
        return block

    def find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """The lowest unmapped piece (from the free block before it) where ``size`` bytes fit in a row, else the
        unmapped range of a new expandable segment."""
        for addr in sorted(pool.unmapped):
            start = pool.unmapped[addr]
            if start.prev is not None and not start.prev.allocated:
                start = start.prev
            room, block = 0, start
            while block is not None and room < size and not block.allocated:
                room, block = room + block.size, block.next
            if room >= size:
                return start
        block = _Block(self.next_addr, 1 << 48, pool.small, pool.stream, self.next_addr, mapped=False)
        self.next_addr += 1 << 48
        pool.unmapped[block.addr] = block
        return block

    def map_block(self, pool: _Pool, block: _Block, size: int) -> bool:
        """Map the pages that hold the first ``size`` bytes of an unmapped piece; False if they do not fit."""
        page = SMALL_BUFFER_BYTES if block.small else LARGE_BUFFER_BYTES
        mapped = -(-size // page) * page  # an unmapped piece starts on a page
        if not self.reserve(mapped):
            return False
        del pool.unmapped[block.addr]
        block.mapped = True
        if mapped < block.size:
            _splice(block, rest := block.piece(block.addr + mapped, block.size - mapped, mapped=False), block.next)
            pool.unmapped[rest.addr] = rest
            block.size = mapped
        self.try_merge(block, block.prev, pool)
        self.try_merge(block, block.next, pool)
        pool.add(block)
        return True

    def unmap_block(self, pool: _Pool, block: _Block) -> None:
        """Unmap the whole pages inside a cached block of an expandable segment."""
        page, base = SMALL_BUFFER_BYTES if block.small else LARGE_BUFFER_BYTES, block.base or 0
        end = block.addr + block.size
        start, stop = base + -(-(block.addr - base) // page) * page, base + (end - base) // page * page
        if start >= stop:
            return
        pool.remove(block)
        if start > block.addr:
            _splice(block.prev, before := block.piece(block.addr, start - block.addr), block)
            pool.add(before)
        if stop < end:
            _splice(block, after := block.piece(stop, end - stop), block.next)
            pool.add(after)
        block.addr, block.size, block.mapped = start, stop - start, False
        self.try_merge(block, block.prev, pool)
        self.try_merge(block, block.next, pool)
        pool.unmapped[block.addr] = block
        self.reserved -= stop - start


def replay(events: Iterable[Event], config: AllocatorConfig = AllocatorConfig()) -> AllocatorPeaks:
    """Run ``events`` in order through the caching allocator's rules; stop at the first out of memory.

    A request of 0 bytes takes no block, as in torch. Raises InvalidInputError for a handle allocated twice
    or freed while not allocated, a negative size, or another type of event."""
    state = _Allocator(config)
    live: dict[int, _Block | None] = {}
    oom = None
    for i, event in enumerate(events):
        if isinstance(event, Alloc) and event.handle not in live and event.nbytes >= 0:
            block = state.malloc(event.nbytes, event.stream) if event.nbytes else None
            if event.nbytes and block is None:
                segment = allocation_size(round_size(event.nbytes))
                oom = OutOfMemory(i, event, segment, state.allocated, state.reserved)
                break
            live[event.handle] = block
        elif isinstance(event, Free) and event.handle in live:
            if (block := live.pop(event.handle)) is not None:
                state.free(block)
        else:
            raise InvalidInputError(f"event {i} is {event!r}: give Alloc (of a handle not allocated, nbytes >= 0) "
                                    "and Free (of an allocated handle) events")
    return AllocatorPeaks(state.allocated_peak, state.reserved_peak, state.requested_peak, state.device_allocs,
                          state.allocated, state.reserved, oom)


def events_of(storages: Iterable[Any]) -> list[Event]:
    """The events of storages given in allocation order: objects with ``nbytes``, ``alloc_index`` and
    ``free_index`` (:class:`~remat.costs.recording.Storage`) or such tuples; a storage's handle is its position.

    At each timeline index, first the frees of the storages whose ``free_index`` is that index, then the
    allocations made there, in the given order; storages never freed stay allocated. A storage made and freed
    at the same index (inside one operator) is freed after that index's allocations."""
    at: dict[int, tuple[list[Event], list[Event], list[Event]]] = {}
    for k, storage in enumerate(storages):
        nbytes, alloc_index, free_index = (storage.nbytes, storage.alloc_index, storage.free_index) if hasattr(
            storage, "alloc_index") else storage
        if free_index is not None and free_index < alloc_index:
            raise InvalidInputError(f"storage {k} ({storage!r}) is freed before it is allocated")
        at.setdefault(alloc_index, ([], [], []))[1].append(Alloc(k, nbytes))
        if free_index is not None:
            at.setdefault(free_index, ([], [], []))[0 if free_index > alloc_index else 2].append(Free(k))
    return [event for index in sorted(at) for part in at[index] for event in part]
