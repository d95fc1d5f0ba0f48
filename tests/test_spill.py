"""The disk tier under the host: spill files, the host budget, bit-exact reloads, cleanup after a
job and after a killed coordinator, and read-only tensors whose values live in a source."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from conftest import TEST_DEVICE
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, JobState, TrainingJob
from tensile_db.errors import CorruptModel, InvalidArgument
from tensile_db.memory.manager import MemoryManager, Residency
from tensile_db.memory.spill import SpillDir, SpillFile
from tensile_db.runtime import model as models
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.program import Kind, Slot

JOB = 1


@pytest.fixture
def spill(tmp_path):
    d = SpillDir(str(tmp_path / "spill"))
    yield d
    d.close()


def manager(spill, budget=1 << 20, host_budget=0) -> MemoryManager:
    mm = MemoryManager(make_device(TEST_DEVICE), budget, host_budget_nbytes=host_budget, spill=spill)
    mm.register_job(JOB)
    return mm


def values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def write(mm, t, host: np.ndarray) -> None:
    """Set the values of the resident tensor ``t`` from the host array ``host``."""
    mm.array(t)[...] = mm.device.xp.asarray(host)


def load(mm, t) -> np.ndarray:
    mm.acquire(JOB, [t], [])
    out = mm.to_host(t)
    mm.unpin([t])
    return out


@pytest.mark.parametrize("nbytes", [4, 512, 4096 + 4, 3 << 20])
def test_spill_file_round_trips_any_size_and_alignment(tmp_path, nbytes):
    f = SpillFile(str(tmp_path / "f.spill"))
    data = np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes + 1), np.uint8)[1:]   # misaligned
    offset = f.reserve(nbytes)
    f.write_from(offset, data)
    out = np.empty(nbytes + 1, np.uint8)[1:]
    f.read_into(offset, out)
    assert np.array_equal(out, data)
    f.close()
    assert not os.path.exists(f.path)


def test_spill_file_reuses_freed_slots(tmp_path):
    f = SpillFile(str(tmp_path / "f.spill"))
    a, b = f.reserve(5000), f.reserve(5000)
    assert (a, b) == (0, 8192) and f.end_nbytes == 16384
    f.release(a, 5000)
    assert f.reserve(6000) == a and f.end_nbytes == 16384     # same 4096-rounded size
    assert f.reserve(100) == 16384
    f.close()


def test_adopted_tensors_beyond_the_host_budget_go_to_disk_and_come_back_bit_exact(spill):
    mm = manager(spill, host_budget=8192)
    a, b = values(1024, 1), values(1024, 2)               # 4096 bytes each
    c = values(3000, 3)                                   # 12,000 bytes: over what is left
    ta, tb, tc = (mm.adopt(JOB, n, Kind.WEIGHT, v) for n, v in (("a", a), ("b", b), ("c", c)))
    assert (ta.host is not None, tb.host is not None, tc.spill is not None) == (True, True, True)
    assert mm.jobs[JOB].host_nbytes == 8192 and mm.jobs[JOB].disk_nbytes == c.nbytes
    mm.check()
    for t, v in ((ta, a), (tb, b), (tc, c)):
        assert np.array_equal(load(mm, t), v)
    assert mm.jobs[JOB].disk_nbytes == 0 and mm.jobs[JOB].disk_read_nbytes == c.nbytes
    mm.check()
    mm.close()


@pytest.mark.parametrize("planned", [False, True])
def test_swapped_out_tensors_spill_when_the_host_tier_is_full_and_reload_bit_exact(spill, planned):
    mm = manager(spill, budget=64 << 10, host_budget=16 << 10)
    tensors = []
    for i in range(6):                                    # 6 x 12 KiB on a 64 KiB device, 16 KiB host
        (t,) = mm.acquire(JOB, [], [Slot(f"t{i}", Kind.ACTIVATION, (3072,))])
        write(mm, t, values(3072, 10 + i))
        mm.unpin([t])
        tensors.append(t)
    for t in tensors:
        if planned:
            mm.swap_out(t)
            mm.release(t)
        else:
            mm.evict(t)
        mm.check()
    assert [t.host is not None for t in tensors] == [True] + [False] * 5   # one 12 KiB copy fits 16 KiB
    assert all(t.spill is not None for t in tensors[1:])
    j = mm.jobs[JOB]
    assert j.host_nbytes == 3072 * 4 and j.disk_nbytes == 5 * 3072 * 4 and j.spilled_nbytes == j.disk_nbytes
    assert mm.host_tier.peak_nbytes <= 16 << 10
    for i, t in enumerate(tensors):
        if planned:
            mm.swap_in(t)
        assert np.array_equal(load(mm, t), values(3072, 10 + i))
        mm.free(t)
        mm.check()
    assert (j.host_nbytes, j.disk_nbytes, j.swap_ins) == (0, 0, 6)
    mm.close()


def test_release_job_removes_its_spill_file(spill):
    mm = manager(spill)
    t = mm.adopt(JOB, "w", Kind.WEIGHT, values(2048, 0))
    path = mm.host_tier.files[JOB].path
    assert t.spill is not None and os.path.getsize(path) >= 8192
    mm.release_job(JOB)
    assert not os.path.exists(path) and mm.host_tier.disk_nbytes == 0
    mm.close()


def test_a_spill_directory_of_a_killed_coordinator_is_removed_at_the_next_start(tmp_path):
    root = str(tmp_path / "spill")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        import numpy as np
        from tensile_db.memory.spill import SpillDir
        d = SpillDir({root!r})
        f = d.open("job-1")
        f.write_from(f.reserve(1 << 20), np.ones(1 << 20, np.uint8))
        print(d.directory, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    dead = child.stdout.readline().strip()
    live = SpillDir(root)                       # the child is alive: its directory stays
    assert os.path.exists(os.path.join(dead, "job-1.spill")) and live.removed_files == 0
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert os.path.exists(dead)
    after = SpillDir(root)
    assert not os.path.exists(dead) and after.removed_files == 1 and after.removed_nbytes >= 1 << 20
    assert os.path.exists(live.directory)       # another live one's is kept
    live.close()
    after.close()
    assert os.listdir(root) == []


def test_a_host_budget_needs_a_spill_directory():
    with pytest.raises(InvalidArgument, match="spill directory"):
        MemoryManager(CpuDevice(), 1 << 20, host_budget_nbytes=0)


class Source:
    """A layer's bytes read from memory, or failing as a corrupted file would."""

    def __init__(self, array: np.ndarray, corrupt: bool = False):
        self.array, self.nbytes, self.corrupt, self.reads = array, array.nbytes, corrupt, 0

    def read_into(self, out: np.ndarray) -> None:
        self.reads += 1
        if self.corrupt:
            raise CorruptModel("layer 0 failed its checksum")
        out[...] = self.array.view(np.uint8)


