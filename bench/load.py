"""Load: many concurrent trainings, and pgbench on ``tensile.predict`` beside trainings.

Starts an embedded cluster of its own in a fresh temporary directory, loads the digits tables
(``digits_train`` / ``digits_test``, 64 real features) and runs two phases against one device
budget, a few times one small model's unscheduled peak, so that the trainings cannot all be
resident at once (``tensile.max_active_jobs`` = 8; more wait queued).

- Phase A: ``--trainings`` concurrent ``CALL tensile.train_model`` from as many connections, each
  with a model name of its own. Reports completions, errors (by SQLSTATE and message), the wall
  time, trainings per minute and the CALLs' latencies.
- Phase B: ``pgbench`` running a one-row ``tensile.predict`` (64 random features per
  transaction) from ``--clients`` connections for ``--duration`` seconds, while
  ``--side-trainings`` connections train back to back. Reports pgbench's tps, latency and failed
  transactions, and the side trainings' completions and errors.

- Phase C: the coordinator stopped with SIGSTOP; ``--cancels`` times each, a backend waiting on
  it (a ``train_model`` and a ``SELECT * FROM tensile.jobs``) is cancelled with
  ``pg_cancel_backend``, and another is ended by ``tensile.coordinator_timeout``. Reports how long
  the cancel took to end the call (median and max) and the deadline's overshoot.

In phases A and B a sampler polls ``tensile.memory`` every 0.2 s (running / queued jobs, bytes in
use); each phase starts a fresh coordinator, so its high-water mark (``peak_bytes``) is the
phase's own, and is checked against the budget. Exits non-zero when a check fails. The cluster
is stopped and its directory removed at the end. Not part of the test suite: about a minute on
two cores.

    python bench/load.py [--trainings 40] [--epochs 3] [--budget-peaks 3]
                         [--clients 16] [--threads 2] [--duration 20] [--side-trainings 4] [--cancels 10]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import site
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg
from sqlalchemy import create_engine
from tabulate import tabulate

from tensile_db.cluster import EmbeddedCluster
from tensile_db.demo import FEATURES, load_digits_tables
from tensile_db.runtime import model as models
from tensile_db.runtime.builder import build_training_program

DATABASE = "tensile_load"
ARCHITECTURE = {"layers": [{"dense": 64, "activation": "relu"}]}
BATCH = 128
CLASSES = 10
MAX_ACTIVE_JOBS = 8
#: Seconds between two samples of tensile.memory.
SAMPLE_PERIOD_S = 0.2
#: Longest one CALL may run before statement_timeout cancels it, seconds (an error, counted).
CALL_TIMEOUT_S = 240
#: Most trainings one side connection runs in phase B (bounds the loop besides the clock).
MAX_SIDE_TRAININGS = 200

#: pgbench's summary lines (PostgreSQL 15), each a figure.
PGBENCH_SUMMARY = {
    "transactions": r"number of transactions actually processed: (\d+)",
    "failed": r"number of failed transactions: (\d+)",
    "latency_ms": r"latency average = ([\d.]+) ms",
    "stddev_ms": r"latency stddev = ([\d.]+) ms",
    "connect_ms": r"initial connection time = ([\d.]+) ms",
    "tps": r"tps = ([\d.]+) \(without initial connection time\)",
}
#: pgbench's progress report period, seconds (-P; also makes it print the latency's stddev).
PROGRESS_S = 5
PGBENCH_PROGRESS = r"progress: ([\d.]+) s, ([\d.]+) tps, lat ([\d.]+) ms stddev ([\d.]+|NaN), (\d+) failed"


def unscheduled_peak_nbytes(epochs: int) -> int:
    """The small model's vanilla peak, bytes, as the coordinator computes it."""
    spec = models.ModelSpec(models.parse_architecture(ARCHITECTURE), len(FEATURES), CLASSES, "classification")
    opts = models.parse_options({"epochs": epochs, "batch_size": BATCH})
    return build_training_program(spec, opts, BATCH).vanilla_peak_nbytes()


