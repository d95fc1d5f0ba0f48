"""``python -m tensile_db.coordinator``: run a coordinator in the foreground.

Backends start it on demand (see ``client.start``); it can also be started explicitly.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys

from .. import settings
from ..errors import TensileError
from ..memory.arena import UNIT_NBYTES
from ..runtime import workers
from ..runtime.model import Limits
from .address import START_FAILED
from .server import Coordinator

#: glibc's ``mallopt`` parameter number of the mmap threshold (``malloc.h``).
_M_MMAP_THRESHOLD = -3
#: Allocations at least this large get their own mapping, returned to the system when freed.
MMAP_THRESHOLD_NBYTES = 1 << 20


def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_NBYTES`. By default glibc raises the
    threshold to the size of each large block freed (up to 32 MiB), after which arrays of that
    size come from the heap and stay resident when freed: the host copies and reads of the tiers
    would then hold memory no budget counts. Training a model 4x the device and host budgets
    (``bench/spill.py``), the coordinator's peak resident set was 151 MiB with glibc's default and
    121 MiB with the threshold fixed (one run each). A no-op where the C library has no mallopt."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_NBYTES)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensile_db.coordinator", description=__doc__)
    parser.add_argument("--socket-dir", required=True, help="0700 directory for the socket and lock")
    parser.add_argument("--device", choices=settings.DEVICES, default=settings.DEFAULT_DEVICE)
    parser.add_argument("--devices", default="",
                        help="several devices of one kind, comma-separated (cpu:0,cpu:1); default: --device alone")
    parser.add_argument("--budget", default=str(settings.DEFAULT_BUDGET_NBYTES),
                        help="device arena size, bytes: one for every device, or one per device, comma-separated")
    parser.add_argument("--host-budget", type=int, default=settings.DEFAULT_HOST_BUDGET_NBYTES,
                        help="host memory for swapped-out tensors, bytes; beyond it they go to spill files")
    parser.add_argument("--spill-dir", help="directory of the spill files (default: <socket-dir>/spill)")
    parser.add_argument("--max-active-jobs", type=int, default=settings.DEFAULT_MAX_ACTIVE_JOBS,
                        help="jobs run at once; more wait queued")
    parser.add_argument("--max-pressure", default=str(settings.DEFAULT_MAX_PRESSURE),
                        help="beyond the budget, admit a queued job only while the running jobs' unscheduled peaks "
                             "and its own stay within this many times the budget and the device's jobs are predicted "
                             "to end sooner, summed, so than with it waiting; 'none': every job at once")
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
    try:
        devices = settings.parse_devices(args.devices)
        max_pressure = settings.parse_max_pressure(args.max_pressure)
        budgets = [int(b) for b in args.budget.split(",")]
    except (TensileError, ValueError) as exc:
        parser.error(str(exc))
    if min(budgets) < UNIT_NBYTES:
        parser.error(f"--budget must be at least {UNIT_NBYTES} bytes, got {args.budget}")
    if args.host_budget < 0:
        parser.error(f"--host-budget must not be negative, got {args.host_budget}")
    if args.spill_dir is not None and not os.path.isabs(args.spill_dir):
        parser.error(f"--spill-dir must be an absolute path, got {args.spill_dir!r}")
    for flag in ("max_active_jobs", "max_layers", "max_parameters", "max_job_bytes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    fix_mmap_threshold()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s tensile-coordinator[%(process)d] %(levelname)s %(message)s")
    try:                              # a budget count that is not one or one per device
        coordinator = Coordinator(args.socket_dir, args.device, budgets, args.max_active_jobs,
                                  args.postmaster_pid_file, policy=args.policy, pool=args.pool,
                                  limits=Limits(args.max_layers, args.max_parameters, args.max_job_bytes),
                                  host_budget_nbytes=args.host_budget, spill_dir=args.spill_dir, devices=devices,
                                  max_pressure=max_pressure)
    except TensileError as exc:
        parser.error(str(exc))
    try:
        listener = coordinator.start()
    except Exception as exc:          # the backend that started it reads the cause from this line
        logging.getLogger(__name__).error("%s%s", START_FAILED, " ".join(str(exc).split()) or type(exc).__name__,
                                          exc_info=True)
        return 1
    if listener is not None:
        coordinator.serve(listener)
    return 0


if __name__ == "__main__":
    workers.with_blas_environment()
    sys.exit(main())
