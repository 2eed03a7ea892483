"""The manylinux wheel on a machine with no compiler (issue 32).

Builds the wheel as `make wheel` does (zig's clang for glibc 2.28; incremental in build/wheel/,
compiled in the background while the other tests run: tests/wheel_build.py),
checks it (scripts/check_wheel.py: auditwheel's tag, exports, glibc, run paths, nothing
bundled), installs it alone into a fresh venv (`pip install --no-index --no-deps
--only-binary=:all:`; the venv sees this environment's dependencies, torch, TensorFlow and
PySpark, through a .pth file, so nothing is downloaded) with gcc, g++, cc, c++, clang and zig
shadowed by failing stubs, and runs from outside the repository (spark_hvd from the venv's
site-packages): a 2-rank spark-hvd-run allreduce, a 2-rank torch DistributedOptimizer job, a
2-rank TensorFlow tf.function allreduce through the compiled op (no fallback warning) and a
TorchEstimator fit on local[2]."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import wheel_smoke  # noqa: E402

import wheel_build  # noqa: E402  (tests/, beside this file)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _has(module):
    import importlib.util
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if not _has("ziglang"):
        pytest.skip("the ziglang package is not installed (scripts/setup.sh installs it)")
    # conftest.py started this build in the background (tests/wheel_build.py): what it
    # compiled is reused here, and this foreground build is the one checked.
    background = wheel_build.wait_for_background(timeout=1200)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(wheel_build.command(out), capture_output=True, text=True,
                          env=wheel_build.env(), timeout=1800)
    assert proc.returncode == 0, background + "\n" + proc.stdout[-4000:] + proc.stderr[-4000:]
    wheels = list(out.glob("spark_hvd-*.whl"))
    assert len(wheels) == 1 and "manylinux_2_28_" in wheels[0].name, wheels
    check = subprocess.run([sys.executable, str(REPO / "scripts" / "check_wheel.py"),
                            str(wheels[0])], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    return wheel_smoke.make_venv(wheel, tmp_path_factory.mktemp("wheel_venv"))


def _run(venv, script, np_=2, timeout=600):
    try:
        return wheel_smoke.run_job(venv, script, np_, timeout)
    except RuntimeError as e:
        pytest.fail(str(e))


def test_check_build_names_the_wheels_binary(venv):
    out = subprocess.run([str(venv["run"]), "--check-build"], capture_output=True, text=True,
                         env=venv["env"], cwd=venv["cwd"], timeout=120).stdout
    assert "via zig, for glibc 2.28 and later (the manylinux wheel's build)" in out, out
    assert "site-packages" in out and "TensorFlow op library: yes" in out, out
    import torch
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    line = next(ln for ln in out.splitlines() if "shared-gradient allocator" in ln)
    assert minor in line.split(":", 1)[1].replace(" ", "").split(","), out


@pytest.mark.parametrize("python", [p for p in os.environ.get(
    "SPARK_HVD_WHEEL_OTHER_PYTHONS", "").split(os.pathsep) if p] or [None])
def test_other_framework_versions(wheel, python):
    """The same wheel against the frameworks of other environments (their interpreters in
    SPARK_HVD_WHEEL_OTHER_PYTHONS, colon-separated; e.g. one with TensorFlow 2.16, one with
    another torch minor): scripts/wheel_smoke.py's jobs for what each imports."""
    if python is None:
        pytest.skip("SPARK_HVD_WHEEL_OTHER_PYTHONS names no other environment")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "wheel_smoke.py"),
                           str(wheel), "--python", python], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("job", ["numpy", "torch", "tensorflow"])
def test_job(venv, job):
    """numpy: an allreduce; torch: DistributedOptimizer with the wheel's allocator for this
    torch; tensorflow: tf.function allreduces through the compiled op, no fallback warning
    (scripts/wheel_smoke.py's jobs)."""
    out = _run(venv, wheel_smoke.JOBS[job])
    assert out.count("OK") == 2, out


def test_torch_estimator_fit(venv):
    out = _run(venv, """
        import numpy as np
        import torch
        from pyspark.sql import SparkSession
        from spark_hvd.estimators import TorchEstimator, Store
        import tempfile
        spark = (SparkSession.builder.master("local[2]")
                 .config("spark.ui.enabled", "false").getOrCreate())
        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, 4)).astype("float32")
        y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32")).astype("float32")
        df = spark.createDataFrame([(list(map(float, a)), float(b)) for a, b in zip(x, y)],
                                   ["features", "label"])
        model = torch.nn.Linear(4, 1)
        est = TorchEstimator(num_proc=2, model=model,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                             loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                             label_cols=["label"], batch_size=32, epochs=2, verbose=0,
                             store=Store.create(tempfile.mkdtemp()))
        fitted = est.fit(df)
        print("OK fit", sorted(fitted.getHistory()))
        spark.stop()
    """, np_=0, timeout=900)
    assert "OK fit" in out, out