class Sampler(threading.Thread):
    """Polls tensile.memory every SAMPLE_PERIOD_S on a connection of its own until stopped;
    keeps the highest running / queued counts and bytes in use, and the last row."""

    def __init__(self, conninfo: str):
        super().__init__(daemon=True)
        self.conninfo = conninfo
        self.done = threading.Event()
        self.samples = 0
        self.max_running = self.max_queued = self.max_in_use_nbytes = 0
        self.last: dict = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                while not self.done.is_set():
                    row = conn.execute("SELECT in_use_bytes, peak_bytes, budget_bytes, running_jobs, queued_jobs "
                                       "FROM tensile.memory").fetchone()
                    if row:
                        in_use, peak, budget, running, queued = row
                        self.last = {"peak_bytes": peak, "budget_bytes": budget}
                        self.max_in_use_nbytes = max(self.max_in_use_nbytes, in_use)
                        self.max_running, self.max_queued = max(self.max_running, running), max(self.max_queued, queued)
                        self.samples += 1
                    self.done.wait(SAMPLE_PERIOD_S)
        except BaseException as exc:   # reported by the phase
            self.error = exc

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)


def error_key(exc: BaseException) -> str:
    """``SQLSTATE: primary message`` of a database error, else the exception's type and text."""
    if isinstance(exc, psycopg.Error):
        message = exc.diag.message_primary or str(exc).strip().splitlines()[0]
        return f"{exc.sqlstate or '-----'}: {message}"
    return f"{type(exc).__name__}: {exc}"


class Trainings:
    """Outcomes of CALL tensile.train_model from many threads: latencies and errors by key."""

    def __init__(self, conninfo: str, epochs: int):
        self.conninfo = conninfo
        self.options = json.dumps({"epochs": epochs, "batch_size": BATCH, "seed": 0})
        self.lock = threading.Lock()
        self.call_s: list[float] = []         # guarded by lock
        self.errors: Counter[str] = Counter()   # guarded by lock
        self.vanilla_peak_nbytes = 0          # guarded by lock; from the trainings' metrics

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.conninfo, autocommit=True, options=f"-c statement_timeout={CALL_TIMEOUT_S * 1000}")

    def train(self, conn: psycopg.Connection, name: str) -> None:
        t0 = time.perf_counter()
        try:
            _, metrics, _, _ = conn.execute(
                "CALL tensile.train_model(%s, 'digits_train', 'label', NULL, %s::jsonb, %s::jsonb)",
                (name, json.dumps(ARCHITECTURE), self.options)).fetchone()
        except BaseException as exc:   # counted
            with self.lock:
                self.errors[error_key(exc)] += 1
            return
        with self.lock:
            self.call_s.append(time.perf_counter() - t0)
            self.vanilla_peak_nbytes = max(self.vanilla_peak_nbytes, metrics.get("vanilla_peak_nbytes", 0))

    def one(self, name: str, barrier: threading.Barrier) -> None:
        """One connection, one training, started when every thread has connected."""
        try:
            conn = self.connect()
        except BaseException as exc:
            with self.lock:
                self.errors[error_key(exc)] += 1
            barrier.abort()
            return
        with conn:
            try:
                barrier.wait(timeout=120)
            except threading.BrokenBarrierError:
                pass
            self.train(conn, name)

    def back_to_back(self, prefix: str, until: threading.Event) -> None:
        """One connection training model after model until ``until`` is set."""
        try:
            with self.connect() as conn:
                for n in range(MAX_SIDE_TRAININGS):
                    if until.is_set():
                        break
                    self.train(conn, f"{prefix}_{n}")
        except BaseException as exc:
            with self.lock:
                self.errors[error_key(exc)] += 1


def restart_coordinator(conninfo: str) -> None:
    """A fresh coordinator, so that tensile.memory's peak_bytes counts from now."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT tensile.stop_coordinator()")
        deadline = time.monotonic() + 30
        while True:
            try:
                conn.execute("SELECT tensile.start_coordinator()")
                return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def memory_rows(sampler: Sampler) -> tuple[list[list], bool]:
    """Table rows of the sampled figures and whether the phase's peak stayed within the budget."""
    if sampler.error:
        print(f"sampler failed: {error_key(sampler.error)}", file=sys.stderr)
    peak, budget = sampler.last.get("peak_bytes"), sampler.last.get("budget_bytes")
    within = peak is not None and peak <= budget
    return [["tensile.memory samples", sampler.samples],
            ["max running jobs seen", sampler.max_running],
            ["max queued jobs seen", sampler.max_queued],
            ["max in_use_bytes seen", f"{sampler.max_in_use_nbytes:,}"],
            ["coordinator peak_bytes", f"{peak:,}" if peak is not None else "-"],
            ["budget_bytes", f"{budget:,}" if budget is not None else "-"],
            ["peak <= budget", "PASS" if within else "FAIL"]], within


def error_rows(errors: Counter) -> list[list]:
    return [[count, key] for key, count in errors.most_common()]


