"""The planner's work, counted: what a plan costs the coordinator, as a deterministic figure.

A plan is work the coordinator does on its CPU while the jobs run on. On ``cuda`` and ``cpu``
that work takes wall time on its own (in another process, so that it never holds the executor's
GIL); on the simulated device (:mod:`tensile_db.runtime.simulated`) a plan takes effect only
after its planning time has passed on the virtual clock (Note [Paid planning] in
:mod:`~tensile_db.scheduler.engine`). That time must not depend on the speed or load of the machine
that simulates, or two runs would differ, so it is *modelled*: the planners count their work in
units that dominate their cost (:class:`PlanWork`), and :meth:`PlanWork.seconds` turns the counts
into seconds with per-unit costs calibrated against their wall time on this project's machines.

Note [Planning cost model]
--------------------------
Units (each counted where the work is done, once):

- ``events``: events summed or copied in bulk (NumPy, or a C-level sum over the op times): every
  replay of a period by the simulator that times each op
  (:meth:`~tensile_db.scheduler.timeline.Simulator.simulate`), every usage profile computed;
- ``steps``: events visited one by one in Python by the simulator (the events with actions; a
  candidate's trial, :meth:`~tensile_db.scheduler.timeline.Simulator.extra_s`, visits only these,
  and counts one where it adds seconds up instead: Note [Inline plans add up] there);
- ``rows``: absences scanned by a vectorised search of the planner's store (candidates at a peak);
- ``items``: objects made one by one in Python: a timeline's events and tensors, the absences of
  the planner's store;
- ``decisions``: decisions the greedy takes (their bookkeeping: usage, the store, the simulator).

``seconds = Σ count × SECONDS_PER_UNIT[unit] + PLAN_OVERHEAD_S``. The per-unit costs were fitted
(non-negative least squares) to the wall time of the planners on this project's 2-core machine
over the paper workloads' timelines (one and four ResNet-50, the four models of the mixed arrival)
at 70%, 50% and 35% of their peaks, 54 plans of six policies: modelled over measured seconds had a
median of 1.0 and a range of about 0.5 to 2 (``bench/plan_cost.py`` refits them and prints the
modelled against the measured seconds of every plan). Since the planners' trials stopped replaying
every event (:meth:`~.timeline.Simulator.extra_s`) and a slot's bytes are computed once, the same
54 plans give a median of 1.11 and a range of 0.77 to 2.26 (the largest on vDNN's plans of a few
milliseconds), 0.84 to 1.39 on the global planner's: the constants were kept, so that no planner
is charged less than it takes (the refit lowered the cost of ``items``, and with it the charge of
the global planner's plans of the mixed arrival to 0.6 of their wall time). The model is linear in counts the planners' loops
run through, so a slower algorithm (more simulations, more decisions) is charged for it; it is not
exact for any one plan (the calibration table gives the spread), and it knows nothing of caches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Seconds per unit of work (Note [Planning cost model]), fitted on this project's machines.
SECONDS_PER_UNIT = {
    "events": 4.4e-8,       # bulk work per event: NumPy and C-level sums
    "steps": 3.2e-7,        # the simulator's Python loop, per event with actions
    "rows": 8.0e-8,         # vectorised scans of the store of absences, per row
    "items": 2.4e-6,        # an event, tensor, absence or carried decision made in Python
    "decisions": 1.5e-4,    # a decision of the greedy's: the store renewed, the simulator extended
}
#: Seconds every plan costs whatever its size (taking the snapshot, sending it, installing).
PLAN_OVERHEAD_S = 2e-3


@dataclass
class PlanWork:
    """Counts of a planner's work (Note [Planning cost model]); every field a count of units."""

    events: int = 0
    steps: int = 0
    rows: int = 0
    items: int = 0
    decisions: int = 0

    def seconds(self) -> float:
        """The modelled seconds of this work on this project's machines (:data:`SECONDS_PER_UNIT`)."""
        return PLAN_OVERHEAD_S + sum(getattr(self, f.name) * SECONDS_PER_UNIT[f.name] for f in fields(self))

    def add(self, other: "PlanWork") -> None:
        """Count ``other``'s work in this one too (a plan made of plans of parts)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def counts(self) -> dict[str, int]:
        """Unit -> count."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


if set(SECONDS_PER_UNIT) != {f.name for f in fields(PlanWork)}:       # checked when the module loads
    raise ImportError(f"SECONDS_PER_UNIT prices {sorted(SECONDS_PER_UNIT)} but PlanWork counts "
                      f"{sorted(f.name for f in fields(PlanWork))}")
