"""Scheduling of tensors: which tensor leaves the device, how (swap or recompute), and when.

- ``trace.py``: access sequences with measured op times (the cold-start record).
- ``cost.py``: the cost model, host<->device bandwidth measured at start.
- ``timeline.py``: the combined timeline of all running jobs, the executor's pace (fair sharing:
  iterations per period of each job) and the simulator of a plan.
- ``planners.py``: TENSILE's greedy planner, the swap selection of arXiv 1903.06631, and vDNN.
- ``curves.py``: the global planner (policy ``tensile``): per-model curves of the greedy, combined over
  all running jobs.
- ``work.py``: the planners' work, counted, and the planning time it is modelled to take.
- ``bound.py``: a lower bound on the extra time of any plan that meets a target, the planners'
  optimal reference (linear programs, ``docs/bound.md``).
- ``reactive.py``: farthest next use, the fallback that keeps every job inside the budget under
  ``reactive`` and the baselines.
- ``dtr.py``: Dynamic Tensor Rematerialization (policy ``dtr``, and the fallback under
  ``tensile``): evict the least cost / (bytes x staleness), dropping what recomputes.
- ``engine.py``: the :class:`Scheduler` the executor runs around every op.
- ``allocations.py``: a job's recurring allocations under a swap schedule, for the offline lifetime
  planner (:mod:`tensile_db.memory.lifetimes`) and the pool benchmark.
"""

from .engine import POLICIES, Scheduler

__all__ = ["POLICIES", "Scheduler"]
