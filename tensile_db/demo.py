"""The main job: four models trained at once, from SQL, under one device budget.

Starts (or reuses) the embedded cluster in ``<home>/cluster``, creates the database ``tensile_demo``
afresh with the extension (dropping the previous run's), loads scikit-learn's bundled digits data (1,797 8x8 images, 64 features, 10
classes) into ``digits_train`` / ``digits_test`` (a stratified 75/25 split), sets the device budget
below the sum of the models' unscheduled peaks, runs four ``CALL tensile.train_model`` from four
connections at the same time — three MLPs and a convolutional network that reads each row's 64
pixels as a 1x8x8 image — and prints per model the test accuracy (computed in SQL
with ``tensile.predict``), the training time, the peak device bytes and the bytes swapped, then
the budget and the coordinator's combined high-water mark.
"""

from __future__ import annotations

import site
import sys
import threading
import time
from pathlib import Path

from sqlalchemy import create_engine, text
from tabulate import tabulate

from .client import TensileClient
from .cluster import EmbeddedCluster
from .runtime import model as models
from .runtime.builder import build_training_program

DATABASE = "tensile_demo"
#: Budget as a fraction of the sum of the models' unscheduled peaks.
BUDGET_FRACTION = 0.5
OPTIONS = {"epochs": 30, "batch_size": 128, "optimizer": "adam", "lr": 0.001, "seed": 7}
#: The convolutional network: a stem, a residual block, pooling, a branch joined by concatenation.
CNN = {"input": {"shape": [1, 8, 8]}, "layers": [
    {"conv": 16, "kernel": 3, "padding": 1, "bias": False, "activation": "none"},
    {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 16, "padding": 1}, {"conv": 16, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"max_pool": 2},
    {"concat": [[], [{"conv": 16, "kernel": 1}]]},
    {"conv": 32, "padding": 1}, {"global_avg_pool": {}}, {"dense": 64}]}
#: name -> (architecture, options beyond OPTIONS, the test accuracy it must reach)
MODELS = {
    "digits_wide": ({"layers": [{"dense": 512, "activation": "relu", "dropout": 0.1}, {"dense": 256, "activation": "relu"}]},
                    {}, 0.95),
    "digits_deep": ({"layers": [{"dense": 256}, {"dense": 256}, {"dense": 128}, {"dense": 64}]}, {}, 0.95),
    "digits_tanh": ({"layers": [{"dense": 384, "activation": "tanh"}, {"dense": 128, "activation": "sigmoid"}]}, {}, 0.95),
    "digits_cnn": (CNN, {"batch_size": 64, "lr": 0.003}, 0.97),
}
FEATURES = [f"p{i}" for i in range(64)]


def unscheduled_peak(architecture: dict, options: dict, n_rows: int) -> tuple[int, int]:
    """(vanilla peak, smallest working set) of one model, bytes, as the coordinator computes them."""
    spec = models.ModelSpec.parse(architecture, len(FEATURES), 10, "classification")
    opts = models.parse_options(dict(OPTIONS, **options))
    program = build_training_program(spec, opts, min(opts.batch_size, n_rows))
    return program.vanilla_peak_nbytes(), program.min_working_set_nbytes


