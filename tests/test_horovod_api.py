"""The parts of Horovod 0.28.1's API an audit found missing, each made to work or refused with
a clear error: hvd.elastic, keras load_model(legacy_opts=), init(process_sets="dynamic"),
HOROVOD_TIMELINE=DYNAMIC, spark_hvd.run (horovod.run), the launcher's remaining flags
(-v, --config-file, ...), the log level of every layer, and every documented HOROVOD_*
variable honoured or warned about. Jobs run through the real launcher
(tests/workers/horovod_api.py)."""

import os
import re
import subprocess
import sys

import pytest

from conftest import PY, REPO, WORKERS, job_env, run_job

WORKER = str(WORKERS / "horovod_api.py")


def launcher(args, timeout=60, **env):
    """``python -m spark_hvd.runner ARGS`` with a clean environment plus ``env``."""
    return subprocess.run([PY, "-m", "spark_hvd.runner", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=job_env(env))


def rank_env(stdout, rank=0):
    """{NAME: value} from the worker's ``env`` mode, as rank ``rank`` printed it."""
    prefix = f"[{rank}]<stdout>: ENV "
    return dict(line[len(prefix):].split("=", 1) for line in stdout.splitlines()
                if line.startswith(prefix))


# -- hvd.elastic, load_model -----------------------------------------------------------------

@pytest.mark.timeout(90)
def test_elastic_torch_states_and_refusals():
    """TorchState / ObjectState sync, commit and restore on 2 ranks; hvd.elastic.run syncs
    and runs once in a fixed-size job; ElasticSampler shards the dataset."""
    run_job(2, "horovod_api", "elastic_torch", transport="shm", timeout=80).assert_ok(2)


@pytest.mark.timeout(150)
def test_elastic_keras_and_load_model(tmp_path):
    """KerasState (both Keras namespaces), TensorFlowState and the state callbacks on 2 ranks;
    TensorFlow's elastic.run runs once; load_model(legacy_opts=False) wraps the optimizer and
    legacy_opts=True is a ValueError naming Keras 3."""
    pytest.importorskip("tensorflow")
    run_job(2, "horovod_api", "elastic_keras", tmp_path, transport="shm",
            timeout=140).assert_ok(2)


def test_elastic_names_exist():
    """Horovod's names are attributes of the framework modules (hvd.elastic.X)."""
    import spark_hvd.torch as hvd
    for name in ("run", "TorchState", "ObjectState", "State", "ElasticSampler"):
        assert hasattr(hvd.elastic, name), name


# -- process sets, timeline --------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_init_dynamic_process_sets():
    """init(process_sets="dynamic") enables add/remove_process_set; other strings raise; a
    plain init's refusal names both ways to enable them."""
    run_job(3, "horovod_api", "dynamic_sets", transport="shm", timeout=50).assert_ok(3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variable", ["HOROVOD_TIMELINE", "SPARK_HVD_TIMELINE"])
def test_dynamic_timeline(tmp_path, variable):
    """TIMELINE=DYNAMIC: no timeline until start_timeline(path, mark_cycles=True), which
    records until stop_timeline(); no file named DYNAMIC appears."""
    path = tmp_path / "timeline.json"
    r = run_job(2, "horovod_api", "dynamic_timeline", path, transport="shm",
                env={variable: "DYNAMIC"}, timeout=50)
    r.assert_ok(2)
    assert not (REPO / "DYNAMIC").exists()


# -- spark_hvd.run ---------------------------------------------------------------------------

def _driver(case):
    done = subprocess.run([PY, WORKER, "run_driver", case], cwd=REPO, capture_output=True,
                          text=True, timeout=90,
                          env=job_env({"PYTHONPATH": f"{REPO}{os.pathsep}{WORKERS}"}))
    lines = [line for line in done.stdout.splitlines() if line.startswith("DRIVER ")]
    assert lines, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    import json
    return json.loads(lines[0][len("DRIVER "):]), done


@pytest.mark.timeout(120)
def test_run_returns_results_in_rank_order():
    """spark_hvd.run(fn, args, kwargs, np=2) runs fn on 2 ranks that talk to each other and
    returns their values in rank order."""
    out, _ = _driver("ok")
    assert out == [{"rank": 0, "size": 2, "total": 14.0}, {"rank": 1, "size": 2, "total": 14.0}]


@pytest.mark.timeout(120)
def test_run_raises_naming_the_failed_rank():
    """A rank whose fn raises makes run() raise RunError naming that rank and its exception,
    not the rank that merely lost its peer."""
    out, done = _driver("fail")
    assert out["rank"] == 1 and out["kind"] == "user", out
    assert "KeyError" in out["message"] and "rank 1 gives up" in out["message"]
    assert "[1]<stderr>:" in done.stdout + done.stderr  # the ranks' output was forwarded


@pytest.mark.parametrize("kwargs", [{"reset_limit": 1}, {"slots": 2},
                                    {"cooldown_range": (1, 2)}, {"elastic_timeout": 5}])
def test_run_elastic_only_arguments_need_an_elastic_run(kwargs):
    """Horovod's rule: min_num_proc, max_num_proc or host_discovery_script make a run elastic
    (tests/test_elastic_launcher.py runs them); the other elastic arguments alone are an
    error naming that rule."""
    import spark_hvd
    with pytest.raises(ValueError, match="applies to elastic runs only"):
        spark_hvd.run(print, np=2, **kwargs)


def test_run_refuses_bad_arguments():
    import spark_hvd
    with pytest.raises(ValueError, match="MPI is not supported"):
        spark_hvd.run(print, use_mpi=True)
    with pytest.raises(ValueError, match="disagree"):
        spark_hvd.run(print, num_proc=2, np=3)
    with pytest.raises(ValueError, match="not this machine"):
        spark_hvd.run(print, np=1, hosts="unreachable.example.invalid:1")


# -- launcher flags ------------------------------------------------------------------------------

def test_version_flag():
    import spark_hvd
    for flag in ("-v", "--version"):
        done = launcher([flag])
        assert done.returncode == 0 and spark_hvd.__version__ in done.stdout, done


def test_help_says_hierarchical_has_no_effect():
    done = launcher(["--help"])
    text = " ".join(done.stdout.split())
    for flag in ("--hierarchical-allreduce", "--no-hierarchical-allgather", "--config-file",
                 "--network-interfaces", "--cache-capacity", "--timeline-mark-cycles",
                 "--gloo-timeout-seconds"):
        assert flag in text, flag
    assert "currently no effect" in text


NAMES = ("SPARK_HVD_FUSION_THRESHOLD", "SPARK_HVD_CYCLE_TIME", "SPARK_HVD_CACHE_CAPACITY",
         "SPARK_HVD_TIMELINE", "SPARK_HVD_TIMELINE_MARK_CYCLES", "SPARK_HVD_STALL_CHECK_DISABLE",
         "SPARK_HVD_STALL_CHECK_TIME_SECONDS", "SPARK_HVD_START_TIMEOUT",
         "SPARK_HVD_LOG_LEVEL", "SPARK_HVD_HIERARCHICAL_ALLREDUCE",
         "SPARK_HVD_HIERARCHICAL_ALLGATHER", "SPARK_HVD_NETWORK_INTERFACE",
         "SPARK_HVD_AUTOTUNE", "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES")


@pytest.mark.timeout(60)
def test_flags_reach_the_ranks():
    done = launcher(["-np", "1", "--cache-capacity", "77", "--timeline-mark-cycles",
                     "--gloo-timeout-seconds", "17", "--hierarchical-allreduce",
                     "--no-hierarchical-allgather", "--network-interfaces", "lo",
                     PY, WORKER, "env", *NAMES])
    assert done.returncode == 0, done.stderr
    v = rank_env(done.stdout)
    assert v["SPARK_HVD_CACHE_CAPACITY"] == "77"
    assert v["SPARK_HVD_TIMELINE_MARK_CYCLES"] == "1"
    assert v["SPARK_HVD_START_TIMEOUT"] == "17"
    assert v["SPARK_HVD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert v["SPARK_HVD_HIERARCHICAL_ALLGATHER"] == "0"
    assert v["SPARK_HVD_NETWORK_INTERFACE"] == "lo"
    done = launcher(["-np", "1", "--gloo-timeout-seconds", "17", "--start-timeout", "9",
                     PY, WORKER, "env", *NAMES])
    assert rank_env(done.stdout)["SPARK_HVD_START_TIMEOUT"] == "9"  # the explicit one wins


CONFIG = """\
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 2
  cache_capacity: 512
  hierarchical_allreduce: true
timeline:
  filename: {timeline}
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 15
library_options:
  gloo_timeout_seconds: 40
  thread_affinity: 1
logging:
  level: info
autotune:
  enabled: false
  warmup_samples: 3
"""


@pytest.mark.timeout(60)
def test_config_file(tmp_path):
    """Horovod's YAML file fills what the command line did not give; keys without an
    equivalent are named on stderr."""
    config = tmp_path / "horovod.yaml"
    config.write_text(CONFIG.format(timeline=tmp_path / "t.json"))
    done = launcher(["--config-file", config, "--cycle-time-ms", "7", "-np", "1",
                     PY, WORKER, "env", *NAMES])
    assert done.returncode == 0, done.stderr
    v = rank_env(done.stdout)
    assert v["SPARK_HVD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert v["SPARK_HVD_CYCLE_TIME"] == "7"  # the command line wins
    assert v["SPARK_HVD_CACHE_CAPACITY"] == "512"
    assert v["SPARK_HVD_TIMELINE"] == str(tmp_path / "t.json")
    assert v["SPARK_HVD_TIMELINE_MARK_CYCLES"] == "1"
    assert v["SPARK_HVD_STALL_CHECK_DISABLE"] == "1"
    assert v["SPARK_HVD_STALL_CHECK_TIME_SECONDS"] == "15"
    assert v["SPARK_HVD_START_TIMEOUT"] == "40"
    assert v["SPARK_HVD_LOG_LEVEL"] == "INFO"
    assert v["SPARK_HVD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert "library_options.thread_affinity ignored" in done.stderr
    assert v["SPARK_HVD_AUTOTUNE"] == "0"
    assert v["SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES"] == "3"
    # logging.level INFO is the launcher's level too: its plan is shown.
    assert "rank 0 on localhost locally" in done.stderr


@pytest.mark.parametrize("body,match", [
    ("controller: mpi\n", "controller: mpi is not supported"),
    ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms"),
    ("params:\n  cache_capacity: -1\n", "must be >= 0"),
    ("- a list\n", "mapping"),
    ("params: [1\n", "--config-file"),
])
def test_config_file_errors(tmp_path, body, match):
    config = tmp_path / "bad.yaml"
    config.write_text(body)
    done = launcher(["--config-file", config, "-np", "1", "true"])
    assert done.returncode == 2 and match in done.stderr, done.stderr


def test_elastic_flags_are_documented():
    done = launcher(["--help"])
    for flag in ("--min-np", "--max-np", "--host-discovery-script", "--slots-per-host",
                 "--elastic-timeout", "--reset-limit", "--blacklist-cooldown-range"):
        assert flag in done.stdout, flag


# -- log level -------------------------------------------------------------------------------------

DEBUG_LINES = ("spark-hvd-run: settings for the ranks",  # the launcher
               "spark_hvd DEBUG: rank 0: connected to 1 peer",  # the native core
               "spark_hvd DEBUG: initialized rank 0 of 2")  # the Python side


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["flag", "HOROVOD_LOG_LEVEL", "SPARK_HVD_LOG_LEVEL"])
def test_debug_log_level_reaches_every_layer(how):
    args, env = ["-np", "2"], {}
    if how == "flag":
        args += ["--log-level", "debug"]
    else:
        env[how] = "debug"
    done = launcher([*args, PY, WORKER, "env_warnings"], **env)
    assert done.returncode == 0, done.stderr
    for line in DEBUG_LINES:
        assert line in done.stderr, f"{line!r} missing:\n{done.stderr}"


@pytest.mark.timeout(60)
def test_default_log_level_is_quiet():
    done = launcher(["-np", "2", PY, WORKER, "env_warnings"])
    assert done.returncode == 0, done.stderr
    for line in DEBUG_LINES:
        assert line not in done.stderr
    assert "rank 0 on localhost locally" not in done.stderr  # INFO, without --verbose


# -- HOROVOD_* variables ---------------------------------------------------------------------------

WARN_ENV = {"HOROVOD_DISABLE_GROUP_FUSION": "1", "HOROVOD_THREAD_AFFINITY": "0,1",
            "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",  # honoured: no warning
            "HOROVOD_CONTROLLER": "gloo",  # likewise
            "HOROVOD_MPI_THREADS_DISABLE": "1",  # no effect, said in the table: no warning
            "HOROVOD_FUSION_THRESHOLD": "1048576"}  # honoured


@pytest.mark.timeout(60)
def test_unsupported_variables_warned_once_per_process():
    """Each rank warns once about each variable it does not implement, though it initializes
    twice; nothing about those it honours or that ask for what it does anyway."""
    r = run_job(2, "horovod_api", "env_warnings", transport="shm", env=WARN_ENV, timeout=50)
    assert r.returncode == 0, r.describe()
    for rank in range(2):
        err = r.lines(rank, "stderr")
        for name in ("HOROVOD_DISABLE_GROUP_FUSION=1", "HOROVOD_THREAD_AFFINITY=0,1"):
            hits = [line for line in err if line.startswith(f"spark_hvd WARNING: {name} is set")]
            assert len(hits) == 1, (name, r.describe())
            assert hits[0].endswith("it is ignored")
        for name in ("HIERARCHICAL_ALLREDUCE", "CONTROLLER", "MPI_THREADS_DISABLE",
                     "FUSION_THRESHOLD"):
            assert not [line for line in err if f"HOROVOD_{name}=" in line], (name, r.describe())


@pytest.mark.timeout(60)
def test_warnings_follow_the_log_level():
    """At log level ERROR neither the ranks' warnings nor the launcher's notes appear; the
    launcher's --torus-allreduce makes the ranks warn that it has no effect."""
    r = run_job(2, "horovod_api", "env_warnings", transport="shm",
                env={**WARN_ENV, "HOROVOD_LOG_LEVEL": "ERROR"}, launcher_args=["--autotune"],
                timeout=50)
    assert r.returncode == 0, r.describe()
    assert "WARNING" not in r.stderr and "autotuning" not in r.stderr, r.describe()
    r = run_job(2, "horovod_api", "env_warnings", transport="shm",
                launcher_args=["--torus-allreduce"], timeout=50)
    assert r.returncode == 0, r.describe()
    for rank in range(2):
        assert any("SPARK_HVD_TORUS_ALLREDUCE=1 is set but torus" in line
                   for line in r.lines(rank, "stderr")), r.describe()


# Every HOROVOD_* variable of Horovod 0.28.1's docs/*.rst and horovod/common/common.h (the
# audit's list; HOROVOD_MPI / GLOO / CCL are values of HOROVOD_CONTROLLER there).
DOCUMENTED = """
ADASUM_MPI_CHUNK_SIZE ALLOW_MIXED_GPU_IMPL AUTOTUNE AUTOTUNE_BAYES_OPT_MAX_SAMPLES
AUTOTUNE_GAUSSIAN_PROCESS_NOISE AUTOTUNE_LOG AUTOTUNE_STEPS_PER_SAMPLE AUTOTUNE_WARMUP_SAMPLES
BATCH_D2D_MEMCOPIES BUILD_ARCH_FLAGS BUILD_CUDA_CC_LIST CACHE_CAPACITY CCL_CACHE CMAKE
CONTROLLER CPU_OPERATIONS CUDA_HOME CYCLE_TIME DEBUG DISABLE_GROUP_FUSION DISABLE_NVTX_RANGES
DYNAMIC_PROCESS_SETS ELASTIC ELASTIC_TIMEOUT ENABLE_ASYNC_COMPLETION ENABLE_XLA_OPS
FUSION_THRESHOLD GLOO_IFACE GPU GPU_ALLGATHER GPU_ALLREDUCE GPU_ALLTOALL GPU_BROADCAST
GPU_OPERATIONS GPU_REDUCESCATTER HIERARCHICAL_ALLGATHER HIERARCHICAL_ALLREDUCE
MPI_THREADS_DISABLE NCCL_HOME NCCL_INCLUDE NCCL_LIB NCCL_LINK NUM_NCCL_STREAMS ROCM_HOME
SPARK_START_TIMEOUT SPARK_USE_LOCAL_RANK_GPU_INDEX STALL_CHECK_DISABLE STALL_CHECK_TIME_SECONDS
STALL_SHUTDOWN_TIME_SECONDS THREAD_AFFINITY TIMELINE TIMELINE_MARK_CYCLES TORUS_ALLREDUCE
WITHOUT_GLOO WITHOUT_MPI WITHOUT_MXNET WITHOUT_PYTORCH WITHOUT_TENSORFLOW WITH_GLOO WITH_MPI
WITH_MXNET WITH_PYTORCH WITH_TENSORFLOW
LOG_LEVEL LOG_HIDE_TIME GLOO_TIMEOUT_SECONDS START_TIMEOUT
RANK SIZE LOCAL_RANK LOCAL_SIZE CROSS_RANK CROSS_SIZE HOSTNAME GLOO_RENDEZVOUS_ADDR
GLOO_RENDEZVOUS_PORT
""".split()


def test_every_documented_variable_is_in_the_table():
    from spark_hvd.common import _config
    statuses = {_config.HONOURED, _config.NO_EFFECT, _config.WARNED, _config.BOOTSTRAP}
    missing = [name for name in DOCUMENTED if name not in _config.HOROVOD_VARIABLES]
    assert not missing, missing
    for name, var in _config.HOROVOD_VARIABLES.items():
        assert var.status in statuses, name
        assert var.reason.strip(), name
    # Honoured ones are really read somewhere under spark_hvd/ (as env("NAME") or the full
    # HOROVOD_/SPARK_HVD_ name).
    sources = "".join(p.read_text() for p in (REPO / "spark_hvd").rglob("*.py"))
    for name, var in _config.HOROVOD_VARIABLES.items():
        if var.status == _config.HONOURED:
            assert re.search(rf'"(SPARK_HVD_|HOROVOD_)?{name}"', sources), name


def test_unknown_log_level_falls_back_with_a_warning():
    code = ("import logging, spark_hvd.common._config as c; print(c.log_level()); "
            "print(c.log_level())")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=job_env({"HOROVOD_LOG_LEVEL": "chatty"}), timeout=30)
    assert done.stdout.split() == ["WARNING", "WARNING"], done
    assert done.stderr.count("is not one of") == 1, done.stderr
