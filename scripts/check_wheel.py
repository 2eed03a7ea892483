#!/usr/bin/env python3
"""Checks a spark_hvd wheel (make wheel runs it):

- auditwheel confirms its platform tag: manylinux_2_28 or older (``auditwheel show``);
- every library in it exports only its C API (shvd_* functions; the TensorFlow op library
  exports nothing: TensorFlow finds its ops through static constructors), needs no glibc newer
  than 2.28, no C++ runtime from the system (the torch allocators excepted: torch's classes hold
  libstdc++'s types, and torch has loaded libstdc++ by then), and carries no run path but
  $ORIGIN;
- no MPI, torch or TensorFlow library is in it (each plugin names the one loaded before it).

    python scripts/check_wheel.py dist/spark_hvd-*.whl

Prints one line per library and exits non-zero, saying why, when a check fails."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

MAX_GLIBC = (2, 28)
FOREIGN = ("libmpi", "libmpich", "libc10", "libtorch", "libtensorflow", "libstdc++", "libc++")
# Needed libraries a library may name: glibc's, the core (by $ORIGIN), what a framework or MPI
# loaded before the library.
ALLOWED_NEEDED = re.compile(r"^(lib(c|m|dl|rt|pthread)\.so\.\d|ld-linux[-\w.]*\.so\.\d|"
                            r"libspark_hvd_core\.so|libtensorflow_framework\.so\.2|libc10\.so|"
                            r"libmpi\.so\.40|libmpich\.so\.12|libgcc_s\.so\.1|libstdc\+\+\.so\.6)$")


def library_facts(path: Path) -> dict:
    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        needed, runpaths = [], []
        for section in elf.iter_sections():
            if isinstance(section, DynamicSection):
                for tag in section.iter_tags():
                    if tag.entry.d_tag == "DT_NEEDED":
                        needed.append(tag.needed)
                    elif tag.entry.d_tag in ("DT_RPATH", "DT_RUNPATH"):
                        runpaths.append(getattr(tag, "runpath", None) or tag.rpath)
        versions = set()
        for section in elf.iter_sections():
            if isinstance(section, GNUVerNeedSection):
                for _, auxiliaries in section.iter_versions():
                    versions.update(a.name for a in auxiliaries)
        dynsym = elf.get_section_by_name(".dynsym")
        exported = sorted(s.name for s in dynsym.iter_symbols()
                          if s.name and s["st_shndx"] != "SHN_UNDEF"
                          and s["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")
                          and s["st_info"]["type"] in ("STT_FUNC", "STT_OBJECT"))
    return {"needed": needed, "runpaths": runpaths, "versions": versions, "exported": exported}


def check_library(name: str, facts: dict) -> list[str]:
    problems = []
    glibc = [tuple(int(x) for x in v.split("_", 1)[1].split(".")) for v in facts["versions"]
             if v.startswith("GLIBC_") and v[6:7].isdigit()]
    if glibc and max(glibc) > MAX_GLIBC:
        problems.append(f"needs GLIBC_{'.'.join(map(str, max(glibc)))}")
    for n in facts["needed"]:
        if not ALLOWED_NEEDED.match(n):
            problems.append(f"needs {n}")
        if n.startswith("libstdc++") and not name.startswith("libspark_hvd_torch_"):
            problems.append("needs the system's C++ runtime")
    for r in facts["runpaths"]:
        if any(p and p != "$ORIGIN" for p in r.split(":")):
            problems.append(f"run path {r!r}")
    others = [s for s in facts["exported"] if not s.startswith("shvd_")]
    if others:
        problems.append(f"exports {len(others)} symbols besides shvd_* ({', '.join(others[:5])})")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    failed = []
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                           capture_output=True, text=True)
    text = " ".join(shown.stdout.split())
    print(text)
    m = re.search(r'consistent with the following platform tag: "manylinux_(\d+)_(\d+)_', text)
    if shown.returncode != 0 or m is None:
        failed.append("auditwheel names no manylinux tag")
    elif (int(m.group(1)), int(m.group(2))) > MAX_GLIBC:
        failed.append(f"auditwheel's tag is manylinux_{m.group(1)}_{m.group(2)}")
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".so") or ".so." in n]
        for n in names:
            base = Path(n).name
            if base.startswith(FOREIGN):
                failed.append(f"{n}: a library of MPI, a framework or a C++ runtime is bundled")
                continue
            facts = library_facts(Path(z.extract(n, tmp)))
            problems = check_library(base, facts)
            print(f"{base}: needs {', '.join(facts['needed'])}; "
                  f"{len(facts['exported'])} exported; "
                  + ("ok" if not problems else "; ".join(problems)))
            failed += [f"{base}: {p}" for p in problems]
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(f"{wheel.name}: ok ({len(names)} libraries)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
