"""What UCX itself says it chose, from a log written with UCX_LOG_LEVEL=info and UCX_PROTO_INFO=y.

Prints, without timestamps and once each: the lanes of every endpoint configuration
(``ucp_worker.c ... cfg#N rma_bw(...) am(...)``), every protocol table UCX printed (its
title, such as "remote memory write by ucp_put* from cuda memory to cuda", and its rows:
message-size range, protocol, transport/device), and UCX's warnings and errors (a CUDA
context it could not use, a peer it cannot reach, NVLink absent...). Active-message tables
(control traffic) are left out.

    python scripts/gpu_nixl_ucx_evidence.py OUT/ucx_two_proc.log
"""

from __future__ import annotations

import re
import sys

_PREFIX = re.compile(r"^\[\d+\.\d+\] \[[^\]]+\]\s*")
_NOTEWORTHY = re.compile(r"WARN|ERROR|context|cannot reach|unreachable|nvlink|no route|not supported", re.I)


def evidence(lines: list[str]) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    table: list[str] = []

    def emit(text: str) -> None:
        if " :: active message" in text:  # control traffic; the data moves by remote memory access
            return
        if text not in seen:
            seen.add(text)
            out.append(text)

    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip("\n"))
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 1 and "cfg#" in cells[0] and table:  # the next table's title
                emit(_table_line(table))
                table = []
            if cells and cells[0] not in ("Range", ""):
                table.append(" | ".join(c for c in cells if c))
            continue
        if line.startswith("+"):
            continue
        if table:  # a table ended: its first rows are its title, the rest its protocols
            emit(_table_line(table))
            table = []
        if "cfg#" in line and "ucp_worker" in line:
            emit(re.sub(r"^.*?UCX\s+\w+\s+", "lanes: ", line))
        elif "UCX" in line and _NOTEWORTHY.search(line):
            emit(re.sub(r"^\s*\S+:\d+\s+", "", line))
    if table:
        emit(_table_line(table))
    return out


def _table_line(table: list[str]) -> str:
    """``endpoint cfg#N :: operation :: range | protocol | transport ;; ...``."""
    return " :: ".join(table[:2]) + " :: " + " ;; ".join(table[2:])


def main() -> None:
    for path in sys.argv[1:]:
        try:
            with open(path, errors="replace") as f:
                found = evidence(f.readlines())
        except OSError as exc:
            print(f"{path}: {exc}")
            continue
        print(f"--- {path}: {len(found)} distinct UCX lines")
        for text in found:
            print(" ", text[:300])


if __name__ == "__main__":
    main()
