"""Rows per second from a table into the coordinator, for numeric and for categorical data.

Fills two tables of ROWS rows, generated in SQL: ``ingest`` with 16 real columns, and
``ingest_mixed`` with 12 real columns (one in fifty values NULL) and 4 text columns of 10
categories each (one in fifty NULL), each with an integer label. Trains a one-epoch model on each
through ``CALL tensile.train_model`` (the mixed one with one-hot columns and imputed gaps), and
reports the data path's phases from the stored metrics: ``read_s`` (the backend's one scan
through ``tensile._read_columns``, which writes every value into a memory file the backend maps,
each text column dictionary-encoded as it is read), ``prepare_s`` (the held-out split, the
preprocessing fitted on the training rows and the network's inputs built) and ``transfer_s``
(shipping the arrays over the coordinator socket until the job is accepted, the coordinator's
fit of their scaling included; the numeric table's rows go as the scan wrote them, its sealed
file passed with the training and held-out rows' indices, and the coordinator gathers the
held-out ones: Note [Rows sent as the scan wrote them] in :mod:`tensile_db.pg.prepare`). Rows per second count every row of the table. Then the table's size on disk and the
peak resident memory of the CALL's backend and of a coordinator started for the CALL
(``VmHWM``, the most over the repeats), against it. Each table is trained on ``--repeats`` times,
each CALL in a new session with a new coordinator; each phase is given as the median over them
with its range. After the fill, the table is vacuumed and analyzed and a checkpoint written, as
pgbench vacuums before its runs: else autovacuum found the fresh table beside the first CALL
(its training took 1.54 s against 0.31 to 0.59 in the others; the autovacuum and autoanalyze of
the table fell in that CALL's second), and the first scan set the rows' hint bits.
Runs in the embedded cluster of ``--home``, for each of ``--rows``. Before the tables, the
shipping alone: the same number of rows of 16 float32 columns and an int32 label sent with the
coordinator's protocol over a Unix socket, in a shared memory file (Note [Shared arrays] in
:mod:`tensile_db.coordinator.protocol`) and in frames, interleaved repeats, until the receiver
has read every value once (a sum of each array). After each table, its read alone, in one
session, by both readers of :mod:`tensile_db.pg.scan` alternated ``--repeats`` times:
``tensile._read_columns`` and the ``string_agg`` reader of a database whose extension predates
it (what every database read through before the extension had C). For 1,000,000 rows, the
target lines: the numeric table read in at most 0.6 s, the mixed table's read at least 3 times
as fast as by ``string_agg``, the rows shipped until the job is accepted in at most 0.1 s, and
the whole CALL in at most 1.5 s; each decided only where the whole spread lies on one side.

    python bench/ingest.py --home .tensile [--rows 1000000 10000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import site
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from pathlib import Path

import numpy as np
import psycopg
from tabulate import tabulate

import cnn
from common import decided, median_and_range
from tensile_db.cluster import EmbeddedCluster
from tensile_db.coordinator import protocol

COLUMNS = 16
#: The mixed table: real columns, text columns and categories per text column.
MIXED_REAL, MIXED_TEXT, CATEGORIES = 12, 4, 10
NULL_EVERY = 50
SHIP_REPEATS = 5
#: The targets at TARGET_ROWS rows on this machine: seconds at most (a ratio at least, for the
#: text columns' read against string_agg's).
TARGET_ROWS = 1_000_000
READ_S, TEXT_SPEEDUP, TRANSFER_S, CALL_S = 0.6, 3.0, 0.1, 1.5
#: One read of a table in the backend by the reader named, its seconds as a NOTICE.
READ_ALONE = """
import time
from tensile_db.pg import data, scan
from tensile_db.runtime import preprocess
from tensile_db.runtime import model as models
opts = models.parse_options(%s)
reader = scan._read_columns
if %s:
    scan._read_columns = scan._aggregate           # the reader of an extension without the C function
try:
    started = time.perf_counter()
    data.read_training_data(plpy, %s, 'label', None, False, imputed=lambda c: preprocess.imputes(opts, c))
    plpy.notice(str(time.perf_counter() - started))
finally:
    scan._read_columns = reader
"""


@dataclass
class Run:
    """One table's CALLs, one a repeat: seconds, the stored metrics, and sizes in bytes."""

    fill_s: float
    call_s: list[float]
    metrics: list[dict]
    table_nbytes: int           # the table on disk (pg_total_relation_size)
    backend_peak_nbytes: int    # the CALL's backend process, peak resident (VmHWM), the most of the repeats
    coordinator_peak_nbytes: int    # a coordinator started for the CALL, peak resident (VmHWM), the most


