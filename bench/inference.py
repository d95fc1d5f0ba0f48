"""Demand-layered inference: device memory and time per batch against the prefetch window, and
concurrent ``predict_batch`` calls on several models under one small budget.

Part 1 (the coordinator's runtime, no PostgreSQL): a model of ``--layers`` dense layers of
``--width`` units (48 x 512 by default, 12.3 million parameters). *Preloaded* is the classical
way: every layer resident before the call (a call whose layers are all in the weight cache), so a
batch costs its arithmetic only. Each window ``W`` runs with the cache off, so every batch streams
every layer through the arena, ``W`` layers ahead of the one computing. Device bytes are the
arena's high-water mark of a fresh manager; time per batch is the median over ``--repeats`` calls
of the call's time over its batches. Writes ``bench/out/inference_memory_delay.png``. A second
table runs the same on a convolutional network (``--cnn``, ResNet-50 at a quarter of its width on
3 x 32 x 32 images by default), whose activations and convolution workspaces, not its weights,
are most of a call's device bytes.

Part 2 (through SQL, a real cluster with ``--calls`` connections): ``--calls`` models of
``--model-layers`` x ``--width`` layers and a budget that holds about a third of them;
``tensile.predict_batch`` on each model, first one call after another on one connection, then all
at once from one connection each. Rows per second of all calls together.

    python bench/inference.py [--device cpu|cuda] [--skip-cnn] [--skip-sql]
"""

from __future__ import annotations

import argparse
import os
import site
import statistics
import tempfile
import threading
import time

import numpy as np
from tabulate import tabulate

from tensile_db.inference.service import InferenceService
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.weights import serialize_weights

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
#: Targets of batch inference.
WINDOW_1_SAVING, WINDOW_1_DELAY = 0.90, 0.15
BEST_SAVING, BEST_DELAY = 0.80, 0.02


def make_model(layers: int, width: int, n_features: int, n_outputs: int, seed: int = 0):
    arch = models.parse_architecture({"layers": [{"dense": width}] * (layers - 1)})
    spec = models.ModelSpec(arch, n_features, n_outputs, "classification")
    return spec, models.init_weights(spec, seed)


def make_cnn(name: str, width: float, side: int, seed: int = 0):
    """A named convolutional network (:mod:`tensile_db.runtime.zoo`) on 3 x side x side images, 10 classes."""
    arch = models.parse_architecture({"model": name, "width": width, "input": {"shape": [3, side, side]}})
    spec = models.ModelSpec(arch, 3 * side * side, 10, "classification")
    return spec, models.init_weights(spec, seed)


def timed_call(device: str, spec, weights, x, window: int, batch: int, preloaded: bool) -> tuple[float, int, object]:
    """(seconds per batch, arena high-water mark in bytes, the call's stats) of one call on a fresh
    manager. ``preloaded``: a first call fills the weight cache and the timed one finds every layer
    resident."""
    budget = 2 * sum(w.nbytes for w in weights.values()) + (64 << 20)
    svc = InferenceService(MemoryManager(make_device(device), budget))
    try:
        if preloaded:
            model = svc.store.add(1, "v", "bench", spec, weights)
            svc.predict(model, x, window, batch, cache=True)
        model = svc.store.checkout(1, "v") or svc.store.add(1, "v", "bench", spec, weights)
        _, stats = svc.predict(model, x, window, batch, cache=preloaded)
        return stats.time_s / stats.batches, svc.manager.peak_nbytes, stats
    finally:
        svc.manager.close()


def window_rows(args, spec, weights, batch: int, windows) -> list[dict]:
    """One row per run: preloaded, then each window below ``L - 1`` (``L``: layers with weights);
    medians over ``args.repeats`` calls of ``args.batches`` batches of ``batch`` rows."""
    x = np.random.default_rng(1).normal(size=(batch * args.batches, spec.n_features)).astype(np.float32)
    n_layers = len(spec.network.layered)
    runs = [("preloaded", n_layers, True)] + [(str(w), w, False) for w in windows if w < n_layers - 1]
    timed_call(args.device, spec, weights, x[:batch * 2], 1, batch, False)      # warm-up
    samples: dict[str, list] = {label: [] for label, _, _ in runs}
    for _ in range(args.repeats):              # interleaved, so drift on a shared machine hits all alike
        for label, window, preloaded in runs:
            samples[label].append(timed_call(args.device, spec, weights, x, window, batch, preloaded))
    rows = []
    base_s = statistics.median(s[0] for s in samples["preloaded"])
    base_nbytes = samples["preloaded"][0][1]
    for label, window, _ in runs:
        per_batch = statistics.median(s[0] for s in samples[label])
        nbytes = samples[label][0][1]
        stats = samples[label][0][2]
        rows.append({"window": label, "device_nbytes": nbytes, "saving": 1 - nbytes / base_nbytes,
                     "ms_per_batch": per_batch * 1e3, "delay": per_batch / base_s - 1,
                     "loads_per_batch": stats.weight_loads / stats.batches,
                     "wait_ms_per_batch": stats.load_wait_s / stats.batches * 1e3})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(tabulate([[r["window"], f"{r['device_nbytes']:,}", f"{r['saving']:.1%}", f"{r['ms_per_batch']:.2f}",
                     f"{r['delay']:+.1%}", f"{r['loads_per_batch']:.0f}", f"{r['wait_ms_per_batch']:.2f}"] for r in rows],
                   headers=["window (layers ahead)", "device bytes", "less memory", "ms / batch", "delay",
                            "layer loads / batch", "ms / batch waiting"],
                   colalign=("left", "right", "right", "right", "right", "right", "right")))


