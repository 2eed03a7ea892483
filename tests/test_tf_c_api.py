"""The TensorFlow op library's own declarations of TensorFlow's C API (native/tensorflow/
tf_c_api.h, which lets it build without TensorFlow) against TensorFlow's headers: compiled after
them, a declaration that differs fails to compile, and every enum value it names is
static_assert'ed equal to TensorFlow's."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "native" / "tensorflow" / "tf_c_api.h"


def _tf_include():
    tf = pytest.importorskip("tensorflow")
    include = Path(tf.sysconfig.get_include())
    if not (include / "tensorflow" / "c" / "kernels.h").exists():
        pytest.skip(f"TensorFlow {tf.__version__} has no C API headers in {include}")
    return include


def test_declarations_match_tensorflows_headers(tmp_path):
    include = _tf_include()
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    values = re.findall(r"^\s*(TF_[A-Z0-9_]+)\s*=\s*(\d+)\s*,", HEADER.read_text(), re.M)
    assert len(values) >= 10, values
    source = tmp_path / "check.cc"
    source.write_text(
        "#include \"tensorflow/c/kernels.h\"\n#include \"tensorflow/c/ops.h\"\n"
        "#include \"tensorflow/c/tf_tensor.h\"\n#include \"tensorflow/c/tf_status.h\"\n"
        f"#include \"{HEADER}\"\n"
        + "".join(f"static_assert({name} == {value}, \"{name}\");\n" for name, value in values))
    proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{include}", str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
