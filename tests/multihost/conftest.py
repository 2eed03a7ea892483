"""Fixtures for tests on the multi-host bed (see bed.py). Every test here is marked
``multihost`` (run them alone with ``-m multihost``) and skips, with the reason, where network
namespaces cannot be made."""

from __future__ import annotations

import os
import sys

import pytest

# The tests and helpers here import their neighbours by bare name (``from bed import Bed``), as
# benchmarks/multihost.py does with this folder on its path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bed import Bed, unavailable_reason  # noqa: E402

_REASON = unavailable_reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/multihost/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.multihost)
            if _REASON:
                item.add_marker(pytest.mark.skip(reason=f"no multi-host bed: {_REASON}"))


def _bed(**kwargs):
    bed = Bed(**kwargs)
    with bed:
        yield bed
    left = bed.leftovers()
    assert not left, f"the bed left these behind: {left}"


@pytest.fixture
def bed2():
    """Two hosts, h0 and h1, on one bridge."""
    yield from _bed(n_hosts=2)


@pytest.fixture
def bed3():
    """Three hosts, h0, h1 and h2, on one bridge."""
    yield from _bed(n_hosts=3)


@pytest.fixture
def bed2_mgmt():
    """Two hosts whose management links (mgmt0) reach only the root namespace."""
    yield from _bed(n_hosts=2, mgmt_links=True)


@pytest.fixture(scope="module")
def bed2_2gbit_sshd():
    """(bed, ssh access): two hosts running sshd, each host's egress limited to 2 Gbit/s; one
    bed for the whole test module (jobs over ssh start in seconds, a bed in about one)."""
    for bed in _bed(n_hosts=2, rate="2gbit"):
        yield bed, bed.start_sshd()