@pytest.mark.parametrize("prefetch", [False, True])
def test_read_only_tensors_load_from_their_source_and_cache_on_the_host_within_the_budget(spill, prefetch):
    mm = manager(spill, host_budget=4096)
    small, large = values(1024, 1), values(2048, 2)
    ts, tl = (mm.adopt_source(JOB, n, Kind.WEIGHT, v.shape, v.dtype, Source(v)) for n, v in (("s", small), ("l", large)))
    for t, v in ((ts, small), (tl, large)):
        if prefetch:
            mm.cache.prefetch(t)
        assert np.array_equal(load(mm, t), v)
        if prefetch:
            mm.cache.unwant(t)
    assert ts.host is not None and tl.host is None        # 4096 bytes cached; 8192 more do not fit
    assert mm.host_tier.cache_nbytes == 4096
    mm.evict(ts)
    mm.evict(tl)
    assert np.array_equal(load(mm, ts), small) and ts.source.reads == 1      # from the host cache
    assert np.array_equal(load(mm, tl), large) and tl.source.reads == 2      # from the source again
    mm.check()
    mm.close()


def test_a_job_needing_host_room_takes_it_from_cached_read_only_copies(spill):
    mm = manager(spill, host_budget=4096)
    v = values(1024, 1)
    t = mm.adopt_source(JOB, "layer", Kind.WEIGHT, v.shape, v.dtype, Source(v))
    load(mm, t)
    assert mm.host_tier.cache_nbytes == 4096
    w = mm.adopt(JOB, "w", Kind.WEIGHT, values(1024, 2))
    assert w.host is not None and w.spill is None and mm.host_tier.cache_nbytes == 0 and t.host is None
    mm.check()
    mm.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_failed_source_read_raises_and_leaves_the_tensor_off_the_device(spill, prefetch):
    mm = manager(spill)
    v = values(1024, 1)
    t = mm.adopt_source(JOB, "layer", Kind.WEIGHT, v.shape, v.dtype, Source(v, corrupt=True))
    if prefetch:
        mm.cache.prefetch(t)
    with pytest.raises(CorruptModel, match="checksum"):
        mm.acquire(JOB, [t], [])
    assert t.residency is Residency.HOST and t.offset is None and mm.in_use_nbytes == 0 and not t.pins
    mm.check()
    mm.close()


