"""Demand layering from disk: a served model ten times larger than the device and host budgets
together, its layers read from its model file as each call needs them.

The coordinator's classes are driven directly (no PostgreSQL): a memory manager with a device
budget and a host budget (``--device-mib``, ``--host-mib``, 32 MiB each by default) and its spill
directory, and the inference service with its models directory. The model is an MLP of
``--layers`` dense layers ``--width`` wide (160 x 1024 by default: 168 million float32
parameters, 671 MB), written once to its model file as the weights are generated, array by array
(the coordinator's streaming write), so no process ever holds it whole.

Each run is a fresh process (so its peak resident set, ``VmHWM``, is its own) that opens the
model from its file, as a restarted coordinator does, and times one call of ``--batches``
batches of ``--batch`` rows:

- *window W* (1, 2, 4): demand layering with the weight cache off, so every batch reads every
  layer from the file (``O_DIRECT``: from the disk, not the page cache; the output says which
  the file system allowed) through a prefetch window of W layers, verifying each layer's
  checksum; the manager keeps host copies of layers within the host budget.
- *all resident*: the reference. A fully resident model cannot fit the budget, so the reference
  runs with an unlimited device budget: a first call loads every layer, the timed call finds
  them all in the arena (no layering, no reads).

Memory saved is ``1 - device peak / the reference's device peak`` (the arena's high-water mark,
weights and activations); delay is ``time / the reference's time - 1``. Runs are interleaved and
repeated; the table prints medians with [min, max]. A run's peak resident set must stay within
device budget + host budget + a fixed overhead, which the output states: the process's resident
set before the store opens the model (the interpreter, NumPy, the package, the call's rows; the
peak counts from the process's start, so a model read whole at open would show), one batch's
host copies (the standardised inputs and the manager's copy of them, the outputs) and the
largest packed layer once more (a host copy made as it lands). The child fixes glibc's mmap
threshold as the coordinator does.

    python bench/disk_layering.py [--dir DIR] [--repeats 5] [--layers 160] [--width 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
from tabulate import tabulate

from common import spread
from tensile_db.coordinator.__main__ import fix_mmap_threshold
from tensile_db.coordinator.address import resident_set
from tensile_db.inference.files import ModelFiles
from tensile_db.inference.service import InferenceService
from tensile_db.memory.manager import MemoryManager
from tensile_db.memory.spill import SpillDir
from tensile_db.runtime import model as models
from tensile_db.runtime.device import CpuDevice

#: Demand Layering (Ji et al., arXiv 2210.04024): memory saved and delay, as the paper reports them.
PAPER = [("paper: least memory", "96.5%", "+14.8%"), ("paper: least delay", "88.4%", "< 1 ms")]
MODEL_ID, VERSION, NAME = 1, "bench/disk_layering", "disk_layering"


def make_spec(layers: int, width: int, n_outputs: int = 10) -> models.ModelSpec:
    """An MLP of ``layers`` dense layers: ``layers - 1`` of ``width`` units (relu), then the output."""
    arch = models.parse_architecture({"layers": [{"dense": width}] * (layers - 1)})
    return models.ModelSpec(arch, width, n_outputs, "classification")


class Generated:
    """The model's weights made one array at a time (He-uniform, zero biases), as a stream the
    model file's writer takes (:meth:`ModelFiles.write`): ``declared`` first, then the arrays."""

    def __init__(self, spec: models.ModelSpec, seed: int = 0):
        self.spec, self.seed = spec, seed
        self.declared = [(k, np.dtype(np.float32), s) for k, s in spec.network.weight_shapes().items()]

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        for k, shape in self.spec.network.weight_shapes().items():
            if k.startswith("W"):
                limit = math.sqrt(6 / shape[0])
                yield k, rng.uniform(-limit, limit, shape).astype(np.float32)
            else:
                yield k, np.zeros(shape, np.float32)


