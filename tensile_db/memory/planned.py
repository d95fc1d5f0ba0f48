"""The planned pool at run time: recurring allocations served at lifetime-planned offsets.

Note [Planned pool]
-------------------
Every block the memory manager allocates for a job's tensor carries a *key*: (job id, slot, the
position of the op that allocates it). While the same jobs run on the same schedule, the
executor's combined timeline repeats every period (:mod:`tensile_db.coordinator.executor`), and
so does the sequence of keyed allocations and frees. The pool (Zhang, Yeung, Shu, He, Wang,
arXiv 1903.06631, section III, made to run across several jobs):

1. *records* that sequence over one period, from one period boundary to the next, with the
   blocks live at the first boundary;
2. at the second boundary, if the period was *steady* (the same keys live at its end as at its
   start; no eviction, passive swap-in or early swap-out, whose timing depends on the allocator's
   state rather than on the schedule), turns it into :class:`~tensile_db.memory.lifetimes.Allocation`\\ s
   — a block live across the boundary is one allocation of two segments — and plans their offsets
   on a planning thread or in the planning process (:func:`~tensile_db.memory.lifetimes.plan_smallest`,
   best fit, with a search of :data:`SEARCH_S` seconds; where the executor waits for the offsets, a
   small period's at that boundary: :data:`HERE_MAX_ALLOCATIONS`), checked by
   :func:`~tensile_db.memory.lifetimes.check_plan`;
3. at the first boundary after the plan is ready (or, at the latest, :data:`PLAN_WAIT_PERIODS`
   boundaries on, waiting for it), if the same keys are live as at the recorded period's start,
   asks the manager to *install* it: one block of the arena becomes the planned
   region and the live blocks move to their planned offsets (Note [Blocks kept in place]);
4. *serves*: every keyed event is compared with the recorded sequence (one comparison); while they
   agree, an allocation is a lookup. An event that does not agree — a swap-in the plan did not
   make, a tensor evicted, a period that ends early — is a *mismatch*: the manager dissolves the
   region (its live blocks become ordinary general-pool blocks where they are; nothing moves),
   that request and the rest go to the general pool, and the pool records again after a back-off.
   A schedule change or a job arriving or leaving does the same without counting a mismatch; a
   re-plan whose plan takes the same actions at the same positions as the one in force is not a
   change (a re-plan for drifted op times often gives the same plan, and planning the offsets
   again takes CPU from the jobs).

Safety: while the events agree, the blocks live at every moment are exactly those of the recorded
period, whose planned offsets do not overlap; once they disagree no block is placed in the region
again until a new plan is installed. So no request fails and no two live tensors share bytes.

Limitations: periods with reactive evictions are never planned (the reactive policy under a tight
budget stays on the general pool).

Note [Blocks kept in place]
---------------------------
Rationale: the blocks live at a period boundary are a training job's weights and optimizer state,
live through the whole period. The general pool put them where it found room as they came, so a
packing planned from scratch puts every one of them elsewhere: one ResNet-50 at 70% of its peak
on the simulated H100 moved all 589 at its install, 3 ms of copy launches, a third of an
iteration. Yet a block live at every event of the period conflicts with every other, so where it
lies matters to the others only through the gaps it leaves.

Approach: with the recording, the pool notes where the live blocks lie (``where``), and the
planning thread makes a second packing with those live through the whole period fixed at their
offsets and the others placed around them (:func:`~tensile_db.memory.lifetimes.plan_offsets` with ``fixed``, the best of
its orders). At the install that packing is tried first where its region is at most
:data:`KEPT_MAX_RATIO` of the most bytes live at once (the bound the packing from scratch is held
to) and fits beside the blocks in use and the reserve: then nothing that is live moves (on that
ResNet-50, a region 3.6% above the live bytes, 3.2% larger than the packing from scratch); else
the packing from scratch is installed as before. A region kept in place takes more of the budget,
and its larger size counts in the device's peak. The
figures and :attr:`PlannedPool.history` report the packing from scratch (the planner's quality);
``figures["installed_arena_nbytes"]`` says what the installed region takes.

Limitations: the offsets are those at the end of the recorded period; a block the general pool
moves before the install (a compaction) moves at the install too, and so does a block live at the
boundary but freed and allocated again within the period (a weight swapped out and back in), which
the general pool may have put elsewhere by then. Where the budget leaves no room
for the larger region, every live block still moves.

Note [A region that does not fit]
---------------------------------
Rationale: a failed install was retried like any other failure, recording again after a back-off
of 1, 2, 4, ... up to :data:`MAX_BACKOFF_PERIODS` periods. Where the budget is the job's largest
working set, the packing of its period comes out a few kilobytes above the room beside the
blocks in use (the small CNN of ``bench/throughput.py`` at 50% of its peak: a region of
29,410,304 bytes in a budget of 29,404,672), and every retry fails the same way. Each costs a
search of :data:`SEARCH_S` seconds: on the pool's planning thread, which held the GIL the
executor needs after every kernel, the iteration it fell in took 110 to 150 ms against 30 to 40
ms, four or five times in 24 iterations, and once every 64 periods for as long as the job ran; in
the planning process (Note [Planning off the GIL] in :mod:`tensile_db.scheduler.worker`) it
still takes a core.

Approach: the manager says *no room* with a :class:`NoRoom` (neither packing fits beside the
blocks in use and the reserve); the pool then waits :data:`NO_ROOM_BACKOFF_PERIODS` periods
before recording again, or until :meth:`PlannedPool.invalidate` (a job arriving or leaving, a new
schedule), which may leave room. Other refusals (an install that would stage too much through
host memory, which depends on where the blocks lie) and failures back off as before.

Limitations: a region that would fit after a one-off peak of library temporaries in the recorded
period, or after the general pool's blocks move, waits that long. The scheduler's plans now keep
headroom at the events other than the largest ops' at such a budget, where they can (Note
[Targets under the floor] in :mod:`tensile_db.scheduler.engine`), and that small CNN's region
packed to its budget in each of three runs.

Note [A search the jobs wait for]
---------------------------------
Rationale: the offsets' search runs for :data:`SEARCH_S` seconds unless it reaches the most live
bytes, which it often cannot, and where the executor waits for the offsets (Note [Plans beside
kernels on every core] in :mod:`tensile_db.scheduler.engine`) the jobs wait that long. The MLP of
``bench/throughput.py`` at half its peak, its optimizer steps in sub-groups: the fixed orders
packed its period 0.97% above the most live bytes in a millisecond, the search brought that to
0.06% in 100 ms, and the iteration that waited for it took 127 to 130 ms against 5.5 to 6 (two
runs): in a run of 64 iterations, a third more time per iteration. With the search ended as below,
that iteration took 13 to 20 ms.

Approach: where the pool's plans are waited for, the search ends at the first packing (the fixed
orders' best, and the one more order tried before the search, included) that is at most
:data:`ENOUGH_RATIO` of the most live bytes and fits the region's room, the budget less the
library temporaries' bytes that the install keeps free; elsewhere, and where no packing found so
far fits, it searches as before. A region that fits is installed either way, and one within the
plans' headroom does not make them keep more (Note [Headroom for the pool] in
:mod:`tensile_db.scheduler.engine`). The plan of a period recorded again is reused only where it
fits the room of then; once a region found no room (pinned blocks, or blocks that the layout
cannot move round), the pool searches whole again until the jobs or the schedule change.

Limitations: the region may take up to :data:`ENOUGH_RATIO` of the most live bytes where a search
would have found less, and the device's peak counts it; the room is the budget's, not what the
blocks in use leave at the install. :data:`ENOUGH_RATIO` is the scheduler's default headroom
written again: a job configured with another headroom does not move it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import logging
import math
from typing import Callable

from .lifetimes import (
    Allocation,
    PoolPlan,
    best_fixed_order,
    check_plan,
    max_live_nbytes,
    packing_figures,
    period_allocations,
    plan_smallest,
    small_overlaps,
)

log = logging.getLogger(__name__)

Key = tuple          # (job id, slot, op position)

#: Most periods the pool waits before recording again after repeated failures.
MAX_BACKOFF_PERIODS = 64
#: Seconds the planning thread searches for a smaller packing than the greedy orders find.
SEARCH_S = 0.1
#: Randomised orders a synchronous pool tries instead (a time limit would make it non-deterministic).
SEARCH_TRIES = 4
#: the most a region with the live blocks kept in place may take, over the most bytes its period
#: holds live at once (Note [Blocks kept in place])
KEPT_MAX_RATIO = 1.05
#: Boundaries a plan may take before the executor waits for it: a planner competes with the
#: executor (for the GIL on the pool's thread, for a core in the planning process) and can starve.
PLAN_WAIT_PERIODS = 4
#: A search the jobs wait for ends at a packing this close to the most bytes its period holds live
#: at once, where it fits the room (Note [A search the jobs wait for]): the headroom the
#: scheduler's plans keep by default (Note [Headroom for the pool] in
#: :mod:`tensile_db.scheduler.engine`)
ENOUGH_RATIO = 1.03
#: Seconds the boundary that asks for a plan waits for it where plans are waited for (Note [Plans
#: beside kernels on every core] in :mod:`tensile_db.scheduler.engine`); after that, as elsewhere.
WAIT_S = 4.0
#: Periods the pool waits before recording again after a region found no room (Note [A region that
#: does not fit]), unless invalidated first.
NO_ROOM_BACKOFF_PERIODS = 1024
#: a period of more allocations than this is planned by :attr:`PlannedPool.offload` when it is
#: set: every one (the 400-layer job of ``bench/fairness.py``: 1.5 s of planning beside the
#: executor; a search of :data:`SEARCH_S` holds the GIL the executor needs too, Note [Planning off
#: the GIL] in :mod:`tensile_db.scheduler.worker`)
OFFLOAD_MIN_ALLOCATIONS = 0
#: Where the executor waits for the offsets, a period of at most this many allocations is planned
#: at the boundary that waits, on its own thread (Note [Plans the waiting thread makes] in
#: :mod:`tensile_db.scheduler.engine`); larger ones as elsewhere, the wait bounded by :data:`WAIT_S`.
HERE_MAX_ALLOCATIONS = 512


class NoRoom(str):
    """Why an install was not made, where the reason is that the region (either packing) and the
    reserve do not fit beside the blocks in use (Note [A region that does not fit])."""


class State(str, enum.Enum):
    IDLE = "idle"               # general pool only; records at a coming boundary
    RECORDING = "recording"     # general pool; the period's events are being recorded
    PLANNING = "planning"       # general pool; the offsets are being planned, or wait to be installed
    SERVING = "serving"         # recurring allocations come from the planned region


class PlannedPool:
    """The planned region's sequence of events, recorded and then replayed.

    Args:
        install: ``install(plan, live_keys, reserve_nbytes) -> base offset or why not`` (a
            :class:`NoRoom` where the region finds no room) — the
            manager reserves ``plan.arena_nbytes`` bytes at a base offset, moves the live blocks
            (whose keys are ``live_keys``) to ``base + plan.offsets[key]``, and keeps at least
            ``reserve_nbytes`` free for unkeyed blocks; a string saying why if it does not. The
            layout and the moves are :func:`~tensile_db.memory.moves.region_layout`'s; the manager
            performs them.
        dissolve: ``dissolve()`` — the manager turns the region back into general-pool blocks.
        enabled: False for the general pool only (``tensile.pool = 'general'``).
        synchronous: plan at the boundary that finishes a recording, in the caller's thread, with
            a search bounded by tries (:data:`SEARCH_TRIES`), not time: the same recording always
            gives the same plan at the same boundary (the simulated device's determinism).
    """

    def __init__(self, install: Callable, dissolve: Callable, enabled: bool = True, synchronous: bool = False,
                 where: Callable[[], dict] | None = None, room: Callable[[], int] | None = None):
        self.enabled = enabled
        self.synchronous = synchronous
        self.state = State.IDLE
        self.plan: PoolPlan | None = None            # the installed plan (offsets relative to base)
        self.base = 0                                # arena offset of the region, bytes
        self.history = collections.deque(maxlen=8)   # (allocations, plan) of the latest installs
        self.figures: dict = {}                      # bytes of the last plan, joint and per job
        self.plans_installed = 0
        self.planned_allocations = 0                 # served by lookup, cumulative
        self.mismatches = 0
        self.last_mismatch = ""
        self.periods_served = 0                      # periods replayed without a mismatch
        self._install, self._dissolve, self._where, self._room = install, dissolve, where, room
        self._events: list[tuple[str, Key]] = []     # ("a" | "f", key), while recording
        self._sizes: dict[Key, int] = {}             # key -> bytes
        self._start_live: dict[Key, int] = {}        # blocks live when the recording started
        self._steady = True
        self._unkeyed_nbytes = 0                     # unkeyed (library) bytes live, while recording
        self._unkeyed_peak = 0
        self._cursor = 0
        self._expected: list[tuple[Key | None, int | None]] = []   # serving: (key, offset or None for a free)
        self._failures = 0
        self._wait = 0                               # boundaries to let pass before recording
        self._planning: concurrent.futures.Future | None = None
        self._planning_periods = 0                   # boundaries since the plan was asked for
        self._last_plan: tuple | None = None         # _plan's result last installed or tried
        # Note [A search the jobs wait for]: a region found no room (search whole until invalidated);
        # the room the plan being made and the last plan were searched for (0: whole)
        self._no_room, self._planning_room, self._last_room = False, 0, 0
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensile-pool")
        #: ``offload(fn, *args) -> Future`` running ``fn`` in another process, for plans of more
        #: than :data:`OFFLOAD_MIN_ALLOCATIONS` (None: the planning thread makes every plan)
        self.offload: Callable | None = None
        #: whether the boundary that asks for a plan waits for it (at most :data:`WAIT_S`) and
        #: installs it at once (Note [Plans beside kernels on every core] in
        #: :mod:`tensile_db.scheduler.engine`)
        self.waits_for_plans = False

    @property
    def packing_ratio(self) -> float | None:
        """The last offset plan's arena over the most bytes its period held live at once (at least
        1; installed or not); None before the first plan."""
        if self._last_plan is None:
            return None
        figures = self._last_plan[2]
        return figures["planned_arena_nbytes"] / max(figures["max_live_nbytes"], 1)

    @property
    def region_nbytes(self) -> int:
        """Bytes the planned region holds in the arena now (0 unless serving)."""
        return self.plan.arena_nbytes if self.state is State.SERVING else 0

    # -- events from the manager ----------------------------------------------------------------

    def lookup(self, key: Key | None) -> int | None:
        """The arena offset planned for the next allocation, keyed ``key``, if it is the one the
        plan expects next; else None (and, for a keyed one while serving, a mismatch): use the
        general pool. Unkeyed blocks (library temporaries) always come from the general pool."""
        if self.state is not State.SERVING or key is None:
            return None
        expected, offset = self._expected[self._cursor]
        if offset is not None and expected == key:
            self._cursor += 1
            self.planned_allocations += 1
            return offset
        self._mismatch(f"allocation of {_name(key)}")
        return None

    def allocated(self, key: Key | None, nbytes: int) -> None:
        """A general-pool block of ``nbytes`` was allocated under ``key`` (None: unkeyed)."""
        if self.state is State.RECORDING:
            if key is None:
                self._unkeyed_nbytes += nbytes
                self._unkeyed_peak = max(self._unkeyed_peak, self._unkeyed_nbytes)
            else:
                self._events.append(("a", key))
                self._sizes[key] = nbytes

    def freed(self, key: Key | None, nbytes: int) -> None:
        """A block allocated under ``key`` was freed (planned or not)."""
        if self.state is State.RECORDING:
            if key is None:
                self._unkeyed_nbytes -= nbytes
            else:
                self._events.append(("f", key))
        elif self.state is State.SERVING and key is not None:
            expected, offset = self._expected[self._cursor]
            if offset is None and expected == key:
                self._cursor += 1
            else:
                self._mismatch(f"free of {_name(key)}")

    def disturb(self, reason: str) -> None:
        """Something happened whose timing the schedule does not fix (an eviction, a passive
        swap-in, a swap-out finished early): the recorded period is not steady, and a served
        one has left its plan."""
        if self.state is State.RECORDING:
            self._steady = False
        elif self.state is State.SERVING:
            self._mismatch(reason)

    def invalidate(self, reason: str) -> None:
        """The schedule or the set of jobs changed: back to the general pool; record afresh at
        the next boundary."""
        if self.state is State.SERVING:
            self._dissolve()
            log.info("planned pool dissolved: %s", reason)
        self.state, self.plan, self._failures, self._wait = State.IDLE, None, 0, 0
        self._planning, self._no_room = None, False

    def wait_for_plan(self) -> None:
        """Block until the plan asked for at the last boundary is made (a no-op unless planning),
        so that the next boundary installs it. Raises whatever the planner raised."""
        if self._planning is not None:
            self._planning.result()

    def close(self) -> None:
        """Stop the planning thread."""
        self._planning = None
        self._thread.shutdown(wait=True, cancel_futures=True)

    # -- period boundaries ------------------------------------------------------------------------

    def boundary(self, snapshot: Callable[[], tuple[dict[Key, int], int]]) -> None:
        """A period boundary (between rounds, no op running). ``snapshot()`` returns (key -> bytes
        of every keyed block live now, bytes of unkeyed blocks live now); it is called only when
        needed, not in a period served as planned."""
        if not self.enabled:
            return
        if self.state is State.SERVING:
            if self._expected[self._cursor][0] is None:      # the sentinel: every event happened
                self._cursor = 0
                self.periods_served += 1
                self._failures = 0
                return
            self._mismatch(f"the period ended after {self._cursor} of {len(self._expected) - 1} planned events")
        live, unkeyed_nbytes = snapshot()
        if self.state is State.RECORDING:
            why = self._finish_recording(live)
            if why is not None:
                self._fail(why)
            elif not self.waits_for_plans:          # else waited for and installed below
                return
        if self.state is State.PLANNING:
            self._planning_periods += 1
            if self.waits_for_plans:
                concurrent.futures.wait([self._planning], timeout=WAIT_S)
            if not self._planning.done() and self._planning_periods < PLAN_WAIT_PERIODS:
                return
            why = self._install_planned(live)
            if why is None:
                return
            self._fail(why)
        if self.state is State.IDLE and live:
            if self._wait:
                self._wait -= 1
                return
            self.state, self._events, self._sizes = State.RECORDING, [], {}
            self._start_live, self._steady = dict(live), True
            self._unkeyed_nbytes = self._unkeyed_peak = unkeyed_nbytes

    def _finish_recording(self, live: dict[Key, int]) -> str | None:
        """Hand a steady recorded period to the planner (the planning thread or process, or this
        thread: Note [Plans the waiting thread makes] in :mod:`tensile_db.scheduler.engine`);
        None on success, else why not."""
        if not self._steady:
            return "the period had evictions or unplanned swap-ins"
        if live != self._start_live:
            return "the blocks live at the end of the period differ from those at its start"
        allocs = period_allocations(self._events, self._sizes, self._start_live)
        if allocs is None:
            return "the period's allocations and frees do not pair up"
        self.state, self._planning_periods = State.PLANNING, 0
        where = self._where() if self._where is not None else {}
        keep = {key: where[key] for key in live if key in where}       # Note [Blocks kept in place]
        # Note [A search the jobs wait for]: the region's room, the budget less the reserve
        room = (self._room() - self._unkeyed_peak
                if self.waits_for_plans and self._room is not None and not self._no_room else 0)
        if (self._last_plan is not None and self._last_plan[0] == allocs and self._last_plan[4] == keep
                and (self._last_room <= 0 or 0 < room and self._last_plan[1].arena_nbytes <= room)):
            # The same period as last time (a re-plan of the scheduler that left the interleaving
            # as it was): its plan still holds, and planning it again would only take CPU from the jobs.
            self._planning, self._planning_room = _made_here(lambda: self._last_plan), self._last_room
        elif self.synchronous:
            self._planning = _made_here(_plan, allocs, math.inf, SEARCH_TRIES, keep)
        elif self.waits_for_plans and len(allocs) <= HERE_MAX_ALLOCATIONS:
            # Note [Plans the waiting thread makes] in tensile_db.scheduler.engine
            self._planning, self._planning_room = _made_here(_plan, allocs, SEARCH_S, None, keep, room), room
        else:
            submit = self.offload if self.offload is not None and len(allocs) > OFFLOAD_MIN_ALLOCATIONS \
                else self._thread.submit
            self._planning, self._planning_room = submit(_plan, allocs, SEARCH_S, None, keep, room), room
        return None

    def _install_planned(self, live: dict[Key, int]) -> str | None:
        """Install the plan the planner made; None on success, else why not (a planner's error is
        logged and is one)."""
        try:
            allocs, packed, figures, kept, _ = self._last_plan = self._planning.result()
            self._last_room = self._planning_room
        except Exception as exc:  # a bug in the planner must not stop the jobs: stay general
            log.exception("planning the pool failed")
            return f"planning failed: {exc!r}"
        finally:
            self._planning = None
        if live != self._start_live:
            return "the blocks live at this boundary differ from those the plan starts from"
        for plan in [p for p in (kept, packed) if p is not None]:     # Note [Blocks kept in place]
            try:
                base = self._install(plan, set(live), self._unkeyed_peak)
            except Exception as exc:    # a failed copy of a move: the blocks stay where they are now
                log.exception("installing the planned pool failed; back to the general pool")
                self._dissolve()
                return f"the install failed: {exc!r}"
            if not isinstance(base, str):
                break
        if isinstance(base, str):
            return base
        figures = {**figures, "installed_arena_nbytes": plan.arena_nbytes}
        self.state, self.plan, self.base, self.figures = State.SERVING, plan, base, figures
        self.history.append((allocs, packed))
        self._expected = [(key, base + plan.offsets[key] if kind == "a" else None) for kind, key in self._events]
        self._events, self._sizes = [], {}
        self._expected.append((None, -1))            # sentinel: the period is over
        self._cursor = 0
        self.plans_installed += 1
        log.info("planned pool %d: %d allocations in %d bytes at offset %d (max live %d bytes)",
                 self.plans_installed, len(allocs), plan.arena_nbytes, base, figures["max_live_nbytes"])
        return None

    def _mismatch(self, what: str) -> None:
        self.mismatches += 1
        self.last_mismatch = what
        log.info("planned pool mismatch: %s; back to the general pool", what)
        self._dissolve()
        self.state, self.plan = State.IDLE, None
        self._fail(what)

    def _fail(self, why: str) -> None:
        self._no_room |= isinstance(why, NoRoom)            # Note [A search the jobs wait for]
        self.state = State.IDLE
        self._failures += 1
        periods = (NO_ROOM_BACKOFF_PERIODS if isinstance(why, NoRoom)       # Note [A region that does not fit]
                   else min(MAX_BACKOFF_PERIODS, 2 ** (self._failures - 1)))
        self._wait = periods - 1
        log.debug("planned pool not installed (%s); recording again in %d periods", why, self._wait + 1)

    # -- reporting --------------------------------------------------------------------------------

    def describe(self) -> dict:
        """JSON-able figures for ``tensile.memory`` (bytes and counts)."""
        return {"pool": self.state.value if self.enabled else "general only",
                "planned_region_nbytes": self.region_nbytes,
                "pool_plans_installed": self.plans_installed,
                "planned_allocations": self.planned_allocations,
                "pool_mismatches": self.mismatches,
                "planned_arena_nbytes": self.figures.get("planned_arena_nbytes"),
                "max_live_nbytes": self.figures.get("max_live_nbytes"),
                "general_pool_nbytes": self.figures.get("general_pool_nbytes")}

    def job_figures(self, job_id: int) -> dict:
        """Bytes of the last plan for one job's allocations alone: its planned arena, lower bound
        (max live bytes) and the general pool's high-water mark on the same trace."""
        return self.figures.get("per_job", {}).get(job_id, {})


