"""Sphinx extension of the spark_hvd documentation.

- Writes the pages generated from the code before the build reads any page: the API reference
  (``reference.py``, into ``docs/api/``) and the tables of settings, Horovod's variables and the
  launcher's flags (``generated.py``, into ``docs/_generated/``).
- Reads docstrings as they are written for ``help()``: an indented block after a paragraph (and
  a blank line) is a code example, so it becomes a literal block, as if the paragraph ended in
  ``::``.
- Fails the build (a warning, and the build runs with -W) for every public function or class
  without a docstring (``api.py``), and for every docstring that does not render as written:
  an indented block that is not a literal block (a code example after a paragraph that does not
  end in ``::`` becomes a block quote whose lines run together).
"""

from __future__ import annotations

from docutils import nodes
from sphinx.util import logging

from . import api, generated, reference

logger = logging.getLogger(__name__)


def _write_generated(app):
    generated.write_all(app.srcdir)
    reference.write_all(app.srcdir)
    for name in api.undocumented():
        logger.warning("public API without a docstring: %s", name, type="spark_hvd",
                       subtype="docstring")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _examples_as_literal_blocks(app, what, name, obj, options, lines):
    """Ends with `` ::`` each paragraph that a blank line and a more indented block follow, so
    that block renders as code (`` ::`` after a space is not shown)."""
    for i in range(1, len(lines) - 1):
        before, blank, after = lines[i - 1], lines[i], lines[i + 1]
        if blank.strip() or not before.strip() or not after.strip():
            continue
        if _indent(after) <= _indent(before) or before.rstrip().endswith("::"):
            continue
        if before.lstrip().startswith(("..", ":", "- ", "* ")) or before.rstrip().endswith(":"):
            continue  # directives, fields, list items, section headers (Args:) keep their meaning
        lines[i - 1] = before.rstrip() + " ::"


def _check_docstrings(app, doctree):
    for quote in doctree.findall(nodes.block_quote):
        source = quote.source or ""
        if "docstring of" not in source:
            continue
        logger.warning("an indented block in this docstring is not a literal block: end the "
                       "paragraph before it with '::' (%s)", quote.astext()[:60].strip(),
                       location=quote, type="spark_hvd", subtype="docstring")


def _module_of(target: str) -> str:
    """The longest importable prefix of a dotted name."""
    import importlib
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:end]))
            return ".".join(parts[:end])
        except ImportError:
            continue
    return ""


def _resolve_alias(app, env, node, contnode):
    """A reference to a name that re-exports an object documented elsewhere resolves to that
    entry (``spark_hvd.torch.init`` -> ``spark_hvd.common.init``)."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    module = node.get("py:module")
    for name in (target, f"{module}.{target}" if module else None):
        documented = reference.ALIASES.get(name) if name else None
        if documented:
            return env.domains["py"].resolve_xref(env, node["refdoc"], app.builder,
                                                  node["reftype"], documented, node, contnode)
    return None


def _internal_reference(app, domain, node):
    """True (no warning) for a reference into a spark_hvd module the reference does not
    document (private modules, the core's internals): docstrings may name them for developers,
    and they render as plain code."""
    target = node.get("reftarget", "")
    if not target.startswith("spark_hvd."):
        return None
    return True if _module_of(target) not in api.PUBLIC_MODULES else None


def setup(app):
    app.connect("missing-reference", _resolve_alias)
    app.connect("warn-missing-reference", _internal_reference)
    app.connect("builder-inited", _write_generated)
    app.connect("doctree-read", _check_docstrings)
    # Before napoleon (priority 500) turns Google-style sections into fields.
    app.connect("autodoc-process-docstring", _examples_as_literal_blocks, priority=400)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