def make_job(held_out: bool = False) -> TrainingJob:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 16)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    spec = models.ModelSpec(models.parse_architecture({"layers": [{"dense": 256}, {"dense": 256}]}), 16, 2,
                            "classification")
    options = {"epochs": 2, "batch_size": 64, "optimizer": "adam", "seed": 3}
    if held_out:
        options.update(epochs=4, patience=1)
        return TrainingJob(JobInfo(1, "tester", "spilled"), spec, models.parse_options(options), x[:512], y[:512],
                           x[512:], y[512:])
    return TrainingJob(JobInfo(1, "tester", "spilled"), spec, models.parse_options(options), x, y)


def train(mm: MemoryManager, policy: str, held_out: bool = False) -> TrainingJob:
    ex = Executor(mm, policy=policy)
    ex.start()
    try:
        job = make_job(held_out)
        ex.submit(job)
        while True:
            kind, _ = job.events.get(timeout=120)
            if kind != "progress":
                break
        assert job.state is JobState.DONE, job.error
        return job
    finally:
        ex.stop()


@pytest.mark.parametrize("policy", ["tensile", "reactive"])
def test_training_through_the_disk_tier_is_bit_identical_to_an_unlimited_run(spill, policy):
    reference = train(MemoryManager(make_device(TEST_DEVICE), 64 << 20), policy)
    mm = MemoryManager(make_device(TEST_DEVICE), 1 << 20, host_budget_nbytes=256 << 10, spill=spill)
    spilled = train(mm, policy)
    assert spilled.memory.spilled_nbytes > 0 and spilled.memory.disk_read_nbytes > 0
    assert mm.host_tier.peak_nbytes <= 256 << 10
    assert set(spilled.result) == set(reference.result)
    for name, array in reference.result.items():
        assert np.array_equal(spilled.result[name], array), name
    assert not spilled.result.in_memory and reference.result.in_memory   # 280 KB of weights, 256 KiB of host
    left = sorted(os.listdir(spill.directory))              # the job's own spill file is gone; its result's stays
    assert len(left) == 2 and left[0] == "lock" and left[1].startswith(f"weights-{spilled.id}-")
    spilled.discard_result()
    assert os.listdir(spill.directory) == ["lock"]
    assert mm.host_tier.used_nbytes() == 0


def test_a_result_that_fits_the_host_tier_is_counted_in_it_until_discarded(spill):
    mm = MemoryManager(make_device(TEST_DEVICE), 1 << 20, host_budget_nbytes=4 << 20, spill=spill)
    job = train(mm, "tensile")
    assert job.result.in_memory
    weights = sum(a.nbytes for name, a in job.result.items() if name[0] not in "xy")
    assert mm.host_tier.used_nbytes() == weights
    job.discard_result()
    assert mm.host_tier.used_nbytes() == 0 and job.result is None


