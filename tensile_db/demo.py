"""The main job: four models trained at once, from SQL, under one device budget; then a model of
data with categories and gaps.

Two forms. :func:`run` starts (or reuses) the embedded cluster in ``<home>/cluster``, creates the
database ``tensile_demo`` afresh with the extension (dropping the previous run's) and sets the
device budget; :func:`run_on_server` runs the same demo in the database of any server's
connection string (the compose database, or a user's own PostgreSQL), creating the extension
there if it is missing and bringing it to the installed version, with the server's own budget
(a session cannot change it). Then both load scikit-learn's bundled digits data (1,797 8x8 images, 64 features, 10
classes) into ``digits_train`` / ``digits_test`` (a stratified 75/25 split), run four ``CALL tensile.train_model`` from four
connections at the same time — three MLPs and a convolutional network that reads each row's 64
pixels as a 1x8x8 image, each holding out a tenth of ``digits_train`` — and prints per model the
held-out accuracy stored with it, the test accuracy on ``digits_test`` (computed in SQL with
``tensile.predict``), the training time, the peak device bytes and the bytes swapped, then the
budget and the coordinator's combined high-water mark.

Then it loads the Palmer penguins (``palmerpenguins``: species, island and sex as text, the
measurements with their real gaps) and trains a classifier of the species on the text columns
(one-hot) and the measurements, the gaps filled with the training rows' means (the text columns'
with their modes), and prints its held-out metrics and a few predictions of rows with NULLs.
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
OPTIONS = {"epochs": 30, "batch_size": 128, "optimizer": "adam", "lr": 0.001, "seed": 7, "test_size": 0.1}
#: The penguins model: its features, options and the held-out accuracy it must reach.
PENGUIN_FEATURES = ["island", "sex", "bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g"]
PENGUIN_OPTIONS = {"epochs": 60, "batch_size": 32, "lr": 0.01, "seed": 0, "impute": "mean"}
PENGUIN_TARGET = 0.9
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


def shared_budget(n_rows: int) -> tuple[int, int]:
    """(the device budget the embedded demo sets, the sum of the models' unscheduled peaks), bytes:
    :data:`BUDGET_FRACTION` of that sum, or the largest smallest working set if that is more."""
    peaks = [unscheduled_peak(arch, options, n_rows) for arch, options, _ in MODELS.values()]
    vanilla_sum = sum(p for p, _ in peaks)
    return max(int(vanilla_sum * BUDGET_FRACTION), max(w for _, w in peaks)), vanilla_sum


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


def penguin_model(engine, client: TensileClient) -> float:
    """Load the penguins, train the species model from SQL, print its held-out metrics and the
    predictions of rows with gaps; returns its held-out accuracy."""
    from .datasets import load_penguins

    n = load_penguins(engine, replace=True)
    nulls = {}
    with engine.connect() as conn:
        for c in PENGUIN_FEATURES:
            nulls[c] = conn.execute(text(f'SELECT count(*) - count("{c}") FROM penguins')).scalar_one()
    gaps = ", ".join(f"{c} {k}" for c, k in nulls.items() if k)
    print(f"\nloaded the Palmer penguins: {n} rows; NULLs: {gaps}")
    result = client.train("penguins", "penguins", "species", features=PENGUIN_FEATURES,
                          architecture={"layers": [{"dense": 16}]}, options=PENGUIN_OPTIONS)
    m = result["metrics"]
    print(f"CALL tensile.train_model('penguins', ...): {m['samples']} training rows, {m['test_samples']} held out "
          f"(stratified); island and sex one-hot, gaps imputed (means; modes for text)")
    print(tabulate([["accuracy", m["accuracy"]], ["F1 macro", m["f1_macro"]],
                    ["ROC AUC (one-vs-rest)", m["roc_auc"]], ["log loss", m["log_loss"]]],
                   headers=["held-out metric", "value"], floatfmt=".3f"))
    with engine.connect() as conn:
        classes = conn.execute(text("SELECT label_names FROM tensile.models WHERE name = 'penguins' AND deployed")
                               ).scalar_one()
    print("confusion matrix (rows: true, columns: predicted):")
    print(tabulate([[c, *row] for c, row in zip(classes, m["confusion_matrix"])], headers=["", *classes]))
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT id, species, island, sex, bill_length_mm, body_mass_g, tensile.predict_label('penguins', p) "
            "AS predicted FROM penguins p WHERE sex IS NULL OR bill_length_mm IS NULL ORDER BY id LIMIT 5")).all()
    print("rows with gaps, predicted with tensile.predict_label('penguins', p):")
    print(tabulate([r._asdict() for r in rows], headers="keys", missingval="NULL"))
    return float(m["accuracy"])


def run(home: str) -> int:
    """The demo in the embedded cluster of ``home``, under a device budget of
    :data:`BUDGET_FRACTION` of the models' unscheduled peaks; returns the exit code (0: every
    check passed)."""
    site_packages = site.getsitepackages()[0]
    cluster = EmbeddedCluster(Path(home) / "cluster", python_paths=[site_packages])
    print(f"starting PostgreSQL in {cluster.data_dir} (socket in {cluster.socket_dir}, no TCP)")
    cluster.start()
    cluster.create_database(DATABASE, fresh=True)      # the demo's own database, rebuilt every run
    engine = create_engine(cluster.url(DATABASE), pool_size=8)
    n_train = load_digits_tables(engine)
    print(f"loaded digits: {n_train} training rows, 64 features, 10 classes")
    budget, vanilla_sum = shared_budget(n_train)
    with engine.begin() as conn:
        conn.execute(text("SELECT tensile.stop_coordinator()"))      # the next call starts one with the new budget
    cluster.configure({"tensile.device_budget": f"'{budget}'"})
    print(f"device budget {budget:,} bytes = {BUDGET_FRACTION:.0%} of the unscheduled peaks' sum {vanilla_sum:,} bytes")
    code = _train_and_check(engine, vanilla_sum, shared=True)
    print(f"\nthe cluster keeps running: psql \"{cluster.conninfo(DATABASE)}\"; stop it with "
          f"`{sys.executable} -m tensile_db.cli cluster stop --home {home}`")
    return code


def run_on_server(dsn: str) -> int:
    """The demo in the database of the libpq connection string ``dsn``: the extension created
    if missing (``CREATE EXTENSION`` needs a superuser) and updated to the installed version; the
    tables ``digits_train``, ``digits_test`` and ``penguins`` and the demo's models replaced. The
    server's ``tensile.device_budget`` stays as it is: when it holds every model at once, the
    check that they share it is reported as not exercised. Returns the exit code (0: every check
    that ran passed)."""
    import psycopg

    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), pool_size=8)
    with engine.begin() as conn:
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS tensile_db CASCADE"))
        conn.execute(text("ALTER EXTENSION tensile_db UPDATE"))
        version, database = conn.execute(text(
            "SELECT extversion, current_database() FROM pg_extension WHERE extname = 'tensile_db'")).one()
    print(f"tensile_db {version} in database {database}")
    n_train = load_digits_tables(engine)
    print(f"loaded digits: {n_train} training rows, 64 features, 10 classes")
    _, vanilla_sum = shared_budget(n_train)
    with engine.begin() as conn:
        conn.execute(text("SELECT tensile.start_coordinator()"))
    budget = TensileClient(engine).memory()["budget_bytes"]
    share = budget < vanilla_sum
    print(f"device budget {budget:,} bytes (the server's tensile.device_budget); the unscheduled peaks' sum is "
          f"{vanilla_sum:,} bytes" + ("" if share else f": every model fits at once (set tensile.device_budget "
                                                       f"below {vanilla_sum:,} bytes to make them share it)"))
    return _train_and_check(engine, vanilla_sum, shared=share)


def _train_and_check(engine, vanilla_sum: int, shared: bool) -> int:
    """Train the four models at once, check them, then the penguins; print the tables and the
    checks and return the exit code. ``shared``: the budget is below the peaks' sum, so that the
    check that the models shared it applies."""
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
            rows.append({"model": name, "held-out accuracy": m["accuracy"], "test accuracy": float(acc),
                         "target": MODELS[name][2],
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
    penguins = penguin_model(engine, client)
    checks = {
        "every model reaches its target test accuracy": all(r["test accuracy"] >= r["target"] for r in rows),
        f"the penguins model reaches {PENGUIN_TARGET} held-out accuracy": penguins >= PENGUIN_TARGET,
        "tensile.predict_batch gives tensile.predict's label on every test row":
            all(r["predict_batch agrees"] == 1 for r in rows),
        "the combined peak stayed within the budget": memory["peak_bytes"] <= memory["budget_bytes"],
    }
    if shared:
        checks["the budget is below the sum of unscheduled peaks"] = memory["budget_bytes"] < vanilla_sum
    print()
    for what, passed in checks.items():
        print(f"{'ok    ' if passed else 'FAILED'} {what}")
    if not shared:
        print("not exercised: models sharing a budget below their peaks' sum (the server's budget holds them all)")
    return 0 if all(checks.values()) else 1
