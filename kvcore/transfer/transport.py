"""Which UCX transport carries a NixlAgent's transfers to a peer, inferred from the memory on
both sides, where the peer runs and ``UCX_TLS`` (NIXL does not say which lane UCX picked)."""

from __future__ import annotations

import os
import socket
from typing import Any

import attrs

from kvcore.transfer.nixl_api import mem_type

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


def pick(candidates: tuple[str, ...], tls: str | None) -> str:
    """The first of ``candidates`` that ``UCX_TLS`` allows (``tcp`` when none is)."""
    if not tls or tls.strip() in ("all", "^"):
        return candidates[0]
    names = set()
    for name in tls.removeprefix("^").split(","):
        names.update(_ALIASES.get(name.strip(), (name.strip(),)))
    negated = tls.startswith("^")
    return next((name for name in candidates if (name in names) != negated), "tcp")


def transport_between(local: Any, remote: Any, peer_info: dict[str, Any], tls: str | None = None) -> Transport:
    """The transport UCX uses between caches ``local`` and ``remote`` (descriptors), inferred:
    VRAM to VRAM is ``cuda_ipc`` between processes, ``cuda_copy`` within one; VRAM to host
    memory ``cuda_copy`` (staged through ``cma``/``tcp`` for another process); host memory
    ``cma``; another host ``rc``; ``tcp`` where ``UCX_TLS`` leaves none of these."""
    tls = os.environ.get("UCX_TLS") if tls is None else tls
    here = process_info()
    same_host = peer_info.get("host") == here["host"]
    same_process = same_host and peer_info.get("pid") == here["pid"]
    mine, theirs = (mem_type(d.allocations[0].device)[0] for d in (local, remote))
    vram = "VRAM" in (mine, theirs)
    if not same_host:
        candidates = ("rc", "dc", "tcp")
    elif same_process and vram:
        candidates = ("cuda_copy",)
    elif vram:
        candidates = ("cuda_ipc", "tcp") if mine == theirs else ("cma", "tcp")
    else:
        candidates = ("cma", "posix", "sysv", "tcp")
    name = pick(candidates, tls)
    if vram and same_host and name in ("cma", "tcp", "posix", "sysv"):
        name = f"cuda_copy+{name}"  # device memory staged through host memory
    where = "one process" if same_process else "two processes on one host"
    where = where if same_host else "two hosts"
    detail = f"{mine} here, {theirs} on the peer, {where}" + (f", UCX_TLS={tls}" if tls else "")
    return Transport(name, "inferred", detail)
