"""Write a smaller copy of a NIXL wheel that keeps only what kvcore's NixlAgent uses.

The nixl-cu12 / nixl-cu13 wheels (about 60 MB) carry every NIXL backend plugin
(GDS, object stores, libfabric, ...) and the NIXL-EP extension; kvcore uses the
UCX backend alone. This keeps the Python package, the UCX plugin, UCX's CUDA
(cuda_copy, cuda_ipc) and CMA transports and every shared library those need
(followed through ELF NEEDED entries with ``readelf``), drops the rest and
writes a wheel with a fresh RECORD, small enough to carry to the lent GPU
machine (64 MiB per call).

    python scripts/trim_nixl_wheel.py nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl .whl/
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import PurePosixPath

from _wheel import write_kept  # NOTE: scripts/ is on sys.path when a script runs

_UCX_MODULES = ("libuct_cuda.so", "libucm_cuda.so", "libuct_cma.so")


def _needed(data: bytes, tmp: str) -> list[str]:
    with open(tmp, "wb") as f:
        f.write(data)
    out = subprocess.run(["readelf", "-d", tmp], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\).*\[(.+)\]", out)


def _is_elf(name: str) -> bool:
    return ".so" in PurePosixPath(name).name


def trim(src: str, out_dir: str) -> str:
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        pkg = next(n.split("/")[0] for n in names if n.endswith("/_api.py"))
        by_base: dict[str, list[str]] = {}
        for n in names:
            by_base.setdefault(PurePosixPath(n).name, []).append(n)
        roots = [n for n in names if n.startswith(f"{pkg}/") and _is_elf(n)]
        roots += [n for n in names if PurePosixPath(n).name == "libplugin_UCX.so"]
        roots += [n for n in names if "/ucx/" in n and PurePosixPath(n).name.startswith(_UCX_MODULES)]
        keep, todo = set(), list(roots)
        while todo:
            n = todo.pop()
            if n in keep:
                continue
            keep.add(n)
            todo += [m for lib in _needed(zin.read(n), "/tmp/_trim_nixl.so") for m in by_base.get(lib, [])]
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        kept = [n for n in names
                if not n.endswith("/") and not n.endswith("RECORD")
                and (n in keep or not _is_elf(n))
                and not n.startswith((f"{pkg.replace('nixl_', 'nixl_ep_')}/", f"{dist_info[:-10]}.data/"))
                and not n.startswith(f"{pkg}.scripts/")]
        dest = f"{out_dir.rstrip('/')}/{PurePosixPath(src).name}"
        return write_kept(zin, kept, dist_info, dest)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(trim(sys.argv[1], sys.argv[2]))
