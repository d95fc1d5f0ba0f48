"""The arena allocator: rounding and alignment, best fit, splitting, merging, statistics.

The allocator is pure bookkeeping, so every rule is checked directly on offsets and sizes, and a
seeded random workload checks the invariants (no overlap, inside the arena, exact byte counts)
over a few thousand allocate / free operations.
"""

from __future__ import annotations

import numpy as np
import pytest

from tensile_db.memory.arena import UNIT_NBYTES, ArenaAllocator, round_up

U = UNIT_NBYTES


@pytest.mark.parametrize("nbytes, expected", [
    (0, U), (1, U), (U - 1, U), (U, U), (U + 1, 2 * U), (3 * U, 3 * U), (10 * U - 7, 10 * U),
])
def test_round_up(nbytes, expected):
    assert round_up(nbytes) == expected


def test_capacity_rounded_down_to_unit():
    assert ArenaAllocator(10 * U + U - 1).capacity_nbytes == 10 * U
    empty = ArenaAllocator(U - 1)
    assert empty.capacity_nbytes == 0
    assert empty.free_blocks == 0 and empty.largest_free_nbytes == 0
    assert empty.allocate(1) is None


def test_sizes_rounded_and_offsets_aligned():
    a = ArenaAllocator(64 * U)
    for n in (1, 7, U, U + 1, 3 * U - 5, 1000):
        off = a.allocate(n)
        assert off is not None
        assert off % U == 0
        assert a.size_of(off) == round_up(n)
    assert a.in_use_nbytes == sum(round_up(n) for n in (1, 7, U, U + 1, 3 * U - 5, 1000))


def _with_holes(hole_units: list[int], capacity_units: int = 64) -> tuple[ArenaAllocator, list[int]]:
    """An arena with free holes of the given sizes (units), separated by one-unit live blocks,
    followed by the free tail. Returns the allocator and the holes' offsets."""
    a = ArenaAllocator(capacity_units * U)
    holes = []
    for units in hole_units:
        holes.append(a.allocate(units * U))
        a.allocate(U)                                    # separator, stays allocated
    for off in holes:
        a.free(off)
    return a, holes


def test_best_fit_picks_smallest_fitting_block():
    a, holes = _with_holes([8, 3, 5])                    # free: 8, 3, 5 and the large tail
    assert a.free_blocks == 4
    assert a.allocate(4 * U) == holes[2]                 # 5 is the smallest block >= 4
    assert a.allocate(3 * U) == holes[1]                 # exact fit
    assert a.allocate(6 * U) == holes[0]                 # only 8 (and the tail) fit; 8 is smaller


def test_best_fit_prefers_lowest_offset_among_equal_sizes():
    a, holes = _with_holes([4, 4, 4])
    assert a.allocate(2 * U) == holes[0]


def test_split_leaves_remainder_free():
    a, holes = _with_holes([8])
    blocks_before = a.free_blocks
    off = a.allocate(3 * U)
    assert off == holes[0]
    assert a.free_blocks == blocks_before               # hole shrank, not removed
    # the remainder of the hole is the best fit for a 5-unit request and starts right after
    assert a.allocate(5 * U) == off + 3 * U
    assert a.free_blocks == blocks_before - 1           # now consumed exactly


def test_free_merges_with_both_neighbours():
    a = ArenaAllocator(10 * U)
    left, mid, right = a.allocate(2 * U), a.allocate(3 * U), a.allocate(U)
    # tail [6U, 10U) is free
    a.free(left)
    assert a.free_blocks == 2
    a.free(right)                                        # merges with the tail
    assert a.free_blocks == 2
    assert a.largest_free_nbytes == 5 * U
    a.free(mid)                                          # merges with both sides
    assert a.free_blocks == 1
    assert a.largest_free_nbytes == a.capacity_nbytes
    assert a.in_use_nbytes == 0
    assert a.allocate(10 * U) == 0                       # the whole arena is one block again


def test_freeing_everything_in_any_order_leaves_one_block():
    rng = np.random.default_rng(7)
    a = ArenaAllocator(256 * U)
    offs = [a.allocate(int(n) * U) for n in rng.integers(1, 6, size=40)]
    assert None not in offs
    for i in rng.permutation(len(offs)):
        a.free(offs[i])
    assert a.free_blocks == 1
    assert a.largest_free_nbytes == a.capacity_nbytes
    assert a.fragmentation == 0.0


