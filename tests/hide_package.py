"""Runs Python code in a subprocess in which a package cannot be imported (as if it were not
installed), for the tests of optional dependencies' errors."""

import subprocess
import sys
import textwrap

_HIDE = """
import sys

class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == {package!r} or name.startswith({package!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Hide())
"""


def run_without(package: str, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` run by this Python with ``package`` hidden; stdout and stderr captured."""
    script = _HIDE.format(package=package) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout)
