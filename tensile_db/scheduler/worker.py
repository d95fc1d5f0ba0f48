"""The planning process: plans made in a child process, so that planning never holds the GIL the
executor's thread needs.

The executor runs every job's ops from one Python thread. A planner on another thread of the same
process spends most of its run in Python loops and holds the GIL for them: every op of every job
waits for it (on ``cpu``, a small job beside a 400-layer job trained 4.9 times slower than alone,
``bench/fairness.py``). A :class:`PlanningProcess` makes the plans in one child process instead.

This module owns the policies' planners (:data:`PLANNERS`, :func:`make_plan`), which a plan
made in the scheduler's own thread (the simulated device's) uses too.

Protocol: :meth:`PlanningProcess.submit` sends the policy's name, the jobs' traces, the period,
the cost model, the target bytes and the time limit; the child builds the
:class:`~.timeline.Timeline`, makes the plan (:func:`make_plan`; the global planner's curves are
kept in the child across its plans, per cost model) and sends back the :class:`~.planners.Plan`
and the seconds it took, measured in the child. A program's kernels are closures that do not
pickle, so the traces travel with their programs' skeletons
(:meth:`~tensile_db.runtime.program.Program.skeleton`), which answer every question a planner
asks; the plan that comes back holds them too, and what the executor reads of a plan (its
``before`` and ``after`` actions, ``decisions``, ``timeline.traces`` by job id,
``timeline.work``, the predicted figures) is all there. Plans are made one at a time, in the
order submitted.

The child is spawned, not forked (the coordinator has threads: a fork copies their locks in
whatever state they are), by :meth:`~PlanningProcess.start` or the first plan submitted. Starting
it took 0.1 s on this project's 2-core machine (an interpreter importing NumPy and the scheduler;
spawning also imports the parent's main script again, if it is one: 0.2 to 0.3 s under a
benchmark). It exits when its parent does: a thread in it waits on the parent's sentinel
(:func:`multiprocessing.parent_process`), which becomes ready when the parent dies however it
dies (without it a killed coordinator's child waited for work forever). A planner's exception is
the future's exception. If the child dies (killed, out of memory), the pending plans' futures
fail with :class:`~concurrent.futures.process.BrokenProcessPool` and the next submit starts a new
child. :meth:`~PlanningProcess.close` ends the child without waiting for the plan it is making.

Cost, measured on the four models of ``bench/paper.py``'s mixed arrival (3,869 ops): their traces
pickle to 0.9 MB in about 9 ms, a plan to 1.5 MB; unpickling the plan holds the parent's GIL for
about 15 ms, or 50 to 90 ms when the collection of cyclic garbage runs over a large heap meanwhile.

Who uses it (Note [Planning off the GIL]): on ``cpu`` and ``cuda`` the scheduler sends the plans
of timelines of more than :data:`PROCESS_MIN_OPS` ops per period (every one, but the small ones
the executor waits for, which it makes itself: Note [Plans the waiting thread makes] in
:mod:`~tensile_db.scheduler.engine`; and a plan of the
global planner that can take no action, the jobs' peaks summed fitting its target: made on the
planning thread, it builds the timeline and simulates it once; the MLP of ``bench/throughput.py``
with unlimited memory lost the round trip, about 1.6% of its time per iteration over 64, and a
timeline of thousands of ops would hold the GIL for tens of milliseconds), and the planned pool
its offset plans of more than :data:`~tensile_db.memory.planned.OFFLOAD_MIN_ALLOCATIONS`
allocations (every one, but a small period's that the executor waits for), to one process-wide
child (:func:`shared`), which the scheduler starts when it is made, so that the first plan need
not wait for it.

Note [A pipe with no reader]
----------------------------
Rationale: a request is pickled into a pipe to the child by a feeder thread of the pool. When
the child dies (killed by :meth:`~PlanningProcess.close`, or by the kernel for memory) while a
request larger than the pipe's buffer is queued behind the plan it is making, the feeder blocks
in its write: this process held the pipe's read end too, so the write never failed. The pool's
shutdown then waited for the feeder forever: ``close()`` hung, and so did the interpreter's exit
after a child's death (reproduced: a 2.2 MB request queued behind a 300-layer plan, the child
killed, ``close()`` still waiting after 10 s). Later CPython releases stop the feeder in the
pool itself when a worker dies; Debian's 3.11.2, which the project's PL/Python embeds, does not.

Approach: once the child is started (it holds its own copies of the pipe's ends), this process
closes its copy of the read end (:func:`_drop_request_reader`). A write to a dead child's pipe
then fails at once with EPIPE, which the pool's queue ignores, and the shutdown completes.

Limitations: the pool must never start another child, which would be handed the closed read end:
it has one worker and no limit of tasks per child, and a new pool (with its own pipe) replaces a
broken one.

Note [Planning off the GIL]
---------------------------
``bench/fairness.py`` on ``cpu`` (budget far above the peaks, so no plan cuts anything): while a
small job ran 0.3 s beside a 400-layer job, the scheduler's planning thread ran 0.3 s (five plans
of the 400-layer timeline: building it and simulating it) and the pool's planning thread 1.5 s
(one offset plan of its period's allocations), both in Python loops that hold the GIL the
executor's thread needs for every op.

Small plans were once made on those threads, whose GIL holds seemed short. They are not short for
the executor: it gives up the GIL in every kernel (a convolution on oneDNN does in each call into
the library), and takes it back only when the planning thread's switch interval (5 ms) runs out.
The small CNN of ``bench/throughput.py`` at 50% of its peak (about 100 ops): an iteration during
one of the scheduler's plans (20 to 50 ms of planning) took 100 ms, during a search of the planned
pool (0.1 s) 150 ms, against 45 to 50 ms. With every plan in the child, its time at 50% over the
unlimited run's went from 1.57 and 1.65 to 1.41 and 1.41 (five alternated runs each, medians;
the child takes a core meanwhile, but not the GIL).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

from ..errors import InvalidArgument
from .baselines import BASELINE_PLANNERS
from .cost import CostModel
from .curves import plan_global
from .planners import Plan, plan_swap_score, plan_vdnn
from .timeline import JobTrace, Timeline

log = logging.getLogger(__name__)

#: timelines of more ops per period than this are planned in the planning process (not simulated
#: devices): every one (Note [Planning off the GIL])
PROCESS_MIN_OPS = 0

#: policy -> planner(timeline, cost, target bytes, max_seconds: None for no time limit)
PLANNERS = {"tensile": plan_global, "swap_score": plan_swap_score,
            "vdnn": lambda timeline, cost, target, max_seconds: plan_vdnn(timeline, cost, target),
            **BASELINE_PLANNERS}


def make_plan(policy: str, timeline: Timeline, cost: CostModel, target_nbytes: int, max_seconds: float | None,
              curves: dict | None = None) -> Plan:
    """The plan of ``policy``'s planner (:data:`PLANNERS`) for ``timeline`` at ``target_nbytes``
    bytes within ``max_seconds`` (None: no limit). ``curves``: the global planner's curves, a
    dict the caller keeps across re-plans (:func:`~.curves.plan_global`; None: none kept).

    Raises:
        KeyError: an unknown policy; and whatever the planner raises.
    """
    planner = PLANNERS[policy]
    if planner is plan_global:
        planner = functools.partial(plan_global, memo=curves)
    return planner(timeline, cost, target_nbytes, max_seconds)


class PlanningProcess:
    """One child process that makes plans (see the module docstring); started by :meth:`start`
    or else on first use.

    Raises:
        RuntimeError: :meth:`submit` or :meth:`start` after :meth:`close`.
    """

    def __init__(self):
        self._lock = threading.Lock()       # guards the three fields below
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pid: concurrent.futures.Future | None = None      # the child's process id, once it runs
        self._closed = False

    def submit(self, policy: str, traces: list[JobTrace], period: int | None, cost: CostModel,
               target_nbytes: int, max_seconds: float | None) -> concurrent.futures.Future:
        """Make the plan of ``policy`` for ``traces`` (their sequences must not change
        afterwards: send snapshots) at ``period`` rounds, ``target_nbytes`` bytes, within
        ``max_seconds`` (None: no limit), in the child. The future's result is ``(plan,
        seconds)``: the planner's :class:`~.planners.Plan` and the child's wall-clock seconds
        for it; its exception is the planner's, or BrokenProcessPool if the child died.

        Raises:
            InvalidArgument: an unknown policy.
            RuntimeError: the planning process was closed.
        """
        if policy not in PLANNERS:
            raise InvalidArgument(f"no planner for policy {policy!r}; use one of {', '.join(PLANNERS)}")
        return self._submit(_plan, policy, [_portable(t) for t in traces], period, cost, target_nbytes, max_seconds)

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` in the child (``fn`` a module-level function, its arguments and result
        picklable); the future's result is its return value, its exception what it raised, or
        BrokenProcessPool if the child died.

        Raises:
            RuntimeError: the planning process was closed.
        """
        return self._submit(fn, *args)

    def start(self) -> concurrent.futures.Future:
        """Start the child now, so that the first plan need not wait for it to start. The
        future's result is the child's process id, once it is ready to plan.

        Raises:
            RuntimeError: the planning process was closed.
        """
        return self._submit(os.getpid)

    def ready(self, timeout_s: float) -> bool:
        """Wait until a child that was started is ready to plan, at most ``timeout_s`` seconds;
        whether it is (True too where none was started: nothing to wait for)."""
        with self._lock:
            pid = self._pid
        if pid is None:
            return True
        try:
            pid.result(timeout=timeout_s)
            return True
        except (concurrent.futures.TimeoutError, BrokenProcessPool):
            return False

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            if self._pool is not None:
                try:
                    return self._pool.submit(fn, *args)
                except BrokenProcessPool:
                    log.warning("the planning process died; starting a new one")
                    self._pool.shutdown(wait=True)
                    self._pool = None
            self._start()
            return self._pool.submit(fn, *args)

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("the planning process is closed")
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_exit_with_parent)
            self._pid = self._pool.submit(os.getpid)       # spawns the child, which takes its pipe ends
            _drop_request_reader(self._pool)

    def close(self) -> None:
        """End the child, and with it the plan being made: nobody waits for that one. The futures
        of the plans not made fail with BrokenProcessPool, or are cancelled."""
        with self._lock:
            pool, pid, self._pool, self._pid, self._closed = self._pool, self._pid, None, None, True
        if pool is None:
            return
        try:
            os.kill(pid.result(), signal.SIGTERM)   # not reaped before the pool joins it: still ours
        except (BrokenProcessPool, ProcessLookupError):
            pass                                    # it died already
        pool.shutdown(wait=True, cancel_futures=True)


