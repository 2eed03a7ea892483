# The spark_hvd documentation: Sphinx with MyST (pages in Markdown), autodoc (the API reference
# from the docstrings, which are written in reStructuredText) and the furo theme.
# Built strictly by `make docs` (sphinx-build -W -n): any warning, a broken link or reference,
# a page outside the table of contents, a docstring that does not render, fails the build.
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up lines on stderr

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(DOCS, "_ext"))

import spark_hvd  # noqa: E402

project = "spark_hvd"
author = "the spark_hvd developers"
copyright = "the spark_hvd developers"
release = version = spark_hvd.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "spark_hvd_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# _generated/: pages the spark_hvd_docs extension writes from the code, included by others.
exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]

# MyST: GitHub-style heading anchors (links such as gpus.md#gpus-with-spark), ::: fences.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]
myst_links_external_new_tab = False

# Every cross-reference must resolve (references into spark_hvd's internal modules, which the
# reference does not document, are let through by the spark_hvd_docs extension); names from
# other projects (torch, TensorFlow, PySpark,
# the standard library) cannot, without network access for intersphinx.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|tensorflow|tf|keras|pyspark|numpy|np|lightning|pytorch_lightning|"
               r"pyarrow|pandas|fsspec|mlflow|mpi4py|collections|typing|concurrent|"
               r"threading|subprocess|os|io|logging|pathlib|enum|ctypes)(\..*)?"),
    (r"py:(class|obj|data)", r"(optional|callable|iterable|sequence|mapping|any|object|"
                             r"None|bool|int|float|str|bytes|dict|list|tuple|set|type|"
                             r"Exception|ValueError|RuntimeError|TimeoutError|"
                             r"NotImplementedError|KeyboardInterrupt)"),
]

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = True
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_keyword = False

html_theme = "furo"
html_title = f"spark_hvd {release}"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"
html_show_sourcelink = False
html_copy_source = False
pygments_style = "friendly"
pygments_dark_style = "monokai"
