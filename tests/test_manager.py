"""The memory manager on the CPU device: residency, exact swapping, the eviction rule, the budget.

Sizes are counted in arena units (``U`` bytes) so that budgets are small and every eviction is
forced on purpose. Values are compared bit for bit (through ``uint32`` views), including NaN,
infinities, signed zeros and subnormals, because a swap must be an exact copy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensile_db.errors import DeviceOutOfMemory
from tensile_db.memory.arena import UNIT_NBYTES as U
from tensile_db.memory.manager import MemoryManager, Residency
from tensile_db.memory.tiers import HostTier
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.program import Kind, Slot

F32_PER_UNIT = U // 4
ACT = Kind.ACTIVATION


def make(budget_units: int, next_use=None, jobs=(1,)) -> MemoryManager:
    mm = MemoryManager(CpuDevice(), budget_units * U, next_use)
    for j in jobs:
        mm.register_job(j)
    return mm


def pattern(n: int, seed: int) -> np.ndarray:
    """``n`` float32 values: random normals plus NaN, +-inf, -0.0 and a subnormal."""
    a = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], dtype=np.float32)
    a[: min(n, len(special))] = special[: min(n, len(special))]
    return a


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def new(mm: MemoryManager, job: int, slot: str, units: int = 1, fill: np.ndarray | None = None):
    """Allocate one float32 tensor of ``units`` arena units, optionally write ``fill``, release it."""
    (t,) = mm.acquire(job, [], [Slot(slot, ACT, (units * F32_PER_UNIT,), "float32")])
    if fill is not None:
        mm.array(t)[...] = fill
    mm.unpin([t])
    return t


# --- basics --------------------------------------------------------------------------------------


def test_acquire_array_release_free():
    mm = make(8)
    (t,) = mm.acquire(1, [], [Slot("h", ACT, (3, 5), "float32")])
    assert t.residency is Residency.DEVICE and t.pins == 1
    assert t.job_id == 1 and t.slot == "h" and t.kind is ACT
    arr = mm.array(t)
    assert arr.shape == (3, 5) and arr.dtype == np.float32
    arr[...] = np.arange(15, dtype=np.float32).reshape(3, 5)
    mm.unpin([t])
    assert t.pins == 0
    assert np.array_equal(mm.to_host(t), np.arange(15, dtype=np.float32).reshape(3, 5))
    assert t.nbytes == 60 and t.arena_nbytes == U
    assert mm.in_use_nbytes == U and mm.jobs[1].device_nbytes == U
    mm.free(t)
    assert t.residency is Residency.FREED
    assert mm.in_use_nbytes == 0 and mm.jobs[1].device_nbytes == 0
    with pytest.raises(AssertionError):
        mm.unpin([t])                                  # no longer pinned


def test_a_block_taken_again_is_seen_in_the_new_tensors_shape_and_dtype():
    """Views of the arena are kept for reuse by offset, shape and dtype: a tensor that takes
    the block of a freed one of another shape or dtype sees its own, over the same bytes."""
    mm = make(4)
    (a,) = mm.acquire(1, [], [Slot("a", ACT, (4, 2), "float32")])
    mm.array(a)[...] = np.arange(8, dtype=np.float32).reshape(4, 2)
    offset, view = a.offset, mm.array(a)
    assert mm.array(a) is view
    mm.unpin([a])
    mm.free(a)
    (b,) = mm.acquire(1, [], [Slot("b", ACT, (8,), "int32")])
    assert b.offset == offset
    assert mm.array(b).shape == (8,) and mm.array(b).dtype == np.int32
    assert np.array_equal(mm.array(b), np.arange(8, dtype=np.float32).view(np.int32))
    mm.unpin([b])
    mm.close()


def test_to_host_is_a_copy():
    mm = make(4)
    t = new(mm, 1, "a", fill=pattern(F32_PER_UNIT, 0))
    host = mm.to_host(t)
    host[...] = 0
    assert same_bits(mm.to_host(t), pattern(F32_PER_UNIT, 0))


def test_budget_rounded_down_to_unit():
    mm = MemoryManager(CpuDevice(), 5 * U + 100)
    assert mm.budget_nbytes == 5 * U
    assert mm.buffer.nbytes == 5 * U


# --- swapping ------------------------------------------------------------------------------------


def test_values_survive_swap_out_and_in_exactly():
    mm = make(4)
    values = {s: pattern(2 * F32_PER_UNIT, seed) for seed, s in enumerate("abc")}
    ts = {s: new(mm, 1, s, 2, values[s]) for s in "ab"}
    ts["c"] = new(mm, 1, "c", 2, values["c"])            # arena holds two: one was swapped out
    out = [t for t in ts.values() if t.residency is Residency.HOST]
    assert len(out) == 1 and out[0].slot in "ab"
    for s, t in ts.items():                              # readable wherever it lives
        assert same_bits(mm.to_host(t), values[s])
    for s, t in ts.items():                              # swap each one in and read the arena
        mm.acquire(1, [t], [])
        assert t.residency is Residency.DEVICE
        assert same_bits(np.array(mm.array(t)), values[s])
        mm.unpin([t])
    assert mm.jobs[1].swap_outs >= 2 and mm.jobs[1].swap_ins >= 1
    assert mm.peak_nbytes <= mm.budget_nbytes


def test_victim_is_farthest_next_use():
    distance = {"a": 5, "b": 50, "c": 1, "d": 20, "e": 0, "f": 0}
    mm = make(4, next_use=lambda t: distance[t.slot])
    ts = {s: new(mm, 1, s) for s in "abcd"}
    new(mm, 1, "e")
    assert ts["b"].residency is Residency.HOST
    assert all(ts[s].residency is Residency.DEVICE for s in "acd")
    new(mm, 1, "f")
    assert ts["d"].residency is Residency.HOST
    assert all(ts[s].residency is Residency.DEVICE for s in "ac")
    assert mm.jobs[1].swap_outs == 2


def test_victim_tie_broken_by_size_and_evicts_until_fit():
    mm = make(6)                                         # default next_use: inf for every tensor
    small = new(mm, 1, "small", 1)
    big = new(mm, 1, "big", 2)
    other = new(mm, 1, "other", 3)
    new(mm, 1, "x", 2)                                   # the largest unpinned goes first
    assert other.residency is Residency.HOST
    assert small.residency is Residency.DEVICE and big.residency is Residency.DEVICE
    new(mm, 1, "y", 6)                                   # needs the whole arena: evicts the rest
    assert small.residency is big.residency is Residency.HOST
    assert mm.in_use_nbytes == 6 * U


def test_pinned_tensors_are_never_evicted():
    mm = make(4, next_use=lambda t: math.inf if t.slot == "pinned" else 1.0)
    value = pattern(2 * F32_PER_UNIT, 3)
    (p,) = mm.acquire(1, [], [Slot("pinned", ACT, (2 * F32_PER_UNIT,), "float32")])
    mm.array(p)[...] = value
    for i in range(6):                                   # churn the other half of the arena
        new(mm, 1, f"t{i}", 1)
        assert p.residency is Residency.DEVICE
    with pytest.raises(DeviceOutOfMemory):               # fits the budget, not beside the pin
        mm.acquire(1, [], [Slot("big", ACT, (3 * F32_PER_UNIT,), "float32")])
    assert p.residency is Residency.DEVICE and p.pins == 1
    assert same_bits(np.array(mm.array(p)), value)
    mm.unpin([p])
    new(mm, 1, "big2", 3)                                # unpinned, it can now be evicted
    assert p.residency is Residency.HOST
    assert same_bits(mm.to_host(p), value)


def test_out_of_memory_message_and_attributes():
    budget = 2000 * U                                    # 1,024,000 bytes
    mm = make(2000)
    existing = new(mm, 1, "w", 1000)
    with pytest.raises(DeviceOutOfMemory) as info:
        mm.acquire(1, [existing], [Slot("h", ACT, (1001 * F32_PER_UNIT,), "float32")], what="op dense0")
    err = info.value
    assert err.requested_nbytes == 2001 * U and err.budget_nbytes == budget
    msg = str(err)
    assert "1,024,512" in msg and "1,024,000" in msg and "op dense0" in msg
    assert existing.pins == 0 and existing.residency is Residency.DEVICE   # nothing changed
    with pytest.raises(DeviceOutOfMemory, match="1,024,512"):
        mm.acquire(1, [], [Slot("h", ACT, (2001 * F32_PER_UNIT,), "float32")])


def test_fragmentation_fallback_packs_the_working_set():
    mm = make(4)
    va, vc = pattern(F32_PER_UNIT, 10), pattern(F32_PER_UNIT, 11)
    a, b, c, d = mm.acquire(1, [], [Slot(s, ACT, (F32_PER_UNIT,), "float32") for s in "abcd"])
    mm.array(a)[...] = va
    mm.array(c)[...] = vc
    mm.unpin([a, b, c, d])
    assert [t.offset for t in (a, b, c, d)] == [0, U, 2 * U, 3 * U]
    # a and c pinned at units 0 and 2: evicting b and d frees 2 units, but not contiguous
    (n,) = mm.acquire(1, [a, c], [Slot("n", ACT, (2 * F32_PER_UNIT,), "float32")])
    assert all(t.residency is Residency.DEVICE and t.pins == 1 for t in (a, c, n))
    assert b.residency is Residency.HOST and d.residency is Residency.HOST
    spans = sorted((t.offset, t.offset + t.arena_nbytes) for t in (a, c, n))
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))   # no overlap
    assert spans[-1][1] <= mm.budget_nbytes
    assert same_bits(np.array(mm.array(a)), va) and same_bits(np.array(mm.array(c)), vc)
    assert mm.peak_nbytes <= mm.budget_nbytes
    mm.unpin([a, c, n])


def test_working_set_that_cannot_be_packed_raises():
    mm = make(4)
    (p,) = mm.acquire(1, [], [Slot("p", ACT, (F32_PER_UNIT,), "float32")])  # stays pinned
    q = new(mm, 1, "q", 3)
    with pytest.raises(DeviceOutOfMemory) as info:       # within budget, but p is in the way
        mm.acquire(1, [], [Slot("n", ACT, (4 * F32_PER_UNIT,), "float32")])
    assert info.value.requested_nbytes == 4 * U
    assert p.residency is Residency.DEVICE and p.pins == 1
    assert q.residency is Residency.HOST                 # evicted while trying
    assert mm.peak_nbytes <= mm.budget_nbytes


# --- counters ------------------------------------------------------------------------------------


def test_per_job_counters_and_release_job():
    mm = make(4, jobs=(1, 2))
    n = 100                                              # 400 bytes: one unit in the arena
    (t1,) = mm.acquire(1, [], [Slot("a", ACT, (n,), "float32")])
    mm.array(t1)[...] = pattern(n, 5)
    mm.unpin([t1])
    assert mm.jobs[1].device_nbytes == U and mm.jobs[1].peak_nbytes == U
    new(mm, 2, "b", 4)                                   # job 2 needs the whole arena
    j1 = mm.jobs[1]
    assert t1.residency is Residency.HOST
    assert (j1.swap_outs, j1.swapped_out_nbytes, j1.host_nbytes, j1.device_nbytes) == (1, 400, 400, 0)
    assert mm.jobs[2].device_nbytes == 4 * U and mm.jobs[2].swap_outs == 0
    mm.acquire(1, [t1], [])                              # swap back in: evicts job 2's tensor
    mm.unpin([t1])
    assert (j1.swap_ins, j1.swapped_in_nbytes, j1.host_nbytes, j1.device_nbytes) == (1, 400, 0, U)
    assert mm.jobs[2].swap_outs == 1 and mm.jobs[2].host_nbytes == 4 * U
    assert same_bits(mm.to_host(t1), pattern(n, 5))
    snap = mm.snapshot()
    assert snap["host_nbytes"] == 4 * U and snap["in_use_nbytes"] == U
    assert set(snap["jobs"]) == {1, 2}

    counters = mm.release_job(1)
    assert counters is j1 and 1 not in mm.jobs
    assert counters.device_nbytes == 0 and counters.host_nbytes == 0
    assert counters.swapped_out_nbytes == 400 and counters.swap_ins == 1   # cumulative kept
    assert t1.residency is Residency.FREED
    assert mm.in_use_nbytes == 0
    mm.check()
    c2 = mm.release_job(2)
    assert c2.host_nbytes == 0 and c2.device_nbytes == 0 and c2.peak_nbytes == 4 * U
    assert mm.snapshot()["host_nbytes"] == 0 and mm.allocator.free_blocks == 1


def test_adopt_counts_swap_in_only_after_a_real_swap_out():
    mm = make(2)
    value = pattern(2 * F32_PER_UNIT, 9)
    w = mm.adopt(1, "W0", Kind.WEIGHT, value.copy())
    j = mm.jobs[1]
    assert w.residency is Residency.HOST
    assert (j.host_nbytes, j.device_nbytes) == (2 * U, 0)
    mm.acquire(1, [w], [])                               # first load: not a swap-in
    mm.unpin([w])
    assert w.residency is Residency.DEVICE
    assert (j.swap_ins, j.swapped_in_nbytes, j.swap_outs, j.host_nbytes) == (0, 0, 0, 0)
    assert same_bits(np.array(mm.array(w)), value)
    new(mm, 1, "h", 2)                                   # evicts the weight
    assert w.residency is Residency.HOST and j.swap_outs == 1
    mm.acquire(1, [w], [])                               # now it is a swap-in
    mm.unpin([w])
    assert (j.swap_ins, j.swapped_in_nbytes) == (1, 2 * U)
    assert same_bits(mm.to_host(w), value)


# --- randomized ----------------------------------------------------------------------------------


def test_randomized_values_and_budget():
    """Random ops of two jobs under a small budget: every tensor keeps its values wherever it
    lives, pinned tensors are resident during their op, and the counters add up."""
    rng = np.random.default_rng(99)
    budget_units = 12
    mm = make(budget_units, next_use=lambda t: (t.id * 7919) % 13, jobs=(1, 2))
    shadow: dict[int, tuple] = {}                        # id -> (tensor, expected values)
    for step in range(400):
        job = int(rng.integers(1, 3))
        mine = [t for t, _ in shadow.values() if t.job_id == job]
        reads = list(rng.choice(len(mine), size=min(len(mine), int(rng.integers(0, 4))), replace=False))
        reads = [mine[i] for i in reads]
        sizes = [int(rng.integers(1, 4 * F32_PER_UNIT)) for _ in range(int(rng.integers(0, 3)))]
        need = sum(t.arena_nbytes for t in reads) + sum(-(-4 * s // U) * U for s in sizes)
        if need > mm.budget_nbytes:
            with pytest.raises(DeviceOutOfMemory):
                mm.acquire(job, reads, [Slot(f"s{step}_{i}", ACT, (s,), "float32") for i, s in enumerate(sizes)])
            continue
        created = mm.acquire(job, reads, [Slot(f"s{step}_{i}", ACT, (s,), "float32") for i, s in enumerate(sizes)])
        for t in reads + created:
            assert t.residency is Residency.DEVICE and t.pins == 1
        for t in reads:                                  # read, check, modify in place
            assert same_bits(np.array(mm.array(t)), shadow[t.id][1])
            mm.array(t)[...] += 1
            shadow[t.id] = (t, np.array(mm.array(t)))
        for t in created:
            v = rng.standard_normal(t.shape).astype(np.float32)
            mm.array(t)[...] = v
            shadow[t.id] = (t, v)
        mm.unpin(reads + created)
        if shadow and rng.random() < 0.3:                # free a random tensor
            tid = list(shadow)[int(rng.integers(len(shadow)))]
            mm.free(shadow.pop(tid)[0])

        assert mm.peak_nbytes <= mm.budget_nbytes
        resident = [t for t, _ in shadow.values() if t.residency is Residency.DEVICE]
        on_host = [t for t, _ in shadow.values() if t.residency is Residency.HOST]
        assert mm.in_use_nbytes == sum(t.arena_nbytes for t in resident)
        assert sum(j.device_nbytes for j in mm.jobs.values()) == mm.in_use_nbytes
        assert sum(j.host_nbytes for j in mm.jobs.values()) == sum(t.nbytes for t in on_host)
        mm.check()
        if step % 20 == 0:
            for t, v in shadow.values():
                assert same_bits(mm.to_host(t), v)
    assert sum(j.swap_outs for j in mm.jobs.values()) > 0
    assert sum(j.swap_ins for j in mm.jobs.values()) > 0
    mm.release_job(1)
    mm.release_job(2)
    assert mm.in_use_nbytes == 0 and mm.allocator.free_blocks == 1


# --- planned moves and compaction ----------------------------------------------------------------


def test_planned_swap_out_release_swap_in_are_exact_and_counted():
    mm = make(8)
    value = pattern(2 * F32_PER_UNIT, 3)
    t = new(mm, 1, "h", 2, value)
    mm.swap_out(t)
    assert t.residency is Residency.SWAPPING_OUT and mm.in_use_nbytes == 2 * U   # block kept
    mm.release(t)
    assert t.residency is Residency.HOST and mm.in_use_nbytes == 0
    assert mm.jobs[1].swap_outs == 1 and mm.jobs[1].host_nbytes == t.nbytes
    mm.swap_in(t)
    assert t.residency is Residency.SWAPPING_IN and mm.in_use_nbytes == 2 * U
    mm.acquire(1, [t], [])
    assert t.residency is Residency.DEVICE and same_bits(mm.array(t), value)
    mm.unpin([t])
    j = mm.jobs[1]
    assert (j.planned_swap_ins, j.passive_swap_ins, j.swap_ins, j.host_nbytes) == (1, 0, 1, 0)


def swap_round_trip(mm, t) -> None:
    """A planned swap-out of ``t``, its release, its swap-in and an access that lands it."""
    mm.swap_out(t)
    mm.release(t)
    mm.swap_in(t)
    mm.acquire(1, [t], [])
    mm.unpin([t])


def test_a_landed_swap_in_s_host_buffer_serves_the_next_swap_out_of_its_size():
    mm = make(8)
    a, b = pattern(2 * F32_PER_UNIT, 4), pattern(2 * F32_PER_UNIT, 5)
    ta, tb = new(mm, 1, "a", 2, a), new(mm, 1, "b", 2, b)
    swap_round_trip(mm, ta)
    tier = mm.host_tier
    assert tier.spare_nbytes == ta.nbytes                       # kept, not freed
    (spare,) = tier.spares[ta.nbytes]
    mm.swap_out(tb)
    mm.release(tb)
    assert tb.host.base is spare and tier.spare_nbytes == 0     # the next swap-out's copy
    mm.swap_in(tb)
    mm.acquire(1, [tb], [])
    assert same_bits(mm.array(tb), b) and same_bits(mm.array(ta), a)
    mm.unpin([tb])


def test_an_eviction_copies_into_a_spare_buffer_and_its_landing_gives_the_buffer_back():
    """The reactive path's evictions take their host copies from the spare buffers too (Note
    [Spare host buffers]): a landed swap-in's buffer serves the next eviction of its size, and
    that copy's own landing keeps it as a spare again."""
    mm = make(8)
    a, b = pattern(2 * F32_PER_UNIT, 4), pattern(2 * F32_PER_UNIT, 5)
    ta, tb = new(mm, 1, "a", 2, a), new(mm, 1, "b", 2, b)
    swap_round_trip(mm, ta)
    tier = mm.host_tier
    (spare,) = tier.spares[ta.nbytes]
    mm.evict(tb)
    assert tb.residency is Residency.HOST and tb.host.base is spare and tier.spare_nbytes == 0
    mm.acquire(1, [tb], [])                                     # a passive swap-in lands it
    assert same_bits(mm.array(tb), b) and same_bits(mm.array(ta), a)
    mm.unpin([tb])
    assert tier.spares[tb.nbytes] == [spare]


