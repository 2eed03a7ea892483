"""The ABI's codes have one source, native/include/spark_hvd.h, and every copy is checked.

The core's internal enums are static_asserted against the header (a drifted header does not
compile); Python takes the numbers from the core's shvd_abi_codes table at import and refuses to
load when that table names other codes than the ones Python uses; the framework adapters include
the public header only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

NATIVE = REPO / "native"
HEADER = NATIVE / "include" / "spark_hvd.h"


def header_codes(text: str) -> dict[str, int]:
    """``SHVD_*`` enum constants of the header text, read independently of the core."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return {name: int(value) for name, value in re.findall(r"\b(SHVD_\w+)\s*=\s*(\d+)", text)}


@pytest.fixture(scope="module")
def codes() -> dict[str, int]:
    return header_codes(HEADER.read_text())


def test_python_codes_are_the_headers(codes):
    """Every dtype, reduce-op, op and error code Python uses equals the header's, and Python
    names every code the header defines."""
    from spark_hvd.common import _native, _ops

    groups = {"SHVD_DTYPE_": "dtype", "SHVD_REDUCE_": "reduce_op", "SHVD_OP_": "op",
              "SHVD_ERR_": "error"}
    for prefix, kind in groups.items():
        in_header = {name[len(prefix):].lower(): value for name, value in codes.items()
                     if name.startswith(prefix)}
        in_python = {name.lower(): value for name, value in _native.ABI_CODES[kind].items()}
        assert in_python == in_header, kind
    for name, value in codes.items():
        if name.startswith("SHVD_DTYPE_"):
            assert getattr(_native, name[len("SHVD_DTYPE_"):]) == value
        elif name.startswith("SHVD_OP_"):
            assert getattr(_native, "OP_" + name[len("SHVD_OP_"):]) == value
    for op in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        assert getattr(_ops, op) == codes["SHVD_REDUCE_" + op.upper()]
    assert _native.ERR_UNSUPPORTED == codes["SHVD_ERR_UNSUPPORTED"]
    assert len(_native.DTYPE_SIZES) == codes["SHVD_NUM_DTYPES"]
    assert len(_ops._REDUCE_OP_NAMES) == codes["SHVD_NUM_REDUCE_OPS"]


def test_dtype_sizes_match_torch():
    """The element sizes the core reports are the frameworks' (torch has all eleven dtypes)."""
    torch = pytest.importorskip("torch")
    from spark_hvd.common import _native

    for name, code in _native.ABI_CODES["dtype"].items():
        expected = torch.empty(0, dtype=getattr(torch, name)).element_size()
        assert _native.DTYPE_SIZES[code] == expected, name


@pytest.mark.parametrize("tamper,complaint", [
    (lambda t: {**t, "dtype": {k: v for k, v in t["dtype"].items() if k != "bfloat16"}},
     "dtype: missing bfloat16; unknown to Python -"),
    (lambda t: {**t, "reduce_op": {**t["reduce_op"], "Median": 6}},
     "reduce_op: missing -; unknown to Python Median"),
    (lambda t: {**t, "op": {**t["op"], "join": t["op"]["barrier"]}},
     "op: two names share a code"),
    (lambda t: {k: v for k, v in t.items() if k != "error"},
     "error: missing connect, internal, invalid, none, state, unsupported"),
])
def test_check_refuses_a_mismatch(tamper, complaint):
    """check_abi_codes accepts the core's own table and refuses any table that differs."""
    from spark_hvd.common import _native

    table = _native.parse_abi_codes(_native.lib.shvd_abi_codes().decode())[0]
    _native.check_abi_codes(table)
    with pytest.raises(ImportError, match="disagree about the ABI") as info:
        _native.check_abi_codes(tamper(table))
    assert complaint in str(info.value)


def test_import_fails_on_a_mismatch(tmp_path):
    """A Python side that names a code the core does not have fails at import, saying why
    (a copy of the package whose _native.py expects a dtype the core lacks, with the real
    core)."""
    package = tmp_path / "spark_hvd"
    shutil.copytree(REPO / "spark_hvd", package,
                    ignore=shutil.ignore_patterns("_core", "__pycache__"))
    (package / "_core").symlink_to(REPO / "spark_hvd" / "_core")
    native_py = package / "common" / "_native.py"
    source = native_py.read_text()
    assert '"bfloat16", "float32"' in source
    native_py.write_text(source.replace('"bfloat16", "float32"', '"bfloat17", "float32"', 1))
    result = subprocess.run([sys.executable, "-c", "import spark_hvd.common._native"],
                            cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "disagree about the ABI" in result.stderr
    assert "missing bfloat17; unknown to Python bfloat16" in result.stderr, result.stderr


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(_compiler() is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("source,constant,message", [
    ("#include \"common/types.h\"\n", "SHVD_DTYPE_BOOL", "DataType must equal"),
    ("#include \"common/types.h\"\n", "SHVD_REDUCE_MIN", "ReduceOp must equal"),
    (None, "SHVD_OP_JOIN", "OpType must equal"),  # None: c_api.cc itself
])
def test_internal_enums_are_asserted_against_the_header(tmp_path, source, constant, message):
    """The core compiles with the header as it is and fails to compile when the header gives
    one code another value."""
    tree = tmp_path / "native"
    shutil.copytree(NATIVE, tree, ignore=shutil.ignore_patterns("tests"))
    unit = tree / "c_api.cc"
    if source is not None:
        unit = tree / "unit.cc"
        unit.write_text(source)

    def compile_unit():
        return subprocess.run([_compiler(), "-std=c++17", "-fsyntax-only", str(unit)],
                              capture_output=True, text=True, timeout=300)

    assert compile_unit().returncode == 0
    header = tree / "include" / "spark_hvd.h"
    text = header.read_text()
    drifted = re.sub(rf"\b{constant} = (\d+)", lambda m: f"{constant} = {int(m.group(1)) + 40}",
                     text)
    assert drifted != text
    header.write_text(drifted)
    result = compile_unit()
    assert result.returncode != 0
    assert message in result.stderr


def test_framework_adapters_use_only_the_public_header():
    """The TensorFlow op and the torch allocator talk to the core through spark_hvd.h alone,
    so the core's internals can change without touching them."""
    adapters = [p for d in ("tensorflow", "torch") for p in (NATIVE / d).iterdir()
                if p.suffix in (".cc", ".h")]
    assert adapters
    for path in adapters:
        local = re.findall(r'#include\s+"([^"]+)"', path.read_text())
        # The framework's headers, and the adapter's own beside it (the TF op's declarations
        # of TensorFlow's C API), which this loop checks in turn.
        core = [inc for inc in local if not inc.startswith(("tensorflow/", "c10/", "torch/"))
                and not (path.parent / inc).parent == path.parent]
        assert set(core) <= {"../include/spark_hvd.h"}, (path.name, core)
