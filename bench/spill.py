"""Training a model four times larger than the device and host budgets together, through the
disk tier, against the same training with unlimited memory.

A real coordinator process (``python -m tensile_db.coordinator``, started as a backend starts it,
:func:`tensile_db.coordinator.client.connect`) trains one MLP over its socket, sent a ``train``
request as a backend sends it: 23 dense layers of 1024 units on 256 generated features (10
classes, 512 rows, batch 64, 2 epochs, Adam, seed 0). Its weights plus Adam's two moments are
4x ``device_budget + host_budget`` (32 MiB each); the rest of a swapped-out tensor goes to the
coordinator's spill files. The reference run is the same request to a coordinator whose device
budget holds everything (no swap at all).

Each run is a fresh coordinator, so its peak resident set (VmHWM, read through the ``memory``
request, the figures of ``tensile.memory``) is that run's own. The runs alternate, repeated.

The bound on the limited run's peak RSS is ``device_budget + host_budget + overhead``, where the
overhead is fixed by the model and the data, not by the model's size in total, and is printed
part by part:

- the idle coordinator's RSS (the interpreter, NumPy, the package; read before the request);
- the training rows, three times (received, cast to float32, scaled);
- four times the largest tensor: initial weights are drawn in float64 and cast (three times one
  tensor), and a tensor read back from the disk tier for the result is one more;
- three 1 MiB bounce buffers of the spill files, one per thread that reads or writes unaligned
  host arrays (the adopted initial weights, a result being read back and sent).

Spill files are opened with ``O_DIRECT`` where the file system allows it (ext4 here: printed), so
the page cache is bypassed and every spilled byte is written to and read from the disk; nothing
is left to drop. The result's arrays (sent back one at a time) are hashed in this process and
must be bit-identical between the two runs; the bench exits non-zero when they differ, when a
run fails, or when the peak RSS exceeds the bound.

Printed: per run kind, wall time of the request (median [min, max]), EOR = limited / unlimited
- 1 per repeat, peak RSS against the bound, bytes spilled to and read from disk, the host tier's
peak against its budget, the device peak against its budget.

    python bench/spill.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
from tabulate import tabulate

from common import spread
from tensile_db.coordinator import client as coordinator_client
from tensile_db.coordinator.address import LOG_NAME
from tensile_db.memory import spill
from tensile_db.memory.spill import SpillFile
from tensile_db.runtime import model as models
from tensile_db.runtime.builder import build_training_program

MIB = 1 << 20
DEVICE_BUDGET = 32 * MIB
HOST_BUDGET = 32 * MIB
UNLIMITED_BUDGET = 2048 * MIB
FEATURES, CLASSES, ROWS, WIDTH, DEPTH = 256, 10, 512, 1024, 23
OPTIONS = {"epochs": 2, "batch_size": 64, "optimizer": "adam", "lr": 0.0005, "seed": 0}
ARCHITECTURE = {"layers": [{"dense": WIDTH}] * DEPTH}
BOUNCE_NBYTES = 3 * spill.BOUNCE_NBYTES   # one per thread: the executor's, the copy thread, the connection's


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES] @ rng.standard_normal(CLASSES)).argsort().argsort() * CLASSES // ROWS
    return x, y.astype(np.int32)


def persistent_nbytes() -> tuple[int, int, int]:
    """(weights and optimizer state, bytes; the largest tensor, bytes; the unscheduled peak)."""
    spec = models.ModelSpec.parse(ARCHITECTURE, FEATURES, CLASSES, "classification")
    program = build_training_program(spec, models.parse_options(OPTIONS), OPTIONS["batch_size"])
    slots = [s for s in program.slots.values() if s.kind.persistent]
    return sum(s.nbytes for s in slots), max(s.nbytes for s in program.slots.values()), program.vanilla_peak_nbytes()


def run(budget: int, host_budget: int, root: str) -> dict:
    """One fresh coordinator, one train request; its figures."""
    socket_dir = tempfile.mkdtemp(dir=root)
    os.chmod(socket_dir, 0o700)
    spec = coordinator_client.StartSpec(budget_nbytes=budget, host_budget_nbytes=host_budget, max_active_jobs=1,
                                        python_path=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    client = coordinator_client.connect(socket_dir, spec, timeout_s=60)
    try:
        idle = client.request({"type": "memory"})[0]
        x, y = data()
        started = time.perf_counter()
        client.send({"type": "train", "architecture": ARCHITECTURE, "options": OPTIONS, "model_name": "wide",
                     "task": "classification", "n_outputs": CLASSES}, {"x": x, "y": y})
        while True:
            header, arrays = client.receive()
            if header["type"] == "result":
                break
        wall_s = time.perf_counter() - started
        digest = hashlib.sha256()
        for name in sorted(arrays):
            digest.update(name.encode() + arrays[name].tobytes())
        del arrays
        memory = client.request({"type": "memory"})[0]
        client.send({"type": "shutdown"})
        client.receive()
    except BaseException:
        log = os.path.join(socket_dir, LOG_NAME)
        if os.path.exists(log):
            sys.stderr.write(open(log).read()[-4000:])
        raise
    finally:
        client.close()
    m = header["metrics"]
    return {"wall_s": wall_s, "digest": digest.hexdigest(), "idle_rss": idle["rss_nbytes"],
            "peak_rss": memory["peak_rss_nbytes"], "spilled": m.get("spilled_nbytes", 0),
            "swapped_out": m["swapped_out_nbytes"], "peak_device": m["peak_device_nbytes"],
            "host_peak": memory["host_peak_nbytes"], "disk_read": memory["disk_read_bytes_per_s"],
            "disk_write": memory["disk_write_bytes_per_s"], "data_nbytes": x.nbytes + y.nbytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    state, largest, vanilla = persistent_nbytes()
    print(f"weights + Adam state {state / MIB:.0f} MiB = {state / (DEVICE_BUDGET + HOST_BUDGET):.1f}x "
          f"(device budget {DEVICE_BUDGET / MIB:.0f} MiB + host budget {HOST_BUDGET / MIB:.0f} MiB); "
          f"unscheduled peak {vanilla / MIB:.0f} MiB; largest tensor {largest / MIB:.0f} MiB")
    root = tempfile.mkdtemp(prefix="tensile-bench-spill-", dir=os.environ.get("TENSILE_BENCH_DIR", "/var/tmp"))
    probe = SpillFile(os.path.join(root, "probe"))
    print(f"spill files in {root}: {'O_DIRECT (the page cache is bypassed)' if probe.direct else 'buffered'}")
    probe.close()
    runs: dict[str, list[dict]] = {"unlimited": [], "limited": []}
    for r in range(args.repeats):
        order = ["unlimited", "limited"] if r % 2 == 0 else ["limited", "unlimited"]
        for kind in order:
            budget, host = (UNLIMITED_BUDGET, UNLIMITED_BUDGET) if kind == "unlimited" else (DEVICE_BUDGET, HOST_BUDGET)
            runs[kind].append(run(budget, host, root))
            print(f"repeat {r + 1}, {kind}: {runs[kind][-1]['wall_s']:.2f} s", flush=True)
    failures = []
    digests = {res["digest"] for rs in runs.values() for res in rs}
    if len(digests) != 1:
        failures.append(f"results differ between runs: {len(digests)} distinct weight digests")
    lim = runs["limited"]
    overhead = {"idle coordinator": max(r["idle_rss"] for r in lim), "training rows x3": 3 * lim[0]["data_nbytes"],
                "largest tensor x4": 4 * largest, "bounce buffers": BOUNCE_NBYTES}
    bound = DEVICE_BUDGET + HOST_BUDGET + sum(overhead.values())
    eor = [lo["wall_s"] / un["wall_s"] - 1 for lo, un in zip(runs["limited"], runs["unlimited"])]
    rows = []
    for kind, rs in runs.items():
        rows.append([kind, spread([r["wall_s"] for r in rs], ".2f"),
                     f"{max(r['peak_rss'] for r in rs) / MIB:,.0f}",
                     f"{bound / MIB:,.0f}" if kind == "limited" else "-",
                     f"{max(r['peak_device'] for r in rs) / MIB:,.1f}",
                     f"{max(r['host_peak'] for r in rs) / MIB:,.1f}" if kind == "limited" else "-",
                     f"{statistics.median(r['swapped_out'] for r in rs) / MIB:,.0f}",
                     f"{statistics.median(r['spilled'] for r in rs) / MIB:,.0f}"])
    print(tabulate(rows, headers=["run", "wall s", "peak RSS MiB", "RSS bound MiB", "device peak MiB",
                                  "host tier peak MiB", "swapped out MiB", "spilled to disk MiB"]))
    print(f"EOR (limited / unlimited - 1, per repeat): median {statistics.median(eor):.2f} "
          f"[{min(eor):.2f}, {max(eor):.2f}]")
    print("RSS bound = device budget + host budget + overhead: " + ", ".join(
        f"{k} {v / MIB:.1f} MiB" for k, v in overhead.items()))
    bw = lim[0]
    if bw["disk_read"]:
        print(f"spill directory measured at start: read {bw['disk_read'] / 1e9:.2f} GB/s, "
              f"write {bw['disk_write'] / 1e9:.2f} GB/s")
    print(f"results bit-identical across all {2 * args.repeats} runs: {len(digests) == 1}")
    unlimited_peak = max(r["peak_device"] for r in runs["unlimited"])
    print(f"MSR (device) = 1 - {max(r['peak_device'] for r in lim) / MIB:.0f} / {unlimited_peak / MIB:.0f} MiB = "
          f"{1 - max(r['peak_device'] for r in lim) / unlimited_peak:.1%}; peak RSS saved "
          f"{1 - max(r['peak_rss'] for r in lim) / max(r['peak_rss'] for r in runs['unlimited']):.1%}")
    shutil.rmtree(root, ignore_errors=True)
    for r in lim:
        if r["peak_rss"] > bound:
            failures.append(f"peak RSS {r['peak_rss']:,} bytes over the bound {bound:,}")
        if r["host_peak"] > HOST_BUDGET:
            failures.append(f"host tier peak {r['host_peak']:,} over its budget")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
