"""``tensile-db``: the demo and the embedded cluster from the command line.

    tensile-db demo --home DIR            four concurrent trainings in an embedded cluster, then penguins
    tensile-db demo --dsn CONNINFO        the same demo in the database of any server
    tensile-db cluster start|stop|status|url --home DIR
"""

from __future__ import annotations

import argparse
import site
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensile-db", description="tensile_db: in-database ML with a shared device coordinator")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train four models at once from SQL under one device budget, then a model "
                                       "of data with categories and gaps; exit status 0 when every check passes")
    where = demo.add_mutually_exclusive_group()
    where.add_argument("--home", default=".tensile", help="directory for the embedded cluster (the default form)")
    where.add_argument("--dsn", help="a libpq connection string: run in that database of a running server instead "
                                     "(its superuser creates or updates the extension; its tables digits_train, "
                                     "digits_test and penguins are replaced)")
    cluster = sub.add_parser("cluster", help="manage the embedded PostgreSQL cluster")
    cluster.add_argument("action", choices=("start", "stop", "status", "url"))
    cluster.add_argument("--home", default=".tensile", help="directory of the embedded cluster")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run, run_on_server

        return run_on_server(args.dsn) if args.dsn else run(args.home)
    from .cluster import EmbeddedCluster

    c = EmbeddedCluster(Path(args.home) / "cluster", python_paths=[site.getsitepackages()[0]])
    if args.action == "start":
        c.start()
        print(c.conninfo())
    elif args.action == "stop":
        c.stop()
    elif args.action == "status":
        print("running" if c.running else "stopped")
        return 0 if c.running else 3
    else:
        print(c.url())
    return 0


if __name__ == "__main__":
    sys.exit(main())
