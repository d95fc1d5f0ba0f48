"""The arena unit: the granularity and alignment of every device block, shared by the layers.

The runtime sizes its slots in arena bytes (:attr:`tensile_db.runtime.program.Slot.arena_nbytes`),
the memory manager allocates in them (:mod:`tensile_db.memory.arena`) and the scheduler plans in
them, so the unit is defined here, at the bottom of the import order, and imported downward only.
"""

from __future__ import annotations

#: Allocation granularity and alignment, bytes (CuPy's pool uses the same unit).
UNIT_NBYTES = 512


def round_up(nbytes: int, unit: int = UNIT_NBYTES) -> int:
    """``nbytes`` rounded up to a whole number of ``unit`` bytes (at least one), bytes."""
    return max(unit, -(-nbytes // unit) * unit)
