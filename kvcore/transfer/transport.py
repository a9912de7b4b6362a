"""Which UCX transport carries a NixlAgent's transfers to a peer (inferred, and said so).

NIXL 1.5 names a transfer's backend (``"UCX"``) but not the lane UCX picked (only UCX's
log does: ``UCX_PROTO_INFO=y``), so kvcore infers it from what decides UCX's choice: the
memory on both sides, where the peer runs (pid and host travel in kvcore's metadata) and
``UCX_TLS``. VRAM to VRAM is ``cuda_ipc`` between two processes of one host, ``cuda_copy``
within one process (``cuda_ipc`` cannot reach it); VRAM to host memory is ``cuda_copy``
(through ``cma``/``tcp`` when another process owns the host memory); host memory on one
host moves by ``cma``; another host means ``rc`` or ``tcp``. Where ``UCX_TLS`` leaves none
of these, ``tcp`` (UCX's fallback). ``scripts/gpu_transfer.sh`` checks this against UCX's log.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import attrs

# UCX_TLS aliases (UCX 1.18+ docs): a name in UCX_TLS that stands for several transports.
_ALIASES = {
    "cuda": ("cuda_copy", "cuda_ipc", "gdr_copy"),
    "sm": ("cma", "knem", "xpmem", "posix", "sysv"),
    "shm": ("cma", "knem", "xpmem", "posix", "sysv"),
    "ib": ("rc", "ud", "dc"),
    "rc_v": ("rc",), "rc_x": ("rc",), "rc_verbs": ("rc",), "rc_mlx5": ("rc",),
}


@attrs.frozen
class Transport:
    """The UCX transport of a peer's transfers: ``name`` (``"cuda_ipc"``...), its source, why."""

    name: str
    source: str
    detail: str

    def __str__(self) -> str:
        return self.name


def process_info() -> dict[str, Any]:
    """What a peer needs to tell where this process runs."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _allowed(tls: str | None) -> tuple[bool, set[str]]:
    """(negated, names) of a UCX_TLS value; ``(True, set())`` allows everything."""
    if not tls or tls.strip() in ("all", "^"):
        return True, set()
    negated = tls.startswith("^")
    names = set()
    for name in tls.removeprefix("^").split(","):
        name = name.strip()
        names.update(_ALIASES.get(name, (name,)))
    return negated, names


def pick(candidates: tuple[str, ...], tls: str | None) -> str:
    """The first of ``candidates`` that ``UCX_TLS`` allows (``tcp`` when none is)."""
    negated, names = _allowed(tls)
    for name in candidates:
        if (name not in names) if negated else (name in names):
            return name
    return "tcp"


def _memory(descriptor: Any) -> str:
    return "VRAM" if descriptor.allocations[0].device.startswith("cuda") else "DRAM"


def transport_between(
    local: Any, remote: Any, peer_info: dict[str, Any], tls: str | None = None
) -> Transport:
    """The transport UCX uses between caches ``local`` and ``remote`` (descriptors), inferred."""
    tls = os.environ.get("UCX_TLS") if tls is None else tls
    here = process_info()
    same_host = peer_info.get("host") == here["host"]
    same_process = same_host and peer_info.get("pid") == here["pid"]
    mine, theirs = _memory(local), _memory(remote)
    where = "two processes on one host" if same_host else "two hosts"
    where = "one process" if same_process else where
    if not same_host:
        candidates = ("rc", "dc", "tcp")
    elif mine == theirs == "VRAM":
        candidates = ("cuda_copy",) if same_process else ("cuda_ipc", "tcp")
    elif "VRAM" in (mine, theirs):
        candidates = ("cuda_copy",) if same_process else ("cma", "tcp")
    else:
        candidates = ("cma", "posix", "sysv", "tcp")
    name = pick(candidates, tls)
    if "VRAM" in (mine, theirs) and name in ("cma", "tcp", "posix", "sysv") and same_host:
        name = f"cuda_copy+{name}"  # device memory staged through host memory
    detail = f"{mine} here, {theirs} on the peer, {where}" + (f", UCX_TLS={tls}" if tls else "")
    return Transport(name, "inferred", detail)
