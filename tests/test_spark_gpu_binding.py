"""GPUs bound per Spark barrier task, on a real ``local-cluster`` without GPUs (slow).

Spark schedules whatever addresses the workers' GPU discovery script reports, so a script that
prints ``{"name": "gpu", "addresses": ["0", "1"]}`` gives every task real Spark GPU resources on
a machine without any. Each scenario is one Spark application (the task's GPU amount is
application-wide), run by this file as a driver (``python tests/test_spark_gpu_binding.py
SCENARIO WORKDIR``) in a subprocess; the applications run side by side and each test reads
its scenario's report:

- ``one``: ``local-cluster[2,2,1024]``, two GPUs per executor, one per task (four ranks): each
  rank sees its executor's GPUs in local-rank order, so device ``hvd.local_rank()`` (Horovod's
  ``torch.cuda.set_device(hvd.local_rank())``) is its task's own; the TorchEstimator with
  ``use_gpu=True`` trains on the CPU (no CUDA here) and says so in one line.
- ``two``: four GPUs on one executor, two per task: each rank sees only its own two, from 0;
  a third rank does not fit the GPUs (three cores) and ``run`` refuses it at once. The GPUs
  come from the example's discovery script, ``examples/spark/gpu_discovery.sh``, with a fake
  ``nvidia-smi``.
- ``shared``: one GPU, ``spark.task.resource.gpu.amount=0.5``: two ranks share it, each sees
  it as device 0, and the driver shows one line naming them.
- ``none``: no GPU resources, the executors' ``CUDA_VISIBLE_DEVICES`` set through
  ``spark.executorEnv``: the ranks see it unchanged.

Every scenario also records what Spark itself gave each task (``BarrierTaskContext.resources()``
in a plain barrier stage) to check the binding against.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE_SCRIPT = REPO / "examples" / "spark" / "gpu_discovery.sh"

# scenario: (master, GPU addresses per worker (None: no GPU resources), task amount,
#            ranks of the main job)
SCENARIOS = {
    "one": ("local-cluster[2,2,1024]", ["0", "1"], "1", 4),
    "two": ("local-cluster[1,3,1024]", ["0", "1", "2", "3"], "2", 2),
    "shared": ("local-cluster[1,2,1024]", ["0"], "0.5", 2),
    "none": ("local-cluster[1,2,1024]", None, None, 2),
}
EXECUTOR_CUDA_VISIBLE_DEVICES = "3,1"   # scenario "none": the executors' own setting
APP_TIMEOUT = 240


# -- the driver (runs in the subprocess) ------------------------------------------------------

def discovery_script(workdir: Path, addresses: list[str], example: bool) -> Path:
    """A GPU discovery script reporting ``addresses`` (Spark runs it on each worker): one
    written here, or the example's (``examples/spark/gpu_discovery.sh``) with a fake
    ``nvidia-smi`` on the application's PATH (``WORKDIR/bin``, see :class:`Apps`)."""
    if example:
        fake = workdir / "bin" / "nvidia-smi"
        fake.write_text("#!/bin/sh\nprintf '" + "\\n".join(addresses) + "\\n'\n")
        fake.chmod(0o755)
        return EXAMPLE_SCRIPT
    path = workdir / "gpu_discovery.sh"
    path.write_text("#!/bin/sh\necho '" + json.dumps({"name": "gpu", "addresses": addresses})
                    + "'\n")
    path.chmod(0o755)
    return path


def spark_confs(scenario: str, workdir: Path) -> dict[str, str]:
    master, addresses, task_amount, _ = SCENARIOS[scenario]
    confs = {"spark.master": master, "spark.driver.host": "127.0.0.1",
             "spark.driver.bindAddress": "127.0.0.1", "spark.ui.enabled": "false",
             "spark.executor.memory": "512m", "spark.local.dir": str(workdir / "local"),
             "spark.ui.showConsoleProgress": "false",
             # One stage attempt: a task that fails fails the test, not a retry.
             "spark.stage.maxConsecutiveAttempts": "1"}
    if addresses is None:
        confs["spark.executorEnv.CUDA_VISIBLE_DEVICES"] = EXECUTOR_CUDA_VISIBLE_DEVICES
        return confs
    script = str(discovery_script(workdir, addresses, example=scenario == "two"))
    n = str(len(addresses))
    confs.update({
        "spark.worker.resource.gpu.amount": n,
        "spark.worker.resource.gpu.discoveryScript": script,
        "spark.executor.resource.gpu.amount": n,
        "spark.executor.resource.gpu.discoveryScript": script,
        "spark.task.resource.gpu.amount": task_amount,
    })
    return confs


