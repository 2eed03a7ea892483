"""The native core's folders form layers: a file includes headers of its own folder and of the
folders below it, never of one above or beside it (docs/architecture.md). The framework
libraries (native/tensorflow, native/torch) see the C ABI only. A layer that starts to depend
on a higher one (the algorithms on the controller's messages, MPI on the algorithms, the GPU path
on the engine) fails here, naming the file and the include.
"""

from __future__ import annotations

import re
from pathlib import Path

NATIVE = Path(__file__).resolve().parent.parent / "native"

# Bottom to top. Folders of one level are siblings: neither includes the other.
LAYERS = [
    ["include"],                # the C ABI
    ["common"],                 # types, errors, logging, HMAC
    ["kernels"],                # element-wise reductions
    ["transport", "timeline"],  # links, the communicator; the Chrome-trace timeline
    ["mpi"],                    # MPI as a data path (the dispatcher's MPI rows call it)
    ["algorithms", "controller"],  # the dispatcher and the algorithms; negotiation
    ["gpu"],                    # CUDA tensors: NCCL and host staging
    ["engine"],                 # the background engine
    ["."],                      # c_api.cc, which defines the C ABI
]
LEVEL = {folder: i for i, level in enumerate(LAYERS) for folder in level}

# Includes across layers that are allowed, and why.
EXCEPTIONS = {
    # The engine hands the GPU path its entries (the request, the caller's buffers, the handle):
    # a data structure in a header of its own, not the engine.
    ("gpu", "engine/entry.h"),
}

# Consumers of the core that must see nothing but the C ABI.
ABI_ONLY = ("tensorflow", "torch")

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _folder(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else "."


def _violations(root: Path) -> list[str]:
    """Every include under ``root`` that breaks the layering, as a readable line."""
    wrong = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cc") or not path.is_file():
            continue
        src = _folder(path, root)
        for include in INCLUDE.findall(path.read_text()):
            target = (path.parent / include).resolve()
            if not target.is_relative_to(root.resolve()):
                continue  # a system or framework header
            dst = _folder(target, root.resolve())
            rel = str(target.relative_to(root.resolve()))
            here = f"{path.relative_to(root)} ({src}) includes {rel} ({dst})"
            if src == dst or src == "tests":
                continue
            if src in ABI_ONLY:
                if dst != "include":
                    wrong.append(f"{here}: it may use the C ABI only")
            elif dst not in LEVEL or src not in LEVEL:
                wrong.append(f"{here}: a folder with no layer in this test")
            elif (src, rel) not in EXCEPTIONS and LEVEL[dst] >= LEVEL[src]:
                wrong.append(f"{here}, which is not below it")
    return wrong


def test_every_folder_has_a_layer():
    folders = {_folder(p, NATIVE) for p in NATIVE.rglob("*") if p.suffix in (".h", ".cc")}
    missing = folders - set(LEVEL) - set(ABI_ONLY) - {"tests"}
    assert not missing, f"native folders with no layer in this test: {sorted(missing)}"


def test_includes_point_down():
    wrong = _violations(NATIVE)
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_upward_and_sideways_includes(tmp_path):
    for folder, text in {
        "common/types.h": '#include "../engine/engine.h"\n',          # up
        "algorithms/dispatch.h": '#include "../controller/message.h"\n',  # beside
        "torch/alloc.cc": '#include "../common/types.h"\n',            # past the C ABI
        "engine/engine.h": '#include "../common/types.h"\n',           # down: fine
        "controller/message.h": "", "include/spark_hvd.h": "",
    }.items():
        (tmp_path / folder).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / folder).write_text(text)
    wrong = _violations(tmp_path)
    assert len(wrong) == 3, wrong
    assert any(w.startswith("common/types.h") for w in wrong)
    assert any(w.startswith("algorithms/dispatch.h") for w in wrong)
    assert any(w.startswith("torch/alloc.cc") and "C ABI only" in w for w in wrong)