def test_adopted_values_are_never_taken_as_spare_buffers():
    mm = make(4)
    value = pattern(2 * F32_PER_UNIT, 9)
    given = value.copy()
    w = mm.adopt(1, "W0", Kind.WEIGHT, given)
    mm.acquire(1, [w], [])                                      # lands the caller's array
    mm.unpin([w])
    assert mm.host_tier.spare_nbytes == 0
    other = new(mm, 1, "h", 2, pattern(2 * F32_PER_UNIT, 1))
    swap_round_trip(mm, other)
    assert same_bits(given, value)


def test_spare_buffers_stay_within_the_host_budget():
    tier = HostTier(3 * U, None, None)
    buffers = [tier.host_buffer((F32_PER_UNIT,), np.float32) for _ in range(4)]
    for b in buffers[:3]:
        tier.give_back(b)
    assert tier.spare_nbytes == 3 * U                           # all within the budget
    tier.give_back(buffers[3])
    assert tier.spare_nbytes == 3 * U                           # a fourth does not fit: let go
    tier.nbytes = 2 * U                                         # swapped-out copies grow into the budget
    tier.note_peak()
    assert tier.spare_nbytes == U
    tier.give_back(np.empty(F32_PER_UNIT, np.float32))          # not a buffer the tier made
    assert tier.spare_nbytes == U


