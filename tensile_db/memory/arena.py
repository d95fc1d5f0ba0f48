"""The arena allocator: offsets inside one contiguous block of ``capacity`` bytes.

Best fit over free blocks; a chosen block is split and the remainder stays free; a freed block
is merged with its address-ordered free neighbours. Every size is rounded up to
:data:`~tensile_db.runtime.units.UNIT_NBYTES` (defined in the runtime layer), which is also the alignment of every offset. The allocator only does
bookkeeping — it never touches memory — so it is tested without a device, and the memory manager
uses the same class over the real arena buffer.

Statistics follow CuPy / PyTorch: current, peak and total bytes, free-block count, largest free
block. ``peak_nbytes`` is the arena's high-water mark of allocated bytes; it can never exceed
``capacity_nbytes``.
"""

from __future__ import annotations

import bisect
import itertools

from ..runtime.checks import require
from ..runtime.units import UNIT_NBYTES, round_up

__all__ = ["UNIT_NBYTES", "ArenaAllocator", "round_up"]


class ArenaAllocator:
    """Best-fit allocator over ``[0, capacity_nbytes)``.

    ``allocate`` returns an offset or ``None`` when no free block is large enough (the caller
    decides whether to evict); ``free`` takes an offset returned by ``allocate``.
    """

    def __init__(self, capacity_nbytes: int):
        self.capacity_nbytes = capacity_nbytes // UNIT_NBYTES * UNIT_NBYTES  # bytes
        self._free_by_size: list[tuple[int, int]] = []   # sorted (size, offset) of free blocks
        self._free_start: dict[int, int] = {}            # offset -> size, free blocks
        self._free_end: dict[int, int] = {}              # end offset -> start offset, free blocks
        self._used: dict[int, int] = {}                  # offset -> size, allocated blocks
        self.in_use_nbytes = 0       # bytes currently allocated
        self.peak_nbytes = 0         # high-water mark of in_use_nbytes
        self.total_nbytes = 0        # bytes ever allocated (cumulative)
        if self.capacity_nbytes:
            self._add_free(0, self.capacity_nbytes)

    # -- queries ------------------------------------------------------------------------------

    @property
    def free_nbytes(self) -> int:
        return self.capacity_nbytes - self.in_use_nbytes

    @property
    def free_blocks(self) -> int:
        return len(self._free_start)

    @property
    def largest_free_nbytes(self) -> int:
        return self._free_by_size[-1][0] if self._free_by_size else 0

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / free bytes: 0 when the free space is one block."""
        free = self.free_nbytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_nbytes / free

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes allocated now."""
        self.peak_nbytes = self.in_use_nbytes

    def blocks(self) -> list[tuple[int, int]]:
        """Allocated blocks as sorted ``(offset, size)`` pairs."""
        return sorted(self._used.items())

    # -- allocate / free ----------------------------------------------------------------------

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new block of ``round_up(nbytes)`` bytes, or None if none fits."""
        size = round_up(nbytes)
        i = bisect.bisect_left(self._free_by_size, (size, -1))
        if i == len(self._free_by_size):
            return None
        block_size, offset = self._free_by_size[i]
        self._remove_free(offset, block_size)
        if block_size > size:
            self._add_free(offset + size, block_size - size)
        self._used[offset] = size
        self.in_use_nbytes += size
        self.total_nbytes += size
        self.peak_nbytes = max(self.peak_nbytes, self.in_use_nbytes)
        assert self.in_use_nbytes <= self.capacity_nbytes
        return offset

    def free(self, offset: int) -> None:
        """Return the block at ``offset``; merge it with free neighbours."""
        size = self._used.pop(offset)
        self.in_use_nbytes -= size
        assert self.in_use_nbytes >= 0
        end = offset + size
        if end in self._free_start:                      # merge with the block after
            after = self._free_start[end]
            self._remove_free(end, after)
            size += after
        if offset in self._free_end:                     # merge with the block before
            before_start = self._free_end[offset]
            before = self._free_start[before_start]
            self._remove_free(before_start, before)
            offset, size = before_start, size + before
        self._add_free(offset, size)

    def compact(self, movable, need_nbytes: int | None = None) -> list[tuple[int, int, int]]:
        """Slide the allocated blocks whose offsets are in ``movable`` toward offset 0, in address
        order, past no immovable block; returns the moves as ``(old, new, size)`` in the order they
        must be copied (each moves down, so copying in this order never overwrites bytes still to
        be copied from). Free blocks are rebuilt; sizes and statistics are unchanged.

        With ``need_nbytes``, only the run of consecutive movable blocks whose sliding opens one
        free block of at least that many bytes at the least bytes moved (:meth:`_cheapest_run`)
        slides, down to the end of the block below it; nothing moves if no run does."""
        window = None
        if need_nbytes is not None:
            window = self._cheapest_run(movable, need_nbytes)
            if window is None:
                return []
        moves = []
        layout = {}
        cursor = 0
        for offset, size in sorted(self._used.items()):
            if offset in movable and (window is None or window[0] <= offset <= window[1]):
                if cursor != offset:
                    moves.append((offset, cursor, size))
                layout[cursor] = size
                cursor += size
            else:
                layout[offset] = size
                cursor = offset + size
        if moves:
            self.relayout(layout)
        return moves

    def _cheapest_run(self, movable, need_nbytes: int) -> tuple[int, int] | None:
        """(first, last) offsets of the run of consecutive movable blocks that, slid down together,
        leave a free block of at least ``need_nbytes`` above them at the least bytes moved. Blocks
        ``lo`` to ``hi - 1`` slid down free the gaps below, between and above them; within each
        maximal run of movable blocks, the least ``hi`` that frees enough never decreases as
        ``lo`` grows (two pointers over prefix sums). None if no run frees enough."""
        blocks = sorted(self._used.items())
        ends = [0] + [o + size for o, size in blocks]
        gaps = [o - ends[k] for k, (o, _) in enumerate(blocks)] + [self.capacity_nbytes - ends[-1]]
        gap_sum = list(itertools.accumulate(gaps, initial=0))           # gap_sum[k]: gaps before k
        size_sum = list(itertools.accumulate((size for _, size in blocks), initial=0))
        best, best_cost = None, None
        i = 0
        while i < len(blocks):
            if blocks[i][0] not in movable:
                i += 1
                continue
            end = i
            while end < len(blocks) and blocks[end][0] in movable:
                end += 1                                               # the run is blocks[i:end]
            hi = i + 1
            for lo in range(i, end):
                hi = max(hi, lo + 1)
                while hi <= end and gap_sum[hi + 1] - gap_sum[lo] < need_nbytes:
                    hi += 1
                if hi > end:
                    break
                cost = size_sum[hi] - size_sum[lo]
                if best_cost is None or cost < best_cost:
                    best, best_cost = (blocks[lo][0], blocks[hi - 1][0]), cost
            i = end
        return best

    def relayout(self, used: dict[int, int]) -> None:
        """Replace the allocated blocks by ``used`` (offset -> size, bytes; sizes whole units,
        disjoint, inside the arena) and rebuild the free blocks around them. Bytes in use become
        their sum; the peak and total statistics carry on. The caller moves the bytes."""
        self._used = dict(used)
        self._free_by_size, self._free_start, self._free_end = [], {}, {}
        end = 0
        for offset, size in sorted(self._used.items()):
            assert offset >= end and size % UNIT_NBYTES == 0, f"block [{offset}, {offset + size}) overlaps"
            if offset > end:
                self._add_free(end, offset - end)
            end = offset + size
        assert end <= self.capacity_nbytes, f"block ending at {end} outside the arena"
        if end < self.capacity_nbytes:
            self._add_free(end, self.capacity_nbytes - end)
        self.in_use_nbytes = sum(self._used.values())
        self.peak_nbytes = max(self.peak_nbytes, self.in_use_nbytes)

    def size_of(self, offset: int) -> int:
        """Size in bytes of the allocated block at ``offset``."""
        return self._used[offset]

    def check_blocks(self, blocks, region: tuple[int, int]) -> None:
        """Raise AssertionError unless ``blocks`` (``(offset, bytes, planned, name)``, sorted by
        offset) share no byte and lie inside the arena, a planned one inside ``region`` (start,
        end) and any other one this allocator's block of its size, and the bytes in use are the
        blocks' (the region counting whole)."""
        end = 0
        for offset, size, planned, name in blocks:
            require(offset >= end, f"{name} at {offset:,} overlaps the block below")
            require(offset + size <= self.capacity_nbytes, f"{name} ends outside the arena")
            if planned:
                require(region[0] <= offset and offset + size <= region[1], f"{name} outside the region")
            else:
                require(self._used.get(offset) == size, f"{name} is not the allocator's block")
            end = offset + size
        general = sum(size for _, size, planned, _ in blocks if not planned)
        require(self.in_use_nbytes == general + region[1] - region[0],
                f"{self.in_use_nbytes:,} bytes in use, but the blocks hold {general:,} and the planned region "
                f"{region[1] - region[0]:,}")

    # -- free-list maintenance ----------------------------------------------------------------

    def _add_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_by_size, (size, offset))
        self._free_start[offset] = size
        self._free_end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free_by_size, (size, offset))
        del self._free_by_size[i]
        del self._free_start[offset]
        del self._free_end[offset + size]
