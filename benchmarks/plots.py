"""Draws the benchmark figures from the results in ``benchmarks/results/*.json``.

    .venv/bin/python benchmarks/plots.py                      # -> build/bench-figures/*.png
    .venv/bin/python benchmarks/plots.py --out DIR
    # a new allreduce.py run becomes the current results, then its figures:
    .venv/bin/python benchmarks/allreduce.py --json /tmp/run.json
    .venv/bin/python benchmarks/plots.py --from-allreduce /tmp/run.json \\
        --into benchmarks/results/allreduce.json

Each results file names the benchmark, the command, the machine, the date and the commit, and
holds its figures' data (``figures``: a title, axes, categories or sizes, one series per
system). The documentation's benchmarks page draws the same figures at every build
(``docs/_ext``), with those facts under each one; ``make bench`` skips this script.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "build", "bench-figures")
# One colour per system, the same in every figure.
COLOURS = {"spark_hvd": "#1f5fa8", "Open MPI": "#d1712b", "gloo": "#5a9e4b",
           "torch NCCL": "#8e44ad", "torch DDP (NCCL)": "#8e44ad", "torch DDP (gloo)": "#5a9e4b"}


def load(results_dir: str = RESULTS) -> dict[str, dict]:
    """``{name: results}`` of every ``*.json`` in ``results_dir``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            out[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
    return out


def _colour(name, i):
    for key, colour in COLOURS.items():
        if name == key or name.startswith(key + " "):
            return colour
    return f"C{i}"


def draw(figure: dict, path: str) -> str:
    """One figure (an entry of a results file's ``figures``) as a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    kind, x, series = figure["kind"], figure["x"], figure["series"]
    if kind == "line":
        for i, (name, ys) in enumerate(series.items()):
            ax.plot(x, ys, marker="o", markersize=4, label=name, color=_colour(name, i))
        if figure.get("log_x"):
            ax.set_xscale("log", base=2)
        if figure.get("log_y"):
            ax.set_yscale("log")
        if figure.get("x_tick_labels"):
            ax.set_xticks(x, figure["x_tick_labels"], rotation=35, ha="right")
            ax.minorticks_off()
        if figure.get("ceiling"):
            ax.axhline(figure["ceiling"], color="grey", linestyle="--", linewidth=1,
                       label=figure.get("ceiling_label", "ceiling"))
    elif kind in ("bar", "stacked"):
        width = 0.8 / (1 if kind == "stacked" else len(series))
        bottom = [0.0] * len(x)
        for i, (name, ys) in enumerate(series.items()):
            if kind == "stacked":
                pos = list(range(len(x)))
                ax.bar(pos, ys, width, bottom=bottom, label=name, color=f"C{i}")
                bottom = [b + y for b, y in zip(bottom, ys)]
            else:
                pos = [j + (i - (len(series) - 1) / 2) * width for j in range(len(x))]
                bars = ax.bar(pos, ys, width, label=name, color=_colour(name, i))
                ax.bar_label(bars, fmt="%g", fontsize=8)
        ax.set_xticks(range(len(x)), x, rotation=15, ha="right")
        if figure.get("target"):
            ax.axhline(figure["target"], color="grey", linestyle="--", linewidth=1,
                       label=f"target {figure['target']}")
    elif kind == "barh":
        (name, ys), = series.items()
        bars = ax.barh(range(len(x)), ys, color=[_colour(lbl, i) for i, lbl in enumerate(x)])
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=8, padding=3)
        ax.set_yticks(range(len(x)), x)
        ax.invert_yaxis()
        ax.set_xlabel(figure["y_label"])
        ax.margins(x=0.15)
    else:
        raise ValueError(f"unknown figure kind {kind!r}")
    if kind != "barh":
        ax.set_xlabel(figure.get("x_label", ""))
        ax.set_ylabel(figure["y_label"])
    ax.set_title(figure["title"], fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    if kind != "barh":
        ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    return path


def draw_all(out_dir: str = DEFAULT_OUT, results_dir: str = RESULTS) -> list[str]:
    """Every figure of every results file, as ``out_dir/<figure name>.png``."""
    return [draw(figure, os.path.join(out_dir, figure["name"] + ".png"))
            for results in load(results_dir).values() for figure in results["figures"]]


def from_allreduce(run: dict) -> dict:
    """A results file from the ``--json`` output of ``allreduce.py``: rank 0's median latency
    per size (the best round) for each system that ran, and the bus bandwidth it gives."""
    names = {"spark_hvd": "spark_hvd", "mpi": "Open MPI", "gloo": "gloo"}
    systems = {names.get(s, s): r for s, r in run["results"].items()
               if r.get("sizes") and not r.get("skipped")}
    sizes = sorted({int(n) for r in systems.values() for n in r["sizes"]})
    ranks = 2

    def median_us(r, n):
        rec = (r["sizes"].get(str(n)) or {}).get("0")
        return None if not rec else round(rec["median_s"] * 1e6, 3)

    latency = {s: [median_us(r, n) for n in sizes] for s, r in systems.items()}
    busbw = {s: [None if us is None else round(n / (us * 1e-6) / 1e9 * 2 * (ranks - 1) / ranks, 6)
                 for n, us in zip(sizes, ys)] for s, ys in latency.items()}
    labels = [f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB" if n >= 2**10
              else f"{n} B" for n in sizes]
    common = {"kind": "line", "x_label": "message size", "log_x": True, "log_y": True,
              "x": sizes, "x_tick_labels": labels}
    return {"benchmark": "benchmarks/allreduce.py", "command": "benchmarks/allreduce.py",
            "machine": run.get("host", ""), "date": run.get("started", ""),
            "commit": run.get("source") or "",
            "figures": [dict(common, name="allreduce-latency", series=latency,
                             title="float32 allreduce latency, 2 ranks on one host",
                             y_label="latency (µs, median, best round)"),
                        dict(common, name="allreduce-busbw", series=busbw,
                             title="float32 allreduce bus bandwidth, 2 ranks on one host",
                             y_label="bus bandwidth (GB/s)")]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the PNGs")
    p.add_argument("--results", default=RESULTS, help="folder of the results files")
    p.add_argument("--from-allreduce", metavar="FILE",
                   help="allreduce.py --json output to turn into a results file (--into)")
    p.add_argument("--into", metavar="FILE", help="with --from-allreduce: where to write it")
    args = p.parse_args(argv)
    if args.from_allreduce:
        with open(args.from_allreduce) as f:
            results = from_allreduce(json.load(f))
        into = args.into or os.path.join(args.results, "allreduce.json")
        with open(into, "w") as f:
            json.dump(results, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"results: {into}")
    for path in draw_all(args.out, args.results):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
