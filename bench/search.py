"""A hyperparameter search from SQL: its trials trained at the same time under one device budget,
beside the same trials trained one after another.

One ``CALL tensile.train_model`` with ``options.search`` = a grid of 2 learning rates x 4 layer
stacks (8 trials) on scikit-learn's digits (1,347 rows of 64 pixels, 10 classes; 20% held out by
the extension, stratified, seed 0), run three ways:

- ``parallel 8``: the 8 trials as 8 concurrent jobs on the coordinator,
- ``parallel 1``: the same 8 trials one after another,
- ``parallel 8, halving``: the same with successive halving (the worse half stopped at each rung),
- a reference: ``parallel 8`` with room for every trial at once (twice the sum of their peaks),

the first three with ``tensile.device_budget`` below the sum of the 8 trials' unscheduled (vanilla)
peaks and above the largest one, so that training them at once must swap while any one alone fits.
The peaks are computed as the coordinator computes them
(:func:`tensile_db.runtime.builder.build_training_program`) and checked afterwards against the
``vanilla_peak_nbytes`` each version is stored with. Before each run the budget is written to the
cluster's settings file (:meth:`tensile_db.cluster.EmbeddedCluster.configure`) and a fresh
coordinator started (``tensile.stop_coordinator()``, then ``tensile.start_coordinator()`` once the
old one has gone, outside the timing), so ``tensile.memory.peak_bytes`` read after the CALL is that
run's own high-water mark. The runs alternate, the order reversed every other repeat.

Printed: per mode the CALL's wall time as the median over the repeats with [min, max], the peak
device bytes against the budget and against the mode's unscheduled peak (the sum of the 8 peaks
at once, the largest one for one at a time) with the memory saving ratio MSR = 1 - peak / that,
the bytes swapped out, the best held-out F1 macro, and the speed of each parallel mode against
parallel 1 per repeat (parallel 1's wall time over the mode's in the same repeat): decided only
when every repeat's ratio lies on one side of 1, "not decided" otherwise, and whether the
wall-time ranges themselves overlap. Every trial must finish (8 stored versions, no failed trial)
and the peak must stay within the budget, or the bench exits non-zero.

    python bench/search.py [--repeats 3] [--epochs 10]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from sqlalchemy import create_engine, text
from tabulate import tabulate

import cnn
from common import spread
from tensile_db.client import TensileClient
from tensile_db.cluster import scratch_cluster
from tensile_db.demo import FEATURES, load_digits_tables
from tensile_db.runtime import model as models
from tensile_db.runtime.builder import build_training_program

DATABASE = "tensile_bench_search"
CLASSES = 10
TEST_SIZE = 0.2
LAYERS = [[{"dense": 512}, {"dense": 256}], [{"dense": 256}, {"dense": 256}, {"dense": 128}],
          [{"dense": 1024}], [{"dense": 512}, {"dense": 512}, {"dense": 256}]]
LRS = [0.001, 0.003]
#: The device budget as a fraction of the sum of the trials' unscheduled peaks.
BUDGET_FRACTION = 0.4
#: The reference mode's budget, as a multiple of that sum: room for every trial at once.
ROOMY_FRACTION = 2.0
#: mode -> (trials at a time, budget as a fraction of the sum of the trials' unscheduled peaks, halving)
MODES = {"parallel 8": (8, BUDGET_FRACTION, False), "parallel 1": (1, BUDGET_FRACTION, False),
         "parallel 8, halving": (8, BUDGET_FRACTION, True),
         "parallel 8, roomy budget (reference)": (8, ROOMY_FRACTION, False)}


def options(epochs: int, parallel: int, halving: bool = False) -> dict:
    return {"epochs": epochs, "batch_size": 128, "optimizer": "adam", "seed": 0, "test_size": TEST_SIZE,
            "replace": True, "search": {"method": "grid", "params": {"lr": LRS, "layers": LAYERS},
                                        "parallel": parallel, "halving": halving}}


def unscheduled_peaks(epochs: int, n_rows: int) -> list[int]:
    """The vanilla peak of each trial, bytes, as the coordinator computes it for ``n_rows``
    training rows (the rows left after the held-out ones)."""
    peaks = []
    for layers in LAYERS:
        for lr in LRS:
            spec = models.ModelSpec.parse({"layers": layers}, len(FEATURES), CLASSES, "classification")
            opts = models.parse_options(dict(options(epochs, 1), lr=lr, search=None))
            peaks.append(build_training_program(spec, opts, min(opts.batch_size, n_rows)).vanilla_peak_nbytes())
    return peaks


def restart_coordinator(engine) -> None:
    """Stop the coordinator (``tensile.stop_coordinator`` returns once its process has exited) and
    start a fresh one."""
    with engine.begin() as conn:
        conn.execute(text("SELECT tensile.stop_coordinator()"))
    with engine.begin() as conn:
        conn.execute(text("SELECT tensile.start_coordinator()"))


def run(cluster, engine, client: TensileClient, name: str, epochs: int, parallel: int, budget: int,
        halving: bool) -> dict:
    """One search on a fresh coordinator with a device budget of ``budget`` bytes: wall s of the
    CALL, the coordinator's peak and budget bytes, and the stored versions' trials, scores,
    vanilla peaks and bytes swapped out."""
    # The budget is read by the coordinator when it starts, from the cluster's settings.
    cluster.configure({"tensile.device_budget": f"'{budget}'", "tensile.max_active_jobs": str(len(LAYERS) * len(LRS))})
    restart_coordinator(engine)
    notices: list[str] = []
    started = time.perf_counter()
    client.train(name, "SELECT * FROM digits_train", "label", architecture={"layers": LAYERS[0]},
                 options=options(epochs, parallel, halving), on_notice=notices.append)
    wall_s = time.perf_counter() - started
    memory = client.memory()
    versions = [v for v in client.models() if v["name"] == name]
    client.drop(name)
    return {"wall_s": wall_s, "peak_nbytes": memory["peak_bytes"], "budget_nbytes": memory["budget_bytes"],
            "trials": len(versions), "failed": [n for n in notices if "failed" in n],
            "best_score": max(v["score"] for v in versions),
            "vanilla_peaks": sorted(v["metrics"]["vanilla_peak_nbytes"] for v in versions),
            "swapped_out_nbytes": sum(v["metrics"]["swapped_out_nbytes"] for v in versions),
            "stopped": sum(v["metrics"].get("stopped") == "halving" for v in versions)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of every trial")
    args = parser.parse_args()
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with scratch_cluster(DATABASE) as cluster:
        engine = create_engine(cluster.url(DATABASE))
        client = TensileClient(engine)
        n_source = load_digits_tables(engine)
        n_rows = n_source - math.ceil(TEST_SIZE * n_source)      # the rows left after the held-out ones
        peaks = unscheduled_peaks(args.epochs, n_rows)
        budgets = {mode: int(fraction * sum(peaks)) for mode, (_, fraction, _) in MODES.items()}
        if not max(peaks) < budgets["parallel 8"] < sum(peaks):
            raise SystemExit(f"budget {budgets['parallel 8']:,} is not between the largest trial's peak "
                             f"{max(peaks):,} and their sum {sum(peaks):,}; change BUDGET_FRACTION")
        for r in range(args.repeats):
            for mode in list(MODES) if r % 2 == 0 else list(MODES)[::-1]:
                parallel, _, halving = MODES[mode]
                runs[mode].append(run(cluster, engine, client, f"digits_search_{parallel}", args.epochs, parallel,
                                      budgets[mode], halving))
        device = client.memory()["device"]
        engine.dispose()

    rows, checks = [], {}
    for mode, (parallel, _, _) in MODES.items():
        ms = runs[mode]
        vanilla = sum(peaks) if parallel == len(peaks) else max(peaks)
        peak = max(m["peak_nbytes"] for m in ms)
        rows.append([mode, spread([m["wall_s"] for m in ms], ".1f"), f"{peak:,}", f"{ms[0]['budget_nbytes']:,}",
                     f"{vanilla:,}", f"{1 - peak / vanilla:.0%}",
                     f"{statistics.median(m['swapped_out_nbytes'] for m in ms):,}",
                     spread([m["best_score"] for m in ms], ".3f"), f"{min(m['trials'] for m in ms)} / {len(peaks)}",
                     str(statistics.median(m["stopped"] for m in ms))])
        checks[f"{mode}: every trial of every run finished (8 versions stored, none failed)"] = all(
            m["trials"] == len(peaks) and not m["failed"] for m in ms)
        checks[f"{mode}: the peak stayed within the budget"] = all(
            m["peak_nbytes"] <= m["budget_nbytes"] <= budgets[mode] for m in ms)
        checks[f"{mode}: the stored unscheduled peaks are the ones computed here"] = all(
            m["vanilla_peaks"] == sorted(peaks) for m in ms)
    print("# Hyperparameter search from SQL: 8 trials at once against one after another, measured on this machine\n")
    print(tabulate(rows, headers=["mode", "wall s median [min, max]", "peak device bytes (max)", "budget bytes",
                                  "unscheduled peak bytes", "MSR", "swapped out bytes (median)",
                                  "best held-out F1 macro", "trials stored", "stopped by halving (median)"],
                   tablefmt="github", disable_numparse=True, colalign=("left",) + ("right",) * 9))
    print()
    alone = [m["wall_s"] for m in runs["parallel 1"]]
    for mode in ("parallel 8", "parallel 8, halving", "parallel 8, roomy budget (reference)"):
        together = [m["wall_s"] for m in runs[mode]]
        speedups = [a / t for a, t in zip(alone, together)]
        # Paired by repeat, as the runs were interleaved: decided only when every repeat agrees.
        verdict = (f"{mode} faster" if min(speedups) > 1 else "parallel 1 faster" if max(speedups) < 1
                   else "not decided")
        overlap = min(together) <= max(alone) and min(alone) <= max(together)
        print(f"Speed of {mode} against parallel 1: {statistics.median(speedups):.2f}x (per repeat "
              f"{min(speedups):.2f}x to {max(speedups):.2f}x): {verdict}"
              + ("; the wall-time ranges themselves overlap" if overlap else ""))
    print(f"\nGrid: lr {LRS} x layers {[[l['dense'] for l in ls] for ls in LAYERS]}, ReLU, Adam, batch 128, "
          f"{args.epochs} epochs, {n_rows:,} training rows; unscheduled peaks per trial "
          f"{', '.join(f'{p:,}' for p in peaks)} bytes (sum {sum(peaks):,}, largest {max(peaks):,}); budget "
          f"{BUDGET_FRACTION:.0%} of the sum (the reference: {ROOMY_FRACTION:.0%}), rounded down to the arena's "
          f"unit. {args.repeats} repeats, interleaved; the coordinator's {device} device; measured on this machine: "
          f"{cnn.machine()}.\n")
    for what, passed in checks.items():
        print(f"{'ok    ' if passed else 'FAILED'} {what}")
    print(f"\nBenchmark took {time.perf_counter() - started:.0f} s.")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
