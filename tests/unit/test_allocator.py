"""remat.costs.allocator on hand-written event sequences whose outcome the caching allocator's rules fix
(c10/cuda/CUDACachingAllocator.cpp); each test derives its byte figures in comments. No torch, milliseconds."""

from __future__ import annotations

import pytest

from remat.costs.allocator import (
    Alloc, AllocatorConfig, AllocatorPeaks, Free, OutOfMemory, allocation_size, events_of, replay, round_size,
)
from remat.costs.recording import Storage
from remat.errors import InvalidInputError

KiB, MiB = 1 << 10, 1 << 20


def run(*events: Alloc | Free, **config) -> AllocatorPeaks:
    return replay(events, AllocatorConfig(**config))


def test_round_size_and_segment_size():
    assert [round_size(n) for n in (1, 511, 512, 513, 1025)] == [512, 512, 512, 1024, 1536]
    # small (<= 1 MiB) -> 2 MiB; large under 10 MiB -> 20 MiB; from 10 MiB: rounded up to 2 MiB
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB) == 12 * MiB


def test_a_tiny_request_takes_512_bytes_of_a_2mib_segment():
    # 100 -> round_size 512, small pool, get_allocation_size 2 MiB; 2 MiB - 512 remain (>= 512): split
    p = run(Alloc(0, 100))
    assert p == AllocatorPeaks(allocated_peak_bytes=512, reserved_peak_bytes=2 * MiB, requested_peak_bytes=100,
                               segments=1, allocated_end_bytes=512, reserved_end_bytes=2 * MiB, oom=None)


def test_one_byte_over_1mib_takes_a_20mib_segment():
    # 1 MiB + 1 -> 1 MiB + 512 > kSmallSize: large pool, under 10 MiB -> 20 MiB; 19 MiB - 512 remain (> 1 MiB): split
    p = run(Alloc(0, MiB + 1))
    assert (p.allocated_peak_bytes, p.reserved_peak_bytes, p.segments) == (MiB + 512, 20 * MiB, 1)


def test_exactly_1mib_is_small_and_two_share_a_segment():
    # 1 MiB <= kSmallSize: a 2 MiB segment, split (1 MiB >= 512 remain); the second takes the 1 MiB remainder
    p = run(Alloc(0, MiB), Alloc(1, MiB))
    assert (p.allocated_peak_bytes, p.reserved_peak_bytes, p.segments) == (2 * MiB, 2 * MiB, 1)


def test_two_600kib_requests_share_one_2mib_segment():
    # 600 KiB = 614400 (a multiple of 512): 2 MiB segment split; the second fits the 1482752-byte remainder
    p = run(Alloc(0, 600 * KiB), Alloc(1, 600 * KiB))
    assert (p.allocated_peak_bytes, p.reserved_peak_bytes, p.segments) == (1228800, 2 * MiB, 1)


def test_11mib_gets_its_own_12mib_segment_and_the_1mib_remainder_is_not_split():
    # 11 MiB >= kMinLargeAlloc: segment rounded up to 2 MiB = 12 MiB; remainder exactly 1 MiB is not > 1 MiB,
    # so the whole 12 MiB block is allocated
    p = run(Alloc(0, 11 * MiB))
    assert (p.allocated_peak_bytes, p.reserved_peak_bytes, p.requested_peak_bytes) == (12 * MiB, 12 * MiB, 11 * MiB)


def test_a_large_remainder_over_1mib_is_split_and_reused():
    # 11 MiB - 512: 12 MiB segment, remainder 1 MiB + 512 > 1 MiB: split; then 1 MiB + 512 (large pool) fits the
    # remainder exactly: no second segment; allocated 12 MiB in all
    p = run(Alloc(0, 11 * MiB - 512), Alloc(1, MiB + 512))
    assert (p.allocated_peak_bytes, p.reserved_peak_bytes, p.segments) == (12 * MiB, 12 * MiB, 1)


def test_a_small_remainder_of_512_bytes_is_split():
    # A 1024 at [0, 1024), B 512 at [1024, 1536) of one 2 MiB segment; free A; C 512: best fit is A's 1024-byte
    # block (smaller than the tail), 512 remain (>= kMinBlockSize): split, so C holds 512 bytes, not 1024;
    # D 512 then takes the 512 left: allocated B + C + D = 1536, still one segment
    p = run(Alloc(0, 1024), Alloc(1, 512), Free(0), Alloc(2, 512), Alloc(3, 512))
    assert (p.allocated_end_bytes, p.allocated_peak_bytes, p.segments) == (1536, 1536, 1)


