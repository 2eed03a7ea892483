"""Interface choice on one machine (the bed's two-network tests are in
tests/multihost/test_interfaces.py): which setting names the interface, how a list is read,
and that a job's ranks bind to and advertise the interface's address, or fail naming the
interfaces there are."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from spark_hvd.common._network import interface_setting, pinned_interface_address

PY = sys.executable
_JOIN = ("import spark_hvd.numpy as hvd, numpy as np; hvd.init(); "
         "print('sum', hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum).tolist()); "
         "hvd.shutdown()")


def test_settings_and_their_order():
    assert interface_setting({}) is None
    assert interface_setting({"HOROVOD_GLOO_IFACE": "lo"}) == ("HOROVOD_GLOO_IFACE", ["lo"])
    assert interface_setting({"HOROVOD_NETWORK_INTERFACE": "eth1", "HOROVOD_GLOO_IFACE": "lo"}) \
        == ("HOROVOD_NETWORK_INTERFACE", ["eth1"])
    assert interface_setting({"SPARK_HVD_NETWORK_INTERFACE": " ib0, lo ",
                              "HOROVOD_NETWORK_INTERFACE": "eth1"}) \
        == ("SPARK_HVD_NETWORK_INTERFACE", ["ib0", "lo"])


def test_a_list_takes_the_first_interface_this_host_has():
    assert pinned_interface_address({}) is None
    env = {"SPARK_HVD_NETWORK_INTERFACE": "no-such-if0,lo"}
    assert pinned_interface_address(env) == ("lo", "127.0.0.1")
    with pytest.raises(ValueError, match=r"SPARK_HVD_NETWORK_INTERFACE=no-such-if0: host \S+ "
                                         r"has no network interface .*lo 127\.0\.0\.1"):
        pinned_interface_address({"SPARK_HVD_NETWORK_INTERFACE": "no-such-if0"})


def _launch(env_extra, *args, rank_env=()):
    """A 2-rank job on this machine; ``rank_env``: variables set for the ranks only."""
    env = dict(os.environ, SPARK_HVD_LOG_LEVEL="DEBUG", **env_extra)
    command = ["env", *rank_env] if rank_env else []
    return subprocess.run([PY, "-m", "spark_hvd.runner", "-np", "2", "--start-timeout", "20",
                           *args, *command, PY, "-c", _JOIN], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.timeout(150)
def test_ranks_listen_on_the_interface_horovodrun_names():
    done = _launch({"HOROVOD_GLOO_IFACE": "lo"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("sum [2.0, 2.0, 2.0]") == 2, done.stdout
    listens = re.findall(r"rank \d listens on (\S+):\d+ \(interface lo\), advertised as (\S+)$",
                         done.stderr, re.M)
    assert listens == [("127.0.0.1", "127.0.0.1")] * 2, done.stderr


@pytest.mark.timeout(150)
def test_an_interface_a_host_lacks_fails_every_rank_that_reaches_init():
    # The launcher runs ranks here, so it checks the name itself before starting any.
    done = _launch({}, "--network-interface", "no-such-if0")
    assert done.returncode == 2
    assert re.search(r"no-such-if0.* has no network interface .*lo 127\.0\.0\.1", done.stderr), \
        done.stderr
    # Set only for the ranks (as a Spark task or horovodrun does), each rank says so.
    done = _launch({}, rank_env=["HOROVOD_GLOO_IFACE=no-such-if0"])
    assert done.returncode == 1
    assert re.search(r"ValueError: spark_hvd.init: rank \d: HOROVOD_GLOO_IFACE=no-such-if0: host "
                     r"\S+ has no network interface", done.stderr), done.stderr


# Rank 1 leaves between the rendezvous and connecting (its core never starts), so rank 0's
# connections time out; rank 0 prints the error and the core's error kind.
_UNCONNECTED = """
import os
import spark_hvd.numpy as hvd
from spark_hvd.common import _bootstrap, _native

class LeavesBeforeConnecting:
    def __getattr__(self, name):
        return (lambda options: os._exit(0)) if name == "shvd_init" else getattr(_native.lib, name)

if os.environ["SPARK_HVD_RANK"] == "1":
    _bootstrap.lib = LeavesBeforeConnecting()
try:
    hvd.init()
except hvd.HorovodInternalError as e:
    print("KIND", _native.lib.shvd_last_error_kind() == _native.ERR_CONNECT, "ERROR", e)
"""


@pytest.mark.timeout(150)
def test_ranks_that_do_not_connect_hear_the_advertised_addresses():
    """The core reports a mesh that did not connect in time as its own error kind
    (SHVD_ERR_CONNECT), and init() adds by that kind which addresses the ranks advertised."""
    done = subprocess.run([PY, "-m", "spark_hvd.runner", "-np", "2", "--start-timeout", "3",
                           PY, "-c", _UNCONNECTED], capture_output=True, text=True, timeout=120)
    assert "KIND True ERROR" in done.stdout, (done.stdout, done.stderr)
    assert "waiting for ranks [1] to connect" in done.stdout, done.stdout
    assert re.search(r"The ranks advertised these addresses: rank 0: 127\.0\.0\.1:\d+ on \S+; "
                     r"rank 1: 127\.0\.0\.1:\d+ on \S+\.", done.stdout), done.stdout
