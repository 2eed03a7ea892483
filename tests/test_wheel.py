"""The manylinux wheel on a machine with no compiler (issue 32).

Builds the wheel as `make wheel` does (zig's clang for glibc 2.28; incremental in build/wheel/),
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
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _has(module):
    import importlib.util
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if not _has("ziglang"):
        pytest.skip("the ziglang package is not installed (scripts/setup.sh installs it)")
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, SPARK_HVD_TOOLCHAIN="zig")
    env.pop("CXX", None)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(REPO)],
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    wheels = list(out.glob("spark_hvd-*.whl"))
    assert len(wheels) == 1 and "manylinux_2_28_" in wheels[0].name, wheels
    check = subprocess.run([sys.executable, str(REPO / "scripts" / "check_wheel.py"),
                            str(wheels[0])], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel_venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    # The dependencies come from this environment, after the venv's own site-packages.
    Path(site, "deps_from_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    stubs = root / "stubs"
    stubs.mkdir()
    for name in ("gcc", "g++", "cc", "c++", "clang", "clang++", "zig"):
        stub = stubs / name
        stub.write_text(f"#!/bin/sh\necho 'no compiler here ({name})' >&2\nexit 1\n")
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CXX", "CC", "SPARK_HVD_TOOLCHAIN")}
    env.update(PATH=f"{stubs}:{venv / 'bin'}:{env.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="3")
    install = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-deps",
                              "--only-binary=:all:", str(wheel)], capture_output=True, text=True,
                             env=env, timeout=600, cwd=root)
    assert install.returncode == 0, install.stdout + install.stderr
    where = subprocess.run([str(py), "-c", "import spark_hvd; print(spark_hvd.__file__, "
                            "spark_hvd.__version__)"], capture_output=True, text=True, env=env,
                           cwd=root, timeout=120)
    assert where.stdout.startswith(site), where.stdout + where.stderr
    return {"py": py, "run": venv / "bin" / "spark-hvd-run", "env": env, "cwd": root}


def _run(venv, script, np_=2, timeout=600):
    path = Path(venv["cwd"]) / "job.py"
    path.write_text(textwrap.dedent(script))
    cmd = ([str(venv["run"]), "-np", str(np_), str(venv["py"]), str(path)] if np_
           else [str(venv["py"]), str(path)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=venv["env"],
                          cwd=venv["cwd"], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_check_build_names_the_wheels_binary(venv):
    out = subprocess.run([str(venv["run"]), "--check-build"], capture_output=True, text=True,
                         env=venv["env"], cwd=venv["cwd"], timeout=120).stdout
    assert "via zig, for glibc 2.28 and later (the manylinux wheel's build)" in out, out
    assert "site-packages" in out and "TensorFlow op library: yes" in out, out


def test_numpy_allreduce(venv):
    out = _run(venv, """
        import numpy as np
        import spark_hvd.numpy as hvd
        hvd.init()
        got = hvd.allreduce(np.full(4, hvd.rank() + 1.0), op=hvd.Sum)
        assert (got == 3.0).all(), got
        print("OK", hvd.rank())
    """)
    assert out.count("OK") == 2, out


def test_torch_distributed_optimizer(venv):
    out = _run(venv, """
        import torch
        import spark_hvd.torch as hvd
        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.full((4, 8), float(hvd.rank()))).sum()
            loss.backward()
            opt.step()
        w = hvd.allgather(model.weight.detach().reshape(1, -1))
        assert torch.equal(w[0], w[1]), w
        print("OK", hvd.rank())
    """)
    assert out.count("OK") == 2, out


def test_tensorflow_function_allreduce_uses_the_op(venv):
    out = _run(venv, """
        import warnings
        warnings.simplefilter("error")  # a fallback warning fails the job
        import tensorflow as tf
        import spark_hvd.tensorflow as hvd
        hvd.init()
        f = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))
        kinds = {op.type for op in f.get_concrete_function(
            tf.TensorSpec([3], tf.float32)).graph.get_operations()}
        assert "SparkHvdAllreduce" in kinds and "PyFunc" not in kinds, kinds
        got = f(tf.fill([3], float(hvd.rank() + 1)))
        assert got.numpy().tolist() == [3.0, 3.0, 3.0], got
        print("OK", hvd.rank())
    """)
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
