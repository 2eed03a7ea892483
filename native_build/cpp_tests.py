"""The C++ test programs of native/tests/ (each with its own main, never part of a library),
built for the tests that run them (tests/test_native_*.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .layout import DEFAULT_BUILD, DEFAULT_SRC, HEADER_SUFFIXES
from .toolchain import BASE_FLAGS, LINK_LIBS, RELEASE_FLAGS, compiler, env_flags, produce


def build_test_program(name: str, sources: list[str], src_dir: Path = DEFAULT_SRC,
                       build_dir: Path = DEFAULT_BUILD) -> Path:
    """Compiles a standalone C++ test program of native/tests/ (``sources``: paths relative to
    ``src_dir``, its own file with main() first, then the library sources it tests) with the
    library's release flags, and returns the binary. The binary is named after a hash of the
    compiler, the flags, the sources and every header under ``src_dir``, so a rerun with
    nothing changed only runs it. Raises BuildError with the compiler's output."""
    cxx = compiler()
    flags = BASE_FLAGS + RELEASE_FLAGS + env_flags("CXXFLAGS")
    paths = [src_dir / s for s in sources]
    headers = sorted(p for p in src_dir.rglob("*") if p.suffix in HEADER_SUFFIXES and p.is_file())
    digest = hashlib.sha256(" ".join(cxx + flags).encode())
    for path in paths + headers:
        digest.update(str(path.relative_to(src_dir)).encode())
        digest.update(path.read_bytes())
    out_dir = build_dir / "tests"
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / f"{name}_{digest.hexdigest()[:16]}"
    if not binary.exists():
        produce(cxx + flags + [str(p) for p in paths] + LINK_LIBS + env_flags("LDFLAGS"),
                binary, "compiling test program", verbose=False)
    return binary
