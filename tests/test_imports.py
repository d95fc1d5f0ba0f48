"""What a PostgreSQL backend loads: every session that calls a tensile function imports
``tensile_db.pg.entry``, so it must not drag in the coordinator's server, executor, memory
manager, scheduler or inference code, which only the coordinator process runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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


#: The package's layers, lowest first: a module imports only from its own layer and those before it.
LAYERS = ("runtime", "memory", "scheduler", "inference", "coordinator", "pg")


def _imports(path) -> set[str]:
    """The tensile_db modules a source file imports (relative imports resolved)."""
    import ast

    package = ["tensile_db", *Path(path).relative_to(ROOT / "tensile_db").parent.parts]
    found = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.update([module] if node.module else [f"{module}.{a.name}" for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("tensile_db")}


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for layer_index, layer in enumerate(LAYERS):
        for path in sorted((ROOT / "tensile_db" / layer).glob("*.py")):
            for module in _imports(path):
                parts = module.split(".")
                if len(parts) > 1 and parts[1] in LAYERS and LAYERS.index(parts[1]) > layer_index:
                    upward.append(f"{path.relative_to(ROOT)} imports {module}")
    assert upward == []
