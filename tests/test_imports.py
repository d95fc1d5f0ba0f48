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


def _imports(path, package: list[str] | None = None) -> set[str]:
    """The tensile_db modules a source file imports, at the top or inside functions (relative
    imports resolved in ``package``, by default the file's own); ``from package import name``
    counts as an import of ``package.name`` too, which may be a module."""
    import ast

    package = package or ["tensile_db", *Path(path).relative_to(ROOT / "tensile_db").parent.parts]
    found = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.update([module] if node.module else [])
            found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("tensile_db")}


def _module_of(path) -> str:
    parts = Path(path).relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> the modules it imports): its strongly connected
    components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):                                   # recursion depth: the longest import chain
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for layer_index, layer in enumerate(LAYERS):
        for path in sorted((ROOT / "tensile_db" / layer).glob("*.py")):
            for module in _imports(path):
                parts = module.split(".")
                if len(parts) > 1 and parts[1] in LAYERS and LAYERS.index(parts[1]) > layer_index:
                    upward.append(f"{path.relative_to(ROOT)} imports {module}")
    assert upward == []



def test_no_import_cycle():
    """No module imports itself through others, at the top or inside a function: each has its
    place in the layers by what it needs."""
    files = {_module_of(p): p for p in (ROOT / "tensile_db").rglob("*.py")}
    graph = {m: (_imports(p) & set(files)) - {m} for m, p in files.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_modules_that_import_each_other_inside_functions(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "b.py").write_text("def g():\n    from .a import f\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    graph = {f"tensile_db.x.{n}": _imports(tmp_path / f"{n}.py", ["tensile_db", "x"]) for n in "abc"}
    graph = {m: deps & set(graph) for m, deps in graph.items()}
    assert _cycles(graph) == [["tensile_db.x.a", "tensile_db.x.b"]]
