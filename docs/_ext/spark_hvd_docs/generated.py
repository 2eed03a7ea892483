"""The pages generated from the code, as Markdown: the configuration reference (from
``spark_hvd.common._config.SETTINGS``), Horovod's variables (``HOROVOD_VARIABLES``) and the
launcher's flags (``spark-hvd-run``'s argument parser). The build writes them into
``docs/_generated/`` and pages include them, so none of these facts is written by hand.
"""

from __future__ import annotations

import argparse
import os

GENERATED = "_generated"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _link(see: str | None, page: str) -> str:
    """A Markdown link from ``page`` (relative to docs/) to ``see`` (the same)."""
    if not see:
        return ""
    target, _, anchor = see.partition("#")
    rel = os.path.relpath(target, os.path.dirname(page) or ".")
    return f" ([more]({rel}{'#' + anchor if anchor else ''}))"


def settings_tables(page: str = "reference/configuration.md") -> str:
    """One table per section of :data:`SETTINGS`: variable, default, meaning."""
    from spark_hvd.common import _config

    sections: dict[str, list[str]] = {}
    for name, setting in _config.SETTINGS.items():
        rows = sections.setdefault(setting.section, [])
        horovod = f"<br>`HOROVOD_{name}`" if setting.horovod else ""
        default = setting.shown_default()
        rows.append(f"| `SPARK_HVD_{name}`{horovod} | {_cell(f'`{default}`' if default else '')} "
                    f"| {_cell(setting.meaning)}{_link(setting.see, page)} |")
    out = []
    for section, rows in sections.items():
        out += [f"## {section[0].upper() + section[1:]}", "",
                "| Variable | Default | Meaning |", "| --- | --- | --- |", *rows, ""]
    return "\n".join(out)


def horovod_variables_table() -> str:
    """Every ``HOROVOD_*`` variable Horovod documents, what spark_hvd does with it and why."""
    from spark_hvd.common import _config

    order = {_config.HONOURED: 0, _config.BOOTSTRAP: 1, _config.WARNED: 2, _config.NO_EFFECT: 3}
    rows = sorted(_config.HOROVOD_VARIABLES.items(), key=lambda kv: (order[kv[1].status], kv[0]))
    out = ["| Variable | What spark_hvd does | Why / meaning |", "| --- | --- | --- |"]
    for name, var in rows:
        out.append(f"| `HOROVOD_{name}` | {var.status} | {_cell(var.reason)} |")
    return "\n".join(out) + "\n"


def _flag_row(action: argparse.Action) -> str | None:
    if not action.option_strings or action.help in (None, argparse.SUPPRESS):
        return None
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs not in (0, None) or action.metavar:
        metavar = action.metavar or action.dest.upper()
        if isinstance(metavar, tuple):
            metavar = " ".join(metavar)
        names += f" `{metavar}`"
    elif action.const is None and action.nargs is None and not isinstance(
            action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                     argparse._StoreConstAction, argparse.BooleanOptionalAction)):
        names += f" `{action.dest.upper()}`"
    return f"| {names} | {_cell(action.help)} |"


def launcher_flags() -> str:
    """``spark-hvd-run``'s flags, one table per group of its argument parser."""
    from spark_hvd.runner import launch

    parser = launch.build_parser()
    out = []
    for group in parser._action_groups:  # argparse has no public API for the groups
        rows = [row for row in map(_flag_row, group._group_actions) if row]
        if not rows:
            continue
        title = group.title or "options"
        out += [f"## {title[0].upper() + title[1:]}", "", "| Flag | Meaning |", "| --- | --- |",
                *rows, ""]
    return "\n".join(out)


def _benchmarks():
    """``benchmarks/plots.py`` as a module (benchmarks/ is not a package)."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "plots.py")
    spec = importlib.util.spec_from_file_location("spark_hvd_bench_plots", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_figures(folder: str) -> dict[str, str]:
    """Draws every figure of ``benchmarks/results/*.json`` into ``folder/figures`` and returns
    ``{results name: Markdown}``: each figure with what was run, where, when and at which
    commit."""
    plots = _benchmarks()
    out = {}
    for name, results in plots.load().items():
        lines = []
        for figure in results["figures"]:
            plots.draw(figure, os.path.join(folder, "figures", figure["name"] + ".png"))
            lines += [f"![{figure['title']}](figures/{figure['name']}.png)", ""]
        lines += [f"*{results['benchmark']}* at `{results['commit']}`, {results['date']}; "
                  f"{results['machine']}. Command: `{results['command']}`.", ""]
        out[name] = "\n".join(lines)
    return out


PAGES = {
    "settings.md": settings_tables,
    "horovod_variables.md": horovod_variables_table,
    "launcher_flags.md": launcher_flags,
}


def write_all(docs_dir: str) -> list[str]:
    """Writes every generated page into ``docs_dir/_generated``; returns their paths. A page
    whose text did not change is left alone (Sphinx then does not rebuild its includers)."""
    folder = os.path.join(docs_dir, GENERATED)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, make in PAGES.items():
        path = os.path.join(folder, name)
        text = "<!-- generated from the code by docs/_ext/spark_hvd_docs; do not edit -->\n\n" \
            + make()
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            with open(path, "w") as f:
                f.write(text)
        paths.append(path)
    for name, text in benchmark_figures(folder).items():
        path = os.path.join(folder, f"benchmark_{name}.md")
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            with open(path, "w") as f:
                f.write(text)
        paths.append(path)
    return paths