def test_a_freed_block_is_reused_without_a_new_segment():
    # small: the 512-byte block returns to its merged 2 MiB segment and serves the next request
    assert run(Alloc(0, 100), Free(0), Alloc(1, 200)).segments == 1
    # large: the cached 12 MiB segment serves 11 MiB - 1 (rounded 11 MiB, remainder 1 MiB: not split)
    p = run(Alloc(0, 12 * MiB), Free(0), Alloc(1, 11 * MiB - 1))
    assert (p.segments, p.reserved_peak_bytes, p.allocated_end_bytes) == (1, 12 * MiB, 12 * MiB)


def test_fragmented_free_memory_forces_a_new_segment():
    # two 12 MiB segments, both cached: 24 MiB free, but no block of 20 MiB -> a third segment of 20 MiB
    p = run(Alloc(0, 12 * MiB), Alloc(1, 12 * MiB), Free(0), Free(1), Alloc(2, 20 * MiB))
    assert (p.segments, p.reserved_peak_bytes, p.allocated_peak_bytes) == (3, 44 * MiB, 24 * MiB)


def test_freed_neighbours_merge_so_a_larger_request_fits():
    # one 20 MiB segment: A [0,4) B [4,8) C [8,12) D [12,18) MiB, free tail [18,20) (2 MiB > 1 MiB: split off);
    # free A, B -> one 8 MiB block; E 8 MiB fits it (two 4 MiB blocks would not): allocated 8 + 4 + 6 = 18 MiB
    p = run(Alloc(0, 4 * MiB), Alloc(1, 4 * MiB), Alloc(2, 4 * MiB), Alloc(3, 6 * MiB), Free(0), Free(1),
            Alloc(4, 8 * MiB))
    assert (p.segments, p.reserved_peak_bytes, p.allocated_end_bytes) == (1, 20 * MiB, 18 * MiB)
    # freeing everything merges the segment back whole: 19 MiB takes it all (remainder 1 MiB: not split)
    p = run(Alloc(0, 4 * MiB), Alloc(1, 4 * MiB), Alloc(2, 4 * MiB), Free(1), Free(0), Free(2),
            Alloc(3, 19 * MiB))
    assert (p.segments, p.allocated_end_bytes) == (1, 20 * MiB)


def test_out_of_memory_first_releases_cached_segments():
    # capacity 30 MiB: the cached 12 MiB segment + a new 20 MiB one = 32 MiB do not fit; release_cached_blocks
    # frees the cached one (reserved 0) and the 20 MiB segment fits
    p = run(Alloc(0, 12 * MiB), Free(0), Alloc(1, 20 * MiB), capacity_bytes=30 * MiB)
    assert p.oom is None
    assert (p.segments, p.reserved_peak_bytes, p.reserved_end_bytes) == (2, 20 * MiB, 20 * MiB)


def test_out_of_memory_is_reported_and_the_replay_stops():
    # 12 MiB in use + 20 MiB > 30 MiB, nothing cached to release: OOM at event 1; later events are not replayed
    p = run(Alloc(0, 12 * MiB), Alloc(1, 20 * MiB), Free(0), Alloc(2, 28 * MiB), capacity_bytes=30 * MiB)
    assert p.oom == OutOfMemory(event_index=1, request=Alloc(1, 20 * MiB), segment_bytes=20 * MiB,
                                allocated_bytes=12 * MiB, reserved_bytes=12 * MiB)
    assert (p.allocated_peak_bytes, p.reserved_peak_bytes, p.allocated_end_bytes) == (12 * MiB, 12 * MiB, 12 * MiB)


def test_a_segment_with_a_block_in_use_is_not_released():
    # capacity 24 MiB; A 4 MiB and B 2 MiB split one 20 MiB segment ([0,4) [4,6), free [6,20)); free A: free
    # blocks of 4 and 14 MiB (18 MiB) but none holds 16 MiB; a 16 MiB segment does not fit (20 + 16 > 24) and
    # the segment cannot be released while B lives: OOM
    p = run(Alloc(0, 4 * MiB), Alloc(1, 2 * MiB), Free(0), Alloc(2, 16 * MiB), capacity_bytes=24 * MiB)
    assert p.oom == OutOfMemory(3, Alloc(2, 16 * MiB), 16 * MiB, allocated_bytes=2 * MiB, reserved_bytes=20 * MiB)


