"""The code blocks of the Markdown pages (``docs/**/*.md`` and the README), and what the tests do
with each (``tests/test_docs_snippets.py``).

Every fenced block names its language. A block in a code language (python, bash, sh) says on the
line before it, in a MyST comment (not shown on the site; in the README, which GitHub renders
too, an HTML comment ``<!-- test: ... -->``), how it is tested:

    % test: run [np=N] [setup=NAME] [timeout=S] [slow]
        Python: run it (with ``np=N``: under ``spark-hvd-run -np N``); ``setup=NAME`` puts
        ``tests/docs/setups/NAME.py`` before it (the toy model or data the page leaves out).
    % test: shell [timeout=S] [slow]
        bash / sh: run it with bash in the repository, ``.venv/bin`` first on PATH.
    % test: skip REASON
        not run, for the reason given (several machines, a GPU, a cluster). A skipped Python
        block is still compiled, and every ``spark_hvd`` name it uses must exist.

Blocks in other languages (``text`` for output, ``csv``, ``json``, ...) are not code and need no
comment. A block with no language, or a code block without a comment, fails the tests.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

CODE_LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell",
                  "shell": "shell"}
OUTPUT_LANGUAGES = {"text", "json", "yaml", "ini", "toml"}
ACTIONS = {"run", "shell", "skip"}

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
# "% test: ..." (a MyST comment), or "<!-- test: ... -->" in the README, which GitHub shows too.
_MARK = re.compile(r"^(?:%|<!--)\s*test:\s*(?P<action>\w+)\s*(?P<rest>.*?)\s*(?:-->)?$")


@dataclasses.dataclass
class Snippet:
    path: Path
    line: int            # of the opening fence, 1-based
    language: str        # as written after the fence ("" when none)
    code: str
    action: str | None   # run / shell / skip, None without a comment
    options: dict
    reason: str = ""

    @property
    def kind(self) -> str:
        """``python``, ``shell``, ``output`` (not code) or ``unknown``."""
        if self.language in CODE_LANGUAGES:
            return CODE_LANGUAGES[self.language]
        if self.language in OUTPUT_LANGUAGES:
            return "output"
        return "unknown"

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    def problems(self) -> list[str]:
        """What is wrong with how the block is written or marked ([] when nothing)."""
        where = f"{self.path}:{self.line}"
        if not self.language:
            return [f"{where}: the block names no language (python, bash, text, ...)"]
        if self.kind == "unknown":
            return [f"{where}: unknown language {self.language!r}"]
        if self.kind == "output":
            return [f"{where}: an output block has a test comment"] if self.action else []
        if self.action is None:
            return [f"{where}: a {self.language} block needs a '% test: ...' comment on the "
                    "line before it (run, shell or skip REASON)"]
        if self.action not in ACTIONS:
            return [f"{where}: unknown test action {self.action!r}"]
        if self.action == "skip" and not self.reason:
            return [f"{where}: '% test: skip' needs the reason"]
        if self.action == "run" and self.kind != "python":
            return [f"{where}: 'run' is for python blocks; use 'shell'"]
        if self.action == "shell" and self.kind != "shell":
            return [f"{where}: 'shell' is for bash / sh blocks; use 'run'"]
        return []


def _options(text: str) -> dict:
    options = {}
    for word in text.split():
        key, _, value = word.partition("=")
        options[key] = value if value else True
    return options


def snippets(path: Path) -> list[Snippet]:
    """The top-level fenced blocks of a Markdown file, directives (```{toctree}) excepted."""
    lines = Path(path).read_text().split("\n")
    found = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.group("fence"), match.group("info").strip()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if not info.startswith("{"):
            previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            mark = _MARK.match(previous.strip())
            action, options, reason = None, {}, ""
            if mark:
                action = mark.group("action")
                if action == "skip":
                    reason = mark.group("rest").strip()
                else:
                    options = _options(mark.group("rest"))
            found.append(Snippet(Path(path), i + 1, info.split()[0] if info else "",
                                 "\n".join(lines[i + 1:end]) + "\n", action, options, reason))
        i = end + 1
    return found


def stray_marks(path: Path) -> list[str]:
    """Test comments that no code block follows (a marker must stand right before its block)."""
    lines = Path(path).read_text().split("\n")
    used = set()
    for snippet in snippets(path):
        k = snippet.line - 2
        while k >= 0 and not lines[k].strip():
            k -= 1
        used.add(k)
    return [f"{path}:{i + 1}: a test comment that no code block follows"
            for i, line in enumerate(lines) if _MARK.match(line.strip()) and i not in used]


def pages(repo: Path) -> list[Path]:
    """The Markdown the snippets come from: the README and docs/ (less what the build writes)."""
    docs = repo / "docs"
    generated = {docs / "api", docs / "_generated", docs / "_build"}
    return [repo / "README.md"] + sorted(
        p for p in docs.rglob("*.md") if not any(g in p.parents for g in generated))


def all_snippets(repo: Path) -> list[Snippet]:
    return [s for page in pages(repo) for s in snippets(page)]


# -- the names a Python block uses ------------------------------------------------------------

def missing_names(code: str) -> list[str]:
    """The ``spark_hvd`` names a block imports or uses that do not exist: ``from spark_hvd.x
    import y`` and ``alias.attr[.attr]`` where ``alias`` is an imported spark_hvd module."""
    tree = ast.parse(code)
    aliases, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name.split(".")[0] == "spark_hvd":
                    try:
                        module = importlib.import_module(name.name)
                    except ImportError:
                        missing.append(name.name)
                        continue
                    if name.asname:
                        aliases[name.asname] = module
                    else:
                        aliases["spark_hvd"] = importlib.import_module("spark_hvd")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spark_hvd"):
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                missing.append(node.module)
                continue
            for name in node.names:
                if not hasattr(module, name.name):
                    try:
                        importlib.import_module(f"{node.module}.{name.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{name.name}")
                        continue
                aliases[name.asname or name.name] = getattr(module, name.name, None) or \
                    importlib.import_module(f"{node.module}.{name.name}")
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not chain or not isinstance(node, ast.Name) or node.id not in aliases:
            continue
        obj = aliases[node.id]
        if not (hasattr(obj, "__name__") and str(getattr(obj, "__name__", "")).startswith(
                "spark_hvd")) and not isinstance(obj, type):
            continue
        path = node.id
        for attr in reversed(chain):
            path += "." + attr
            if not hasattr(obj, attr):
                missing.append(path)
                break
            obj = getattr(obj, attr)
            if not (isinstance(obj, type) or hasattr(obj, "__path__")
                    or type(obj).__name__ == "module"):
                break  # an attribute of a value (hvd.size().bit_length) is not ours to check
    return sorted(set(missing))
