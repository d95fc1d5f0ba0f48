"""The values the server-level settings may take and their defaults, shared by the backends
(which check the configuration before starting a coordinator) and the coordinator (which runs
them): the one place each is written. A leaf module: a PostgreSQL backend imports it without the
scheduler or the memory manager.

- ``POLICIES``: ``tensile.policy``, the scheduler: ``tensile`` (TENSILE, arXiv 2105.13336,
  planned over the combined timeline), ``reactive`` (no plan: evict the farthest next use), and
  the published baselines it is measured against: ``vdnn`` (vDNN_all), ``swap_score`` (the swap
  selection of arXiv 1903.06631), ``capuchin`` (Peng et al., ASPLOS 2020), ``checkpoint`` (sqrt(n)
  segments, arXiv 1604.06174), ``tensile_published`` (TENSILE with each job planned alone) and
  ``dtr`` (Dynamic Tensor Rematerialization, Kirisame et al., ICLR 2021: no plan; evict the
  tensor of least cost / (bytes x staleness), dropping what recomputes).
- ``UNPLANNED_POLICIES``: the policies of ``POLICIES`` that make no plan: they decide only when
  an allocation does not fit.
- ``DEVICES``: ``tensile.device``: ``cpu`` (NumPy) or ``cuda`` (CuPy).
- ``POOLS``: ``tensile.pool``: ``planned`` (recurring allocations at lifetime-planned offsets) or
  ``general`` (the best-fit pool only).
"""

POLICIES = ("tensile", "reactive", "vdnn", "swap_score", "capuchin", "checkpoint", "tensile_published", "dtr")
UNPLANNED_POLICIES = ("reactive", "dtr")
DEVICES = ("cpu", "cuda")
POOLS = ("planned", "general")

DEFAULT_DEVICE = "cpu"                 # tensile.device
DEFAULT_BUDGET_NBYTES = 1 << 30        # tensile.device_budget, bytes
DEFAULT_HOST_BUDGET_NBYTES = 1 << 30   # tensile.host_budget, bytes: swapped-out copies in host memory
#: tensile.spill_dir when it is not set: the disk tier's files go under the coordinator's
#: directory in the cluster's data directory.
DEFAULT_SPILL_SUBDIR = "spill"
DEFAULT_MAX_ACTIVE_JOBS = 8            # tensile.max_active_jobs
DEFAULT_POLICY = POLICIES[0]           # tensile.policy: tensile
DEFAULT_POOL = POOLS[0]                # tensile.pool: planned
#: Rows per batch a predict_batch call streams through the layers, at most.
MAX_PREDICT_BATCH_ROWS = 1 << 16
#: Rows per batch a predict call streams when it does not say: at most this many, fewer when a
#: step of that many rows would not fit the device budget.
DEFAULT_PREDICT_BATCH_ROWS = 256