def test_streams_do_not_share_cached_blocks():
    # stream 1 cannot use stream 0's cached segment: a second one; stream 0 reuses its own
    p = run(Alloc(0, 100), Free(0), Alloc(1, 100, stream=1), Alloc(2, 100))
    assert (p.segments, p.reserved_peak_bytes) == (2, 4 * MiB)
    # out of memory releases cached segments of every stream: stream 0's, for stream 1's within 2 MiB
    p = run(Alloc(0, 100), Free(0), Alloc(1, 100, stream=1), capacity_bytes=2 * MiB)
    assert (p.oom, p.segments, p.reserved_peak_bytes) == (None, 2, 2 * MiB)


def test_max_split_size_keeps_oversize_blocks_whole():
    mss = {"max_split_size_bytes": 32 * MiB}
    # default: 12 MiB reuses the cached 40 MiB segment and splits it (28 MiB remain)
    p = run(Alloc(0, 40 * MiB), Free(0), Alloc(1, 12 * MiB))
    assert (p.segments, p.reserved_peak_bytes, p.allocated_end_bytes) == (1, 40 * MiB, 12 * MiB)
    # max_split_size 32 MiB: a request under it takes no block at or over it -> a new 12 MiB segment
    p = run(Alloc(0, 40 * MiB), Free(0), Alloc(1, 12 * MiB), **mss)
    assert (p.segments, p.reserved_peak_bytes, p.allocated_end_bytes) == (2, 52 * MiB, 12 * MiB)
    # 36 MiB >= 32 MiB takes the 40 MiB block (less than 36 + 20 MiB) whole: no split at or over max_split_size
    p = run(Alloc(0, 40 * MiB), Free(0), Alloc(1, 36 * MiB), **mss)
    assert (p.segments, p.allocated_end_bytes) == (1, 40 * MiB)
    # 34 MiB does not take a 60 MiB block (>= 34 + 20 MiB): a new 34 MiB segment
    p = run(Alloc(0, 60 * MiB), Free(0), Alloc(1, 34 * MiB), **mss)
    assert (p.segments, p.reserved_peak_bytes) == (2, 94 * MiB)


def test_max_split_size_releases_oversize_blocks_first_when_out_of_memory():
    # cached: a 40 MiB (oversize) and a 12 MiB segment; 30 MiB cannot take the 40 MiB block; 52 + 30 > 64 MiB;
    # release_available_cached_blocks frees the 40 MiB one only (the smallest >= max(30, 32) MiB): 12 + 30 fit
    events = (Alloc(0, 40 * MiB), Alloc(1, 12 * MiB), Free(0), Free(1), Alloc(2, 30 * MiB))
    p = replay(events, AllocatorConfig(max_split_size_bytes=32 * MiB, capacity_bytes=64 * MiB))
    assert (p.oom, p.segments, p.reserved_peak_bytes, p.reserved_end_bytes) == (None, 3, 52 * MiB, 42 * MiB)
    # without max_split_size, the 40 MiB block is reused and split: no new segment
    p = replay(events, AllocatorConfig(capacity_bytes=64 * MiB))
    assert (p.segments, p.reserved_end_bytes, p.allocated_end_bytes) == (2, 52 * MiB, 30 * MiB)


def test_expandable_segments_reserve_the_page_rounded_high_water_mark():
    events = (Alloc(0, 30 * MiB), Free(0), Alloc(1, 32 * MiB))
    # native: a 30 MiB segment, cached; 32 MiB does not fit it: a new 32 MiB segment, 62 MiB reserved
    assert run(*events).reserved_peak_bytes == 62 * MiB
    # expandable: 30 MiB maps two 20 MiB pages; freed, [0, 40) is one free block that 32 MiB fits:
    # reserved = the addresses in use (32 MiB) rounded up to a page = 40 MiB, one mapping
    p = run(*events, expandable_segments=True)
    assert (p.reserved_peak_bytes, p.allocated_peak_bytes, p.segments) == (40 * MiB, 32 * MiB, 1)
    # small pool pages are 2 MiB
    assert run(Alloc(0, 100), expandable_segments=True).reserved_peak_bytes == 2 * MiB


