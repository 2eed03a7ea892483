"""spark_hvd.common is layered: no module imports, at load or lazily inside a function, one that
imports it back. ``_native`` (the C ABI) <- ``_ops`` (enqueue, wait) <- ``process_sets`` <-
``basics`` (init and shutdown, which start and stop the layers below).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from conftest import REPO

COMMON = REPO / "spark_hvd" / "common"


def import_graph() -> dict[str, set[str]]:
    """Module -> the sibling modules it imports anywhere in its source."""
    modules = {path.stem for path in COMMON.glob("*.py")}
    graph = {}
    for path in COMMON.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.update([node.module.split(".")[0]] if node.module else
                            [alias.name for alias in node.names])
        graph[path.stem] = deps & modules
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path of imports from ``start`` back to itself, if there is one."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        module, path = stack.pop()
        for dep in sorted(graph[module]):
            if dep == start:
                return path + [start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None


def test_common_modules_import_without_cycles():
    graph = import_graph()
    assert {"_native", "_ops", "process_sets", "basics"} <= set(graph)
    cycles = [cycle for module in sorted(graph) if (cycle := cycle_through(graph, module))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_lower_layers_do_not_load_basics():
    """Importing ``_ops`` or ``process_sets`` loads neither ``basics`` nor the modules above."""
    code = ("import json, sys\n"
            "import spark_hvd.common._ops, spark_hvd.common.process_sets\n"
            "print(json.dumps([m.rsplit('.', 1)[1] for m in sys.modules "
            "if m.startswith('spark_hvd.common.')]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert "_ops" in loaded and "process_sets" in loaded
    assert "basics" not in loaded and "_bootstrap" not in loaded, loaded