def print_table(title: str, rows: list[list]) -> None:
    print(f"\n{title}")
    print(tabulate(rows, colalign=("left", "right")))


def phase_a(conninfo: str, trainings: int, epochs: int) -> bool:
    restart_coordinator(conninfo)
    runs = Trainings(conninfo, epochs)
    barrier = threading.Barrier(trainings)
    threads = [threading.Thread(target=runs.one, args=(f"load_a_{i}", barrier), daemon=True) for i in range(trainings)]
    sampler = Sampler(conninfo)
    sampler.start()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=CALL_TIMEOUT_S + 150)
    wall_s = time.perf_counter() - t0
    time.sleep(2 * SAMPLE_PERIOD_S)
    sampler.stop()
    with psycopg.connect(conninfo) as conn:
        stored = conn.execute("SELECT count(*) FROM tensile.models WHERE name LIKE 'load\\_a\\_%'").fetchone()[0]
        accuracy = conn.execute(
            f"SELECT avg((tensile.predict('load_a_0', ARRAY[{', '.join(FEATURES)}]) = label)::int) FROM digits_test"
        ).fetchone()[0] if runs.call_s else None
    done = len(runs.call_s)
    mem, within = memory_rows(sampler)
    rows = [["trainings started", trainings],
            ["completed", done],
            ["errors", sum(runs.errors.values())],
            ["models stored", stored],
            ["wall s (connect to last reply)", f"{wall_s:.1f}"],
            ["trainings per minute", f"{done / wall_s * 60:.1f}"],
            ["CALL s: min / median / max",
             " / ".join(f"{s:.1f}" for s in (min(runs.call_s), statistics.median(runs.call_s), max(runs.call_s)))
             if runs.call_s else "-"],
            ["test accuracy of load_a_0 (tensile.predict)", f"{accuracy:.3f}" if accuracy is not None else "-"],
            ["unscheduled peak of one job, bytes", f"{runs.vanilla_peak_nbytes:,}"], *mem]
    print_table(f"Phase A: {trainings} concurrent CALL tensile.train_model, one connection each, "
                f"{epochs} epochs, MLP 64-{ARCHITECTURE['layers'][0]['dense']}-10", rows)
    if runs.errors:
        print_table("Phase A errors (count, SQLSTATE: message)", error_rows(runs.errors))
    return within and not runs.errors and done == trainings == stored


def pgbench_script(path: Path) -> None:
    """A transaction of 64 random features (0..16, as in the digits) and one tensile.predict."""
    lines = [f"\\set {f} random(0, 16)" for f in FEATURES]
    lines.append("SELECT tensile.predict('load_a_0', ARRAY[" + ", ".join(f":{f}" for f in FEATURES) + "]::real[]);")
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)