def test_held_out_losses_and_early_stopping_with_weights_beyond_the_host_budget(spill):
    reference = train(MemoryManager(make_device(TEST_DEVICE), 64 << 20), "tensile", held_out=True)
    mm = MemoryManager(make_device(TEST_DEVICE), 1 << 20, host_budget_nbytes=256 << 10, spill=spill)
    spilled = train(mm, "tensile", held_out=True)
    assert not spilled.result.in_memory
    assert [h["epoch"] for h in spilled.history] == [h["epoch"] for h in reference.history]
    assert spilled.best_epoch == reference.best_epoch
    np.testing.assert_allclose([h["val_loss"] for h in spilled.history], [h["val_loss"] for h in reference.history],
                               rtol=1e-5)
    for name, array in reference.result.items():
        assert np.array_equal(spilled.result[name], array), name
    spilled.discard_result()
    assert os.listdir(spill.directory) == ["lock"] and mm.host_tier.used_nbytes() == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_moves_through_three_tiers_keep_the_values_and_the_budgets(spill, seed):
    """Random swap-outs, releases, swap-ins, evictions, loads and frees of tensors of random
    sizes: after every step the invariants hold (the host tier within its budget, counters equal
    to the tensors), and every load gives back the values last written."""
    rng = np.random.default_rng(seed)
    mm = manager(spill, budget=64 << 10, host_budget=12 << 10)
    expected, tensors = {}, []

    def create():
        n = int(rng.integers(1, 2048))
        (t,) = mm.acquire(JOB, [], [Slot(f"t{len(expected)}", Kind.ACTIVATION, (n,))])
        expected[t.id] = rng.standard_normal(n).astype(np.float32)
        write(mm, t, expected[t.id])
        mm.unpin([t])
        tensors.append(t)

    for _ in range(6):
        create()
    for _ in range(300):
        t = tensors[int(rng.integers(len(tensors)))]
        step = rng.choice(["out", "release", "in", "evict", "load", "free"])
        if step == "out":
            mm.swap_out(t)
        elif step == "release":
            mm.release(t)
        elif step == "in":
            mm.swap_in(t)
        elif step == "evict":
            mm.evict(t)
        elif step == "load":
            assert np.array_equal(load(mm, t), expected[t.id])
        else:
            mm.free(t)
            tensors.remove(t)
            create()
        mm.check()
        assert mm.host_tier.peak_nbytes <= 12 << 10
    for t in tensors:
        assert np.array_equal(load(mm, t), expected[t.id])
    j = mm.jobs[JOB]
    assert 0 < j.spilled_nbytes < j.swapped_out_nbytes and j.disk_read_nbytes > 0    # both tiers were used
    mm.release_job(JOB)
    assert (mm.host_tier.nbytes, mm.host_tier.disk_nbytes, mm.host_tier.used_nbytes()) == (0, 0, 0)
    assert os.listdir(spill.directory) == ["lock"]
    mm.close()


