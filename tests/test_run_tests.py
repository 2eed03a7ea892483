"""``make test``'s runner (scripts/run_tests.py), run for real on a few quick tests: which
pytest process runs what, the ``-m`` and ``--junitxml`` arguments each one gets, the order of
the phases and their output, and the exit status."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import REPO, job_env

RUNNER = REPO / "scripts" / "run_tests.py"


def run_runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), "-p", "no:cacheprovider", "-q", *args],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=280)


def junit_cases(junit) -> list[str]:
    return sorted(case.get("name") for case in ET.parse(junit).iter("testcase"))


@pytest.mark.timeout(300)
def test_each_phase_runs_its_own_tests(tmp_path):
    """A mostly_waiting test runs in phase 1's second process, another in phase 2, a slow one
    nowhere (the caller's ``-m`` combined with each process's own), and each process writes
    its own JUnit file."""
    junit = tmp_path / "suite.xml"
    r = run_runner("-m", "not slow", "-k", "test_elastic_flag_errors or "
                   "test_discovered_host_grows_the_job or test_common_modules_import_without_cycles",
                   f"--junitxml={junit}")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert junit_cases(tmp_path / "suite-waiting.xml") == ["test_elastic_flag_errors"], out
    assert junit_cases(junit) == ["test_common_modules_import_without_cycles"], out
    assert junit_cases(tmp_path / "suite-bed.xml") == [], out
    assert out.index("== phase 1") < out.index("== the mostly_waiting tests") \
        < out.index("1 passed") < out.index("== phase 2"), out
    assert "the bed: exit 5; the mostly_waiting tests: exit 0; the other tests: exit 0" in out


@pytest.mark.timeout(300)
def test_a_failing_process_fails_the_run():
    """Its exit status is the run's (here pytest's usage error, 4, in every process)."""
    r = run_runner("--no-such-option")
    assert r.returncode == 4 and "unrecognized arguments: --no-such-option" in r.stderr, \
        r.stdout + r.stderr
