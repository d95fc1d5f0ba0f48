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
- ``tensile.max_pressure``: how far the unscheduled peaks of a device's running jobs may exceed its
  budget before the next queued job waits whatever it would gain (:func:`parse_max_pressure`).
- ``tensile.devices``: the devices one coordinator drives, each with its own budget, arena,
  memory manager, executor and plans (:func:`parse_devices`); empty: ``tensile.device`` alone.
- ``POOLS``: ``tensile.pool``: ``planned`` (recurring allocations at lifetime-planned offsets) or
  ``general`` (the best-fit pool only).
"""

from .errors import InvalidArgument

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
#: tensile.max_pressure: beyond its budget, a device admits a queued job only while the unscheduled
#: peaks of its running jobs and that one stay within this many times the budget, and only when the
#: device's jobs are predicted to end sooner, summed, so than with it waiting (Note [Admission by
#: memory pressure] in :mod:`tensile_db.coordinator.executor`); ``none``: every job admitted at once.
DEFAULT_MAX_PRESSURE = 2.0
DEFAULT_POLICY = POLICIES[0]           # tensile.policy: tensile
DEFAULT_POOL = POOLS[0]                # tensile.pool: planned
#: Rows per batch a predict_batch call streams through the layers, at most.
MAX_PREDICT_BATCH_ROWS = 1 << 16
#: Rows per batch a predict call streams when it does not say: at most this many, fewer when a
#: step of that many rows would not fit the device budget.
DEFAULT_PREDICT_BATCH_ROWS = 256
#: Devices one coordinator drives at most (``tensile.devices``).
MAX_DEVICES = 16


def parse_devices(text: str) -> list[str]:
    """The devices of ``tensile.devices``: a comma-separated list of ``kind:index`` (``kind`` one
    of :data:`DEVICES`, all of one kind; ``cpu:0, cpu:1``), as names (``cpu:0``), in order; an
    empty list for an empty value (then ``tensile.device`` alone).

    Raises:
        InvalidArgument: naming the value, for a malformed entry, another kind, two kinds, a
            device listed twice, or more than :data:`MAX_DEVICES`.
    """
    entries = [e.strip() for e in text.split(",")] if text.strip() else []
    names = []
    for entry in entries:
        kind, _, index = entry.partition(":")
        if kind.strip() not in DEVICES or not index.strip().isdigit() or len(index.strip()) > 3:
            raise InvalidArgument(f"tensile.devices entry {entry!r} is not a device: write kind:index, the kind one of "
                                  f"{', '.join(DEVICES)} (tensile.devices = 'cpu:0, cpu:1')")
        names.append(f"{kind.strip()}:{int(index)}")
    if len({n.partition(':')[0] for n in names}) > 1:
        raise InvalidArgument(f"tensile.devices {text!r} mixes device kinds; list devices of one kind")
    if len(set(names)) != len(names):
        raise InvalidArgument(f"tensile.devices {text!r} lists a device twice")
    if len(names) > MAX_DEVICES:
        raise InvalidArgument(f"tensile.devices {text!r} lists {len(names)} devices; at most {MAX_DEVICES}")
    return names


def parse_max_pressure(text: str) -> float | None:
    """``tensile.max_pressure``: a number at least 1, or ``none`` (no bound: None).

    Raises:
        InvalidArgument: naming the value, for anything else.
    """
    value = text.strip().lower()
    if value == "none":
        return None
    try:
        pressure = float(value)
    except ValueError:
        pressure = 0.0
    if not 1.0 <= pressure < 1e6:
        raise InvalidArgument(f"tensile.max_pressure is {text!r}; it must be a number at least 1 (the unscheduled peaks "
                              "of a device's running jobs over its budget) or 'none'")
    return pressure