def file_system(path: str) -> str:
    """The type of the file system that holds ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


# --- one run, in its own process ---------------------------------------------------------------


def run_once(args) -> dict:
    """One timed call (see the module docstring); returns its figures."""
    spec = make_spec(args.layers, args.width)
    rows = args.batch * args.batches
    x = np.random.default_rng(1).normal(size=(rows, spec.n_features)).astype(np.float32)
    reference = args.run == "resident"
    model_nbytes = sum(math.prod(s) * 4 for s in spec.network.weight_shapes().values())
    device_nbytes = model_nbytes + (64 << 20) if reference else args.device_mib << 20
    fix_mmap_threshold()                       # as the coordinator does
    base_rss, _ = resident_set()               # before the store opens anything
    with tempfile.TemporaryDirectory(prefix="tensile-bench-spill-", dir=args.dir) as spill_root:
        spill = SpillDir(spill_root)
        manager = MemoryManager(CpuDevice(), device_nbytes, host_budget_nbytes=args.host_mib << 20, spill=spill)
        svc = InferenceService(manager, models_dir=args.models_dir)
        model = svc.store.checkout(MODEL_ID, VERSION, NAME, spec)
        assert model is not None, "the model file is missing"
        window = len(model.layers) if reference else int(args.run)
        if reference:                          # every layer loaded into the arena before the timed call
            svc.predict(model, x[:args.batch], window, args.batch, cache=True)
            model = svc.store.checkout(MODEL_ID, VERSION)
            with open("/proc/self/clear_refs", "w") as f:     # its high-water mark starts here
                f.write("5\n")
        started = time.perf_counter()
        outputs, stats = svc.predict(model, x, window, args.batch, cache=reference)
        elapsed = time.perf_counter() - started
        _, peak_rss = resident_set()
        result = {"run": args.run, "time_s": elapsed, "device_peak_nbytes": stats.device_peak_nbytes,
                  "peak_rss_nbytes": peak_rss, "base_rss_nbytes": base_rss, "weight_loads": stats.weight_loads,
                  "load_wait_s": stats.load_wait_s, "direct": model.file.direct,
                  "host_peak_nbytes": manager.host_tier.peak_nbytes,
                  "outputs_crc": zlib.crc32(outputs.tobytes())}
        manager.close()
        spill.close()
    return result


def child(args, run: str) -> dict:
    """:func:`run_once` in a fresh interpreter."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", run, "--models-dir", args.models_dir,
            "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
            "--batches", str(args.batches), "--device-mib", str(args.device_mib), "--host-mib", str(args.host_mib)]
    if args.dir:
        argv += ["--dir", args.dir]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the table ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where the model file and spill files go (default: the system's "
                                                    "temporary directory; on the disk to measure, not tmpfs)")
    parser.add_argument("--layers", type=int, default=160)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024, help="rows per batch")
    parser.add_argument("--batches", type=int, default=2, help="batches per call")
    parser.add_argument("--device-mib", type=int, default=32)
    parser.add_argument("--host-mib", type=int, default=32)
    parser.add_argument("--windows", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--models-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.run = args.child
        print(json.dumps(run_once(args)))
        return

    spec = make_spec(args.layers, args.width)
    layer_nbytes = max(sum(math.prod(s) * 4 for s in node.weights.values()) for node in spec.network.layered)
    with tempfile.TemporaryDirectory(prefix="tensile-bench-models-", dir=args.dir) as models_dir:
        os.chmod(models_dir, 0o700)
        args.models_dir = models_dir
        mf = ModelFiles(models_dir)
        started = time.perf_counter()
        file = mf.commit(mf.write(MODEL_ID, VERSION, NAME, spec, Generated(spec)), spec)
        write_s = time.perf_counter() - started
        file_nbytes = file.nbytes
        file.close()
        runs = ["resident"] + args.windows.split(",")
        samples: dict[str, list[dict]] = {r: [] for r in runs}
        for _ in range(args.repeats):         # interleaved, so drift on a shared machine hits all alike
            for run in runs:
                samples[run].append(child(args, run))

    budgets = (args.device_mib + args.host_mib) << 20
    ref = samples["resident"]
    ref_s = statistics.median(r["time_s"] for r in ref)
    ref_device = statistics.median(r["device_peak_nbytes"] for r in ref)
    ref_rss = statistics.median(r["peak_rss_nbytes"] for r in ref)
    batch_nbytes = args.batch * (2 * spec.n_features + spec.n_outputs) * 4
    table, within = [], True
    for run in runs:
        s = samples[run]
        base = max(r["base_rss_nbytes"] for r in s)
        overhead = base + batch_nbytes + layer_nbytes
        bound = budgets + overhead
        ok = all(r["peak_rss_nbytes"] <= bound for r in s)
        if run != "resident":
            within &= ok
        table.append([
            "all resident (unlimited budget)" if run == "resident" else f"window {run}",
            spread([r["device_peak_nbytes"] / 2**20 for r in s], ".1f"),
            spread([1 - r["device_peak_nbytes"] / ref_device for r in s], ".1%"),
            spread([r["time_s"] for r in s], ".2f"),
            spread([r["time_s"] / ref_s - 1 for r in s], "+.1%"),
            spread([r["peak_rss_nbytes"] / 2**20 for r in s], ".0f"),
            spread([1 - r["peak_rss_nbytes"] / ref_rss for r in s], ".1%"),
            "-" if run == "resident" else f"{bound / 2**20:.0f} {'yes' if ok else 'NO'}"])
    for label, saved, delay in PAPER:
        table.append([label, "", saved, "", delay, "", "", ""])
    crcs = {r["outputs_crc"] for s in samples.values() for r in s}
    delays = {run: [r["time_s"] / ref_s - 1 for r in samples[run]] for run in runs[1:]}
    ranked = sorted(delays, key=lambda run: statistics.median(delays[run]))
    decided = max(delays[ranked[0]]) < min(delays[ranked[1]]) if len(ranked) > 1 else True

    print(f"{args.layers} dense layers {args.width} wide ({spec.n_parameters():,} parameters, model file "
          f"{file_nbytes:,} bytes, written in {write_s:.1f} s), {args.batches} batches of {args.batch} rows per "
          f"call; device budget {args.device_mib} MiB, host budget {args.host_mib} MiB: the model is "
          f"{file_nbytes / budgets:.1f}x their sum")
    read_direct = [r["direct"] for s in samples.values() for r in s]
    how = ("O_DIRECT (from the disk, not the page cache) in every run" if all(read_direct) else
           f"buffered I/O in {read_direct.count(False)} of {len(read_direct)} runs (the page cache: O_DIRECT refused)")
    print(f"layers read with {how} "
          f"on {file_system(models_dir)} at {os.path.dirname(models_dir)}; each layer's CRC-32 verified; "
          f"{args.repeats} interleaved runs, each in a fresh process, medians [min, max]")
    print(tabulate(table, headers=["run", "device peak MiB", "memory saved", "seconds", "delay", "peak RSS MiB",
                                   "RSS saved", "RSS bound MiB / within"],
                   colalign=("left", "right", "right", "right", "right", "right", "right", "right")))
    base = max(r["base_rss_nbytes"] for run in runs[1:] for r in samples[run])
    print(f"RSS bound = device budget + host budget + fixed overhead: the resident set before the store opens the model "
          f"(interpreter, NumPy, package, rows; at most {base / 2**20:.0f} MiB) + one batch's host copies "
          f"({batch_nbytes / 2**20:.1f} MiB) + the largest layer ({layer_nbytes / 2**20:.1f} MiB)")
    print(f"least delay: window {ranked[0]}" + ("" if decided else f", within the spread of window {ranked[1]}: "
                                                  "not decided"))
    print(f"outputs identical in every run: {'yes' if len(crcs) == 1 else 'NO'}; peak RSS within the bound in "
          f"every layered run: {'PASS' if within else 'FAIL'}")


if __name__ == "__main__":
    main()