def _drop_request_reader(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Close this process's copy of the read end of the pipe that carries requests to the child
    (Note [A pipe with no reader]); the child, already started, holds its own. Through the
    pool's private fields, as no public interface reaches the pipe."""
    reader = getattr(getattr(pool, "_call_queue", None), "_reader", None)
    if reader is not None:
        reader.close()


_SHARED: PlanningProcess | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> PlanningProcess:
    """The process-wide planning process, made on first use and started by its first plan;
    every executor of this process sends to it (plans are made one at a time) and none closes it:
    it exits with this process."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = PlanningProcess()
        return _SHARED


def _portable(trace: JobTrace) -> JobTrace:
    """``trace`` with its program's skeleton in place of the program (its op times shared)."""
    sequence = copy.copy(trace.sequence)
    sequence.program = sequence.program.skeleton()
    return replace(trace, sequence=sequence)


# --- in the child ---------------------------------------------------------------------------------


def _exit_with_parent() -> None:
    """Exit when the parent process does; leave Ctrl-C in a terminal to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="tensile-plan-parent", daemon=True).start()


#: cost model -> the global planner's curves under it, kept across the plans made in this process:
#: the child's, or the executors' own (Note [Plans the waiting thread makes] in
#: :mod:`~tensile_db.scheduler.engine`), one plan at a time (:data:`_CURVES_LOCK`)
_CURVES: dict[CostModel, dict] = {}
_CURVES_LOCK = threading.Lock()


def make_plan_with_kept_curves(policy: str, timeline: Timeline, cost: CostModel, target_nbytes: int,
                               max_seconds: float | None) -> Plan:
    """:func:`make_plan` with the global planner's curves this process keeps for ``cost`` across
    every plan made with them, whichever executor asks (a curve is one job's, by its program and
    the bucket of its iteration time: :func:`~.curves.plan_global`); one such plan at a time.

    Raises:
        KeyError: an unknown policy; and whatever the planner raises.
    """
    with _CURVES_LOCK:
        return make_plan(policy, timeline, cost, target_nbytes, max_seconds, _CURVES.setdefault(cost, {}))


def _plan(policy: str, traces: list[JobTrace], period: int | None, cost: CostModel, target_nbytes: int,
          max_seconds: float | None) -> tuple[Plan, float]:
    started = time.perf_counter()
    plan = make_plan_with_kept_curves(policy, Timeline(traces, period), cost, target_nbytes, max_seconds)
    return plan, time.perf_counter() - started