def test_access_during_a_swap_out_calls_it_off_and_a_missed_swap_in_is_passive():
    mm = make(8)
    value = pattern(F32_PER_UNIT, 4)
    t = new(mm, 1, "h", 1, value)
    mm.swap_out(t)
    mm.acquire(1, [t], [])                               # still needed: keep the device copy
    assert t.residency is Residency.DEVICE and same_bits(mm.array(t), value)
    mm.unpin([t])
    mm.swap_out(t)
    mm.release(t)
    mm.acquire(1, [t], [])                               # nobody swapped it in: a plan miss
    mm.unpin([t])
    assert same_bits(mm.array(t), value)
    assert (mm.jobs[1].planned_swap_ins, mm.jobs[1].passive_swap_ins) == (0, 1)


def test_dropped_tensor_comes_back_as_an_empty_block():
    mm = make(8)
    t = new(mm, 1, "h", 2, pattern(2 * F32_PER_UNIT, 5))
    mm.drop(t)
    assert t.residency is Residency.DROPPED and mm.in_use_nbytes == 0 and mm.jobs[1].host_nbytes == 0
    mm.acquire(1, [t], [])
    assert t.residency is Residency.DEVICE and mm.in_use_nbytes == 2 * U
    mm.unpin([t])


def test_fragmented_arena_is_compacted_instead_of_evicting():
    mm = make(8)
    values = [pattern(2 * F32_PER_UNIT, s) for s in range(4)]
    ts = [new(mm, 1, f"t{i}", 2, v) for i, v in enumerate(values)]
    mm.free(ts[0])
    mm.free(ts[2])                                       # 4 units free, in two 2-unit holes
    (big,) = mm.acquire(1, [], [Slot("big", ACT, (4 * F32_PER_UNIT,), "float32")])
    mm.unpin([big])
    assert mm.compactions == 1 and mm.jobs[1].swap_outs == 0
    for t, v in ((ts[1], values[1]), (ts[3], values[3])):
        assert t.residency is Residency.DEVICE and same_bits(mm.array(t), v)
    mm.check()


