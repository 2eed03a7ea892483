"""``spark-hvd-run --mpi``: the ranks start under Open MPI's ``mpirun``, meet through mpi4py and
run their CPU collectives through MPI (tests/test_mpi_backend.py tests the MPI path itself;
its ``all`` scenario proves here that the data went through MPI, with the plugin's counters)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from spark_hvd.runner import launch

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="mpirun (Open MPI) is not installed")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARK_HVD_", "HOROVOD_", "OMPI_", "PMIX_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", SPARK_HVD_START_TIMEOUT="30",
               OMPI_MCA_rmaps_base_oversubscribe="1", **extra)
    return env


def _launch(*args, env=None, timeout=120):
    return subprocess.run([PY, "-m", "spark_hvd.runner", *args], env=env or _env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@needs_mpirun
def test_mpi_flag_runs_cpu_collectives_through_mpi():
    with tempfile.TemporaryDirectory() as out_dir:
        p = _launch("--mpi", "-np", "2", PY, "tests/test_mpi_backend.py", "all",
                    env=_env(MPI_TEST_OUT=out_dir))
        results = "".join(f.read_text() for f in sorted(Path(out_dir).iterdir()))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "FAIL" not in results, results
    for r in (0, 1):
        assert f"OK rank={r} " in results, results + p.stdout + p.stderr


@needs_mpirun
def test_mpi_flag_passes_the_tuning_flags_and_the_choice_of_mpi(tmp_path):
    # Each rank writes its own file: mpirun interleaves the ranks' output mid-line.
    code = ("import os; r = os.environ['OMPI_COMM_WORLD_RANK']; "
            "open(os.path.join(os.environ['OUT_DIR'], r), 'w').write("
            "f\"{r} {os.environ.get('SPARK_HVD_FUSION_THRESHOLD')} "
            "{os.environ.get('SPARK_HVD_CPU_OPERATIONS')}\")")

    def seen(out_dir):
        return sorted(f.read_text() for f in out_dir.iterdir())
    (tmp_path / "a").mkdir()
    p = _launch("--mpi", "-np", "2", "--fusion-threshold-mb", "1", PY, "-c", code,
                env=_env(OUT_DIR=str(tmp_path / "a")))
    assert p.returncode == 0, p.stdout + p.stderr
    assert seen(tmp_path / "a") == ["0 1048576 MPI", "1 1048576 MPI"], p.stdout + p.stderr
    # A choice the user made stays.
    (tmp_path / "b").mkdir()
    p = _launch("--mpi", "-np", "1", PY, "-c", code,
                env=_env(OUT_DIR=str(tmp_path / "b"), HOROVOD_CPU_OPERATIONS="gloo"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert seen(tmp_path / "b") == ["0 None None"], p.stdout + p.stderr


def test_mpi_flag_without_mpirun_is_a_clear_error(tmp_path):
    (tmp_path / "python").symlink_to(PY)
    p = _launch("--mpi", "-np", "2", PY, "-c", "pass", env=_env(PATH=str(tmp_path)))
    assert p.returncode == 2
    assert "--mpi needs Open MPI's mpirun on PATH" in p.stderr, p.stderr


@needs_mpirun
def test_mpirun_command_line():
    args = launch.build_parser().parse_args(
        ["--mpi", "-np", "3", "-H", "h1:2,h2:1", "-p", "2222", "-i", "/k", "--mpi-args",
         "--mca btl self,tcp", "--cycle-time-ms", "2", "python", "train.py"])
    cmd, env = launch.mpirun_command(args, args.command, launch.plan_hosts(args))
    assert cmd[1:5] == ["-np", "3", "-H", "h1:2,h2:1"], cmd
    assert cmd[cmd.index("plm_rsh_args") + 1] == "-p 2222 -i /k", cmd
    assert ["--mca", "btl", "self,tcp"] == cmd[cmd.index("btl") - 1:cmd.index("btl") + 2], cmd
    assert cmd[-2:] == ["python", "train.py"], cmd
    assert env["SPARK_HVD_CYCLE_TIME"] == "2" and env["SPARK_HVD_CPU_OPERATIONS"] == "MPI"
    exported = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert {"SPARK_HVD_CYCLE_TIME", "SPARK_HVD_CPU_OPERATIONS", "PYTHONPATH"} <= exported or \
        {"SPARK_HVD_CYCLE_TIME", "SPARK_HVD_CPU_OPERATIONS"} <= exported, cmd