def phase_b(cluster: EmbeddedCluster, conninfo: str, base: Path, args) -> bool:
    script = base / "predict.sql"
    pgbench_script(script)
    restart_coordinator(conninfo)
    runs = Trainings(conninfo, args.epochs)
    pgbench_done = threading.Event()
    side = [threading.Thread(target=runs.back_to_back, args=(f"load_b_{i}", pgbench_done), daemon=True)
            for i in range(args.side_trainings)]
    sampler = Sampler(conninfo)
    sampler.start()
    for t in side:
        t.start()
    # pgbench speaks only to the cluster's Unix socket; the server trusts local connections.
    cmd = ["pgbench", "-n", "-M", "prepared", "-P", str(PROGRESS_S), "-f", str(script), "-c", str(args.clients),
           "-j", str(args.threads),
           "-T", str(args.duration), "-h", str(cluster.socket_dir), "-p", str(cluster.port), "-U", "postgres", DATABASE]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 120)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = exc.stdout or "", (exc.stderr or "") + "\npgbench: timed out", -1
        out, err = (out.decode() if isinstance(out, bytes) else out), (err.decode() if isinstance(err, bytes) else err)
    pgbench_s = time.perf_counter() - t0
    pgbench_done.set()
    for t in side:
        t.join(timeout=CALL_TIMEOUT_S + 30)
    side_s = time.perf_counter() - t0
    time.sleep(2 * SAMPLE_PERIOD_S)
    sampler.stop()

    found = {k: (m.group(1) if (m := re.search(p, out)) else None) for k, p in PGBENCH_SUMMARY.items()}
    progress = [[float(t), float(tps), float(lat), float(sd), int(failed)]
                for t, tps, lat, sd, failed in re.findall(PGBENCH_PROGRESS, err)]
    aborted = Counter(re.sub(r"client \d+ ", "client N ", m.group(1))
                      for m in re.finditer(r"pgbench: error: (.*)", err))
    done = len(runs.call_s)
    mem, within = memory_rows(sampler)
    rows = [["pgbench exit status", rc],
            ["pgbench transactions", found["transactions"] or "-"],
            ["pgbench failed transactions", found["failed"] or "-"],
            ["pgbench aborted-client errors", sum(aborted.values())],
            ["pgbench tps (without connection time)", f"{float(found['tps']):,.0f}" if found["tps"] else "-"],
            ["pgbench latency average ms", found["latency_ms"] or "-"],
            ["pgbench latency stddev ms", found["stddev_ms"] or "-"],
            ["pgbench initial connection ms", found["connect_ms"] or "-"],
            ["pgbench wall s", f"{pgbench_s:.1f}"],
            ["side trainings completed", done],
            ["side trainings errors", sum(runs.errors.values())],
            ["side trainings per minute", f"{done / side_s * 60:.1f}"],
            ["side CALL s: median / max",
             f"{statistics.median(runs.call_s):.1f} / {max(runs.call_s):.1f}" if runs.call_s else "-"], *mem]
    print_table(f"Phase B: pgbench, {args.clients} clients / {args.threads} threads / {args.duration} s of "
                f"SELECT tensile.predict (one row) beside {args.side_trainings} connections training back to back", rows)
    if progress:
        print(f"\npgbench every {PROGRESS_S} s")
        print(tabulate(progress, headers=["s", "tps", "latency ms", "stddev ms", "failed"],
                       floatfmt=(".0f", ",.0f", ".3f", ".3f")))
    if runs.errors:
        print_table("Phase B training errors (count, SQLSTATE: message)", error_rows(runs.errors))
    if aborted:
        print_table("Phase B pgbench errors (count, message)", [[n, k] for k, n in aborted.most_common()])
    if rc != 0 or found["tps"] is None:
        print(f"\npgbench output:\n{out}\n{err}", file=sys.stderr)
    failed = int(found["failed"] or 0)
    return within and rc == 0 and found["tps"] is not None and not failed and not aborted and not runs.errors and done > 0


#: How long phase C lets a call wait on the stopped coordinator before cancelling it, seconds.
CANCEL_AFTER_S = 0.5
#: tensile.coordinator_timeout in phase C, seconds.
PHASE_C_TIMEOUT_S = 1.0


def _ended_after(conninfo: str, sql: str, cancel: bool) -> tuple[float, str]:
    """Run ``sql`` on a connection of its own and, if ``cancel``, cancel it CANCEL_AFTER_S into
    its wait (else let tensile.coordinator_timeout end it): seconds from the cancel (or from the
    deadline) to the call's end, and the SQLSTATE it ended with."""
    outcome = {}

    def call():
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute(f"SET tensile.coordinator_timeout = {PHASE_C_TIMEOUT_S}")
            outcome["pid"] = c.info.backend_pid
            started = time.perf_counter()
            try:
                c.execute(sql)
                outcome["sqlstate"] = "none"
            except psycopg.Error as exc:
                outcome["sqlstate"] = exc.sqlstate or "?"
            outcome["s"] = time.perf_counter() - started
    t = threading.Thread(target=call, daemon=True)
    with psycopg.connect(conninfo, autocommit=True) as canceller:
        t.start()
        time.sleep(CANCEL_AFTER_S)
        if cancel:
            stopped = time.perf_counter()
            canceller.execute("SELECT pg_cancel_backend(%s)", (outcome["pid"],))
            t.join(30)
            return time.perf_counter() - stopped, outcome.get("sqlstate", "still waiting")
    t.join(30)
    return outcome.get("s", float("nan")) - PHASE_C_TIMEOUT_S, outcome.get("sqlstate", "still waiting")


