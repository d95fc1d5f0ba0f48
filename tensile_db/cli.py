"""``tensile-db``: the demo and the embedded cluster from the command line.

    tensile-db demo --home DIR            three concurrent trainings in an embedded cluster
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
    demo = sub.add_parser("demo", help="train three models at once from SQL under one device budget")
    demo.add_argument("--home", default=".tensile", help="directory for the embedded cluster")
    cluster = sub.add_parser("cluster", help="manage the embedded PostgreSQL cluster")
    cluster.add_argument("action", choices=("start", "stop", "status", "url"))
    cluster.add_argument("--home", default=".tensile", help="directory of the embedded cluster")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run

        return run(args.home)
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
