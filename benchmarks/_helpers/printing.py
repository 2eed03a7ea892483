"""How the benchmarks read sizes and print results: sizes in binary units (``16MiB``),
bandwidths, Markdown tables for stdout, progress lines for stderr. Shared by the scripts of
``benchmarks/``."""

import argparse
import sys

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def parse_size(text):
    """'4', '4B', '1KiB', '16MiB', '1K', '1M', '1G' -> bytes (binary units)."""
    t = text.strip().lower().replace("ib", "").rstrip("b")
    mult = 1
    if t and t[-1] in "kmg":
        mult = {"k": KiB, "m": MiB, "g": GiB}[t[-1]]
        t = t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 4B, 1KiB, 16MiB)")
    nbytes = int(value)
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: needs a multiple of 4 bytes (float32)")
    return nbytes


def fmt_size(nbytes):
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_bw(gbs):
    if gbs >= 100:
        return f"{gbs:.0f}"
    if gbs >= 0.01:
        return f"{gbs:.2f}"
    return f"{gbs:.1e}"


def table(headers, rows, align):
    """A Markdown table; ``align`` holds "l" or "r" per column."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    def line(cells):
        out = []
        for c, w, a in zip(cells, widths, align):
            out.append(c.rjust(w) if a == "r" else c.ljust(w))
        return "| " + " | ".join(out) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def log(msg):
    """A progress line, on stderr (stdout is for the report)."""
    print(msg, file=sys.stderr, flush=True)
