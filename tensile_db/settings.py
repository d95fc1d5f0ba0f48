"""The values the server-level settings may take, shared by the backends (which check the
configuration before starting a coordinator) and the coordinator (which runs them). A leaf
module: a PostgreSQL backend imports it without the scheduler or the memory manager.

- ``POLICIES``: ``tensile.policy``, the scheduler: ``tensile`` (TENSILE, arXiv 2105.13336),
  ``reactive`` (no plan: evict the farthest next use), ``vdnn`` (vDNN_all) and ``swap_score``
  (the swap selection of arXiv 1903.06631).
- ``POOLS``: ``tensile.pool``: ``planned`` (recurring allocations at lifetime-planned offsets) or
  ``general`` (the best-fit pool only).
"""

POLICIES = ("tensile", "reactive", "vdnn", "swap_score")
POOLS = ("planned", "general")
