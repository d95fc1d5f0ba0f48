"""Device memory: one arena of ``budget`` bytes, every tensor in it, and the moves between the
arena and host memory. The mechanism (the core) and its policies are apart:

- ``arena.py``: the arena's best-fit allocator over 512-byte units (the general pool).
- ``tensors.py``: the records: a registered tensor, its residency, a job's counters.
- ``manager.py``: :class:`MemoryManager`, the core: registration, acquire / pin / drain, the
  counters, ``snapshot()``, and the public ``tensors()``, ``blocks()`` and ``check()`` (the
  invariants: no overlap, inside the arena, counters equal to the blocks, pinned is resident).
- ``residency.py``: every residency transition, the one place / free chokepoint
  (``_place`` / ``_free_block``) and the one place every per-job counter changes (``_account``).
- ``eviction.py``: the eviction policy: which tensor leaves when an allocation does not fit
  (Note [Eviction order]), and when to compact.
- ``cache.py``: the weight cache's rules for read-only tensors (served model layers).
- ``planned.py``: the planned pool: records a period, installs a lifetime-planned region, serves
  recurring allocations by lookup (Note [Planned pool]).
- ``lifetimes.py``: the offline lifetime planner (interval colouring, arXiv 1903.06631 section III).
- ``moves.py``: the planned region's install and dissolve (:class:`RegionInstaller`, held by the
  manager) and the orders of block moves.
- ``tiers.py``: the tiers under the device, host memory within the host budget and the jobs'
  spill files (:class:`HostTier`, held by the manager); ``spill.py``: the spill files' I/O.
The swap engine that copies between the arena, host memory and spill files is the device's
(:meth:`tensile_db.runtime.device.Device.copy_engine`).
"""