def test_allocate_returns_none_when_nothing_fits():
    a = ArenaAllocator(4 * U)
    assert a.allocate(5 * U) is None
    assert a.allocate(4 * U) == 0
    assert a.allocate(1) is None
    assert a.in_use_nbytes == 4 * U


def test_allocate_returns_none_when_fragmented():
    a = ArenaAllocator(8 * U)
    offs = [a.allocate(U) for _ in range(8)]
    for off in offs[::2]:
        a.free(off)
    assert a.free_nbytes == 4 * U                        # enough bytes in total...
    assert a.largest_free_nbytes == U                    # ...but no contiguous 2-unit block
    assert a.fragmentation == pytest.approx(0.75)
    in_use = a.in_use_nbytes
    assert a.allocate(2 * U) is None
    assert a.in_use_nbytes == in_use                     # a failed allocation changes nothing
    assert a.free_blocks == 4


def test_statistics():
    a = ArenaAllocator(16 * U)
    assert (a.in_use_nbytes, a.peak_nbytes, a.total_nbytes) == (0, 0, 0)
    assert a.free_blocks == 1 and a.largest_free_nbytes == 16 * U and a.fragmentation == 0.0
    x = a.allocate(3 * U)
    y = a.allocate(U + 1)                                # rounds to 2 units
    assert a.in_use_nbytes == 5 * U
    assert a.peak_nbytes == 5 * U
    a.free(x)
    assert a.in_use_nbytes == 2 * U
    assert a.peak_nbytes == 5 * U                        # high-water mark stays
    assert a.total_nbytes == 5 * U
    z = a.allocate(U)
    assert a.total_nbytes == 6 * U                       # cumulative
    assert a.peak_nbytes == 5 * U
    assert a.free_nbytes == 16 * U - 3 * U
    assert a.free_blocks == 2                            # hole [U, 3U) before y, tail after y
    assert a.largest_free_nbytes == 16 * U - 5 * U
    assert a.blocks() == sorted([(z, U), (y, 2 * U)])
    a.free(y)
    a.free(z)
    assert a.in_use_nbytes == 0 and a.peak_nbytes == 5 * U


def test_free_of_unknown_offset_raises():
    a = ArenaAllocator(4 * U)
    off = a.allocate(U)
    a.free(off)
    with pytest.raises(KeyError):
        a.free(off)                                      # double free
    with pytest.raises(KeyError):
        a.free(3 * U)                                    # never allocated


def _check_invariants(a: ArenaAllocator, live: dict[int, int]) -> None:
    blocks = a.blocks()
    assert dict(blocks) == live
    end = 0
    for off, size in blocks:                             # sorted by offset: no overlap
        assert off % U == 0 and size % U == 0 and size > 0
        assert off >= end
        end = off + size
    assert end <= a.capacity_nbytes
    assert a.in_use_nbytes == sum(live.values())
    assert a.in_use_nbytes <= a.peak_nbytes <= a.capacity_nbytes
    # free blocks are disjoint from live blocks and together cover the rest of the arena
    free = sorted(a._free_start.items())
    assert sum(s for _, s in free) == a.free_nbytes
    spans = sorted(blocks + free)
    pos = 0
    for off, size in spans:
        assert off == pos, "gap or overlap between blocks"
        pos = off + size
    assert pos == a.capacity_nbytes
    # no two free blocks are adjacent (they would have been merged)
    for (o1, s1), (o2, _) in zip(free, free[1:]):
        assert o1 + s1 < o2


def test_randomized_invariants():
    rng = np.random.default_rng(20240601)
    a = ArenaAllocator(1000 * U + 123)
    live: dict[int, int] = {}
    peak = 0
    failures = 0
    for step in range(4000):
        if live and rng.random() < 0.45:
            off = list(live)[rng.integers(len(live))]
            a.free(off)
            del live[off]
        else:
            n = int(rng.integers(1, 40 * U))
            free_before, largest_before = a.free_nbytes, a.largest_free_nbytes
            off = a.allocate(n)
            if off is None:
                failures += 1
                assert largest_before < round_up(n)      # None only when no block fits
                assert a.free_nbytes == free_before
            else:
                assert off not in live
                live[off] = round_up(n)
        peak = max(peak, sum(live.values()))
        if step % 50 == 0 or step == 3999:
            _check_invariants(a, live)
        assert a.peak_nbytes == peak
    assert failures > 0, "workload should have exercised a full arena"
    for off in list(live):
        a.free(off)
    _check_invariants(a, {})
    assert a.free_blocks == 1


