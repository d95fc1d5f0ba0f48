"""What a PostgreSQL backend loads: every session that calls a tensile function imports
``tensile_db.pg.entry``, so it must not drag in the coordinator's server, executor, memory
manager, scheduler or inference code, which only the coordinator process runs."""

from __future__ import annotations

import json
import subprocess
import sys

#: Packages and modules only the coordinator process runs.
COORDINATOR_ONLY = ("tensile_db.coordinator.server", "tensile_db.coordinator.executor", "tensile_db.coordinator.jobs",
                    "tensile_db.memory", "tensile_db.scheduler", "tensile_db.inference")


def _loaded_by(module: str) -> list[str]:
    code = (f"import json, sys, {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tensile_db'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_a_backend_loads_no_coordinator_code():
    loaded = _loaded_by("tensile_db.pg.entry")
    assert "tensile_db.pg.entry" in loaded and "tensile_db.coordinator.client" in loaded
    assert [m for m in loaded if m.startswith(COORDINATOR_ONLY)] == []


def test_the_coordinator_loads_what_it_runs():
    """The same check can fail: the coordinator's entry point does load those modules."""
    loaded = _loaded_by("tensile_db.coordinator.__main__")
    assert {"tensile_db.coordinator.server", "tensile_db.memory.manager", "tensile_db.scheduler.engine",
            "tensile_db.inference.service"} <= set(loaded)