def test_a_compaction_copies_adjacent_blocks_sliding_alike_as_one(monkeypatch):
    """Four adjacent 1-unit blocks above a 4-unit hole slide down together: one copy, not four,
    and every block keeps its values; with a 1-unit hole they would overlap their own copy, and go
    one by one."""
    from tensile_db.memory.moves import coalesced

    mm = make(9)
    hole = new(mm, 1, "hole", 4)
    values = [pattern(F32_PER_UNIT, s) for s in range(4)]
    ts = [new(mm, 1, f"t{i}", 1, v) for i, v in enumerate(values)]
    mm.free(hole)
    copies = []
    move_down = mm.device.move_down
    monkeypatch.setattr(mm.device, "move_down", lambda *a: (copies.append(a[1:]), move_down(*a)))
    assert mm.compact(ts)
    assert copies == [(4 * U, 0, 4 * U)]
    assert [t.offset for t in ts] == [0, U, 2 * U, 3 * U]
    assert all(same_bits(mm.array(t), v) for t, v in zip(ts, values))
    mm.check()
    assert coalesced([(2 * U, U, U), (3 * U, 2 * U, U)]) == [(2 * U, U, U), (3 * U, 2 * U, U)]
    assert coalesced([(2 * U, 0, U), (3 * U, U, U), (5 * U, 2 * U, U)]) == [(2 * U, 0, 2 * U), (5 * U, 2 * U, U)]


