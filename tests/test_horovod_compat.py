"""Names of Horovod's modules that its own test suite and some scripts import, besides the public
API: ``horovod.common.util`` (spark_hvd.common.util), ``hvd.mpi_ops._basics`` and
``hvd._executing_eagerly``; and reducescatter's refusal of Adasum, which Horovod raises as a
RuntimeError. The job runs through the real launcher (tests/workers/horovod_compat.py)."""

import os
import subprocess

import pytest

from conftest import PY, REPO, job_env, run_job
from spark_hvd.common import basics, util


def test_env_sets_and_restores_variables(monkeypatch):
    monkeypatch.setenv("SHVD_COMPAT_KEPT", "before")
    monkeypatch.delenv("SHVD_COMPAT_NEW", raising=False)
    with util.env(SHVD_COMPAT_KEPT="inside", SHVD_COMPAT_NEW="new", SHVD_COMPAT_NONE=None):
        assert os.environ["SHVD_COMPAT_KEPT"] == "inside"
        assert os.environ["SHVD_COMPAT_NEW"] == "new"
        assert "SHVD_COMPAT_NONE" not in os.environ  # None values are ignored
    assert os.environ["SHVD_COMPAT_KEPT"] == "before"
    assert "SHVD_COMPAT_NEW" not in os.environ
    with pytest.raises(KeyError):
        with util.env(SHVD_COMPAT_NEW="x"):
            raise KeyError("restored on errors too")
    assert "SHVD_COMPAT_NEW" not in os.environ


def test_cache_computes_once_per_arguments():
    calls = []

    @util._cache
    def square(x, power=2):
        calls.append((x, power))
        return x ** power

    assert [square(3), square(3), square(3, power=3), square(3, power=3)] == [9, 9, 27, 27]
    assert calls == [(3, 2), (3, 3)]


def test_version_comparison_follows_horovod():
    assert util.is_version_greater_equal_than("2.21.0", "2.6.0")
    assert not util.is_version_greater_equal_than("2.5.3", "2.6.0")
    assert util.is_version_greater_equal_than("3.15.0.dev1", "3.0.0")
    with pytest.raises(ValueError, match="major.minor.patch"):
        util.is_version_greater_equal_than("2.21.0", "2.6")
    with pytest.raises(ValueError, match="string"):
        util.is_version_greater_equal_than(2, "2.6.0")


def test_what_was_built():
    from spark_hvd.common import _mpi  # the MPI plugin is built where MPI's headers are
    assert util.gloo_built() is True
    assert util.mpi_built() is os.path.exists(_mpi.plugin_path())
    assert util.nccl_built() is basics.nccl_built() and util.ddl_built() is False
    assert util.ccl_built() is False and util.gpu_available("torch") is False
    assert util.extension_available("torch") and util.extension_available("tensorflow")
    assert not util.extension_available("mxnet")
    assert not util.extension_available("no_such_framework")


def test_list_helpers():
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert [util.num_rank_is_power_2(n) for n in (0, 1, 2, 3, 4, 6, 8)] == \
        [False, True, True, False, True, False, True]
    assert util.is_iterable([1]) and not util.is_iterable(3)
    resolve = util.get_average_backwards_compatibility_fun(type("Ops", (), {"Average": 0,
                                                                           "Sum": 1}))
    assert (resolve(None, None), resolve(1, None)) == (0, 1)
    with pytest.warns(DeprecationWarning):
        assert resolve(None, False) == 1
    with pytest.raises(ValueError, match="supersedes"):
        resolve(1, True)


def test_util_loads_no_framework():
    """Importing it (as Horovod's test modules do first) loads neither the native core nor a
    framework."""
    code = ("import sys, spark_hvd.common.util; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'spark_hvd.common._native') "
            "if m in sys.modules))")
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=job_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_process_set_table_executing_eagerly_and_adasum_refusal(np_):
    run_job(np_, "horovod_compat", transport="shm", timeout=110,
            env={"TF_CPP_MIN_LOG_LEVEL": "3"}).assert_ok(np_)
