"""Rows per second from a table into the coordinator, for numeric and for categorical data.

Fills two tables of ROWS rows, generated in SQL: ``ingest`` with 16 real columns, and
``ingest_mixed`` with 12 real columns (one in fifty values NULL) and 4 text columns of 10
categories each (one in fifty NULL), each with an integer label. Trains a one-epoch model on each
through ``CALL tensile.train_model`` (the mixed one with one-hot columns and imputed gaps), and
reports the data path's phases from the stored metrics: ``read_s`` (the backend's one-scan SPI
read: ``tensile._pack_float4(..)`` per numeric column, each categorical value's length and
UTF-8 bytes), ``prepare_s`` (the held-out split, the preprocessing fitted on the training rows
and the network's inputs built) and ``transfer_s`` (shipping the arrays over the coordinator
socket until the job is accepted). Rows per second count every row of the table. Runs in the
embedded cluster of ``--home``.

    python bench/ingest.py --home .tensile [--rows 1000000]
"""

from __future__ import annotations

import argparse
import site
import time
from pathlib import Path

import psycopg
from tabulate import tabulate

import cnn
from tensile_db.cluster import EmbeddedCluster

COLUMNS = 16
#: The mixed table: real columns, text columns and categories per text column.
MIXED_REAL, MIXED_TEXT, CATEGORIES = 12, 4, 10
NULL_EVERY = 50


def fill_and_train(conn, table: str, select: str, options: str) -> tuple[float, float, dict]:
    """(seconds to fill, seconds of the CALL, the stored metrics)."""
    t0 = time.perf_counter()
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.execute(f"CREATE TABLE {table} AS {select}")
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, metrics, _, _ = conn.execute(
        "CALL tensile.train_model(%s, %s, 'label', NULL, '{\"layers\": [{\"dense\": 8}]}', %s::jsonb)",
        (f"{table}_bench", table, options)).fetchone()
    call_s = time.perf_counter() - t0
    conn.execute("SELECT tensile.drop_model(%s)", (f"{table}_bench",))
    return fill_s, call_s, metrics


def phases(rows: int, call_s: float, m: dict) -> list[list]:
    both = m["read_s"] + m["prepare_s"] + m["transfer_s"]
    return [["read (SPI, one scan)", m["read_s"], rows / m["read_s"]],
            ["prepare (split, preprocessing)", m["prepare_s"], rows / m["prepare_s"]],
            ["transfer to coordinator", m["transfer_s"], rows / m["transfer_s"]],
            ["read + prepare + transfer", both, rows / both],
            ["whole CALL (1 epoch, tiny model)", call_s, rows / call_s]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=".tensile")
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    cluster = EmbeddedCluster(Path(args.home) / "cluster", python_paths=[site.getsitepackages()[0]])
    cluster.start()
    cluster.create_database("tensile_bench", fresh=True)
    rows = args.rows
    options = '{"epochs": 1, "batch_size": 4096}'
    numeric = ", ".join(f"(random() * 10)::real AS f{i}" for i in range(COLUMNS))
    gap = f"CASE WHEN random() < {1 / NULL_EVERY} THEN NULL ELSE"
    mixed = ", ".join([f"{gap} (random() * 10)::real END AS f{i}" for i in range(MIXED_REAL)]
                      + [f"{gap} 'c' || (random() * {CATEGORIES - 1})::int END AS t{i}" for i in range(MIXED_TEXT)])
    with psycopg.connect(cluster.conninfo("tensile_bench"), autocommit=True) as conn:
        runs = {
            f"{COLUMNS} real columns": fill_and_train(
                conn, "ingest", f"SELECT {numeric}, (g % 2) AS label FROM generate_series(1, {rows}) g", options),
            f"{MIXED_REAL} real + {MIXED_TEXT} text columns, gaps imputed": fill_and_train(
                conn, "ingest_mixed", f"SELECT {mixed}, (g % 2) AS label FROM generate_series(1, {rows}) g",
                '{"epochs": 1, "batch_size": 4096, "impute": "mean"}'),
        }
    for what, (fill_s, call_s, metrics) in runs.items():
        print(f"\n{rows:,} rows x {what} + label; {metrics['samples']:,} trained on, {metrics['test_samples']:,} "
              f"held out; table filled in {fill_s:.1f} s")
        print(tabulate(phases(rows, call_s, metrics), headers=["phase", "seconds", "rows/s"],
                       floatfmt=(".0f", ".2f", ",.0f")))
    print(f"\none run each; measured on this machine: {cnn.machine()}")


if __name__ == "__main__":
    main()
