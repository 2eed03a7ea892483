"""Every code block of the documentation (docs/**/*.md and the README) is tested: run, or marked
as not runnable with the reason (docs/_ext/spark_hvd_docs/snippets.py says how). Python blocks
that are not run are still compiled, and the spark_hvd names they use must exist."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PY, REPO, job_env

sys.path.insert(0, str(REPO / "docs" / "_ext"))
from spark_hvd_docs import snippets as _snippets  # noqa: E402

SETUPS = REPO / "tests" / "docs" / "setups"
ALL = _snippets.all_snippets(REPO)
CODE = [s for s in ALL if s.kind in ("python", "shell")]
PYTHON = [s for s in CODE if s.kind == "python"]


def _param(snippet):
    marks = [pytest.mark.slow] if snippet.options.get("slow") else []
    return pytest.param(snippet, id=snippet.id, marks=marks)


RUN = [_param(s) for s in CODE if s.action in ("run", "shell")]


def test_every_block_is_marked():
    assert len(CODE) >= 20, f"only {len(CODE)} code blocks found"
    problems = [p for s in ALL for p in s.problems()]
    problems += [p for page in _snippets.pages(REPO) for p in _snippets.stray_marks(page)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.id) for s in PYTHON])
def test_python_block_compiles_and_its_names_exist(snippet):
    compile(snippet.code, snippet.id, "exec")
    missing = _snippets.missing_names(snippet.code)
    assert not missing, f"{snippet.path}:{snippet.line} uses names spark_hvd does not have: " \
                        f"{missing}"


@pytest.mark.parametrize("snippet", RUN)
def test_block_runs(snippet, tmp_path):
    timeout = float(snippet.options.get("timeout", 240))
    env = job_env()
    env["PATH"] = os.pathsep.join([str(REPO / ".venv" / "bin"), os.path.dirname(PY),
                                   env.get("PATH", "")])
    env["PYSPARK_PYTHON"] = PY  # Spark's Python workers: this environment's Python
    if snippet.action == "shell":
        cmd, cwd = ["bash", "-euo", "pipefail", "-c", snippet.code], REPO
    else:
        code = snippet.code
        setup = snippet.options.get("setup")
        if setup:
            code = (SETUPS / f"{setup}.py").read_text() + "\n" + code
        script = tmp_path / "snippet.py"
        script.write_text(code)
        np_ = int(snippet.options.get("np", 1))
        cmd = [PY, str(script)]
        if np_ > 1:
            cmd = [PY, "-m", "spark_hvd.runner", "-np", str(np_), "--start-timeout", "60"] + cmd
        cwd = tmp_path
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{snippet.path}:{snippet.line} ran past {timeout} s:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, (f"{snippet.path}:{snippet.line} failed "
                                  f"({done.returncode}):\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-3000:]}")