def phase_c(conninfo: str, cancels: int) -> bool:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        pid = conn.execute("SELECT tensile.start_coordinator()").fetchone()[0]
    cases = {"train_model, pg_cancel_backend": ("CALL tensile.train_model('load_c', 'digits_train', 'label')", True),
             "tensile.jobs, pg_cancel_backend": ("SELECT * FROM tensile.jobs", True),
             "tensile.jobs, coordinator_timeout": ("SELECT * FROM tensile.jobs", False)}
    seconds = {k: [] for k in cases}
    states = {k: Counter() for k in cases}
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(cancels):
            for name, (sql, cancel) in cases.items():
                s, state = _ended_after(conninfo, sql, cancel)
                seconds[name].append(s)
                states[name][state] += 1
    finally:
        os.kill(pid, signal.SIGCONT)
    rows = [[name, f"{statistics.median(v) * 1000:.0f}", f"{max(v) * 1000:.0f}",
             ", ".join(f"{k} x{n}" for k, n in states[name].items())] for name, v in seconds.items()]
    print(f"\nPhase C: the coordinator stopped (SIGSTOP); {cancels} calls of each kind, cancelled "
          f"{CANCEL_AFTER_S} s into their wait or ended by tensile.coordinator_timeout = {PHASE_C_TIMEOUT_S} s")
    print(tabulate(rows, headers=["call, ended by", "median ms", "max ms", "SQLSTATE"]))
    print("(ms from pg_cancel_backend to the call's end; for the timeout, ms past the deadline)")
    expected = {"train_model, pg_cancel_backend": "57014", "tensile.jobs, pg_cancel_backend": "57014",
                "tensile.jobs, coordinator_timeout": "08006"}
    return all(set(states[k]) == {expected[k]} and max(seconds[k]) < 0.2 for k in cases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainings", type=int, default=40, help="concurrent trainings in phase A (default 40)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of every training (default 3)")
    parser.add_argument("--budget-peaks", type=float, default=3.0,
                        help="device budget in unscheduled peaks of one training (default 3)")
    parser.add_argument("--clients", type=int, default=16, help="pgbench clients in phase B (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="pgbench threads (default 2)")
    parser.add_argument("--duration", type=int, default=20, help="pgbench seconds (default 20)")
    parser.add_argument("--side-trainings", type=int, default=4,
                        help="connections training back to back beside pgbench (default 4)")
    parser.add_argument("--cancels", type=int, default=10,
                        help="phase C: waits on a stopped coordinator cancelled, per kind (default 10)")
    args = parser.parse_args()
    if shutil.which("pgbench") is None:
        print("pgbench is not installed (Debian: postgresql-contrib / postgresql-client-15)", file=sys.stderr)
        return 2

    vanilla_nbytes = unscheduled_peak_nbytes(args.epochs)
    budget_nbytes = int(vanilla_nbytes * args.budget_peaks)
    base = Path(tempfile.mkdtemp(prefix="tensile-load-"))
    cluster = EmbeddedCluster(base, python_paths=[site.getsitepackages()[0]],
                              settings={"tensile.device_budget": f"'{budget_nbytes}'",
                                        "tensile.max_active_jobs": str(MAX_ACTIVE_JOBS)})
    # Phase A holds a connection per training; phase B a connection per pgbench client and side training.
    connections = max(args.trainings, args.clients + args.side_trainings) + 20
    try:
        cluster.init()
        with open(cluster.data_dir / "postgresql.conf", "a") as f:
            f.write(f"max_connections = {max(100, connections)}\n")
        cluster.start()
        cluster.create_database(DATABASE)
        engine = create_engine(cluster.url(DATABASE))
        try:
            n_train = load_digits_tables(engine)
        finally:
            engine.dispose()
        print(f"cluster in {base} (socket in {cluster.socket_dir}); digits_train: {n_train} rows; "
              f"device budget {budget_nbytes:,} bytes = {args.budget_peaks:g} x one training's unscheduled peak "
              f"{vanilla_nbytes:,}; max_active_jobs {MAX_ACTIVE_JOBS}")
        conninfo = cluster.conninfo(DATABASE)
        ok_a = phase_a(conninfo, args.trainings, args.epochs)
        ok_b = phase_b(cluster, conninfo, base, args)
        ok_c = phase_c(conninfo, args.cancels)
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(base, ignore_errors=True)
            if base not in cluster.socket_dir.parents:
                shutil.rmtree(cluster.socket_dir, ignore_errors=True)
    print(f"\n{'ok    ' if ok_a else 'FAILED'} phase A: every training completed and stored, peak within the budget")
    print(f"{'ok    ' if ok_b else 'FAILED'} phase B: pgbench without failures, side trainings without errors, "
          "peak within the budget")
    print(f"{'ok    ' if ok_c else 'FAILED'} phase C: every wait on a stopped coordinator ended within 0.2 s of its "
          "cancel or deadline, with 57014 / 08006")
    return 0 if ok_a and ok_b and ok_c else 1


if __name__ == "__main__":
    sys.exit(main())
