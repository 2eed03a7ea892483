"""A fit that survives lost ranks (issue 31, part 5): the retry policy and its Params (units),
TorchEstimator going on in memory when a rank is killed (local[2]), and on a
``local-cluster[2,1,1024]`` (spark-submit) a TorchEstimator, a KerasEstimator and a
LightningEstimator each losing an executor mid-fit: the fit returns a model whose history has
every epoch once, and the driver's log names the reset and its cause."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
torch = pytest.importorskip("torch")

import cloudpickle  # noqa: E402

from spark_hvd.estimators import Store, TorchEstimator  # noqa: E402
from spark_hvd.estimators._fit_retry import FitRetryPolicy, GaveUp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import estimator_fns  # noqa: E402

cloudpickle.register_pickle_by_value(estimator_fns)
REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "spark_workers" / "fit_retry_job.py"


# -- the policy -------------------------------------------------------------------------------

def test_user_errors_and_unknown_failures_are_never_retried():
    policy = FitRetryPolicy(max_failures=3, min_num_proc=1)
    with pytest.raises(GaveUp, match="user code is never retried"):
        policy.failed("user", "h", "ValueError: bad")
    with pytest.raises(GaveUp, match="not a lost rank"):
        policy.failed(None, None, "the Spark job failed")
    assert policy.failures == 0


def test_lost_ranks_are_retried_up_to_max_failures():
    policy = FitRetryPolicy(max_failures=2, min_num_proc=1)
    policy.failed("lost", "h", "ranks [1] were lost")
    policy.failed("crash", "h", "rank 1 died")
    with pytest.raises(GaveUp, match="lost 3 times, more than max_failures=2"):
        policy.failed("internal", "h", "lost its peer")
    with pytest.raises(GaveUp):
        FitRetryPolicy(max_failures=0, min_num_proc=1).failed("lost", "h", "x")


def test_ranks_after_a_loss():
    policy = FitRetryPolicy(max_failures=3, min_num_proc=2)
    assert policy.ranks(4, None) == 4          # cannot tell: as asked
    assert policy.ranks(4, 8) == 4
    assert policy.ranks(4, 3) == 3             # on the executors there are
    assert policy.ranks(4, 1) is None          # below min_num_proc: wait
    assert FitRetryPolicy(3, 4).ranks(2, 2) == 2   # min above the request: the request
    with pytest.raises(ValueError):
        FitRetryPolicy(-1, 1)
    with pytest.raises(ValueError):
        FitRetryPolicy(1, 0)


def test_params_persist_and_setters_return_self(spark, tmp_path):
    estimator = TorchEstimator()
    assert (estimator.getMaxFailures(), estimator.getMinNumProc()) == (3, 1)
    assert estimator.setMaxFailures(5) is estimator and estimator.setMinNumProc(2) is estimator
    path = str(tmp_path / "estimator")
    estimator.write().overwrite().save(path)
    loaded = TorchEstimator.load(path)
    assert (loaded.getMaxFailures(), loaded.getMinNumProc()) == (5, 2)
    assert TorchEstimator(max_failures=0, min_num_proc=3).getMaxFailures() == 0
    for module, name in (("spark_hvd.estimators", "KerasEstimator"),
                         ("spark_hvd.estimators.lightning", "LightningEstimator")):
        cls = getattr(__import__(module, fromlist=[name]), name)
        assert cls.max_failures.name == "max_failures" and hasattr(cls, "setMinNumProc")


# -- TorchEstimator in memory, a rank killed (local[2]) ----------------------------------------

def test_torch_fit_goes_on_in_memory_when_a_rank_is_killed(spark, regression_df, tmp_path,
                                                           capfd):
    steps = 4
    torch.manual_seed(0)
    model = estimator_fns.Linear()
    estimator = TorchEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=torch.nn.functional.mse_loss,
        metrics=[estimator_fns.mae], feature_cols=["features"], label_cols=["label"],
        batch_size=16, epochs=4, random_seed=7, verbose=1, partitions_per_process=2,
        run_id="in_memory", train_steps_per_epoch=steps, env={"TEST_STEPS_PER_EPOCH": str(steps)},
        train_minibatch_fn=estimator_fns.killing_minibatch(str(tmp_path), kill_epoch=2))
    fitted = estimator.fit(regression_df)
    out, err = capfd.readouterr()
    assert (tmp_path / "killed").exists()
    history = fitted.getHistory()
    assert len(history["loss"]) == 4 and len(history["mae"]) == 4, history
    assert [e for e, _ in estimator.getStore().list_checkpoints("in_memory")] == [2, 3]
    # The driver named the reset and its cause, and the fit went on without a restart.
    assert "spark_hvd: fit in_memory: reset 1 of 3 in memory: lost rank 1" in out, out + err
    assert "killed by signal 9" in out
    assert "from the checkpoint" not in out
    # Each epoch's line was printed once.
    for epoch in range(1, 5):
        assert out.count(f"Epoch {epoch}/4 - ") == 1, out
    assert history["loss"][-1] < history["loss"][0]
    # The model that came back predicts.
    assert fitted.transform(regression_df.limit(4)).count() == 4


# -- an executor lost mid-fit, each estimator (local-cluster, spark-submit) --------------------

KINDS = ("torch", "keras", "lightning")  # each also the name of the module it needs


@pytest.fixture(scope="module")
def lost_executor_fits(tmp_path_factory):
    """One spark-submit application fits each estimator whose framework is installed in turn,
    each losing an executor (one cluster start and one data preparation warm-up for all three,
    ~25 s less than an application each): (its report, the driver's log)."""
    import importlib.util
    kinds = [k for k in KINDS if importlib.util.find_spec(k)]
    if not kinds:
        pytest.skip("none of torch, keras, lightning is installed")
    from test_spark_cluster import _env, _run, _submit_args
    tmp_path = tmp_path_factory.mktemp("fit_retry")
    report_path = tmp_path / "report.json"
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parent), env["PYTHONPATH"]])
    args = _submit_args("local-cluster[2,1,1024]", tmp_path, "spark.executor.memory=768m",
                        "spark.task.maxFailures=4") + [JOB, report_path, tmp_path,
                                                       ",".join(kinds)]
    result = _run(args, env, timeout=1400)
    log = result.stdout + "\n" + result.stderr
    assert result.returncode == 0, log[-10000:]
    return json.loads(report_path.read_text()), log


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("kind", KINDS)
def test_fit_survives_a_lost_executor(lost_executor_fits, kind):
    pytest.importorskip(kind)
    report, log = lost_executor_fits
    entry = report[kind]
    assert "error" not in entry, (kind, entry, log[-10000:])
    assert entry["killed"], kind
    section = log[log.index(f"=== fit {kind}"):log.index(f"=== end {kind}")]
    history = entry["history"]
    losses = history.get("loss") or history.get("train_loss")
    assert losses is not None and len(losses) == 4, (kind, history)
    assert all(len(v) == 4 for v in history.values()), (kind, history)
    assert entry["checkpoints"][-1] == 3, (kind, entry)
    assert f"spark_hvd: fit retry_{kind}: reset 1 of 3" in section, section[-6000:]
    if kind == "torch":
        # In memory: the survivor went on, the re-run task joined back.
        assert "reset 1 of 3 in memory: lost rank 1 on executor-" in section, section[-6000:]
    else:
        # From the last checkpoint (epoch 1/4), on the executors there were.
        assert "going on on" in section and "from the checkpoint of epoch 1/4" in section, \
            section[-6000:]
    print(f"{kind}: fit with a lost executor took {entry['seconds']:.0f} s")
