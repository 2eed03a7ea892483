#!/usr/bin/env python3
"""The manylinux wheel's core against the g++ build, in one run (issue 32).

    .venv/bin/python benchmarks/wheel.py                     # the newest dist/spark_hvd-*.whl
    .venv/bin/python benchmarks/wheel.py --wheel W.whl --rounds 5 --json /tmp/wheel.json

Two parts, each alternating the two builds round by round (the host may be shared and noisy):

1. Allreduce, float32 Sum at 2 ranks on this host, 4 B, 16 KiB, 1 MiB and 64 MiB: the
   allreduce benchmark (allreduce.py) runs system ``spark_hvd`` on this checkout's g++ build
   (spark_hvd/_core/, `make build`) and system ``spark_hvd_base`` on the wheel, unpacked (its
   package with its own libraries; each round's worker reports which core it mapped).
2. The reduce kernels (native/tests/reduce_kernels_bench.cc: sum, max, average, scale per dtype
   at 16 KiB, 1 MiB, 64 MiB), compiled with the g++ build's flags and with the wheel's
   toolchain (zig's clang for glibc 2.28, the ziglang package), each linked as the core is.

Reported per size and per kernel case: the median over rounds of each round's median, for each
build; the ratio wheel / g++ as the median of the rounds' ratios (the two builds of one round run
back to back, under the same load from elsewhere, so a busy minute moves both); and the ratio of
the two builds' best rounds. PASS when the median ratio is at most 1.05 (issue 32: no size slower
by more than 5 %). Exit status 1 on a failure, and with --strict also on a FAIL.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "_helpers"))
sys.path.insert(0, str(REPO))

from machine import host_description, loadavg, source_version  # noqa: E402
from printing import fmt_size, log, table  # noqa: E402

SIZES = ["4B", "16KiB", "1MiB", "64MiB"]
LIMIT = 1.05  # the wheel may be at most 5 % slower


def find_wheel(path):
    if path:
        return Path(path)
    wheels = sorted((REPO / "dist").glob("spark_hvd-*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None


def allreduce_rounds(tree, args, json_path):
    """allreduce.py on both builds, --rounds interleaved rounds; its JSON records."""
    cmd = [sys.executable, str(HERE / "allreduce.py"), "--systems", "spark_hvd",
           "--baseline", str(tree), "--sizes", ",".join(SIZES), "--grad-tensors", "0",
           "--idle-cpu", "0", "--rounds", str(args.rounds), "--json", str(json_path)]
    if args.rep_scale != 1.0:
        cmd += ["--rep-scale", str(args.rep_scale)]
    # System spark_hvd imports this checkout (its g++ build), not whatever is installed.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"allreduce.py failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads(json_path.read_text())


def kernel_binaries(build_root):
    """The kernel benchmark built with the g++ build's toolchain and with the wheel's."""
    from native_build import toolchain
    from native_build.cpp_tests import build_test_program
    sources = ["tests/reduce_kernels_bench.cc", "kernels/reduce_kernels.cc", "common/types.cc"]
    binaries = {}
    saved = os.environ.get(toolchain.TOOLCHAIN_ENV)
    try:
        for build, value in (("g++", ""), ("wheel", "zig")):
            os.environ[toolchain.TOOLCHAIN_ENV] = value
            binaries[build] = build_test_program("reduce_kernels_bench", sources,
                                                 build_dir=build_root / build)
    finally:
        if saved is None:
            os.environ.pop(toolchain.TOOLCHAIN_ENV, None)
        else:
            os.environ[toolchain.TOOLCHAIN_ENV] = saved
    return binaries


def kernel_rounds(binaries, args):
    """{build: {(case, bytes): [median ns per round]}}."""
    out = {b: {} for b in binaries}
    order = list(binaries)
    for rnd in range(args.rounds):
        for build in order[rnd % 2:] + order[:rnd % 2]:
            log(f"[kernels] round {rnd + 1}: {build}")
            proc = subprocess.run([str(binaries[build]), str(args.kernel_reps)],
                                  capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"{binaries[build]} failed: {proc.stderr[-2000:]}")
            for line in proc.stdout.splitlines():
                rec = json.loads(line)
                out[build].setdefault((rec["case"], rec["bytes"]), []).append(rec["ns"][0])
    return out


def verdict(ratio):
    return "PASS" if ratio <= LIMIT else "FAIL"


def compare(gxx, wheel):
    """(g++ median, wheel median, median of the rounds' ratios, best rounds' ratio)."""
    ratios = [w / g for g, w in zip(gxx, wheel)]
    return (statistics.median(gxx), statistics.median(wheel), statistics.median(ratios),
            min(wheel) / min(gxx))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", help="the wheel (default: the newest dist/spark_hvd-*.whl)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--rep-scale", type=float, default=1.0,
                   help="multiply allreduce.py's repetition counts")
    p.add_argument("--kernel-reps", type=int, default=15,
                   help="timed repetitions per kernel case and round (default 15)")
    p.add_argument("--skip-allreduce", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    p.add_argument("--strict", action="store_true", help="exit 1 when a ratio FAILs")
    args = p.parse_args(argv)

    wheel = find_wheel(args.wheel)
    if wheel is None:  # make bench runs every script: no wheel is a skip there, not a failure
        log("no dist/spark_hvd-*.whl: run `make wheel` first (or pass --wheel); skipped")
        return 0
    if not args.skip_kernels and importlib.util.find_spec("ziglang") is None:
        log("the ziglang package is not installed here: the reduce kernels part is skipped")
        args.skip_kernels = True
    gxx = json.loads((REPO / "spark_hvd" / "_core" / "build_info.json").read_text()) \
        if (REPO / "spark_hvd" / "_core" / "build_info.json").exists() else {}
    if gxx.get("toolchain") == "zig":
        raise SystemExit("spark_hvd/_core/ holds a zig build: run `make build` (g++) first")
    log(f"wheel: {wheel.name}; g++ build: {gxx.get('compiler', '?')}")
    load = [loadavg()]
    record = {"wheel": wheel.name, "host": host_description(), "source": source_version()}
    lines, verdicts = [], []
    with tempfile.TemporaryDirectory(prefix="spark_hvd-wheel-bench-") as tmp:
        tmp = Path(tmp)
        tree = tmp / "wheel"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tree)
        for so in (tree / "spark_hvd" / "_core").glob("*.so"):
            so.chmod(0o755)
        if not args.skip_allreduce:
            data = allreduce_rounds(tree, args, tmp / "allreduce.json")
            cores = {s: sorted({r["meta"].get("core_path", "?") for r in runs})
                     for s, runs in data["rounds"].items()}
            log(f"cores mapped: {cores}")
            assert all(str(tree) in c for c in cores["spark_hvd_base"]), cores
            assert all(str(tree) not in c for c in cores["spark_hvd"]), cores
            rows = []
            for nbytes in sorted({int(k) for k in data["results"]["spark_hvd"]["sizes"]}):
                per_round = {s: data["results"][s]["round_medians"]["sizes"][str(nbytes)]
                             for s in ("spark_hvd", "spark_hvd_base")}
                g, w, ratio, best = compare(per_round["spark_hvd"], per_round["spark_hvd_base"])
                verdicts.append(verdict(ratio))
                rows.append([fmt_size(nbytes), f"{g * 1e6:.1f}", f"{w * 1e6:.1f}",
                             f"{ratio:.3f}", f"{best:.3f}", verdict(ratio)])
                record.setdefault("allreduce", {})[nbytes] = {
                    "gxx_s": g, "wheel_s": w, "ratio": ratio, "best_ratio": best,
                    "gxx_rounds": per_round["spark_hvd"],
                    "wheel_rounds": per_round["spark_hvd_base"]}
            record["cores"] = cores
            lines += [f"Allreduce, float32 Sum, 2 ranks on this host, median of {args.rounds} "
                      "rounds' medians (us):", "",
                      table(["size", "g++ build", "wheel", "wheel / g++", "best rounds",
                             "<= 1.05"], rows, "lrrrrl"), ""]
        if not args.skip_kernels:
            binaries = kernel_binaries(tmp / "kernels")
            got = kernel_rounds(binaries, args)
            rows = []
            for key in got["g++"]:
                g, w, ratio, best = compare(got["g++"][key], got["wheel"][key])
                verdicts.append(verdict(ratio))
                rows.append([key[0], fmt_size(key[1]), f"{g / 1e3:.2f}", f"{w / 1e3:.2f}",
                             f"{ratio:.3f}", f"{best:.3f}", verdict(ratio)])
                record.setdefault("kernels", {})[f"{key[0]} {key[1]}"] = {
                    "gxx_ns": g, "wheel_ns": w, "ratio": ratio, "best_ratio": best,
                    "gxx_rounds": got["g++"][key], "wheel_rounds": got["wheel"][key]}
            lines += [f"Reduce kernels, one call, median of {args.rounds} rounds' medians (us):",
                      "", table(["case", "size", "g++ build", "wheel", "wheel / g++",
                                 "best rounds", "<= 1.05"], rows, "llrrrrl"), ""]
    load.append(loadavg())
    lines.append(f"Load average before/after: {load[0]} / {load[-1]}; "
                 f"{verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL.")
    print("\n".join(lines))
    if args.json:
        record["load"] = load
        Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    return 1 if args.strict and "FAIL" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
