"""The planning process: its plans equal the plans made in-process, a planner's exception reaches
the future, a killed child is replaced on the next submit, and no child outlives ``close()`` or
its parent."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from tensile_db.errors import InvalidArgument
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.model import ModelSpec, TrainOptions, parse_architecture
from tensile_db.runtime.simulated import SimDevice
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.timeline import JobTrace, Timeline
from tensile_db.scheduler.trace import AccessSequence
from tensile_db.scheduler.worker import PLANNERS, PlanningProcess
from tensile_db.settings import POLICIES, UNPLANNED_POLICIES

MLP = ModelSpec(parse_architecture({"layers": [{"dense": 64}, {"dense": 32, "activation": "tanh"}]}),
                48, 4, "classification")
CNN = ModelSpec(parse_architecture({"input": {"shape": [3, 16, 16]}, "layers": [
    {"conv": 8, "padding": 1}, {"batch_norm": {}, "activation": "relu"}, {"max_pool": 2},
    {"residual": [{"conv": 8, "padding": 1}, {"batch_norm": {}}], "activation": "relu"},
    {"global_avg_pool": {}}]}), 768, 4, "classification")
COST = CostModel(h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9, latency_s=1e-5, duplex=True)


def _trace(job_id: int, spec: ModelSpec, phase: int) -> JobTrace:
    device = SimDevice("h100")
    sequence = AccessSequence(build_training_program(spec, TrainOptions(optimizer="adam"), 16))
    sequence.times_s[:] = [device.op_seconds(op) for op in sequence.program.ops]
    sequence.end_iteration()
    return JobTrace(job_id, sequence, phase, job_id)


@pytest.fixture(scope="module")
def request_():
    """(traces, period, target bytes) of two jobs, the target half their combined peak."""
    traces = [_trace(0, MLP, 0), _trace(1, CNN, 5)]
    timeline = Timeline(traces)
    return traces, timeline.period, timeline.vanilla_peak_nbytes() // 2


@pytest.fixture(scope="module")
def planning():
    process = PlanningProcess()
    yield process
    process.close()


def _children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def _figures(plan):
    return (plan.policy, plan.decisions, plan.before, plan.after, plan.predicted_peak_nbytes,
            plan.vanilla_peak_nbytes, plan.target_nbytes, plan.predicted_extra_s, sorted(plan.timeline.traces))


def test_every_policy_that_plans_has_a_planner():
    assert set(PLANNERS) == set(POLICIES) - set(UNPLANNED_POLICIES)


@pytest.mark.parametrize("policy", ["tensile", "checkpoint"])
def test_plan_from_the_process_equals_the_plan_made_here(planning, request_, policy):
    traces, period, target = request_
    here = PLANNERS[policy](Timeline(traces, period), COST, target, None)
    plan, seconds = planning.submit(policy, traces, period, COST, target, None).result(timeout=60)
    assert here.decisions and len(here.decisions) < len(here.timeline.tensors)
    assert _figures(plan) == _figures(here)
    assert 0 < seconds < 60
    assert all(op.run is None for t in plan.timeline.traces.values() for op in t.sequence.program.ops)
    assert all(op.run is not None for t in traces for op in t.sequence.program.ops)     # left as they were


def test_a_planning_error_reaches_the_future(planning, request_):
    traces, period, target = request_
    with pytest.raises(TypeError, match="'<=' not supported") as raised:      # no target: the planner fails
        planning.submit("tensile", traces, period, COST, None, None).result(timeout=60)
    assert "in plan_global" in str(raised.value.__cause__)                     # the child's traceback
    with pytest.raises(ValueError, match="period 1 is shorter"):                # the timeline fails
        planning.submit("tensile", traces, 1, COST, target, None).result(timeout=60)
    assert planning.submit("tensile", traces, period, COST, target, None).result(timeout=60)[0].decisions
    with pytest.raises(InvalidArgument, match="no planner for policy 'lru'"):
        planning.submit("lru", traces, period, COST, target, None)


def test_a_killed_child_is_replaced_on_the_next_submit(request_):
    traces, period, target = request_
    process, others = PlanningProcess(), _children()          # others: the module's planning process
    try:
        expected = _figures(process.submit("checkpoint", traces, period, COST, target, None).result(timeout=60)[0])
        (child,) = _children() - others
        os.kill(child, signal.SIGKILL)
        # A plan submitted before the pool finds the child dead fails with BrokenProcessPool
        # (the caller logs it); once it has failed, the next submit starts a new child.
        future = process.submit("checkpoint", traces, period, COST, target, None)
        try:
            future.result(timeout=60)
        except BrokenProcessPool:
            plan, _ = process.submit("checkpoint", traces, period, COST, target, None).result(timeout=60)
        else:
            plan, _ = future.result()
        assert _figures(plan) == expected
        assert len(_children() - others) == 1 and child not in _children()
    finally:
        process.close()


def test_close_leaves_no_child(request_):
    traces, period, target = request_
    process, others = PlanningProcess(), _children()
    assert _children() == others                         # not started yet
    child = process.start().result(timeout=60)
    assert _children() - others == {child}
    process.submit("tensile", traces, period, COST, target, None).result(timeout=60)
    assert _children() - others == {child}
    process.close()
    assert _children() == others
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    with pytest.raises(RuntimeError, match="closed"):
        process.submit("tensile", traces, period, COST, target, None)


def test_close_stops_a_plan_being_made():
    """A greedy plan of a 300-layer MLP far below its peak takes seconds; close() does not wait for it."""
    long_mlp = ModelSpec(parse_architecture({"layers": [{"dense": 16}] * 300}), 16, 2, "classification")
    process, others = PlanningProcess(), _children()
    process.start().result(timeout=60)
    future = process.submit("swap_score", [_trace(0, long_mlp, 0)], None, COST, 1 << 10, None)
    time.sleep(0.3)
    assert not future.done()
    started = time.perf_counter()
    process.close()
    assert time.perf_counter() - started < 2.0
    assert _children() == others
    with pytest.raises(BrokenProcessPool):
        future.result(timeout=0)


def test_the_child_exits_with_its_parent():
    parent = textwrap.dedent("""
        import multiprocessing, os, sys
        from tensile_db.runtime.builder import build_training_program
        from tensile_db.runtime.model import ModelSpec, TrainOptions, parse_architecture
        from tensile_db.scheduler.cost import CostModel
        from tensile_db.scheduler.timeline import JobTrace
        from tensile_db.scheduler.trace import AccessSequence
        from tensile_db.scheduler.worker import PlanningProcess

        if __name__ == "__main__":
            spec = ModelSpec(parse_architecture({"layers": [{"dense": 8}]}), 4, 2, "classification")
            sequence = AccessSequence(build_training_program(spec, TrainOptions(), 4))
            sequence.times_s[:] = 1e-3
            PlanningProcess().submit("tensile", [JobTrace(0, sequence)], None, CostModel(1e9, 1e9), 1 << 30,
                                     None).result(timeout=60)
            print(multiprocessing.active_children()[0].pid, flush=True)
            os.kill(os.getpid(), 9)
    """)
    # Its output goes to files, not pipes: a child that outlived it would hold a pipe open. (Its
    # resource tracker warns of the semaphores the killed parent left.)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run([sys.executable, "-c", parent], stdout=out, stderr=err, text=True, timeout=120,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out.seek(0), err.seek(0)
        output, errors = out.read(), err.read()
    assert done.returncode == -signal.SIGKILL, errors
    child = int(output)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the planning process {child} outlived its parent")


_QUEUED_BEHIND = textwrap.dedent("""
    import os, signal, sys, time
    from concurrent.futures import CancelledError
    from concurrent.futures.process import BrokenProcessPool
    from tensile_db.runtime.builder import build_training_program
    from tensile_db.runtime.model import ModelSpec, TrainOptions, parse_architecture
    from tensile_db.scheduler.cost import CostModel
    from tensile_db.scheduler.timeline import JobTrace
    from tensile_db.scheduler.trace import AccessSequence
    from tensile_db.scheduler.worker import PlanningProcess

    def traces(layers):     # a request of megabytes: larger than the pipe's buffer
        spec = ModelSpec(parse_architecture({"layers": [{"dense": 16}] * layers}), 16, 2, "classification")
        sequence = AccessSequence(build_training_program(spec, TrainOptions(optimizer="adam"), 16))
        sequence.times_s[:] = 1e-4
        return [JobTrace(0, sequence)]

    if __name__ == "__main__":
        cost = CostModel(2e9, 2e9, latency_s=1e-5, duplex=True)
        process = PlanningProcess()
        child = process.start().result(timeout=60)
        busy = process.call(time.sleep, 60)
        queued = process.submit("swap_score", traces(1500), None, cost, 1 << 10, None)   # megabytes
        time.sleep(0.5)
        if sys.argv[1] == "close":
            process.close()
        else:
            os.kill(child, signal.SIGKILL)
        for future in (busy, queued):
            try:
                future.result(timeout=30)
            except (BrokenProcessPool, CancelledError):
                pass
        if sys.argv[1] == "kill":
            assert process.start().result(timeout=60) != child
        print("done", flush=True)
""")


@pytest.mark.parametrize("death", ["close", "kill"])
def test_a_child_that_dies_with_a_large_request_queued_leaves_nothing_waiting(death):
    """Note [A pipe with no reader]: the child dies, closed or killed, while a request of
    megabytes waits behind the call it is running; the futures fail, a new child starts after a
    kill, and the process exits (before, the pool's shutdown waited forever)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run([sys.executable, "-c", _QUEUED_BEHIND, death], stdout=out, stderr=err, text=True,
                              timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out.seek(0), err.seek(0)
        output, errors = out.read(), err.read()
    assert done.returncode == 0 and output.strip() == "done", errors


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie no parent has reaped yet has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ready_waits_for_a_started_child_and_not_for_one_never_started():
    process = PlanningProcess()
    try:
        assert process.ready(0.0)                          # none started: nothing to wait for
        process.start()
        assert process.ready(60.0)
        assert process._pid.done() and process._pid.result() != os.getpid()
    finally:
        process.close()