def test_fixed_blocks_are_never_moved_by_compaction():
    mm = make(10, next_use=lambda t: math.inf if t.slot == "t2" else 0.0)
    t0, t1 = new(mm, 1, "t0", 2), new(mm, 1, "t1", 2)
    (raw,) = mm.acquire(1, [], [Slot("raw", ACT, (2 * F32_PER_UNIT,), "float32")], fixed=True)
    mm.unpin([raw])                                      # unpinned, yet its address is held elsewhere
    t2 = new(mm, 1, "t2", 2)
    mm.free(t0)                                          # holes [0, 2) and [8, 10) units
    (big,) = mm.acquire(1, [], [Slot("big", ACT, (3 * F32_PER_UNIT,), "float32")])
    mm.unpin([big])
    assert raw.fixed and raw.offset == 4 * U and raw.residency is Residency.DEVICE   # did not move
    # no run of movable blocks opens 3 units past it: nothing slides in vain, room is made by eviction
    assert t1.offset == 2 * U and mm.compactions == 0
    assert t2.residency is Residency.HOST
    mm.check()


def test_check_raises_on_each_broken_invariant():
    mm = make(8)
    a, b = new(mm, 1, "a", 2), new(mm, 1, "b", 2)
    h = mm.adopt(1, "h", Kind.WEIGHT, pattern(F32_PER_UNIT, 1))
    mm.check()
    assert [(offset, size) for offset, size, _ in mm.blocks()] == [(0, 2 * U), (2 * U, 2 * U)]
    assert mm.tensors() == [a, b, h] and mm.tensors(2) == []
    breakages = [
        (lambda: setattr(b, "offset", U), lambda: setattr(b, "offset", 2 * U), "overlaps"),
        (lambda: setattr(b, "offset", 7 * U), lambda: setattr(b, "offset", 2 * U), "outside the arena"),
        (lambda: setattr(mm.jobs[1], "device_nbytes", 5 * U), lambda: setattr(mm.jobs[1], "device_nbytes", 4 * U),
         "job 1 counts"),
        (lambda: setattr(mm.jobs[1], "host_nbytes", 0), lambda: setattr(mm.jobs[1], "host_nbytes", h.nbytes),
         "job 1 counts"),
        (lambda: setattr(h, "pins", 1), lambda: setattr(h, "pins", 0), "pinned but host"),
    ]
    for breaks, mends, message in breakages:
        breaks()
        with pytest.raises(AssertionError, match=message):
            mm.check()
        mends()
        mm.check()