def peak_resident_nbytes(pid: int) -> int:
    """A process's peak resident set size, bytes (``VmHWM`` of ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def fill_and_train(dsn: str, table: str, select: str, options: str, repeats: int) -> Run:
    """Fill ``table`` from ``select``, then train on it ``repeats`` times, each from a new session
    with a coordinator started for it, so that both processes' peaks are that CALL's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        t0 = time.perf_counter()
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE TABLE {table} AS {select}")
        fill_s = time.perf_counter() - t0
        conn.execute(f"VACUUM (ANALYZE) {table}")
        conn.execute("CHECKPOINT")
        table_nbytes = conn.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()[0]
    run = Run(fill_s, [], [], table_nbytes, 0, 0)
    for _ in range(repeats):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT tensile.stop_coordinator()")
            coordinator = conn.execute("SELECT tensile.start_coordinator()").fetchone()[0]
            backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            t0 = time.perf_counter()
            _, metrics, _, _ = conn.execute(
                "CALL tensile.train_model(%s, %s, 'label', NULL, '{\"layers\": [{\"dense\": 8}]}', %s::jsonb)",
                (f"{table}_bench", table, options)).fetchone()
            run.call_s.append(time.perf_counter() - t0)
            run.metrics.append(metrics)
            run.backend_peak_nbytes = max(run.backend_peak_nbytes, peak_resident_nbytes(backend))
            run.coordinator_peak_nbytes = max(run.coordinator_peak_nbytes, peak_resident_nbytes(coordinator))
            conn.execute("SELECT tensile.drop_model(%s)", (f"{table}_bench",))
    return run


def ship_s(rows: int, shared: bool) -> float:
    """Seconds from the start of sending ``rows`` x COLUMNS float32 rows and their int32 labels
    over a Unix socket with the coordinator's protocol until the receiver has read every value
    once (a sum of each array): in a shared memory file (Note [Shared arrays]; the sender told
    that the receiver takes them) or, with ``shared`` False, in frames."""
    rng = np.random.default_rng(0)
    arrays = {"x": rng.random((rows, COLUMNS), dtype=np.float32), "y": rng.integers(0, 2, rows, dtype=np.int32)}
    with tempfile.TemporaryDirectory() as home:
        address = os.path.join(home, "socket")
        with Listener(address, family="AF_UNIX") as listener:
            got = {}

            def receive() -> None:
                with listener.accept() as conn:
                    got.update(protocol.recv(conn)[1])
                    got["sums"] = [float(v.sum(dtype=np.float64)) for v in got.values()]
                    got["at"] = time.perf_counter()
            receiver = threading.Thread(target=receive)
            receiver.start()
            with Client(address, family="AF_UNIX") as conn:
                if shared:
                    protocol.accept_shared(conn)
                started = time.perf_counter()
                protocol.send(conn, {"type": "train"}, arrays)
                receiver.join()
    assert np.array_equal(got["x"], arrays["x"]) and np.array_equal(got["y"], arrays["y"])
    return got["at"] - started


def shipping(rows: int, repeats: int) -> list[list]:
    """The two ways of :func:`ship_s`, interleaved ``repeats`` times: median [min, max] seconds and
    MB/s of the median."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(repeats):
        for shared in ((True, False) if k % 2 else (False, True)):
            times[shared].append(ship_s(rows, shared))
    nbytes = rows * (COLUMNS + 1) * 4
    return [[what, *median_and_range(times[shared], ".3f"), f"{nbytes / statistics.median(times[shared]) / 1e6:,.0f}"]
            for what, shared in (("frames over the socket", False), ("shared memory file", True))]


def phases(rows: int, run: Run) -> list[list]:
    """Each phase's seconds over the repeats, median [min, max], and rows/s of the median."""
    got = {"read (SPI, one scan)": [m["read_s"] for m in run.metrics],
           "prepare (split, preprocessing)": [m["prepare_s"] for m in run.metrics],
           "transfer to coordinator (until the job is accepted)": [m["transfer_s"] for m in run.metrics],
           "read + prepare + transfer": [m["read_s"] + m["prepare_s"] + m["transfer_s"] for m in run.metrics],
           "whole CALL (1 epoch, tiny model)": run.call_s}
    return [[what, *median_and_range(seconds, ".2f"), f"{rows / statistics.median(seconds):,.0f}"]
            for what, seconds in got.items()]


def readers(dsn: str, table: str, options: str, repeats: int) -> dict[str, list[float]]:
    """Seconds of ``repeats`` reads of ``table`` by each reader, alternated (the order reversed
    every other repeat), in one session."""
    times: dict[str, list[float]] = {"C function": [], "string_agg": []}
    with psycopg.connect(dsn, autocommit=True) as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary))
        conn.execute("SELECT tensile._bootstrap()")
        for k in range(repeats):
            for name in (("C function", "string_agg") if k % 2 else ("string_agg", "C function")):
                code = READ_ALONE % (repr(options), name == "string_agg", repr(table))
                conn.execute("DO $tensile$" + code + "$tensile$ LANGUAGE plpython3u")
                times[name].append(float(notices.pop()))
    return times


