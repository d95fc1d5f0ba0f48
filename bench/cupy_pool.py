"""The pool a CuPy user gets, simulated: CuPy's default ``cupy.cuda.MemoryPool``, replayed over
the planned pool's allocation traces so the benchmark can compare the two without a GPU.

It follows ``SingleDeviceMemoryPool`` in ``cupy/cuda/memory.pyx`` of cupy/cupy at commit
005d7598ad307a8fe42a46acf3c65436ef1195c2 (the copy read does not name its version; it has the
per-thread default stream's arenas and ``malloc_async``, so CuPy 9 or later). The policy:

- a request is rounded up to the 512-byte unit (``_round_size``);
- free chunks sit in bins, one per rounded size (bin ``(size - 1) // 512``, ``_bin_index_from_size``),
  kept in a sorted index of bin numbers (``_Arena._index``/``_free``); an allocation takes a
  chunk from the first non-empty bin at or above its own (a binary search of the index,
  ``_get_chunk``): the smallest free chunk that fits;
- a larger chunk is split: the front serves the request, the rest goes back to its bin
  (``_Chunk.split``);
- a freed chunk merges with its next and then its previous neighbour if they are free
  (``free``, ``_Chunk.merge``). Neighbours exist only within one cudaMalloc'ed segment, so
  chunks of different segments never merge;
- with no free chunk that fits, the pool calls cudaMalloc for exactly the rounded size: a new
  segment (``_try_malloc``). Memory goes back to the device only through ``free_all_blocks``
  (segments wholly free), which the pool calls itself only when cudaMalloc fails.

Simplifications:

- the device never runs out, so ``free_all_blocks`` (and the ``gc.collect()`` retry) never runs
  and ``total_bytes()`` never falls: the bytes held at the end are the high-water mark (no
  ``set_limit``, no memory hooks either);
- one stream, so one arena (CuPy keeps one per stream);
- a bin holds chunks of one size (sizes are whole units), among which CuPy pops an arbitrary
  one from a Python ``set``; here the lowest address (segment, offset) is taken, so the replay
  is deterministic;
- bins are dropped from the index as soon as they empty (CuPy flags them and compacts the
  index later; the search finds the same bin);
- 0-byte requests, served outside the pool by CuPy, are refused;
- the order of the allocations made at one event is not in the trace: largest first, as in the
  general pool's replay, stands in for the program's own order.

:func:`replay_cupy_pool` serves a trace as :func:`~tensile_db.memory.lifetimes.replay_general_pool`
does (per event: allocations largest first, then frees), over several iterations of the
periodic trace, since a training run repeats it and CuPy's pool carries its fragments from one
iteration into the next (on the benchmark's single-job traces the bytes held grow, when they do,
in the second iteration and no later).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tensile_db.memory.lifetimes import Allocation

#: CuPy's rounding unit and cudaMalloc's alignment, bytes (``ALLOCATION_UNIT_SIZE``); CuPy's own
#: constant, equal to the arena unit of :mod:`tensile_db.runtime.units` but not tied to it
UNIT_NBYTES = 512
#: iterations of the trace :func:`replay_cupy_pool` serves by default
ITERATIONS = 4


def round_size(nbytes: int) -> int:
    """``nbytes`` rounded up to whole units, bytes (``_round_size``)."""
    return -(-nbytes // UNIT_NBYTES) * UNIT_NBYTES


def bin_of(nbytes: int) -> int:
    """The bin of a chunk of ``nbytes`` (> 0) bytes (``_bin_index_from_size``)."""
    return (nbytes - 1) // UNIT_NBYTES


@dataclass(eq=False)
class Chunk:
    """A piece of one cudaMalloc'ed segment; ``prev``/``next`` are its address-ordered
    neighbours in that segment (None at its ends)."""

    segment: int                     # which cudaMalloc, counted from 0
    offset: int                      # bytes from the segment's start
    nbytes: int
    prev: Chunk | None = None
    next: Chunk | None = None

    @property
    def address(self) -> tuple[int, int]:
        return self.segment, self.offset


class CupyPool:
    """A simulated ``SingleDeviceMemoryPool`` on one stream of a device that never runs out.
    Its counters (bytes) match CuPy's ``used_bytes()``, ``free_bytes()``, ``total_bytes()``."""

    def __init__(self) -> None:
        self._index: list[int] = []                 # sorted bins that hold a free chunk
        self._free: dict[int, set[Chunk]] = {}      # bin -> its free chunks
        self._in_use: set[Chunk] = set()
        self._segments: list[Chunk] = []            # the chunk at offset 0 of each segment
        self.total_bytes = 0                        # cudaMalloc'ed, never returned
        self.used_bytes = 0                         # handed out and not freed
        self.n_mallocs = 0                          # cudaMalloc calls

    @property
    def free_bytes(self) -> int:
        return sum(c.nbytes for chunks in self._free.values() for c in chunks)

    def malloc(self, nbytes: int) -> Chunk:
        """A chunk of ``nbytes`` rounded up to the unit: the smallest free chunk that fits, split,
        else a new segment. Raises ValueError for ``nbytes`` <= 0."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes from the pool; requests must be > 0")
        size = round_size(nbytes)
        chunk = self._take(size) or self._cuda_malloc(size)
        self._in_use.add(chunk)
        self.used_bytes += size
        return chunk

    def free(self, chunk: Chunk) -> None:
        """Return ``chunk`` to the pool, merged with its free neighbours. Raises ValueError for
        a chunk not in use."""
        if chunk not in self._in_use:
            raise ValueError(f"chunk at {chunk.address} is not in use")
        self._in_use.remove(chunk)
        self.used_bytes -= chunk.nbytes
        if chunk.next is not None and self._remove(chunk.next):
            self._merge(chunk, chunk.next)
        if chunk.prev is not None and self._remove(chunk.prev):
            chunk = self._merge(chunk.prev, chunk)
        self._add(chunk)

    def check(self) -> None:
        """Raise AssertionError if a segment's chunks do not tile it, two free chunks are
        neighbours, a chunk is both free and in use, or a counter disagrees with the chunks."""
        free = {c for chunks in self._free.values() for c in chunks}
        assert not free & self._in_use, "a chunk is both free and in use"
        assert self._index == sorted(self._free) and all(self._free.values()), "index and bins disagree"
        assert all(bin_of(c.nbytes) == b for b, chunks in self._free.items() for c in chunks), "chunk in a wrong bin"
        seen = 0
        for head in self._segments:
            end, c = 0, head
            while c is not None:
                assert c.offset == end and c.segment == head.segment, f"gap or overlap at {c.address}"
                assert c in free or c in self._in_use, f"chunk at {c.address} is neither free nor in use"
                assert not (c in free and c.next in free), f"free neighbours at {c.address} not merged"
                end, c, seen = end + c.nbytes, c.next, seen + 1
        assert seen == len(free) + len(self._in_use), "a chunk lies in no segment"
        assert self.used_bytes == sum(c.nbytes for c in self._in_use)
        assert self.total_bytes == self.used_bytes + self.free_bytes

    def _cuda_malloc(self, size: int) -> Chunk:
        chunk = Chunk(len(self._segments), 0, size)
        self._segments.append(chunk)
        self.total_bytes += size
        self.n_mallocs += 1
        return chunk

    def _take(self, size: int) -> Chunk | None:
        """The lowest-addressed chunk of the first non-empty bin at or above ``size``'s, split to
        ``size``; None if no free chunk fits."""
        i = bisect.bisect_left(self._index, bin_of(size))
        if i == len(self._index):
            return None
        chunk = min(self._free[self._index[i]], key=lambda c: c.address)
        self._remove(chunk)
        if chunk.nbytes > size:
            rest = Chunk(chunk.segment, chunk.offset + size, chunk.nbytes - size, chunk, chunk.next)
            if chunk.next is not None:
                chunk.next.prev = rest
            chunk.next, chunk.nbytes = rest, size
            self._add(rest)
        return chunk

    @staticmethod
    def _merge(chunk: Chunk, following: Chunk) -> Chunk:
        """``chunk`` grown over ``following``, its next neighbour."""
        chunk.nbytes += following.nbytes
        chunk.next = following.next
        if chunk.next is not None:
            chunk.next.prev = chunk
        return chunk

    def _add(self, chunk: Chunk) -> None:
        b = bin_of(chunk.nbytes)
        if b not in self._free:
            bisect.insort(self._index, b)
            self._free[b] = set()
        self._free[b].add(chunk)

    def _remove(self, chunk: Chunk) -> bool:
        """Take ``chunk`` out of its bin; False if it is not free."""
        b = bin_of(chunk.nbytes)
        if chunk not in self._free.get(b, ()):
            return False
        self._free[b].remove(chunk)
        if not self._free[b]:
            del self._free[b]
            self._index.remove(b)
        return True


def replay_cupy_pool(allocs: list[Allocation], iterations: int = ITERATIONS) -> int:
    """Serve ``iterations`` repetitions of the periodic trace ``allocs`` (events 0 to its last)
    from a fresh :class:`CupyPool` and return the bytes it holds from the device at its peak
    (``total_bytes()``'s high-water mark). Per event, the segments starting there are allocated,
    largest first, then those ending there are freed. A segment that ends at the trace's last
    event and one of the same allocation that starts at event 0 are one block living across the
    iteration boundary: it is not freed and allocated again there."""
    if not allocs:
        return 0
    n = max(e for a in allocs for _, e in a.segments) + 1     # events per iteration
    blocks = []                                               # (first, last, nbytes), unrolled events
    for a in allocs:
        run = None
        for k in range(iterations):
            for s, e in sorted(a.segments):
                s, e = k * n + s, k * n + e
                if run is not None and s == run[1] + 1 and s % n == 0:
                    run = (run[0], e)
                else:
                    if run is not None:
                        blocks.append((*run, a.nbytes))
                    run = (s, e)
        blocks.append((*run, a.nbytes))
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i, (s, e, _) in enumerate(blocks):
        starts.setdefault(s, []).append(i)
        ends.setdefault(e, []).append(i)
    pool, live = CupyPool(), {}
    for t in range(iterations * n):
        for i in sorted(starts.get(t, ()), key=lambda i: -blocks[i][2]):
            live[i] = pool.malloc(blocks[i][2])
        for i in ends.get(t, ()):
            pool.free(live.pop(i))
    return pool.total_bytes
