"""The simulated CuPy default pool of the pool benchmark (``bench/cupy_pool.py``).

Checked on hand-made sequences (a freed chunk reused for a request of its size or smaller, the
smallest fitting chunk taken, splitting and merging neighbours, chunks of different segments
never merged), on random sequences (the pool's invariants after every call), and on traces
(never below max live, a trace computed by hand, a block across the iteration boundary).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from cupy_pool import CupyPool, bin_of, replay_cupy_pool, round_size  # noqa: E402
from tensile_db.memory.lifetimes import Allocation, max_live_nbytes, replay_general_pool  # noqa: E402

U = 512


def alloc(key, units, *segments):
    return Allocation(key, units * U, tuple(segments))


def test_sizes_round_up_to_the_unit_and_each_size_has_its_bin():
    assert [round_size(n) for n in (1, 511, 512, 513, 1024)] == [U, U, U, 2 * U, 2 * U]
    assert [bin_of(n) for n in (U, 2 * U, 3 * U)] == [0, 1, 2]
    pool = CupyPool()
    assert pool.malloc(1).nbytes == U and pool.total_bytes == U
    with pytest.raises(ValueError, match="must be > 0"):
        pool.malloc(0)


def test_a_freed_chunk_serves_a_request_of_its_size_or_smaller():
    pool = CupyPool()
    a = pool.malloc(2 * U)
    pool.free(a)
    b = pool.malloc(2 * U - 100)                        # same rounded size: the same chunk
    assert b.address == a.address and pool.n_mallocs == 1
    pool.free(b)
    c = pool.malloc(U)                                  # smaller: the front of it, the rest free
    assert c.address == (0, 0) and c.nbytes == U
    assert pool.free_bytes == U and pool.total_bytes == 2 * U and pool.n_mallocs == 1
    pool.check()


def test_a_larger_request_than_any_free_chunk_calls_cuda_malloc_for_its_size():
    pool = CupyPool()
    pool.free(pool.malloc(2 * U))
    big = pool.malloc(3 * U)
    assert big.address == (1, 0) and pool.n_mallocs == 2 and pool.total_bytes == 5 * U
    pool.check()


def test_the_smallest_free_chunk_that_fits_is_taken():
    pool = CupyPool()
    large, small = pool.malloc(8 * U), pool.malloc(2 * U)
    pool.free(large)
    pool.free(small)
    assert pool.malloc(U + 1).address == small.address  # not the front of the lower, larger chunk
    pool.check()


def test_among_free_chunks_of_one_size_the_lowest_address_is_taken():
    pool = CupyPool()                                   # CuPy pops any; the simulation is deterministic
    first, second = pool.malloc(U), pool.malloc(U)
    pool.free(second)
    pool.free(first)
    assert pool.malloc(U).address == first.address == (0, 0)


def test_split_chunks_merge_with_free_neighbours_back_into_the_segment():
    pool = CupyPool()
    pool.free(pool.malloc(4 * U))
    a, b, c = pool.malloc(U), pool.malloc(U), pool.malloc(U)
    assert [x.address for x in (a, b, c)] == [(0, 0), (0, U), (0, 2 * U)] and pool.n_mallocs == 1
    pool.free(b)                                        # both neighbours in use: no merge
    assert pool.free_bytes == 2 * U and pool.malloc(2 * U).address == (1, 0)
    pool.check()
    pool.free(a)                                        # merges with b after it
    assert pool.malloc(2 * U).address == (0, 0)
    pool.check()


def test_a_freed_chunk_merges_with_both_neighbours():
    pool = CupyPool()
    pool.free(pool.malloc(3 * U))
    a, b, c = pool.malloc(U), pool.malloc(U), pool.malloc(U)
    pool.free(a)
    pool.free(c)
    pool.free(b)                                        # a, b, c are one free chunk again
    pool.check()
    whole = pool.malloc(3 * U)
    assert whole.address == (0, 0) and pool.n_mallocs == 1


def test_chunks_of_different_segments_never_merge():
    pool = CupyPool()
    a, b = pool.malloc(U), pool.malloc(U)               # two segments, next to each other in order
    pool.free(a)
    pool.free(b)
    assert pool.free_bytes == 2 * U
    pool.malloc(2 * U)                                  # no free chunk of 2 units: a third segment
    assert pool.n_mallocs == 3 and pool.total_bytes == 4 * U
    pool.check()
    trace = [alloc("a", 1, (0, 1)), alloc("b", 1, (0, 1)), alloc("c", 2, (2, 3))]
    assert replay_cupy_pool(trace) == 4 * U > max_live_nbytes(trace) == replay_general_pool(trace)[1]


def test_freeing_a_chunk_not_in_use_is_refused():
    pool = CupyPool()
    a = pool.malloc(U)
    pool.free(a)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(a)


def test_random_sequences_keep_the_pools_invariants():
    rng = random.Random(0)
    pool, live = CupyPool(), []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.malloc(rng.choice((1, 2, 3, 5, 8, 16)) * U - rng.randrange(U)))
        pool.check()
    assert pool.used_bytes == sum(c.nbytes for c in live) <= pool.total_bytes


def random_trace(rng: random.Random) -> list[Allocation]:
    n = rng.randint(3, 30)
    trace = []
    for i in range(rng.randint(1, 25)):
        s = rng.randrange(n)
        e = rng.randrange(s, n)
        segments = ((0, s), (e, n - 1)) if s < e - 1 and rng.random() < 0.2 else ((s, e),)
        trace.append(alloc(i, rng.choice((1, 2, 3, 4, 7, 16)), *segments))
    return trace


@pytest.mark.parametrize("seed", range(200))
def test_never_below_max_live_and_never_falling_with_more_iterations(seed):
    trace = random_trace(random.Random(seed))
    held = [replay_cupy_pool(trace, k) for k in (1, 2, 4)]
    assert max_live_nbytes(trace) <= held[0] <= held[1] <= held[2]


def test_a_trace_computed_by_hand():
    # t0: a (4 units) gets segment 0.  t1: a freed.
    # t2: c (3) takes segment 0's front, 1 unit left free; b (2) fits nowhere: segment 1.
    # t3: b freed.  t4: d (2) takes segment 1; c freed and merged: segment 0 free, 4 units.
    # t5: e (5) fits nowhere: segment 2.  Held 4 + 2 + 5 = 11 units; max live is d + e = 7.
    trace = [alloc("a", 4, (0, 1)), alloc("b", 2, (2, 3)), alloc("c", 3, (2, 4)),
             alloc("d", 2, (4, 5)), alloc("e", 5, (5, 5))]
    assert max_live_nbytes(trace) == 7 * U
    assert replay_cupy_pool(trace, 1) == 11 * U
    assert replay_cupy_pool(trace, 3) == 11 * U          # the next iterations reuse the three segments


def test_a_block_across_the_iteration_boundary_fragments_the_next_iteration():
    # c lives from t2 across the boundary to t0 of the next iteration (one block, not freed and
    # allocated again). Iteration 1: b (4) and c (1) get segments 0 and 1; at t2 a takes c's old
    # segment 1 and c splits segment 0. Iteration 2: b finds only 1 + 3 free units: segment 2.
    trace = [alloc("a", 1, (2, 2)), alloc("b", 4, (0, 1)), alloc("c", 1, (0, 0), (2, 2))]
    assert max_live_nbytes(trace) == 5 * U
    assert replay_cupy_pool(trace, 1) == 5 * U
    assert replay_cupy_pool(trace, 2) == replay_cupy_pool(trace, 5) == 9 * U
