"""What only a GPU can show: swap copies between the arena and page-locked host memory, and
CuPy's own allocations routed into the arena under a training's budget.

Run with ``TENSILE_TEST_DEVICE=cuda`` on a machine with a GPU and CuPy (the runtime tests that
run jobs on an executor then run on ``cuda`` too); skipped otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TEST_DEVICE
from job_helpers import budget_of, make_job, run
from tensile_db.memory.manager import MemoryManager, Residency
from tensile_db.runtime import cuda
from tensile_db.runtime.cuda import WORKSPACE_JOB, is_pinned
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.program import Kind, Slot

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="runs with TENSILE_TEST_DEVICE=cuda on a GPU")


def test_a_swap_in_copies_straight_from_the_swap_outs_page_locked_copy(monkeypatch):
    import cupy

    mm = MemoryManager(make_device("cuda"), 1 << 20)
    mm.register_job(1)
    value = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    (t,) = mm.acquire(1, [], [Slot("a", Kind.ACTIVATION, value.shape)])
    mm.array(t)[...] = cupy.asarray(value)
    mm.unpin([t])
    mm.swap_out(t)
    mm.release(t)
    assert t.residency is Residency.HOST and is_pinned(t.host)
    assert not is_pinned(value)
    staged = []
    monkeypatch.setattr(cuda, "pinned_empty", lambda *a: staged.append(a) or np.empty(a[1], a[2]))
    mm.swap_in(t)
    mm.acquire(1, [t], [])
    assert np.array_equal(cupy.asnumpy(mm.array(t)), value)
    assert staged == []
    mm.unpin([t])
    mm.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_uniform_draws_are_fixed_by_the_seed_in_zero_to_one_and_allocate_nothing(dtype):
    import cupy

    device = make_device("cuda")
    out, again, other = (cupy.empty((1000, 1000), dtype) for _ in range(3))
    allocations = []
    pool = cupy.get_default_memory_pool()
    with cupy.cuda.using_allocator(lambda n: allocations.append(n) or pool.malloc(n)):
        device.uniform(7, out)
    assert allocations == []
    device.uniform(7, again)
    device.uniform(8, other)
    assert cupy.array_equal(out, again) and not cupy.array_equal(out, other)
    assert float(out.min()) >= 0 and float(out.max()) < 1
    assert abs(float(out.mean()) - 0.5) < 0.002 and abs(float((out < 0.3).mean()) - 0.3) < 0.002
    assert abs(float(cupy.corrcoef(out.ravel()[:-1], out.ravel()[1:])[0, 1])) < 0.005


@pytest.fixture
def routed_allocator():
    """Route CuPy's allocations into the manager that ``route(mm)`` is given; CuPy's own
    allocator is back afterwards."""
    import cupy

    default = cupy.cuda.get_allocator()
    managers = []

    def route(jobs, mm):
        mm.device.route_allocations(mm)
        managers.append(mm)

    yield route
    cupy.cuda.set_allocator(default)
    for mm in managers:
        assert mm.jobs[WORKSPACE_JOB].device_nbytes == 0, "a CuPy temporary outlived its op"


def test_with_cupys_allocations_in_the_arena_training_stays_in_budget_and_matches_unlimited(routed_allocator):
    reference = [make_job(seed=s) for s in (1, 2)]
    run(reference, 64 * sum(j.vanilla_peak_nbytes for j in reference), "reactive")
    jobs = [make_job(seed=s) for s in (1, 2)]
    budget = budget_of(jobs, 0.5)
    mm, _ = run(jobs, budget, "tensile", prepare=routed_allocator)
    assert mm.peak_nbytes <= budget
    assert mm.jobs[0].peak_nbytes > 0                   # the temporaries were in the arena
    for ref, job in zip(reference, jobs):
        assert job.loss == ref.loss
        for name, value in ref.result.items():
            assert np.array_equal(job.result[name], value), name