def spark_view(spark, n: int) -> list[dict]:
    """What Spark gives each task of an ``n``-task barrier stage: executor and GPU addresses."""
    def task(_):
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        me = ctx.getTaskInfos()[ctx.partitionId()].address
        gpu = ctx.resources().get("gpu")
        yield {"executor": me, "gpus": None if gpu is None else list(gpu.addresses),
               "env": os.environ.get("CUDA_VISIBLE_DEVICES")}

    return spark.sparkContext.parallelize(range(n), n).barrier().mapPartitions(task).collect()


def probe():
    """The training function: where the rank is and which GPUs it was given."""
    import spark_hvd.numpy as hvd
    hvd.init()
    info = {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "host": os.environ["SPARK_HVD_HOSTNAME"],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "spark_gpus": os.environ.get("SPARK_HVD_SPARK_GPUS")}
    hvd.shutdown()
    return info


def fit_with_use_gpu(spark, workdir: Path) -> dict:
    """A small TorchEstimator fit with use_gpu=True: the driver's output and the weights."""
    import numpy as np
    import torch
    from pyspark.ml.linalg import Vectors

    from spark_hvd.estimators import Store, TorchEstimator
    from spark_hvd.estimators._base import SparkBackend
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4))
    rows = [(Vectors.dense(xi.tolist()), float(xi.sum())) for xi in x]
    df = spark.createDataFrame(rows, ["features", "label"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    out, err = io.StringIO(), io.StringIO()
    estimator = TorchEstimator(
        store=Store.create(str(workdir / "store")), model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["label"],
        batch_size=16, epochs=1, use_gpu=True, verbose=1,
        backend=SparkBackend(num_proc=2, stdout=out, stderr=err))
    fitted = estimator.fit(df)
    params = list(fitted.getModel().parameters())
    return {"stdout": out.getvalue(), "stderr": err.getvalue(),
            "devices": sorted({str(p.device) for p in params})}


def drive(scenario: str, workdir: Path) -> dict:
    from pyspark.sql import SparkSession

    import spark_hvd.spark
    builder = SparkSession.builder.appName(f"spark_hvd gpu binding {scenario}")
    for k, v in spark_confs(scenario, workdir).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    num_proc = SCENARIOS[scenario][3]
    report = {"seconds": {}}
    try:
        t0 = time.monotonic()
        report["spark"] = spark_view(spark, num_proc)
        report["seconds"]["spark"] = time.monotonic() - t0
        err = io.StringIO()
        t0 = time.monotonic()
        report["ranks"] = spark_hvd.spark.run(probe, num_proc=num_proc, start_timeout=120,
                                              stderr=err)
        report["seconds"]["run"] = time.monotonic() - t0
        report["stderr"] = err.getvalue()
        if scenario == "two":
            try:
                spark_hvd.spark.run(probe, num_proc=num_proc + 1)
                report["refused"] = None
            except spark_hvd.spark.RunError as e:
                report["refused"] = str(e)
        if scenario == "one":
            t0 = time.monotonic()
            report["fit"] = fit_with_use_gpu(spark, workdir)
            report["seconds"]["fit"] = time.monotonic() - t0
    finally:
        spark.stop()
    return report


# -- the tests --------------------------------------------------------------------------------

if __name__ != "__main__":
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    pytestmark = pytest.mark.timeout(APP_TIMEOUT + 60)


class Apps:
    """The scenarios' applications, started together; ``report(name)`` waits for one."""

    def __init__(self, root: Path):
        from test_spark_cluster import _env
        self.procs, self.dirs, self.reports = {}, {}, {}
        for name in SCENARIOS:
            workdir = root / name
            (workdir / "bin").mkdir(parents=True)
            self.dirs[name] = workdir
            env = _env(workdir)
            env["PATH"] = f"{workdir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
            # Output to files: pipes that nobody reads while another app is awaited could fill.
            with open(workdir / "out.log", "wb") as out:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, __file__, name, str(workdir)], env=env, cwd=REPO,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.deadline = time.monotonic() + APP_TIMEOUT

    def report(self, name: str) -> dict:
        if name not in self.reports:
            proc = self.procs[name]
            try:
                proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                pytest.fail(f"scenario {name} did not finish in {APP_TIMEOUT} s\n"
                            f"{self.output(name)}")
            assert proc.returncode == 0, f"scenario {name}:\n{self.output(name)}"
            self.reports[name] = json.loads((self.dirs[name] / "report.json").read_text())
        return self.reports[name]

    def output(self, name: str) -> str:
        return (self.dirs[name] / "out.log").read_text(errors="replace")[-12000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    a = Apps(tmp_path_factory.mktemp("gpu_apps"))
    yield a
    a.stop()


# -- the pure parts (fast) ---------------------------------------------------------------------

@pytest.mark.parametrize("mine,host,expected", [
    (["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"],
     [["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"], ["GPU-1"]],
     "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,GPU-1"),           # UUIDs, as CUDA takes them
    (["MIG-GPU-8932f937/1/0"], [["MIG-GPU-8932f937/1/0"]], "MIG-GPU-8932f937/1/0"),
    (["1"], [["1"], ["0"], ["1"]], "1"),                          # 3 tasks share 2 GPUs
    (["0", "1"], [["0", "1"], ["0", "1"]], "0,1"),                # several, shared
])
def test_visible_devices_uuids_and_sharing(mine, host, expected):
    from spark_hvd.spark import _placement
    assert _placement.visible_devices(mine, host) == expected


def test_shared_gpus_and_the_note():
    from spark_hvd.spark import _placement
    tasks = [("e1", 2, ["0"]), ("e1", 0, ["0"]), ("e2", 1, ["0"]), ("e2", 3, ["1"]),
             ("e1", 4, ["1"]), ("e1", 5, ["1"])]
    shared = _placement.shared_gpus(tasks)
    assert shared == [("e1", "0", [0, 2]), ("e1", "1", [4, 5])]
    assert _placement.shared_gpus([("e1", 0, ["0"]), ("e2", 1, ["0"])]) == []
    note = _placement.sharing_note(shared)
    assert "GPU 0 of executor e1 by ranks 0, 2; GPU 1 of executor e1 by ranks 4, 5" in note


def test_example_discovery_script_reports_nvidia_smi_indices(tmp_path):
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nprintf '0\\n1\\n 2\\n'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    out = subprocess.run([str(EXAMPLE_SCRIPT)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert json.loads(out.stdout) == {"name": "gpu", "addresses": ["0", "1", "2"]}


def by_host(ranks: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        out.setdefault(r["host"], []).append(r)
    return out


def spark_assignments(report) -> dict[str, list[list[str]]]:
    """Spark's own view: every executor's tasks' GPU addresses (sorted)."""
    out: dict[str, list[list[str]]] = {}
    for t in report["spark"]:
        out.setdefault(t["executor"], []).append(t["gpus"])
    return {e: sorted(g) for e, g in out.items()}


@pytest.mark.slow
def test_one_gpu_per_task_local_rank_selects_its_own(apps):
    report = apps.report("one")
    # Spark gave each executor's two tasks its two GPUs, one each.
    assert sorted(map(sorted, spark_assignments(report).values())) == [[["0"], ["1"]]] * 2
    hosts = by_host(report["ranks"])
    assert len(hosts) == 2 and all(len(h) == 2 for h in hosts.values()), hosts
    for ranks in hosts.values():
        own = [r["spark_gpus"] for r in ranks]
        # The rank's own addresses are BarrierTaskContext.resources()['gpu'] of its task: one
        # GPU each, the executor's two between them.
        assert sorted(own) == ["0", "1"], ranks
        for r in ranks:
            visible = r["visible"].split(",")
            # Every GPU of the executor, in local-rank order: device local_rank is its own.
            assert visible == own, ranks
            assert visible[r["local_rank"]] == r["spark_gpus"], r
            assert r["local_size"] == 2
    assert "share" not in report["stderr"], report["stderr"]


@pytest.mark.slow
def test_use_gpu_without_cuda_falls_back_to_the_cpu_in_one_line(apps):
    fit = apps.report("one")["fit"]
    notes = [line for line in fit["stderr"].splitlines()
             if "use_gpu=True but rank(s)" in line]
    assert len(notes) == 1, fit["stderr"]
    note = notes[0]
    assert note.startswith("[0]<stderr>:"), note     # from rank 0 only
    assert "rank(s) 0, 1 train on the CPU" in note and "torch.cuda.is_available() is False" \
        in note, note
    # The env each trainer saw: the GPUs Spark gave its task's executor, in local-rank order
    # (one executor with both tasks: "0,1"; one task on each: its own GPU).
    seen = note.split("CUDA_VISIBLE_DEVICES ", 1)[1].split(")")[0]
    visible = dict(part.split(": ") for part in seen.split("; "))
    assert set(visible) == {"rank 0", "rank 1"}, note
    assert all(v in ("0", "1", "0,1", "1,0") for v in visible.values()), note
    assert fit["devices"] == ["cpu"]
    assert "Epoch 1/1" in fit["stdout"], fit["stdout"]


@pytest.mark.slow
def test_several_gpus_per_task_see_only_their_own_from_zero(apps):
    report = apps.report("two")
    (assigned,) = spark_assignments(report).values()
    assert sorted(a for g in assigned for a in g) == ["0", "1", "2", "3"]
    assert all(len(g) == 2 for g in assigned)
    ranks = report["ranks"]
    assert [r["local_rank"] for r in ranks] == [0, 1]
    own = [r["spark_gpus"].split(",") for r in ranks]
    assert sorted(a for g in own for a in g) == ["0", "1", "2", "3"], ranks
    for r in ranks:
        # Only the task's own two GPUs: the rank addresses them as devices 0 and 1.
        assert r["visible"] == r["spark_gpus"] and len(r["visible"].split(",")) == 2, r


@pytest.mark.slow
def test_more_ranks_than_gpus_is_refused_at_once(apps):
    refused = apps.report("two")["refused"]
    # Three cores but four GPUs at two per task: two task slots.
    assert refused is not None
    assert "runs 3 Spark tasks at once" in refused and "offers 2 task slot(s)" in refused
    assert "spark.task.resource.gpu.amount=2" in refused, refused


@pytest.mark.slow
def test_fractional_amounts_share_a_gpu_with_one_note(apps):
    report = apps.report("shared")
    assert [t["gpus"] for t in report["spark"]] == [["0"], ["0"]]
    ranks = report["ranks"]
    assert [(r["local_rank"], r["spark_gpus"], r["visible"]) for r in ranks] == \
        [(0, "0", "0"), (1, "0", "0")]
    # Device local_rank % device_count() is the shared GPU for both.
    assert all(r["local_rank"] % len(r["visible"].split(",")) == 0 for r in ranks)
    notes = [line for line in report["stderr"].splitlines() if "ranks share GPUs" in line]
    assert len(notes) == 1, report["stderr"]
    assert notes[0].startswith("spark_hvd.spark: ranks share GPUs (GPU 0 of executor ")
    assert "by ranks 0, 1" in notes[0]
    assert "hvd.local_rank() % torch.cuda.device_count()" in notes[0]


@pytest.mark.slow
def test_no_gpu_resources_leave_cuda_visible_devices_alone(apps):
    report = apps.report("none")
    assert [t["gpus"] for t in report["spark"]] == [None, None]
    assert [t["env"] for t in report["spark"]] == [EXECUTOR_CUDA_VISIBLE_DEVICES] * 2
    assert [(r["visible"], r["spark_gpus"]) for r in report["ranks"]] == \
        [(EXECUTOR_CUDA_VISIBLE_DEVICES, None)] * 2
    assert "share" not in report["stderr"]


if __name__ == "__main__":
    _scenario, _workdir = sys.argv[1], Path(sys.argv[2])
    sys.path.insert(0, str(REPO))
    _report = drive(_scenario, _workdir)
    (_workdir / "report.json").write_text(json.dumps(_report))
