"""build.py cannot produce a library that crashes multi-rank jobs.

A core that exports its own copy of the C++ runtime (built with -static-libstdc++ and no
version script) shares some of that runtime's objects with the copy torch loads, and every job
of 2 or more ranks failed in shvd_init (the peers' ports read as 0). The core now exports its C
API and nothing else, and build.py installs a freshly linked core only after a two-process smoke
test that loads it next to the system's C++ runtime, as a framework does.

These tests build with a statically linked libstdc++ into temporary directories (never over the
library the other tests use) through the real `python build.py`, and run a real 2-rank job
through the launcher with torch imported first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_job

STATIC_RUNTIME = "-static-libstdc++ -static-libgcc"
CORE = "libspark_hvd_core.so"
BUILD_TIMEOUT_S = 900  # a full -O3 build of the core on a busy 2-core machine

pytestmark = pytest.mark.skipif(shutil.which("nm") is None or not sys.platform.startswith("linux"),
                                reason="needs Linux and nm (binutils)")


def run_build(*args: str, ldflags: str = "") -> subprocess.CompletedProcess:
    """``python build.py args`` with LDFLAGS set to ``ldflags`` (CXX and CXXFLAGS as the
    caller's environment has them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LDFLAGS", "SPARK_HVD_SKIP_SMOKE_TEST",
                                                             "SPARK_HVD_NATIVE_DIR")}
    env["LDFLAGS"] = ldflags
    return subprocess.run([sys.executable, str(REPO / "build.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


def exported_symbols(library: Path) -> list[str]:
    """The names ``library`` defines in its dynamic symbol table (what other objects bind to)."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                         text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def assert_exports_only_c_api(library: Path) -> None:
    names = exported_symbols(library)
    others = [n for n in names if not n.startswith("shvd_")]
    assert names and not others, (
        f"{library.name} exports {len(others)} symbols besides its C API, e.g. {others[:10]}")


@pytest.fixture(scope="module")
def static_runtime_tree(tmp_path_factory) -> Path:
    """A copy of the spark_hvd package whose core (and torch allocator library) build.py built
    with a statically linked libstdc++; the directory to put on PYTHONPATH."""
    root = tmp_path_factory.mktemp("static_runtime")
    tree = root / "tree"
    shutil.copytree(REPO / "spark_hvd", tree / "spark_hvd",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # The static runtime is a link flag: start from `make build`'s objects (compiled with the
    # same flags), so only the libraries are linked again (~2 s instead of ~20 s).
    if (REPO / "build" / "native" / "release").is_dir():
        shutil.copytree(REPO / "build" / "native", root / "build")
    proc = run_build("--build-dir", str(root / "build"), "--output",
                     str(tree / "spark_hvd" / "_core" / CORE), "--no-tensorflow",
                     ldflags=STATIC_RUNTIME)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "smoke test passed" in proc.stdout, proc.stdout
    return tree


@pytest.mark.slow
def test_static_runtime_build_exports_only_c_api(static_runtime_tree):
    """With libstdc++ linked in, the core exports its shvd_* functions and none of the
    runtime's thousands of std:: symbols (4,888 symbols before the version script), and the
    torch allocator library likewise."""
    core = static_runtime_tree / "spark_hvd" / "_core" / CORE
    ldd = subprocess.run(["ldd", str(core)], capture_output=True, text=True).stdout
    assert "libstdc++" not in ldd, f"the runtime was not linked statically:\n{ldd}"
    assert_exports_only_c_api(core)
    for torch_lib in core.parent.glob("libspark_hvd_torch_*.so"):  # built when torch imports
        assert_exports_only_c_api(torch_lib)


@pytest.mark.slow
def test_up_to_date_build_keeps_the_smoke_test_result(static_runtime_tree):
    """A build with nothing to do does not rerun the smoke test on the library that passed it
    (the build folder records which file passed), so it stays a fraction of a second."""
    proc = run_build("--build-dir", str(static_runtime_tree.parent / "build"), "--output",
                     str(static_runtime_tree / "spark_hvd" / "_core" / CORE), "--no-tensorflow",
                     "--no-torch", ldflags=STATIC_RUNTIME)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout and "smoke test" not in proc.stdout, proc.stdout


TORCH_FIRST_SCRIPT = """
import torch  # first: torch's C++ runtime is loaded and initialised before the core
import os, sys
import spark_hvd.torch as hvd
from spark_hvd.common._native import lib

hvd.init()
rank, expected_tree = hvd.rank(), sys.argv[1]
assert hvd.__file__.startswith(expected_tree), hvd.__file__
total = hvd.allreduce(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="sum")
assert total.tolist() == [hvd.size() * (hvd.size() + 1) / 2] * 1000, total[:4]
# A DistributedOptimizer whose gradients come from the torch allocator library (shared arenas).
torch.manual_seed(0)
model = torch.nn.Linear(256, 512)  # large enough to be reduced in place, not through fusion
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(3):
    opt.zero_grad()
    model(torch.randn(8, 256) * (rank + 1)).pow(2).mean().backward()
    opt.step()
weights = hvd.allgather(model.weight.detach().reshape(1, -1), name="weights")
assert all(torch.equal(weights[0], w) for w in weights), "weights differ across ranks"
print(f"OK rank={rank} inplace={lib.shvd_shared_inplace_allreduces()}", flush=True)
hvd.shutdown()
"""


@pytest.mark.slow
def test_static_runtime_build_runs_multi_rank_torch_job(static_runtime_tree, tmp_path):
    """The job that failed in shvd_init with such a build (torch imported before spark_hvd)
    runs: an allreduce and three DistributedOptimizer steps on 2 ranks, gradients reduced in
    place in the shared arenas through the statically linked torch allocator library."""
    script = tmp_path / "torch_first.py"
    script.write_text(TORCH_FIRST_SCRIPT)
    result = run_job(2, str(script), str(static_runtime_tree), timeout=180,
                     env={"PYTHONPATH": str(static_runtime_tree)}, transport="shm")
    result.assert_ok(2)
    if list((static_runtime_tree / "spark_hvd" / "_core").glob("libspark_hvd_torch_*.so")):
        assert all(int(result.field(r, "inplace")) > 0 for r in range(2)), result.describe()


@pytest.mark.slow
def test_smoke_test_fails_a_build_that_exports_the_runtime(tmp_path):
    """The issue's crash, made by build.py itself: a source tree whose version script exports
    everything, linked with the C++ runtime statically, gives a core whose 2-rank init reads
    every port as 0 when the system's runtime is loaded too. The smoke test catches it without
    torch: the build fails naming the compiler and what to do, and installs no library."""
    src = tmp_path / "native"
    shutil.copytree(REPO / "native", src, ignore=shutil.ignore_patterns("tests"))
    (src / "exports.map").write_text("{ global: *; };\n")
    output = tmp_path / "out" / CORE
    proc = run_build("--debug", "--src", str(src), "--build-dir", str(tmp_path / "build"),
                     "--output", str(output), "--no-tensorflow", "--no-torch",
                     ldflags=STATIC_RUNTIME)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    compiler = subprocess.run(os.environ.get("CXX", "g++").split() + ["--version"],
                              capture_output=True, text=True).stdout.splitlines()[0]
    message = proc.stderr
    assert "smoke test of libspark_hvd_core.so failed" in message, message
    assert "127.0.0.1:0" in message, message  # the symptom, reported by a rank
    assert f"Compiler: {compiler}" in message, message
    assert "drop -static-libstdc++ -static-libgcc from LDFLAGS" in message, message
    assert "CXX=g++ python build.py" in message, message
    assert not output.exists(), "a library that failed the smoke test was installed"
    # The compiler is reported once, at the start of the build.
    assert proc.stdout.count(f"compiler: {compiler}") == 1, proc.stdout


def test_default_build_exports_only_c_api():
    """The library every other test uses exports its C API alone, and the torch allocator
    library its two functions."""
    core = REPO / "spark_hvd" / "_core" / CORE
    assert core.exists(), f"{core} is not built: run `python build.py`"
    assert_exports_only_c_api(core)
    for torch_lib in core.parent.glob("libspark_hvd_torch_*.so"):
        assert_exports_only_c_api(torch_lib)


def test_torch_build_config_is_kept_per_installation(tmp_path):
    """build.py asks torch for its compile flags once per installation (importing it takes
    seconds on every build otherwise): a saved answer for this installation is used as is, one
    saved for another installation is replaced by the real flags."""
    import json
    pytest.importorskip("torch")
    sys.path.insert(0, str(REPO))
    try:
        from native_build.frameworks import framework_config
    finally:
        sys.path.pop(0)
    first = framework_config("torch", sys.executable, tmp_path)
    assert first and first["version"] and any(f.startswith("-I") for f in first["compile"])
    saved = json.loads((tmp_path / "torch_config.json").read_text())
    assert saved["config"] == first
    # The saved answer is what the next build uses (a marker proves nothing was imported).
    saved["config"] = dict(first, version="marker")
    (tmp_path / "torch_config.json").write_text(json.dumps(saved))
    assert framework_config("torch", sys.executable, tmp_path)["version"] == "marker"
    # Another installation (here: another __init__ size) is asked again.
    saved["identity"][2] += 1
    (tmp_path / "torch_config.json").write_text(json.dumps(saved))
    assert framework_config("torch", sys.executable, tmp_path) == first


def test_torch_allocator_flags_from_a_wheel_file(tmp_path):
    """SPARK_HVD_TORCH_WHEELS: a torch wheel file gives the headers and libc10.so of its
    version, unpacked once, and the allocator's file name carries its minor."""
    import zipfile
    sys.path.insert(0, str(REPO))
    try:
        from native_build.frameworks import _torch_from_wheel, torch_library_name
    finally:
        sys.path.pop(0)
    wheel = tmp_path / "torch-9.8.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch/include/c10/core/Allocator.h", "// header\n")
        z.writestr("torch/lib/libc10.so", "ELF")
        z.writestr("torch/lib/libtorch_cpu.so", "not needed")
    got = _torch_from_wheel(wheel, tmp_path / "build")
    unpacked = tmp_path / "build" / "torch-9.8.1+cu130" / "torch"
    assert got["version"] == "9.8.1+cu130"
    assert f"-I{unpacked / 'include'}" in got["compile"] and "-lc10" in got["link"]
    assert (unpacked / "lib" / "libc10.so").exists()
    assert not (unpacked / "lib" / "libtorch_cpu.so").exists()
    assert torch_library_name(got["version"]) == "libspark_hvd_torch_9_8.so"
    assert _torch_from_wheel(tmp_path / "not-a-torch.whl", tmp_path / "build") is None
