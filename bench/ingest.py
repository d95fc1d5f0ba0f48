"""Rows per second from a table into the coordinator, for numeric and for categorical data.

Fills two tables of ROWS rows, generated in SQL: ``ingest`` with 16 real columns, and
``ingest_mixed`` with 12 real columns (one in fifty values NULL) and 4 text columns of 10
categories each (one in fifty NULL), each with an integer label. Trains a one-epoch model on each
through ``CALL tensile.train_model`` (the mixed one with one-hot columns and imputed gaps), and
reports the data path's phases from the stored metrics: ``read_s`` (the backend's one-scan SPI
read: ``tensile._pack_float4_columns(..)`` for the numeric columns, ``tensile._pack_text(..)``
per text column, dictionary-encoded as it is read), ``prepare_s`` (the held-out split, the preprocessing
fitted on the training rows and the network's inputs built) and ``transfer_s`` (shipping the
arrays over the coordinator socket until the job is accepted, the coordinator's scaling of them
included). Rows per second count every row of the table. Then the table's size on disk and the
peak resident memory of the CALL's backend and of a coordinator started for the CALL
(``VmHWM``), against it. The CALL's scan is the table's first (it sets the rows' hint bits).
Runs in the embedded cluster of ``--home``, for each of ``--rows``.

    python bench/ingest.py --home .tensile [--rows 1000000 10000000]
"""

from __future__ import annotations

import argparse
import site
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from tabulate import tabulate

import cnn
from tensile_db.cluster import EmbeddedCluster

COLUMNS = 16
#: The mixed table: real columns, text columns and categories per text column.
MIXED_REAL, MIXED_TEXT, CATEGORIES = 12, 4, 10
NULL_EVERY = 50


@dataclass
class Run:
    """One table's CALL: seconds, the stored metrics, and sizes in bytes."""

    fill_s: float
    call_s: float
    metrics: dict
    table_nbytes: int           # the table on disk (pg_total_relation_size)
    backend_peak_nbytes: int    # the CALL's backend process, peak resident (VmHWM)
    coordinator_peak_nbytes: int    # a coordinator started for this CALL, peak resident (VmHWM)


def peak_resident_nbytes(pid: int) -> int:
    """A process's peak resident set size, bytes (``VmHWM`` of ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def fill_and_train(dsn: str, table: str, select: str, options: str) -> Run:
    """Fill ``table`` from ``select``, then train on it from a new session with a coordinator
    started for it, so that both processes' peaks are this CALL's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        t0 = time.perf_counter()
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE TABLE {table} AS {select}")
        fill_s = time.perf_counter() - t0
        table_nbytes = conn.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()[0]
        conn.execute("SELECT tensile.stop_coordinator()")
    with psycopg.connect(dsn, autocommit=True) as conn:
        coordinator = conn.execute("SELECT tensile.start_coordinator()").fetchone()[0]
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        t0 = time.perf_counter()
        _, metrics, _, _ = conn.execute(
            "CALL tensile.train_model(%s, %s, 'label', NULL, '{\"layers\": [{\"dense\": 8}]}', %s::jsonb)",
            (f"{table}_bench", table, options)).fetchone()
        call_s = time.perf_counter() - t0
        peaks = peak_resident_nbytes(backend), peak_resident_nbytes(coordinator)
        conn.execute("SELECT tensile.drop_model(%s)", (f"{table}_bench",))
    return Run(fill_s, call_s, metrics, table_nbytes, *peaks)


def phases(rows: int, run: Run) -> list[list]:
    m, call_s = run.metrics, run.call_s
    both = m["read_s"] + m["prepare_s"] + m["transfer_s"]
    return [["read (SPI, one scan)", m["read_s"], rows / m["read_s"]],
            ["prepare (split, preprocessing)", m["prepare_s"], rows / m["prepare_s"]],
            ["transfer to coordinator", m["transfer_s"], rows / m["transfer_s"]],
            ["read + prepare + transfer", both, rows / both],
            ["whole CALL (1 epoch, tiny model)", call_s, rows / call_s]]


def memory(run: Run) -> list[list]:
    return [[what, f"{nbytes / 1e6:,.0f}", f"{nbytes / run.table_nbytes:.2f}"] for what, nbytes in
            (("the table on disk", run.table_nbytes), ("backend, peak resident", run.backend_peak_nbytes),
             ("coordinator, peak resident", run.coordinator_peak_nbytes))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=".tensile")
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    args = parser.parse_args()
    cluster = EmbeddedCluster(Path(args.home) / "cluster", python_paths=[site.getsitepackages()[0]])
    cluster.start()
    cluster.create_database("tensile_bench", fresh=True)
    dsn = cluster.conninfo("tensile_bench")
    options = '{"epochs": 1, "batch_size": 4096}'
    numeric = ", ".join(f"(random() * 10)::real AS f{i}" for i in range(COLUMNS))
    gap = f"CASE WHEN random() < {1 / NULL_EVERY} THEN NULL ELSE"
    mixed = ", ".join([f"{gap} (random() * 10)::real END AS f{i}" for i in range(MIXED_REAL)]
                      + [f"{gap} 'c' || (random() * {CATEGORIES - 1})::int END AS t{i}" for i in range(MIXED_TEXT)])
    for rows in args.rows:
        runs = {
            f"{COLUMNS} real columns": fill_and_train(
                dsn, "ingest", f"SELECT {numeric}, (g % 2) AS label FROM generate_series(1, {rows}) g", options),
            f"{MIXED_REAL} real + {MIXED_TEXT} text columns, gaps imputed": fill_and_train(
                dsn, "ingest_mixed", f"SELECT {mixed}, (g % 2) AS label FROM generate_series(1, {rows}) g",
                '{"epochs": 1, "batch_size": 4096, "impute": "mean"}'),
        }
        for what, run in runs.items():
            m = run.metrics
            print(f"\n{rows:,} rows x {what} + label; {m['samples']:,} trained on, {m['test_samples']:,} "
                  f"held out; table filled in {run.fill_s:.1f} s")
            print(tabulate(phases(rows, run), headers=["phase", "seconds", "rows/s"],
                           floatfmt=(".0f", ".2f", ",.0f")))
            print(tabulate(memory(run), headers=["memory", "MB", "x the table"], colalign=("left", "right", "right")))
    print(f"\none run each; measured on this machine: {cnn.machine()}")


if __name__ == "__main__":
    main()