def test_expandable_segments_grow_by_whole_20mib_pages():
    # 11 MiB maps one 20 MiB page and is split (>= 512 remain): allocated 11 MiB, not the native 12 MiB; the
    # second 11 MiB extends the 9 MiB free tail by one more page: 40 MiB, where native makes two 12 MiB segments
    p = run(Alloc(0, 11 * MiB), Alloc(1, 11 * MiB), expandable_segments=True)
    assert (p.reserved_peak_bytes, p.allocated_peak_bytes, p.segments) == (40 * MiB, 22 * MiB, 2)
    assert run(Alloc(0, 11 * MiB), Alloc(1, 11 * MiB)).reserved_peak_bytes == 24 * MiB


def test_expandable_best_fit_prefers_a_block_that_cannot_grow():
    # one page [0,20): P [0,5) Q [5,7) R [7,16), free tail [16,20) MiB; free P. S 4 MiB: best fit is the 4 MiB
    # tail, but it can grow into unmapped space and the 5 MiB hole cannot (expandable_size): S goes to [0,4).
    # T 4.5 MiB then fits neither the 1 MiB left nor the 4 MiB tail: the tail grows by a page, 40 MiB
    p = run(Alloc(0, 5 * MiB), Alloc(1, 2 * MiB), Alloc(2, 9 * MiB), Free(0), Alloc(3, 4 * MiB),
            Alloc(4, 4 * MiB + 512 * KiB), expandable_segments=True)
    assert (p.reserved_peak_bytes, p.segments) == (40 * MiB, 2)


def test_expandable_out_of_memory_unmaps_free_pages():
    # A [0,30) C [30,35) free [35,40) MiB (two pages, 40 MiB); free A. D 35 MiB fits no free block: extending
    # [35,40) needs 30 MiB more, two pages: 80 > 70 MiB. release_cached_blocks unmaps the whole free page
    # [0,20) (reserved 20 MiB; [20,30) stays mapped); [0,30) now holds only 30 MiB in a row, so D extends
    # [35,40) again: 20 + 40 = 60 MiB fits
    events = (Alloc(0, 30 * MiB), Alloc(1, 5 * MiB), Free(0), Alloc(2, 35 * MiB))
    p = replay(events, AllocatorConfig(expandable_segments=True, capacity_bytes=70 * MiB))
    assert (p.oom, p.reserved_peak_bytes, p.reserved_end_bytes, p.segments) == (None, 60 * MiB, 60 * MiB, 2)
    assert replay(events, AllocatorConfig(expandable_segments=True)).reserved_peak_bytes == 80 * MiB
    # within 50 MiB it cannot: 20 + 40 > 50 after the release
    p = replay(events, AllocatorConfig(expandable_segments=True, capacity_bytes=50 * MiB))
    assert p.oom == OutOfMemory(3, Alloc(2, 35 * MiB), 36 * MiB, allocated_bytes=5 * MiB, reserved_bytes=20 * MiB)


def test_events_of_frees_before_allocating_at_the_same_index():
    storages = [(100, 0, 2), (200, 1, None), Storage(300, 2, 3), (400, 2, 2)]
    assert events_of(storages) == [
        Alloc(0, 100), Alloc(1, 200),
        Free(0), Alloc(2, 300), Alloc(3, 400), Free(3),  # index 2: free, allocate, then the one made and freed there
        Free(2),
    ]
    # the 12 MiB freed at index 1 is cached before the next 12 MiB is allocated there: one segment
    assert replay(events_of([(12 * MiB, 0, 1), (12 * MiB, 1, None)])).segments == 1


def test_zero_bytes_take_no_block():
    p = run(Alloc(0, 0), Free(0))
    assert (p.segments, p.reserved_peak_bytes) == (0, 0)


@pytest.mark.parametrize("events", [
    (Alloc(0, 1), Alloc(0, 1)), (Free(0),), (Alloc(0, 1), Free(0), Free(0)), (Alloc(0, -1),), ((0, 1),),
])
def test_malformed_events_are_rejected(events):
    with pytest.raises(InvalidInputError):
        replay(events)


def test_malformed_config_and_storages_are_rejected():
    for bad in ({"max_split_size_bytes": 20 * MiB}, {"max_split_size_bytes": 30 * MiB + 1},
                {"capacity_bytes": -1}):
        with pytest.raises(InvalidInputError):
            AllocatorConfig(**bad)
    with pytest.raises(InvalidInputError):
        events_of([(100, 3, 2)])