class DiskFull(Exception):
    pass


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(True)`` makes every spill write fail as a full disk would."""
    state = {"full": False}
    write = SpillFile.write_from

    def failing(self, offset, array):
        if state["full"]:
            raise DiskFull("No space left on device")
        write(self, offset, array)

    monkeypatch.setattr(SpillFile, "write_from", failing)
    return lambda full: state.update(full=full)


@pytest.mark.parametrize("how", ["adopt", "evict", "planned"])
def test_a_full_disk_fails_the_move_and_loses_nothing(spill, full_disk, how):
    mm = manager(spill, budget=64 << 10, host_budget=0)
    v = values(2048, 4)
    keep = mm.adopt(JOB, "keep", Kind.WEIGHT, v)              # spilled before the disk fills
    full_disk(True)
    if how == "adopt":
        with pytest.raises(DiskFull):
            mm.adopt(JOB, "w", Kind.WEIGHT, values(2048, 5))
        assert [t.slot for t in mm.tensors(JOB)] == ["keep"]
    else:
        (t,) = mm.acquire(JOB, [], [Slot("a", Kind.ACTIVATION, (2048,))])
        write(mm, t, values(2048, 6))
        mm.unpin([t])
        with pytest.raises(DiskFull):
            if how == "evict":
                mm.evict(t)
            else:
                mm.swap_out(t)
                mm.release(t)
        assert t.residency is Residency.DEVICE and t.spill is None    # the device copy stays, whole
        assert np.array_equal(load(mm, t), values(2048, 6))
    mm.check()
    full_disk(False)
    assert np.array_equal(load(mm, keep), v)
    mm.release_job(JOB)
    assert (mm.host_tier.disk_nbytes, mm.host_tier.used_nbytes()) == (0, 0) and os.listdir(spill.directory) == ["lock"]
    mm.close()


def test_a_job_cancelled_while_holding_copies_of_its_weights_gives_them_back(spill):
    mm = MemoryManager(make_device(TEST_DEVICE), 1 << 20, host_budget_nbytes=256 << 10, spill=spill)
    ex = Executor(mm)
    ex.start()
    try:
        job = make_job(held_out=True)
        job.options = models.parse_options({"epochs": 500, "batch_size": 64, "optimizer": "adam", "seed": 3})
        ex.submit(job)
        kind, record = job.events.get(timeout=60)
        assert kind == "progress" and "val_loss" in record          # a copy of the weights is held now
        assert any(name.startswith(f"weights-{job.id}-") for name in os.listdir(spill.directory))
        ex.cancel(job)
        while kind == "progress":
            kind, _ = job.events.get(timeout=60)
        assert job.state is JobState.CANCELLED
    finally:
        ex.stop()
    assert os.listdir(spill.directory) == ["lock"] and mm.host_tier.used_nbytes() == 0


def test_a_failed_read_is_met_by_its_owner_not_by_whoever_lets_the_copies_land(spill):
    mm = manager(spill)
    mm.register_job(2)
    v = values(1024, 1)
    layer = mm.adopt_source(JOB, "layer", Kind.WEIGHT, v.shape, v.dtype, Source(v, corrupt=True))
    mm.cache.prefetch(layer)
    other = mm.adopt(2, "w", Kind.WEIGHT, values(1024, 2))
    with mm._lock:
        assert mm.land_copies() is True                 # another job's path: the failure is not raised there
    mm.acquire(2, [other], [])
    mm.unpin([other])
    assert layer.residency is Residency.HOST and layer.offset is None
    with pytest.raises(CorruptModel):                   # the owner meets it on its own access
        mm.acquire(JOB, [layer], [])
    mm.check()
    mm.close()


def test_training_a_model_larger_than_the_host_budget_never_holds_it_in_host_memory(spill):
    """Python's and NumPy's allocations (traced; the arena is a mapping of its own) while a job
    trains a model whose weights and Adam state are 80x the host budget, and returns its result,
    stay within the host budget plus a few tensors and the rows: initial weights are adopted one
    at a time, swap-outs beyond the host tier go to disk, and the result is kept in a spill file."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 16)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    spec = models.ModelSpec(models.parse_architecture({"layers": [{"dense": 256}] * 8}), 16, 2, "classification")
    options = models.parse_options({"epochs": 2, "batch_size": 64, "optimizer": "adam", "seed": 1})
    host_budget = 64 << 10
    mm = MemoryManager(make_device(TEST_DEVICE), 2 << 20, host_budget_nbytes=host_budget, spill=spill)
    ex = Executor(mm)
    ex.start()
    tracemalloc.start()
    try:
        job = TrainingJob(JobInfo(1, "tester", "wide"), spec, options, x, y)
        ex.submit(job)
        while job.events.get(timeout=120)[0] == "progress":
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        ex.stop()
    assert job.state is JobState.DONE and not job.result.in_memory
    state = sum(t.nbytes for t in job.program.slots.values() if t.kind.persistent)
    largest = max(s.nbytes for s in job.program.slots.values())
    assert state > 80 * host_budget
    assert peak < host_budget + 8 * largest + 4 * x.nbytes < state / 2, (peak, state, largest)
    job.discard_result()
