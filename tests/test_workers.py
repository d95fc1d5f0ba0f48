"""The CPU's kernel threads (``tensile_db.runtime.workers``): chunks run at once, the BLAS on one
thread meanwhile and as before afterwards, a worker's error reaches the caller, and a process
starts again with the BLAS environment it lacks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy  # noqa: F401  (loads the BLAS whose threads these tests read)
import pytest
from threadpoolctl import threadpool_info

from tensile_db.runtime import workers


def blas_threads() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_the_workers_run_at_once_on_a_single_threaded_blas_and_leave_it_as_it_was():
    before = blas_threads()
    assert before
    meeting = threading.Barrier(3, timeout=10)          # broken unless all three run at the same time
    seen = {}

    def work(k: int) -> None:
        seen[k] = (threading.get_ident(), blas_threads())
        meeting.wait()

    workers.run(work, 3)
    assert sorted(seen) == [0, 1, 2]
    assert len({ident for ident, _ in seen.values()}) == 3
    assert seen[0][0] == threading.get_ident()          # the caller takes the first share
    assert all(threads == [1] * len(before) for _, threads in seen.values())
    assert blas_threads() == before


def test_a_workers_error_reaches_the_caller_after_every_worker_has_ended():
    before = blas_threads()
    ended = []

    def work(k: int) -> None:
        if k == 1:
            raise ValueError("chunk 1 failed")
        threading.Event().wait(0.05)
        ended.append(k)

    with pytest.raises(ValueError, match="chunk 1 failed"):
        workers.run(work, 3)
    assert sorted(ended) == [0, 2]
    assert blas_threads() == before


def test_one_worker_runs_here_and_leaves_the_blas_alone():
    before, seen = blas_threads(), []
    workers.run(lambda k: seen.append((k, threading.get_ident(), blas_threads())), 1)
    assert seen == [(0, threading.get_ident(), before)]


def test_a_process_without_the_blas_environment_starts_again_with_it(tmp_path):
    script = tmp_path / "kernels.py"
    script.write_text("import os, sys\nfrom tensile_db.runtime import workers\nprint('started', os.getpid(), flush=True)\n"
                      "workers.with_blas_environment()\n"
                      "print('running', os.getpid(), sys.flags.utf8_mode, sys.argv[1:], "
                      "{k: os.environ[k] for k in workers.BLAS_ENVIRONMENT})\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in workers.BLAS_ENVIRONMENT}
    env["PYTHONPATH"] = root
    out = subprocess.run([sys.executable, "-X", "utf8", str(script), "--an", "argument"], env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split()[0] for line in out] == ["started", "started", "running"]    # once without it, once with
    assert len({line.split()[1] for line in out}) == 1                               # the same process
    assert f"1 ['--an', 'argument'] {workers.BLAS_ENVIRONMENT!r}" in out[2]       # options and arguments kept
    env.update({k: "7" for k in workers.BLAS_ENVIRONMENT})
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True).stdout
    assert out.count("started") == 1 and "'7'" in out   # a value already set is kept


def test_count_is_the_blas_threads_at_first_use():
    assert workers.count() == max(1, min(blas_threads()))


def test_a_run_inside_a_workers_share_runs_in_order_there():
    """A kernel that splits its work, called from a share of another's (a worker waiting on the
    pool that runs it would wait for ever): its shares run in order on that worker's thread."""
    seen = []

    def inner(outer: int):
        return lambda k: seen.append((outer, k, threading.get_ident()))

    def outer(k: int) -> None:
        workers.run(inner(k), 2)

    done = threading.Event()
    thread = threading.Thread(target=lambda: (workers.run(outer, 2), done.set()), daemon=True)
    thread.start()
    assert done.wait(10), "a nested run never returned"
    assert sorted((o, k) for o, k, _ in seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for o in (0, 1):
        assert [k for oo, k, _ in seen if oo == o] == [0, 1]
        assert len({ident for oo, _, ident in seen if oo == o}) == 1


def test_a_larger_run_beside_a_running_one_keeps_the_blas_limit_counted(monkeypatch):
    """A run of three starts while a run of two is under way on another thread (the pool grows):
    the limit is counted for both and dropped when the last ends, the BLAS then as it was."""
    before = blas_threads()
    monkeypatch.setitem(workers._state, "count", 3)
    started, release = threading.Event(), threading.Event()

    def long(k: int) -> None:
        started.set()
        release.wait(10)

    first = threading.Thread(target=workers.run, args=(long, 2), daemon=True)
    first.start()
    assert started.wait(10)
    inside = []
    workers.run(lambda k: inside.append((workers._state["inside"], workers._state["limited"] is not None)), 3)
    assert inside == [(2, True)] * 3
    assert workers._state["inside"] == 1 and workers._state["limited"] is not None     # the first still runs
    release.set()
    first.join(10)
    assert workers._state["inside"] == 0 and workers._state["limited"] is None
    assert blas_threads() == before
