"""Worker processes of the two-process NIXL tests (spawned; metadata travels over a Pipe)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from _transfer_caches import _SAME_SIZE_INT, block_rows, make_cache, raw_buffer  # noqa: E402


def fill(kv, seed: int) -> None:
    raw = raw_buffer(kv)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8))


def rows(kv, ids):
    """Each layer's rows of ``ids`` as raw integers (comparable bit for bit)."""
    return {
        name: view.view(_SAME_SIZE_INT[view.element_size()])[block_rows(kv, name, ids)].clone()
        for name, view in kv.kv_caches.items()
    }


def peer(conn, kind: str, layout: str, num_blocks: int, seed: int) -> None:
    """Serve one KV cache: send metadata, connect back, answer 'rows' and 'raw' requests."""
    from kvcore.transfer import NixlAgent

    kv = make_cache(kind, layout, num_blocks=num_blocks)
    fill(kv, seed)
    agent = NixlAgent("peer", kv)
    conn.send(agent.metadata())
    agent.connect(conn.recv())
    while True:
        request, arg = conn.recv()
        if request == "rows":
            conn.send(rows(kv, arg))
        elif request == "raw":
            conn.send(raw_buffer(kv).clone())
        elif request == "read":  # pull blocks from the other side: (remote ids, local ids)
            agent.read_blocks(agent.peers[0], *arg).wait(timeout=30)
            conn.send("done")
        else:
            break
    agent.close()
    conn.send("closed")