def windows_table(args) -> list[dict]:
    spec, weights = make_model(args.layers, args.width, args.width, 10)
    n_layers = len(spec.network.layered)
    rows = window_rows(args, spec, weights, args.batch, (1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
    print(f"\n{n_layers} dense layers {spec.n_features}-{args.width}x{n_layers - 1}-10, "
          f"{spec.n_parameters():,} parameters ({sum(w.nbytes for w in weights.values()):,} bytes of weights), "
          f"batch {args.batch}, {args.batches} batches per call, median of {args.repeats}, device {args.device}")
    print_rows(rows)
    streamed = rows[1:]
    w1 = streamed[0]
    meets = [r for r in streamed if r["saving"] >= BEST_SAVING and r["delay"] <= BEST_DELAY]
    print(f"window 1: {w1['saving']:.1%} less memory (target >= {WINDOW_1_SAVING:.0%}), delay {w1['delay']:+.1%} "
          f"(target <= {WINDOW_1_DELAY:.0%}): "
          f"{'PASS' if w1['saving'] >= WINDOW_1_SAVING and w1['delay'] <= WINDOW_1_DELAY else 'FAIL'}")
    best = min(meets, key=lambda r: r["device_nbytes"]) if meets else min(streamed, key=lambda r: r["delay"])
    print(f"best window {best['window']}: {best['saving']:.1%} less memory (target >= {BEST_SAVING:.0%}), delay "
          f"{best['delay']:+.1%} (target <= {BEST_DELAY:.0%}): {'PASS' if meets else 'FAIL'}")
    plot(rows, args)
    return rows


def cnn_table(args) -> list[dict]:
    """The same runs on a convolutional network: its activations and convolution workspaces, not
    its weights, are most of a call's device bytes, so streaming the layers saves less."""
    spec, weights = make_cnn(args.cnn, args.cnn_width, args.cnn_side)
    n_layers = len(spec.network.layered)
    rows = window_rows(args, spec, weights, args.cnn_batch, (1, 2, 4, 8, 16))
    print(f"\n{args.cnn} (width {args.cnn_width}) on 3x{args.cnn_side}x{args.cnn_side} images, "
          f"{len(spec.network.nodes)} nodes of which {n_layers} hold weights, {spec.n_parameters():,} parameters "
          f"({sum(w.nbytes for w in weights.values()):,} bytes of weights), batch {args.cnn_batch}, {args.batches} "
          f"batches per call, median of {args.repeats}, device {args.device}")
    print_rows(rows)
    return rows


def plot(rows, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(OUT, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    streamed = rows[1:]
    ax.plot([r["device_nbytes"] / 2**20 for r in streamed], [100 * r["delay"] for r in streamed], "o-",
            label="demand layering, window W")
    for r in streamed:
        ax.annotate(f"W={r['window']}", (r["device_nbytes"] / 2**20, 100 * r["delay"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.plot([rows[0]["device_nbytes"] / 2**20], [0], "s", color="black", label="preloaded")
    ax.axhline(100 * BEST_DELAY, color="grey", lw=0.8, ls=":")
    ax.axhline(100 * WINDOW_1_DELAY, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("device bytes of the call (MiB)")
    ax.set_ylabel("delay per batch against preloaded (%)")
    ax.set_title(f"{args.layers} layers x {args.width}, batch {args.batch}, {args.device}")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(OUT, f"inference_memory_delay{'_cuda' if args.device == 'cuda' else ''}.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# --- part 2: concurrent predict_batch through SQL ------------------------------------------------


def concurrency_table(args) -> None:
    import psycopg

    from tensile_db.cluster import EmbeddedCluster

    spec, first = make_model(args.model_layers, args.width, args.features, 10)
    model_nbytes = sum(w.nbytes for w in first.values())
    budget = model_nbytes * args.calls // 3
    base = tempfile.mkdtemp(prefix="tensile-bench-")
    cluster = EmbeddedCluster(base, python_paths=[site.getsitepackages()[0]],
                              settings={"tensile.device_budget": f"'{budget}'"})
    cluster.start()
    try:
        cluster.create_database("bench")
        dsn = cluster.conninfo("bench")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS tensile_db CASCADE")
            columns = ", ".join(f"(random() * 2 - 1)::real AS f{i}" for i in range(args.features))
            conn.execute(f"CREATE TABLE bench_rows AS SELECT g AS id, {columns} FROM generate_series(1, {args.rows}) g")
            for k in range(args.calls):
                _, weights = make_model(args.model_layers, args.width, args.features, 10, seed=k)
                conn.execute(
                    "INSERT INTO tensile.models (name, version, deployed, task, architecture, options, feature_names, "
                    "label_name, label_classes, metrics, weights) "
                    "VALUES (%s, 1, true, 'classification', %s, '{}', %s, 'label', %s, '{}', %s)",
                    (f"bench_{k}", psycopg.types.json.Jsonb(spec.architecture.to_json()),
                     [f"f{i}" for i in range(args.features)], [float(c) for c in range(10)],
                     serialize_weights(weights)))

        def call(conn, k):
            n = conn.execute("SELECT count(*) FROM tensile.predict_batch(%s, 'bench_rows', 'id', %s)",
                             (f"bench_{k}", f'{{"window": {args.window}, "batch_size": {args.batch}}}')).fetchone()[0]
            assert n == args.rows

        conns = [psycopg.connect(dsn, autocommit=True) for _ in range(args.calls)]
        try:
            for k, conn in enumerate(conns):       # warm-up: coordinator started, every model sent once
                call(conn, k)
            rows = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for k in range(args.calls):
                    call(conns[0], k)
                sequential_s = time.perf_counter() - t0
                threads = [threading.Thread(target=call, args=(conns[k], k)) for k in range(args.calls)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                concurrent_s = time.perf_counter() - t0
                rows.append((sequential_s, concurrent_s))
            memory = conns[0].execute("SELECT peak_bytes, budget_bytes, weight_loads, weight_cache_hits, "
                                      "weight_cache_evictions FROM tensile.memory").fetchone()
        finally:
            for conn in conns:
                conn.close()
    finally:
        cluster.destroy()
    total = args.calls * args.rows
    sequential_s = statistics.median(r[0] for r in rows)
    concurrent_s = statistics.median(r[1] for r in rows)
    print(f"\n{args.calls} models of {args.model_layers} dense layers {args.features}-{args.width}x"
          f"{args.model_layers - 1}-10 ({model_nbytes:,} bytes of weights each, {args.calls * model_nbytes:,} in all), "
          f"budget {budget:,} bytes, {args.rows:,} rows per call, window {args.window}, batch {args.batch}, "
          f"median of {args.repeats}")
    print(tabulate([["one after another (1 connection)", f"{sequential_s:.2f}", f"{total / sequential_s:,.0f}"],
                    [f"{args.calls} at once ({args.calls} connections)", f"{concurrent_s:.2f}",
                     f"{total / concurrent_s:,.0f}"]],
                   headers=["predict_batch calls", "seconds", "rows / s"], colalign=("left", "right", "right")))
    print(f"coordinator: peak {memory[0]:,} of {memory[1]:,} budget bytes; {memory[2]:,} layer loads, "
          f"{memory[3]:,} cache hits, {memory[4]:,} cache evictions")
    print(f"concurrent throughput above sequential: {'PASS' if concurrent_s < sequential_s else 'FAIL'} "
          f"({sequential_s / concurrent_s:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=int, default=48, help="dense layers of the window model")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8, help="batches per timed call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cnn", default="resnet50", help="the named convolutional network of part 1's second table")
    parser.add_argument("--cnn-width", type=float, default=0.25, help="its channel multiplier")
    parser.add_argument("--cnn-side", type=int, default=32, help="its input images' side")
    parser.add_argument("--cnn-batch", type=int, default=32)
    parser.add_argument("--skip-cnn", action="store_true", help="no convolutional network table")
    parser.add_argument("--skip-sql", action="store_true", help="part 1 only (no PostgreSQL, e.g. on a GPU machine)")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--model-layers", type=int, default=12)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--window", type=int, default=2)
    args = parser.parse_args()
    windows_table(args)
    if not args.skip_cnn:
        cnn_table(args)
    if not args.skip_sql:
        args.repeats = max(1, args.repeats // 2)
        concurrency_table(args)


if __name__ == "__main__":
    main()
