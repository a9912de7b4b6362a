"""Write a smaller copy of a FlashInfer wheel that keeps what its JIT paged attention needs.

``flashinfer-python`` (about 62 MB) carries the CUDA sources of every kernel
family it can JIT-compile (MoE, GEMM, MLA, ...) under ``flashinfer/data/csrc``
and experimental kernel trees beside the Python package. kvcore-flashinfer
uses the paged decode and prefill wrappers, whose JIT build reads the
top-level ``data/csrc`` files (bindings and jinja templates) and the header
trees. This keeps every ``.py`` file, the ``.dist-info``, ``data/include``,
``data/spdlog``, ``data/cutlass``, ``data/cccl`` and only the top-level files
of ``data/csrc``, and writes a wheel with a fresh RECORD (about 31 MB), small
enough to carry to the lent GPU machine (64 MiB per call).

    python scripts/trim_flashinfer_wheel.py flashinfer_python-0.7.2.post1-py3-none-any.whl .whl/
"""

from __future__ import annotations

import sys
import zipfile

from _wheel import write_kept  # NOTE: scripts/ is on sys.path when a script runs

#: Trees under ``flashinfer/data`` kept whole.
_DATA_TREES = ("include/", "spdlog/", "cutlass/", "cccl/")


def keeps(name: str) -> bool:
    """Whether the wheel member ``name`` belongs in the trimmed wheel (RECORD is rewritten)."""
    if name.endswith("/") or name.endswith(".dist-info/RECORD"):
        return False
    top = name.split("/")[0]
    if top.endswith(".dist-info") or name.endswith(".py"):
        return True
    if not name.startswith("flashinfer/data/"):
        return False
    rest = name[len("flashinfer/data/"):]
    if rest.startswith(_DATA_TREES):
        return True
    return rest.startswith("csrc/") and "/" not in rest[len("csrc/"):]


def trim(src: str, out_dir: str) -> str:
    """Write the trimmed copy of wheel ``src`` into ``out_dir``; returns its path."""
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        dest = f"{out_dir.rstrip('/')}/{src.rsplit('/', 1)[-1]}"
        return write_kept(zin, [n for n in names if keeps(n)], dist_info, dest)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(trim(sys.argv[1], sys.argv[2]))