def load_digits_tables(engine) -> int:
    """Create and fill digits_train / digits_test; returns the number of training rows."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    columns = ", ".join(f"{c} real NOT NULL" for c in FEATURES)
    with engine.begin() as conn:
        raw = conn.connection.driver_connection
        for table, xs, ys in (("digits_train", x_train, y_train), ("digits_test", x_test, y_test)):
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
            conn.execute(text(f"CREATE TABLE {table} ({columns}, label integer NOT NULL)"))
            with raw.cursor().copy(f"COPY {table} FROM STDIN") as copy:
                for row, label in zip(xs, ys):
                    copy.write_row([*row.tolist(), int(label)])
    return len(x_train)


def run(home: str) -> int:
    site_packages = site.getsitepackages()[0]
    cluster = EmbeddedCluster(Path(home) / "cluster", python_paths=[site_packages])
    print(f"starting PostgreSQL in {cluster.data_dir} (socket in {cluster.socket_dir}, no TCP)")
    cluster.start()
    cluster.create_database(DATABASE, fresh=True)      # the demo's own database, rebuilt every run
    engine = create_engine(cluster.url(DATABASE), pool_size=8)
    n_train = load_digits_tables(engine)
    print(f"loaded digits: {n_train} training rows, 64 features, 10 classes")

    peaks = {name: unscheduled_peak(arch, options, n_train) for name, (arch, options, _) in MODELS.items()}
    vanilla_sum = sum(p for p, _ in peaks.values())
    budget = max(int(vanilla_sum * BUDGET_FRACTION), max(w for _, w in peaks.values()))
    with engine.begin() as conn:
        conn.execute(text("SELECT tensile.stop_coordinator()"))      # the next call starts one with the new budget
    cluster.configure({"tensile.device_budget": f"'{budget}'"})
    print(f"device budget {budget:,} bytes = {BUDGET_FRACTION:.0%} of the unscheduled peaks' sum {vanilla_sum:,} bytes")

    client = TensileClient(engine)
    results: dict[str, dict] = {}
    errors: dict[str, BaseException] = {}

    def train(name: str) -> None:
        t0 = time.perf_counter()
        architecture, options, _ = MODELS[name]
        try:
            results[name] = client.train(name, "SELECT * FROM digits_train", "label", features=FEATURES,
                                         architecture=architecture, options=dict(OPTIONS, replace=True, **options))
            results[name]["wall_s"] = time.perf_counter() - t0
        except BaseException as exc:  # reported below
            errors[name] = exc

    threads = [threading.Thread(target=train, args=(name,)) for name in MODELS]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(1.0)
    live = client.jobs()
    if live:
        print("\ntensile.jobs while training:")
        print(tabulate([{k: r[k] for k in ("job_id", "model_name", "state", "epoch", "loss", "device_bytes",
                                           "swapped_out_bytes")} for r in live], headers="keys", floatfmt=".4f"))
    for t in threads:
        t.join()
    total_s = time.perf_counter() - t0
    for name, exc in errors.items():
        print(f"\n{name} failed: {exc}", file=sys.stderr)
    if errors:
        return 1

    predict = f"tensile.predict(:m, ARRAY[{', '.join(FEATURES)}])"
    numbered = "SELECT row_number() OVER (ORDER BY ctid) AS id, * FROM digits_test"
    rows = []
    with engine.connect() as conn:
        for name in MODELS:
            # row by row in this backend, and set-based on the coordinator's device (demand layering)
            acc, agree = conn.execute(text(
                f"SELECT avg(({predict} = label)::int), avg((p.prediction = {predict})::int) "
                f"FROM ({numbered}) t JOIN tensile.predict_batch(:m, :q, 'id') p USING (id)"),
                {"m": name, "q": numbered}).one()
            m = results[name]["metrics"]
            rows.append({"model": name, "test accuracy": float(acc), "target": MODELS[name][2],
                         "predict_batch agrees": float(agree),
                         "train s": m["train_time_s"],
                         "peak device bytes": m["peak_device_nbytes"], "unscheduled peak": m["vanilla_peak_nbytes"],
                         "swapped out bytes": m["swapped_out_nbytes"], "planned swap-ins": m["planned_swap_ins"],
                         "passive swap-ins": m["passive_swap_ins"], "recomputes": m["recomputes"]})
    memory = client.memory()
    print(f"\n{len(MODELS)} concurrent CALL tensile.train_model, {total_s:.1f} s wall\n")
    print(tabulate(rows, headers="keys", floatfmt=".3f", intfmt=","))
    print()
    print(tabulate([["device", memory["device"]], ["scheduler policy", memory["policy"]],
                    ["plans made", memory["plans_made"]],
                    ["planned pool: plans installed / allocations by lookup / mismatches",
                     f"{memory['pool_plans_installed']} / {memory['planned_allocations']:,} / {memory['pool_mismatches']}"],
                    ["predict_batch: layer loads / weight cache hits",
                     f"{memory['weight_loads']:,} / {memory['weight_cache_hits']:,}"],
                    ["budget bytes", f"{memory['budget_bytes']:,}"],
                    ["combined peak bytes (coordinator high-water mark)", f"{memory['peak_bytes']:,}"],
                    ["sum of unscheduled peaks, bytes", f"{vanilla_sum:,}"]], colalign=("left", "right")))
    checks = {
        "every model reaches its target test accuracy": all(r["test accuracy"] >= r["target"] for r in rows),
        "tensile.predict_batch gives tensile.predict's label on every test row":
            all(r["predict_batch agrees"] == 1 for r in rows),
        "the budget is below the sum of unscheduled peaks": memory["budget_bytes"] < vanilla_sum,
        "the combined peak stayed within the budget": memory["peak_bytes"] <= memory["budget_bytes"],
    }
    print()
    for what, passed in checks.items():
        print(f"{'ok    ' if passed else 'FAILED'} {what}")
    ok = all(checks.values())
    print(f"\nthe cluster keeps running: psql \"{cluster.conninfo(DATABASE)}\"; stop it with "
          f"`{sys.executable} -m tensile_db.cli cluster stop --home {home}`")
    return 0 if ok else 1