def _name(key: Key) -> str:
    job, slot, position = key
    return f"{slot} of job {job} at op {position}"


def _made_here(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)``, called now, as a done future: its result, or the exception it raised (which
    :meth:`PlannedPool._install_planned` logs, as it does a planning thread's), so that a planner's
    error never escapes a boundary nor leaves the pool waiting for a future nobody resolves."""
    made = concurrent.futures.Future()
    try:
        made.set_result(fn(*args))
    except Exception as exc:            # a bug in the planner must not stop the jobs: stay general
        made.set_exception(exc)
    return made


def _plan(allocs: list[Allocation], search_s: float = SEARCH_S, max_tries: int | None = None,
          keep: dict | None = None,
          room_nbytes: int = 0) -> tuple[list[Allocation], PoolPlan, dict, PoolPlan | None, dict]:
    """On the planner's thread (the planning thread's, the planning process's or the boundary's:
    :meth:`PlannedPool._finish_recording`): (the allocations, their offsets (checked), the figures
    reported for them, the packing with the blocks of ``keep`` (key -> arena offset) where they lie (Note
    [Blocks kept in place]; None without ``keep``, or above :data:`KEPT_MAX_RATIO`), ``keep``).
    ``room_nbytes``: where positive, the search for offsets ends at a packing within
    :data:`ENOUGH_RATIO` of the most live bytes that is at most this large (Note [A search the
    jobs wait for])."""
    overlaps = small_overlaps(allocs)                  # once, for both packings
    enough = min(room_nbytes, int(ENOUGH_RATIO * max_live_nbytes(allocs))) if room_nbytes > 0 else 0
    plan = plan_smallest(allocs, "best_fit", search_s, max_tries=max_tries, overlaps=overlaps, enough_nbytes=enough)
    check_plan(allocs, plan)
    figures = packing_figures(allocs, plan)
    kept = None
    end = max((e for a in allocs for _, e in a.segments), default=0)
    fixed = {a.key: keep[a.key] for a in allocs if a.key in (keep or {}) and a.segments == ((0, end),)}
    if fixed:
        kept = best_fixed_order(allocs, "best_fit", figures["max_live_nbytes"], fixed, overlaps)
        check_plan(allocs, kept)
        if kept.arena_nbytes > KEPT_MAX_RATIO * figures["max_live_nbytes"]:
            kept = None
    return allocs, plan, figures, kept, keep or {}