def test_limit_evicts_early_but_a_lone_working_set_may_use_the_whole_budget():
    mm = make(8)
    mm.limit_nbytes = 4 * U
    a = new(mm, 1, "a", 2)
    b = new(mm, 1, "b", 2)
    c = new(mm, 1, "c", 2)                               # over the limit: one of a, b leaves
    assert mm.in_use_nbytes == 4 * U and mm.jobs[1].swap_outs == 1
    assert c.residency is Residency.DEVICE
    (big,) = mm.acquire(1, [], [Slot("big", ACT, (7 * F32_PER_UNIT,), "float32")])
    assert mm.in_use_nbytes == 7 * U                     # nothing left to evict: up to the budget
    assert all(t.residency is Residency.HOST for t in (a, b, c))
    mm.unpin([big])


def test_order_moves_copies_device_to_device_where_safe_and_parks_blocks_to_break_cycles():
    from types import SimpleNamespace

    from tensile_db.memory.moves import free_in_both, order_moves

    rng = np.random.default_rng(3)
    for trial in range(300):
        sizes = rng.integers(1, 5, size=8) * U
        old = np.concatenate(([0], np.cumsum(sizes)[:-1])) + rng.integers(0, 3) * U
        order = rng.permutation(8)
        new = np.concatenate(([0], np.cumsum(sizes[order])[:-1]))[np.argsort(order)]     # a shuffled packing
        blocks = [SimpleNamespace(offset=int(o), arena_nbytes=int(s)) for o, s in zip(old, sizes)]
        capacity = int(max((old + sizes).max(), (new + sizes).max())) + int(rng.integers(0, 6)) * U
        memory = np.zeros(capacity, np.int64)
        for i, b in enumerate(blocks):
            memory[b.offset:b.offset + b.arena_nbytes] = i + 1
        scratch = free_in_both([(b.offset, b.arena_nbytes) for b in blocks],
                               [(int(n), int(s)) for n, s in zip(new, sizes)], capacity)
        moves = [(b, int(n)) for b, n in zip(blocks, new) if n != b.offset]
        copies, staged = order_moves(moves, scratch if trial % 2 else None)
        for b, src, dst in copies:                           # as the manager does: copy, then re-place
            assert dst < src or src + b.arena_nbytes <= dst
            memory[dst:dst + b.arena_nbytes] = memory[src:src + b.arena_nbytes].copy()
            b.offset = dst
        held = [memory[b.offset:b.offset + b.arena_nbytes].copy() for b, _ in staged]
        for (b, n), values in zip(staged, held):
            memory[n:n + b.arena_nbytes] = values
            b.offset = n
        for i, b in enumerate(blocks):
            assert b.offset == new[i] and (memory[b.offset:b.offset + b.arena_nbytes] == i + 1).all(), trial
    swap = [SimpleNamespace(offset=0, arena_nbytes=U), SimpleNamespace(offset=U, arena_nbytes=U)]
    moves = [(swap[0], U), (swap[1], 0)]
    assert order_moves(moves) == ([], moves)                                   # a cycle, no room
    assert order_moves(moves, [(2 * U, 3 * U)]) == ([(swap[0], 0, 2 * U), (swap[1], U, 0), (swap[0], 2 * U, U)], [])


