"""spark_hvd.common is layered: no module imports, at load or lazily inside a function, one that
imports it back. ``_native`` (the C ABI) <- ``_ops`` (enqueue, wait) <- ``process_sets`` <-
``basics`` (init and shutdown, which start and stop the layers below).

spark_hvd.estimators has rooms by the side their code runs on: ``data/`` (the shards: format,
preparation, loader) imports only ``data/`` and the Store; ``rank/`` (what runs inside the
training ranks) imports only ``rank/``, ``data/`` and the Store, and never PySpark; the top level
(the public modules and the driver's side of a fit) may import them all.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from conftest import REPO

COMMON = REPO / "spark_hvd" / "common"
ESTIMATORS = REPO / "spark_hvd" / "estimators"


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


def modules_loaded_by(code: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    code += "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_lower_layers_do_not_load_basics():
    """Importing ``_ops`` or ``process_sets`` loads neither ``basics`` nor the modules above."""
    loaded = [m.rsplit(".", 1)[1] for m in modules_loaded_by(
        "import spark_hvd.common._ops, spark_hvd.common.process_sets")
        if m.startswith("spark_hvd.common.")]
    assert "_ops" in loaded and "process_sets" in loaded
    assert "basics" not in loaded and "_bootstrap" not in loaded, loaded


# -- spark_hvd.estimators' rooms ---------------------------------------------------------------

PACKAGE = "spark_hvd.estimators"
# Room -> the rooms its modules may import from the package (anywhere in their source).
ALLOWED = {"data": {"data", "store"}, "rank": {"rank", "data", "store"}, "store": {"store"}}


def room_of(module: str) -> str:
    """``data``, ``rank``, ``store``, or ``top`` (the public modules and the driver's side)."""
    parts = module.split(".")[2:]
    if parts and parts[0] in ("data", "rank", "store"):
        return parts[0]
    return "top"


def estimator_modules() -> dict[str, Path]:
    modules = {}
    for path in ESTIMATORS.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(module: str, path: Path) -> set[str]:
    """Every module ``module`` imports anywhere in its source, relative imports resolved; for
    ``from X import name``, ``X.name`` where that is a module of the package, else ``X``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = estimator_modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def test_estimator_rooms_import_only_downwards():
    modules = estimator_modules()
    rooms = {room_of(m) for m in modules}
    assert {"data", "rank", "store", "top"} <= rooms, rooms
    assert {f"{PACKAGE}.rank._{n}" for n in ("torch", "keras", "lightning", "training")} <= \
        set(modules)
    wrong = []
    for module, path in sorted(modules.items()):
        room = room_of(module)
        if room == "top":
            continue
        for target in sorted(imported_modules(module, path)):
            if target.split(".")[0] == "pyspark" and room == "rank":
                wrong.append(f"{module} imports {target} (a rank never imports PySpark)")
            elif target.startswith(PACKAGE + ".") and room_of(target) not in ALLOWED[room]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the rooms' direction:\n" + "\n".join(wrong)


def test_a_rank_loads_neither_pyspark_nor_the_driver_side():
    """What a rank loads (the RankEntry the driver pickles for it, then its training loop and
    the shard loader) is no PySpark and no module of the estimators' top level."""
    import pickle

    from spark_hvd.estimators.rank import _torch, _training
    entry = pickle.dumps(_training.RankEntry(_torch.train_on_rank, "spawn"))
    loaded = modules_loaded_by(
        f"import pickle\npickle.loads({entry!r})\n"
        "from spark_hvd.estimators.rank import _keras, _lightning, _torch, _training\n"
        "import spark_hvd.estimators.loader")
    assert f"{PACKAGE}.rank._training" in loaded and f"{PACKAGE}.data._loader" in loaded
    wrong = [m for m in loaded if m.split(".")[0] == "pyspark" or
             (m.startswith(PACKAGE + ".") and room_of(m) == "top" and m != f"{PACKAGE}.loader")]
    assert not wrong, wrong


def test_public_paths_of_the_estimators():
    """The public import paths (API.md, the docs, examples/) and the aliases of moved
    modules: ``loader`` is ``data._loader`` itself; stages saved before the move name
    ``_keras_remote``."""
    code = ("import spark_hvd.estimators as e, spark_hvd.estimators.loader as loader\n"
            "from spark_hvd.estimators import store, Store, LocalStore, TorchEstimator, "
            "TorchModel, KerasEstimator, KerasModel, SparkBackend\n"
            "from spark_hvd.estimators.lightning import LightningEstimator, LightningModel\n"
            "from spark_hvd.estimators.loader import ShardReader, default_steps_per_epoch\n"
            "from spark_hvd.estimators._history import plot_history\n"
            "from spark_hvd.estimators._keras_remote import SavedModel, _KerasObject\n"
            "from spark_hvd.estimators.data import _loader\n"
            "from spark_hvd.estimators.rank import _keras\n"
            "assert loader is _loader and e.loader is _loader, loader\n"
            "assert SavedModel is _keras.SavedModel and _KerasObject is _keras._KerasObject\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
