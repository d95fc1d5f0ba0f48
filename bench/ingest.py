"""Rows per second from a table into the coordinator.

Fills a table with ROWS rows of 16 real columns and an integer label (generated in SQL), trains a
one-epoch model on it through ``CALL tensile.train_model``, and reports the data path's phases from
the stored metrics: ``read_s`` (the backend's one-scan SPI read, ``string_agg(float4send(..))``
per column) and ``transfer_s`` (shipping the arrays over the coordinator socket until the job is
accepted). Runs in the embedded cluster of ``--home``.

    python bench/ingest.py --home .tensile [--rows 1000000]
"""

from __future__ import annotations

import argparse
import site
import time
from pathlib import Path

import psycopg
from tabulate import tabulate

from tensile_db.cluster import EmbeddedCluster

COLUMNS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=".tensile")
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    cluster = EmbeddedCluster(Path(args.home) / "cluster", python_paths=[site.getsitepackages()[0]])
    cluster.start()
    cluster.create_database("tensile_bench", fresh=True)
    with psycopg.connect(cluster.conninfo("tensile_bench"), autocommit=True) as conn:
        cols = ", ".join(f"(random() * 10)::real AS f{i}" for i in range(COLUMNS))
        t0 = time.perf_counter()
        conn.execute("DROP TABLE IF EXISTS ingest")
        conn.execute(f"CREATE TABLE ingest AS SELECT {cols}, (g % 2) AS label FROM generate_series(1, {args.rows}) g")
        fill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, metrics, _, _ = conn.execute(
            "CALL tensile.train_model('ingest_bench', 'ingest', 'label', NULL, '{\"layers\": [{\"dense\": 8}]}', "
            "'{\"epochs\": 1, \"batch_size\": 4096, \"replace\": true}')").fetchone()
        call_s = time.perf_counter() - t0
        conn.execute("SELECT tensile.drop_model('ingest_bench')")
    rows = args.rows
    table = [
        ["read (SPI, one scan)", metrics["read_s"], rows / metrics["read_s"]],
        ["transfer to coordinator", metrics["transfer_s"], rows / metrics["transfer_s"]],
        ["read + transfer", metrics["read_s"] + metrics["transfer_s"], rows / (metrics["read_s"] + metrics["transfer_s"])],
        ["whole CALL (1 epoch, tiny model)", call_s, rows / call_s],
    ]
    print(f"{rows:,} rows x {COLUMNS} real columns + label ({rows * (COLUMNS * 4 + 8) / 1e6:.0f} MB as arrays); "
          f"table filled in {fill_s:.1f} s")
    print(tabulate(table, headers=["phase", "seconds", "rows/s"], floatfmt=(".0f", ".2f", ",.0f")))


if __name__ == "__main__":
    main()
