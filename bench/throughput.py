"""Training throughput (samples per second) of our runtime beside PyTorch on the CPU.

The same MLP, batch, optimizer (Adam) and data, in one process: PyTorch (``torch.nn``,
``torch.optim.Adam``), our runtime through the coordinator's executor and memory manager with an
unlimited budget (vanilla), and our runtime under budgets of 70% and 50% of the model's
unscheduled peak (the reactive farthest-next-use policy swapping to host memory). Each is run
once to warm up, then timed over ``--epochs``. Reports samples/s, the peak device bytes and the
bytes swapped out.

    python bench/throughput.py [--samples 32768] [--epochs 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tabulate import tabulate

from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime.device import Device

ARCHITECTURE = {"layers": [{"dense": 512}, {"dense": 512}, {"dense": 256}]}
FEATURES, CLASSES, BATCH = 64, 10, 128


def data(samples: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, CLASSES))
    return x, (x @ w).argmax(axis=1).astype(np.int32)


def ours(x, y, epochs: int, budget_fraction: float | None) -> tuple[float, dict]:
    spec = models.ModelSpec(models.parse_architecture(ARCHITECTURE), FEATURES, CLASSES, "classification")
    opts = models.parse_options({"epochs": epochs, "batch_size": BATCH, "standardize": False})
    job = TrainingJob(JobInfo(0, "bench", "bench"), spec, opts, x, y)
    budget = int(job.vanilla_peak_nbytes * budget_fraction) if budget_fraction else job.vanilla_peak_nbytes * 4
    budget = max(budget, job.min_working_set_nbytes)
    executor = Executor(MemoryManager(Device("cpu"), budget))
    executor.start()
    t0 = time.perf_counter()
    executor.submit(job)
    while job.events.get()[0] == "progress":
        pass
    elapsed = time.perf_counter() - t0
    if job.error:
        raise job.error
    return job.steps_per_epoch * BATCH * epochs / elapsed, {
        "budget": budget, "peak": job.memory.peak_nbytes, "swapped": job.memory.swapped_out_nbytes,
        "vanilla": job.vanilla_peak_nbytes}


def pytorch(x, y, epochs: int) -> float:
    import torch

    widths = [FEATURES] + [layer["dense"] for layer in ARCHITECTURE["layers"]]
    layers: list = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], CLASSES))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    steps = len(x) // BATCH
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(steps):
            idx = order[i * BATCH:(i + 1) * BATCH]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
            opt.step()
    return steps * BATCH * epochs / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    x, y = data(args.samples)
    import torch

    pytorch(x[:4096], y[:4096], 1)                 # warm-up
    ours(x[:4096], y[:4096], 1, None)
    rows = [["PyTorch 2.13 (CPU)", pytorch(x, y, args.epochs), "-", "-", "-"]]
    for label, fraction in (("tensile_db, unlimited budget", None), ("tensile_db, 70% budget", 0.7),
                            ("tensile_db, 50% budget", 0.5)):
        rate, mem = ours(x, y, args.epochs, fraction)
        rows.append([label, rate, f"{mem['budget']:,}", f"{mem['peak']:,}", f"{mem['swapped']:,}"])
    print(f"MLP {FEATURES}-{'-'.join(str(l['dense']) for l in ARCHITECTURE['layers'])}-{CLASSES}, batch {BATCH}, Adam, "
          f"{args.samples:,} samples x {args.epochs} epochs, float32, {torch.get_num_threads()} torch threads; "
          f"unscheduled peak {mem['vanilla']:,} bytes")
    print(tabulate(rows, headers=["runtime", "samples/s", "budget bytes", "peak device bytes", "swapped out bytes"],
                   floatfmt=",.0f", colalign=("left", "right", "right", "right", "right")))


if __name__ == "__main__":
    main()
