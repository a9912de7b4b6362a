"""Where a NIXL VRAM transfer's time goes (issue #26): two processes on one GPU, 2 MiB blocks.

For each layout and block count, agent ``a`` writes random (odd, never adjacent) blocks into the
peer's same ids, timed five ways in one run:

- ``agent``: ``NixlAgent.write_blocks(...).wait()`` as it is;
- ``split``: the same steps one by one: kvcore's plan, NIXL's ``get_xfer_descs`` (both sides),
  ``initialize_xfer``, then ``transfer`` until DONE (``post``);
- ``prepped``: both sides' descriptor lists prepared once (``prep_xfer_dlist`` on an Nx5 strided
  array: one row per block-pattern run, ``count`` = blocks), then per call ``make_prepped_xfer`` by
  index and ``transfer`` until DONE;
- ``repost``: one prepped handle posted again and again (``post`` only);
- ``consecutive``: blocks ``0..n-1`` through the prepped lists (NIXL merges touching descriptors).

Beside them a device-to-device ``copy_`` of the same bytes. Rows are checked bit for bit.
    python scripts/gpu_nixl_probe.py --json OUT/probe.json [--threads N] [--memory VRAM|VRAM-DRAM]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import numpy as np
import torch

import kvcore.transfer.nixl as knixl
from kvcore_bench.transfer import build_cache
from kvcore_bench.transfer_nixl import ProcessPeer, _same_blocks
from kvcore_bench.transfer_nixl import _fill as fill
from kvcore.transfer import NixlAgent
from kvcore.transfer.pairs import pair_runs
from kvcore.transfer.regions import whole_block_patterns

MODEL = {"layers": 32, "kv_heads": 8, "head_size": 128, "block_size": 16, "dtype": "bfloat16"}


def wait_done(agent, handle) -> None:
    while (state := agent.check_xfer_state(handle)) != "DONE":
        if state == "ERR":
            raise RuntimeError("transfer failed")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def med(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def strided(desc, device_id: int) -> tuple[np.ndarray, int]:
    """Nx5 rows ``(address, length, device, stride, count)``: one per pattern run."""
    pats = whole_block_patterns(desc, tuple(g.group_id for g in desc.groups if g.layers))
    rows = []
    for p in pats:
        base = desc.allocations[p.allocation].base_ptr
        rows += [[base + s, n, device_id, p.block_stride, desc.num_blocks] for s, n in zip(p.starts, p.lengths)]
    return np.array(rows, dtype=np.uint64), len(rows)


def probe(layout: str, counts: list[int], repeats: int, memory: str) -> list[dict]:
    most = max(counts)
    nb = 2 * most + 2
    make = functools.partial(build_cache, MODEL, layout)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # NOTE: on CPU (a dry run) both sides are DRAM
    a = make(nb, dev)
    peer_dev = dev if memory == "VRAM" else "cpu"
    local_kind = "VRAM" if dev == "cuda" else "DRAM"
    remote_kind = "VRAM" if peer_dev == "cuda" else "DRAM"
    peer = ProcessPeer(f"probe-{layout}-b", functools.partial(make, nb, peer_dev))
    agent = NixlAgent(f"probe-{layout}-a", a)
    name = agent.connect(peer.metadata())
    peer.connect(agent.metadata())
    raw = agent._agent
    remote = agent._peers[name].descriptor
    t0 = time.perf_counter()
    local_rows, runs = strided(agent.descriptor, 0)
    remote_rows, _ = strided(remote, 0)
    lh = raw.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, local_kind)
    rh = raw.prep_xfer_dlist(name, remote_rows, remote_kind)
    prep_ms = (time.perf_counter() - t0) * 1e3
    out = []
    gen = torch.Generator().manual_seed(0)
    for n in counts:
        fill(a, 10 + n)
        ids = (torch.randperm(most, generator=gen)[:n] * 2 + 1).tolist()
        idx = np.array([r * nb + b for r in range(runs) for b in ids], dtype=np.int32)
        block_bytes = sum(L.block_bytes for g in agent.descriptor.groups for L in g.layers)
        nbytes = n * block_bytes
        row = {"layout": layout, "memory": memory, "blocks": n, "runs_per_block": runs, "MiB": nbytes / 2**20,
               "prep_ms_once": prep_ms}
        row["agent_us"] = med(lambda: agent.write_blocks(name, ids, ids).wait(timeout=60), repeats)

        def split():
            t = [time.perf_counter()]
            groups = (0,)
            plan = pair_runs(whole_block_patterns(agent.descriptor, groups), torch.tensor(ids),
                             whole_block_patterns(remote, groups), torch.tensor(ids))
            t.append(time.perf_counter())
            arrays = knixl.xfer_arrays(plan, agent.descriptor, remote)
            loc = raw.get_xfer_descs(arrays[0], local_kind)
            far = raw.get_xfer_descs(arrays[1], remote_kind)
            t.append(time.perf_counter())
            h = raw.initialize_xfer("WRITE", loc, far, name)
            t.append(time.perf_counter())
            raw.transfer(h)
            wait_done(raw, h)
            t.append(time.perf_counter())
            raw.release_xfer_handle(h)
            return [(t[i + 1] - t[i]) * 1e6 for i in range(4)]

        split()
        parts = [split() for _ in range(repeats)]
        for k, key in enumerate(("plan", "descs", "init", "post")):
            row[f"split_{key}_us"] = statistics.median(p[k] for p in parts)

        def prepped(indices):
            t = [time.perf_counter()]
            h = raw.make_prepped_xfer("WRITE", lh, indices, rh, indices)
            t.append(time.perf_counter())
            raw.transfer(h)
            wait_done(raw, h)
            t.append(time.perf_counter())
            raw.release_xfer_handle(h)
            return [(t[i + 1] - t[i]) * 1e6 for i in range(2)]

        prepped(idx)
        parts = [prepped(idx) for _ in range(repeats)]
        row["prepped_make_us"] = statistics.median(p[0] for p in parts)
        row["prepped_post_us"] = statistics.median(p[1] for p in parts)
        # exactness of the prepped write: read back through the agent into spare blocks
        fill(a, 99 + n)
        sync()  # NOTE: UCX copies on its own streams: the fill must have landed first
        prepped(idx)
        spare = [b + 1 for b in ids]
        agent.read_blocks(name, ids, spare).wait(timeout=60)
        row["prepped_exact"] = _same_blocks(a, ids, spare)
        h = raw.make_prepped_xfer("WRITE", lh, idx, rh, idx)

        def repost():
            raw.transfer(h)
            wait_done(raw, h)

        row["repost_us"] = med(repost, repeats)

        def split_post(k: int):
            parts = np.array_split(np.arange(len(idx)), min(k, len(idx)))
            hs = [raw.make_prepped_xfer("WRITE", lh, idx[p], rh, idx[p]) for p in parts]
            t0 = time.perf_counter()
            for one in hs:
                raw.transfer(one)
            for one in hs:
                wait_done(raw, one)
            t = (time.perf_counter() - t0) * 1e6
            for one in hs:
                raw.release_xfer_handle(one)
            return t

        for k in (4, 16):
            split_post(k)
            row[f"split{k}_post_us"] = statistics.median(split_post(k) for _ in range(repeats))
        raw.release_xfer_handle(h)
        cidx = np.array([r * nb + b for r in range(runs) for b in range(n)], dtype=np.int32)
        prepped(cidx)
        row["consecutive_post_us"] = statistics.median(prepped(cidx)[1] for _ in range(repeats))
        src = torch.empty(nbytes, dtype=torch.int8, device=dev)
        pin = dev == "cuda" and memory != "VRAM"
        dst = torch.empty(nbytes, dtype=torch.int8, pin_memory=True) if pin else torch.empty_like(src)
        row["ref_copy_us"] = med(lambda: dst.copy_(src, non_blocking=True), repeats)
        for key in ("agent_us", "split_post_us", "prepped_post_us", "repost_us", "consecutive_post_us",
                    "split4_post_us", "split16_post_us"):
            row[key.replace("_us", "_gbps")] = nbytes / row[key] / 1e3
        row["ref_gbps"] = nbytes / row["ref_copy_us"] / 1e3
        row["descs_per_call"] = len(idx)
        out.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    agent.close()
    peer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--layouts", default="BLNHC,LBNHC")
    ap.add_argument("--counts", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--memory", default="VRAM")
    args = ap.parse_args()
    if args.threads:
        agent_cls, config_cls = knixl.nixl_api()
        knixl.nixl_api = lambda: (agent_cls, functools.partial(config_cls, num_threads=args.threads))
    rows = []
    for layout in args.layouts.split(","):
        rows += probe(layout, [int(c) for c in args.counts.split(",")], args.repeats, args.memory)
    json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