@pytest.mark.parametrize("device", ["sim", "cpu"])
def test_a_region_install_that_would_stage_much_through_a_host_link_is_not_made(device):
    """Two blocks that fill the arena and trade places form a cycle with no scratch: installing
    that region moves both through host memory. Across a host link (the simulated GPU) the
    install is refused with its reason and nothing moves; on ``cpu``, whose host memory is the
    device's, both move and keep their values."""
    from tensile_db.memory.lifetimes import PoolPlan
    from tensile_db.runtime.simulated import SimDevice

    mm = MemoryManager(SimDevice("h100", jitter=0.0) if device == "sim" else CpuDevice(), 4 * U)
    mm.register_job(1)
    mm.at(1, 0)                                         # keys the blocks: (job, slot, op position)
    a, b = new(mm, 1, "a", 2, pattern(2 * F32_PER_UNIT, 1)), new(mm, 1, "b", 2, pattern(2 * F32_PER_UNIT, 2))
    assert (a.offset, b.offset) == (0, 2 * U) and a.key != b.key
    plan = PoolPlan("test", {a.key: 2 * U, b.key: 0}, 4 * U)
    out = mm.installer.install(plan, {a.key, b.key}, 0)
    if device == "sim":
        assert out == f"installing a planned region of {4 * U:,} bytes would move {4 * U:,} bytes through host memory"
        assert (a.offset, b.offset) == (0, 2 * U)
    else:                                               # (a simulated device holds no values)
        assert out == 0 and (a.offset, b.offset) == (2 * U, 0)
        assert same_bits(mm.to_host(a), pattern(2 * F32_PER_UNIT, 1))
        assert same_bits(mm.to_host(b), pattern(2 * F32_PER_UNIT, 2))
    mm.close()


