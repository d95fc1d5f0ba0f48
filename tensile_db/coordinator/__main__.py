"""``python -m tensile_db.coordinator``: run a coordinator in the foreground.

Backends start it on demand (see ``client.start``); it can also be started explicitly.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..memory.arena import UNIT_NBYTES
from ..runtime.model import Limits
from .. import settings
from .server import Coordinator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensile_db.coordinator", description=__doc__)
    parser.add_argument("--socket-dir", required=True, help="0700 directory for the socket and lock")
    parser.add_argument("--device", choices=settings.DEVICES, default=settings.DEFAULT_DEVICE)
    parser.add_argument("--budget", type=int, default=settings.DEFAULT_BUDGET_NBYTES, help="device arena size, bytes")
    parser.add_argument("--max-active-jobs", type=int, default=settings.DEFAULT_MAX_ACTIVE_JOBS,
                        help="jobs run at once; more wait queued")
    parser.add_argument("--policy", choices=settings.POLICIES, default=settings.DEFAULT_POLICY,
                        help="the scheduler policy")
    parser.add_argument("--pool", choices=settings.POOLS, default=settings.DEFAULT_POOL,
                        help="planned: recurring allocations at lifetime-planned offsets; general: best fit only")
    parser.add_argument("--postmaster-pid-file", help="exit when the pid in this file's first line is gone")
    parser.add_argument("--max-layers", type=int, default=Limits.max_layers,
                        help="refuse models of more layers (nodes of the network graph) than this")
    parser.add_argument("--max-parameters", type=int, default=Limits.max_parameters,
                        help="refuse models of more weights and biases than this")
    parser.add_argument("--max-job-bytes", type=int, default=Limits.max_job_nbytes,
                        help="refuse training jobs whose unscheduled peak (device and host bytes) exceeds this")
    args = parser.parse_args(argv)
    if args.budget < UNIT_NBYTES:
        parser.error(f"--budget must be at least {UNIT_NBYTES} bytes, got {args.budget}")
    for flag in ("max_active_jobs", "max_layers", "max_parameters", "max_job_bytes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s tensile-coordinator[%(process)d] %(levelname)s %(message)s")
    coordinator = Coordinator(args.socket_dir, args.device, args.budget, args.max_active_jobs,
                              args.postmaster_pid_file, policy=args.policy, pool=args.pool,
                              limits=Limits(args.max_layers, args.max_parameters, args.max_job_bytes))
    coordinator.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