def targets(runs: dict, text_reads: dict[str, list[float]]) -> list[str]:
    """The target lines at :data:`TARGET_ROWS` rows."""
    numeric, _ = runs.values()
    read = [m["read_s"] for m in numeric.metrics]
    transfer = [m["transfer_s"] for m in numeric.metrics]
    ratios = sorted(s / c for s, c in zip(text_reads["string_agg"], text_reads["C function"]))
    lines = [(f"read of {TARGET_ROWS:,} rows x {COLUMNS} real columns at most {READ_S} s", read, READ_S, False),
             (f"the text columns' read at least {TEXT_SPEEDUP:g}x as fast as by string_agg (per repeat)", ratios,
              TEXT_SPEEDUP, True),
             (f"rows shipped until the job is accepted in at most {TRANSFER_S} s", transfer, TRANSFER_S, False),
             (f"whole CALL of one epoch at most {CALL_S} s", numeric.call_s, CALL_S, False)]
    return [f"Target: {what}: median {statistics.median(v):.2f} (spread {min(v):.2f} to {max(v):.2f}): "
            f"{decided(min(v), max(v), target, higher)}" for what, v, target, higher in lines]


def each_call(run: Run) -> str:
    """Every CALL in order, its seconds and its phases' (the training from the job's start to its
    end; queued: from the job's making, its scaling fit among it, to its start; the rest: the
    metrics, storing the model and the session's own work), so that an outlier shows where it
    spent its time."""
    calls = []
    for seconds, m in zip(run.call_s, run.metrics):
        phases = {"read": m["read_s"], "prepare": m["prepare_s"], "transfer": m["transfer_s"],
                  "queued": m["queued_s"], "training": m["train_time_s"]}
        phases["rest"] = seconds - sum(phases.values())
        calls.append(f"{seconds:.2f} (" + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + ")")
    return "each CALL in order, seconds: " + "; ".join(calls)


def memory(run: Run) -> list[list]:
    return [[what, f"{nbytes / 1e6:,.0f}", f"{nbytes / run.table_nbytes:.2f}"] for what, nbytes in
            (("the table on disk", run.table_nbytes), ("backend, peak resident", run.backend_peak_nbytes),
             ("coordinator, peak resident", run.coordinator_peak_nbytes))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=".tensile")
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=3, help="CALLs on each table")
    args = parser.parse_args()
    cluster = EmbeddedCluster(Path(args.home) / "cluster", python_paths=[site.getsitepackages()[0]])
    cluster.start()
    cluster.create_database("tensile_bench", fresh=True)
    dsn = cluster.conninfo("tensile_bench")
    options = '{"epochs": 1, "batch_size": 4096}'
    mixed_options = '{"epochs": 1, "batch_size": 4096, "impute": "mean"}'
    numeric = ", ".join(f"(random() * 10)::real AS f{i}" for i in range(COLUMNS))
    gap = f"CASE WHEN random() < {1 / NULL_EVERY} THEN NULL ELSE"
    mixed = ", ".join([f"{gap} (random() * 10)::real END AS f{i}" for i in range(MIXED_REAL)]
                      + [f"{gap} 'c' || (random() * {CATEGORIES - 1})::int END AS t{i}" for i in range(MIXED_TEXT)])
    for rows in args.rows:
        print(f"\nshipping {rows:,} rows x {COLUMNS} real columns + label ({rows * (COLUMNS + 1) * 4 / 1e6:,.0f} MB) "
              f"with the coordinator's protocol over a Unix socket, until the receiver has read them once "
              f"({SHIP_REPEATS} interleaved repeats)")
        print(tabulate(shipping(rows, SHIP_REPEATS), headers=["arrays", "seconds (median)", "[min, max]", "MB/s"],
                       disable_numparse=True))
        runs = {
            f"{COLUMNS} real columns": fill_and_train(
                dsn, "ingest", f"SELECT {numeric}, (g % 2) AS label FROM generate_series(1, {rows}) g", options,
                args.repeats),
            f"{MIXED_REAL} real + {MIXED_TEXT} text columns, gaps imputed": fill_and_train(
                dsn, "ingest_mixed", f"SELECT {mixed}, (g % 2) AS label FROM generate_series(1, {rows}) g",
                mixed_options, args.repeats),
        }
        reads = {}
        for (what, run), (table, options) in zip(runs.items(), (("ingest", options), ("ingest_mixed", mixed_options))):
            m = run.metrics[0]
            print(f"\n{rows:,} rows x {what} + label; {m['samples']:,} trained on, {m['test_samples']:,} "
                  f"held out; table filled in {run.fill_s:.1f} s; {args.repeats} CALLs")
            print(tabulate(phases(rows, run), headers=["phase", "seconds (median)", "[min, max]", "rows/s"],
                           disable_numparse=True))
            print(each_call(run))
            print(tabulate(memory(run), headers=["memory", "MB", "x the table"], colalign=("left", "right", "right")))
            reads[table] = readers(dsn, table, options, args.repeats)
            print(tabulate([[name, *median_and_range(seconds, ".2f"), f"{rows / statistics.median(seconds):,.0f}"]
                            for name, seconds in reads[table].items()],
                           headers=[f"the read alone ({args.repeats} alternated)", "seconds (median)", "[min, max]",
                                    "rows/s"], disable_numparse=True))
        if rows == TARGET_ROWS:
            print()
            print("\n".join(targets(runs, reads["ingest_mixed"])))
    print(f"\nmeasured on this machine: {cnn.machine()}")


if __name__ == "__main__":
    main()
