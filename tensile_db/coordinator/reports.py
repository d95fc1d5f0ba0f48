"""The rows of ``tensile.jobs`` and ``tensile.memory``: one typed record each, the one place their
fields are named and ordered. A leaf module: the coordinator builds the records, the backends
read them.

The coordinator builds a record from its producers — a job (:meth:`TrainingJob.describe`), the
memory manager's ``snapshot()``, the scheduler's and the inference service's ``describe()`` — by
keyword, so a producer that adds or drops a figure fails loudly instead of being lost on the way,
and sends it as JSON. The backend names the columns by :func:`sql_name` (``_nbytes`` becomes
``_bytes``; a job's ``peak_nbytes`` is ``peak_device_bytes``) and turns the ``*_at`` seconds into
timestamps. The SQL functions' ``OUT`` lists in ``sql/tensile_db.sql`` follow these records field
for field, in order; ``tests/test_reports.py`` checks both ways against a running coordinator
and a real cluster. A new column is a field here, its producer, and an ``OUT`` parameter there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class JobRow:
    """One live training job. Bytes are device bytes unless named otherwise; times are seconds
    since the epoch."""

    job_id: int
    backend_pid: int
    role: str | None                    # None for readers that are not members of the job's role
    model_name: str | None              # likewise
    state: str                          # 'queued' | 'running'
    device: str                         # the device it runs or waits on (Note [Placement])
    epoch: int
    epochs: int
    loss: float | None                  # mean loss of the last epoch; likewise hidden
    device_nbytes: int
    peak_nbytes: int
    vanilla_peak_nbytes: int            # the job alone with unlimited memory
    swapped_out_nbytes: int             # cumulative
    swapped_in_nbytes: int              # cumulative
    host_nbytes: int                    # held in host memory now
    disk_nbytes: int                    # held in the disk tier (its spill file) now
    policy: str
    schedule: str                       # 'cold start' | 'planned' | 'reactive'
    planned_swap_ins: int
    passive_swap_ins: int
    recomputes: int
    created_at: float
    started_at: float | None


@dataclass(frozen=True)
class MemoryRow:
    """One device: its arena, scheduler, planned pool and batch inference, as one row."""

    device: str                         # its name: tensile.device, or one of tensile.devices
    budget_nbytes: int
    in_use_nbytes: int
    peak_nbytes: int                    # high-water mark since the coordinator started
    host_nbytes: int
    free_blocks: int
    largest_free_nbytes: int
    fragmentation: float                # 1 - largest free block / free bytes
    running_jobs: int
    queued_jobs: int
    policy: str
    h2d_bytes_per_s: float              # measured when the coordinator started
    d2h_bytes_per_s: float
    plans_made: int
    predicted_peak_nbytes: int | None   # of the latest plan
    predicted_extra_s: float | None     # of the latest plan, per period
    pool: str                           # the planned pool's state
    planned_region_nbytes: int
    pool_plans_installed: int
    planned_allocations: int
    pool_mismatches: int
    planned_arena_nbytes: int | None    # of the last recorded period
    max_live_nbytes: int | None
    general_pool_nbytes: int | None
    inference_calls: int
    inference_nbytes: int
    weight_cache_nbytes: int
    weight_loads: int
    weight_cache_hits: int
    weight_cache_evictions: int
    per_job: dict                       # job id -> that job's counters (JSON)
    started_at: float
    compactions: int                    # arena compactions, cumulative
    compacted_nbytes: int               # bytes they moved
    served_models: int                  # model versions the coordinator has open (layers read from their files)
    served_host_nbytes: int             # host bytes the model store holds: scaling arrays, read buffers in use
    rss_nbytes: int                     # the coordinator process's resident set (VmRSS), bytes
    peak_rss_nbytes: int                # its high-water mark (VmHWM), bytes
    host_budget_nbytes: int | None      # tensile.host_budget; None: unbounded
    host_used_nbytes: int               # the host tier now: host_nbytes, copies in flight, cached layers
    host_peak_nbytes: int               # its high-water mark; never above host_budget_nbytes
    host_cache_nbytes: int              # cached host copies of served models' layers
    disk_nbytes: int                    # the jobs' bytes in the disk tier now
    spill_file_nbytes: int              # the extent of the jobs' spill files
    disk_read_bytes_per_s: float | None     # the spill directory's, measured when the coordinator started
    disk_write_bytes_per_s: float | None
    served_file_nbytes: int             # bytes of the served models' files
    disk_free_nbytes: int | None        # free on the spill directory's file system now; None: no disk tier


def sql_name(record: type, field: str) -> str:
    """The SQL column of ``field`` of ``record`` (JobRow or MemoryRow)."""
    if record is JobRow and field == "peak_nbytes":
        return "peak_device_bytes"
    return field.replace("_nbytes", "_bytes")


def sql_columns(record: type) -> list[str]:
    """The SQL columns of a record type, in order."""
    return [sql_name(record, f.name) for f in dataclasses.fields(record)]


def sql_row(record: type, row: dict) -> dict:
    """A row received from the coordinator with its keys named as the SQL columns."""
    return {sql_name(record, k): v for k, v in row.items()}


def as_dict(row: JobRow | MemoryRow) -> dict:
    """The record as the JSON the coordinator sends."""
    return dataclasses.asdict(row)