# --- compaction --------------------------------------------------------------------------------


def test_compact_slides_movable_blocks_down_past_no_fixed_block():
    a = ArenaAllocator(16 * U)
    offs = [a.allocate(2 * U) for _ in range(6)]         # 0, 2, 4, 6, 8, 10 (units)
    for i in (0, 2, 4):
        a.free(offs[i])
    fixed = offs[3]                                      # at 6 U: must not move
    assert a.largest_free_nbytes == 4 * U                # [12, 16)
    moves = a.compact({offs[1], offs[5]})
    assert moves == [(offs[1], 0, 2 * U), (offs[5], fixed + 2 * U, 2 * U)]
    assert a.blocks() == [(0, 2 * U), (fixed, 2 * U), (fixed + 2 * U, 2 * U)]
    assert a.in_use_nbytes == 6 * U and a.free_blocks == 2
    assert a.largest_free_nbytes == 6 * U                # [10, 16) coalesced
    assert a.compact({0, fixed + 2 * U}) == []           # already compact: nothing moves
    assert a.allocate(6 * U) == fixed + 4 * U


def _check_blocks(a: ArenaAllocator, live: list[int]) -> None:
    """The allocated blocks are exactly ``live`` (offsets) and no two overlap."""
    blocks = a.blocks()
    assert sorted(live) == [o for o, _ in blocks]
    assert all(o1 + s1 <= o2 for (o1, s1), (o2, _) in zip(blocks, blocks[1:]))


def test_compact_then_random_work_keeps_the_invariants():
    rng = np.random.default_rng(5)
    a = ArenaAllocator(256 * U)
    live = []
    for step in range(2000):
        if live and (rng.random() < 0.45 or a.free_nbytes == 0):
            a.free(live.pop(rng.integers(len(live))))
        else:
            off = a.allocate(int(rng.integers(1, 12)) * U)
            if off is not None:
                live.append(off)
        if step % 97 == 0:
            keep = set(live[::2])
            moved = dict((old, new) for old, new, _ in a.compact(keep))
            live = [moved.get(o, o) for o in live]
        _check_blocks(a, live)
        assert a.in_use_nbytes == sum(s for _, s in a.blocks()) <= a.capacity_nbytes
        assert a.in_use_nbytes + sum(s for s, _ in a._free_by_size) == a.capacity_nbytes


def test_compact_for_a_block_slides_only_the_cheapest_run():
    a = ArenaAllocator(23 * U)
    sizes = [4, 1, 1, 4, 1, 1, 4]                        # units, each with a one-unit hole above
    offs = []
    for size in sizes:
        offs.append(a.allocate(size * U))
        a.allocate(U)
    for off, size in zip(offs, sizes):
        a.free(off + size * U)
    assert offs == [0, 5 * U, 7 * U, 9 * U, 14 * U, 16 * U, 18 * U]
    assert a.largest_free_nbytes == U and a.allocate(2 * U) is None
    movable = set(offs)
    moves = a.compact(movable, need_nbytes=2 * U)
    assert moves == [(5 * U, 4 * U, U)]                  # one unit moved, not a 4-unit block
    assert a.allocate(2 * U) == 5 * U
    big = {offs[0], offs[3], offs[6]}                    # each frees at most 2 U sliding alone
    assert a.compact(big, need_nbytes=3 * U) == []


def test_compact_for_a_block_then_random_work_keeps_the_invariants():
    rng = np.random.default_rng(7)
    a = ArenaAllocator(256 * U)
    live = []
    for step in range(2000):
        if live and (rng.random() < 0.45 or a.free_nbytes == 0):
            a.free(live.pop(rng.integers(len(live))))
        else:
            size = int(rng.integers(1, 12)) * U
            off = a.allocate(size)
            if off is None and a.free_nbytes >= size:
                before = a.in_use_nbytes
                moved = dict((old, new) for old, new, _ in a.compact(set(live[::2]), need_nbytes=size))
                live = [moved.get(o, o) for o in live]
                assert a.in_use_nbytes == before
                off = a.allocate(size)
                assert (off is not None) == bool(moved)      # a run that slid opened the block
            if off is not None:
                live.append(off)
        _check_blocks(a, live)