def test_where_the_kernels_take_every_core_every_cpu_copy_runs_here(monkeypatch):
    """No core is left for the copy thread where the kernels' workers take every one: the
    engine makes every copy between the arena and host memory on the caller's thread, done when
    the call returns (Note [Copies beside kernels on every core])."""
    import sys

    from tensile_db.runtime import workers

    monkeypatch.setattr(workers, "count", lambda: 2)
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1})
    engine = CpuDevice().copy_engine()
    try:
        assert engine.inline_nbytes == sys.maxsize
        values, arena = pattern(1 << 21, 3), np.zeros(1 << 21, np.float32)      # 8 MiB
        assert engine.to_device(values, arena).done() and same_bits(arena, values)
        outward = engine.to_host(arena)
        assert outward.done() and same_bits(outward.host, values)
    finally:
        engine.close()


def test_cpu_copies_of_a_mebibyte_run_here_and_larger_ones_on_the_copy_thread(monkeypatch):
    """The CPU's copy engine with a core free for its copy thread: a copy between the arena and
    host memory of at most ``SPARE_CORE_INLINE_NBYTES`` is done when the call returns, on the
    caller's thread; a larger one runs on the copy thread. Both copy exactly, both ways."""
    import threading

    from tensile_db.runtime import workers
    from tensile_db.runtime.device import CpuCopyEngine

    threads, copyto = [], np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src: (threads.append(threading.get_ident()), copyto(dst, src))[1])
    monkeypatch.setattr(workers, "count", lambda: 1)
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1})
    engine = CpuDevice().copy_engine()
    limit = CpuCopyEngine.SPARE_CORE_INLINE_NBYTES
    assert engine.inline_nbytes == limit
    try:
        for n, here in ((limit // 4, True), (limit // 4 + 1, False)):
            values, arena = pattern(n, n), np.zeros(n, np.float32)
            inward = engine.to_device(values, arena)
            if here:
                assert inward.done()                          # done before the call returned
            inward.wait()
            assert same_bits(arena, values) and (threads[-1] == threading.get_ident()) is here
            outward = engine.to_host(arena)
            if here:
                assert outward.done()
            assert same_bits(outward.wait().host, values) and (threads[-1] == threading.get_ident()) is here
    finally:
        engine.close()
