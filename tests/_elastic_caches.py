"""Elastic KV caches of every shape the elastic tests cover, byte-level helpers, and failures
injected through the seams of ``KVCache.resize`` (:class:`Faults`)."""

from __future__ import annotations

import torch
from _transfer_caches import KINDS, Fixed8Backend, layer_specs, plugin_manager

from kvcore import KVCache, MambaSpec
from kvcore.memory.elastic import block_byte_ranges, merge_ranges, subtract_ranges
from kvcore_torch.backend import TorchAttentionBackend

CASES = [(kind, layout) for kind, layouts in KINDS.items() for layout in layouts]


def make_elastic(kind: str, layout: str, num_blocks: int | None, max_num_blocks: int | None,
                 device: str = "cpu", **kw) -> KVCache:  # fmt: skip
    specs = layer_specs(kind, torch.float16)
    backend = Fixed8Backend if kind == "split" else TorchAttentionBackend
    return KVCache.create(
        specs, {n: backend for n, s in specs.items() if not isinstance(s, MambaSpec)},
        device=device, layout=layout, num_blocks=num_blocks, max_num_blocks=max_num_blocks,
        max_num_seqs=2, max_model_len=64, plugin_manager=plugin_manager(), **kw,
    )


def block_bytes(kv: KVCache, layer: str, block_id: int) -> torch.Tensor:
    """The bytes of manager block ``block_id`` in ``layer``'s view (a live view, not a copy)."""
    view = kv.kv_caches[layer]
    rows = view.shape[0] // kv.max_num_blocks
    return view[block_id * rows : (block_id + 1) * rows].view(torch.int8)


def layer_groups(kv: KVCache) -> list[list[str]]:
    return [[n for n in g.layer_names if n in kv.kv_caches] for g in kv.config.kv_cache_groups]


def views_with_rows(kv: KVCache) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (v, v.shape[0] // kv.max_num_blocks) for n, v in kv.kv_caches.items()}


def granules_touched(ranges, granularity: int) -> set[int]:
    """Granule indices that byte ranges touch (a brute-force model of the committed set)."""
    return {i for start, end in ranges for i in range(start // granularity, (end - 1) // granularity + 1)}


class Faults:
    """Wraps the seams of ``kv``: records what is really committed, raises ``error`` at call
    number ``fail_at`` of ``seam`` (counted across calls) while armed."""

    def __init__(self, kv, seam: str | None = None, fail_at: int = 0, error: type = KeyboardInterrupt):
        self.kv, self.seam, self.fail_at, self.error, self.calls = kv, seam, fail_at, error, 0
        backing, pool = kv.elastic.backing, kv.block_pool
        g = backing.granularity
        self.backed = block_byte_ranges(views_with_rows(kv), kv.num_blocks, g)
        real = {"commit": backing.commit, "decommit": backing.decommit, "pool": pool.resize}

        def seam_of(name):
            def call(*args):
                if name == self.seam:
                    self.calls += 1
                    if self.calls - 1 == self.fail_at:
                        raise self.error("injected")
                real[name](*args)
                if name == "commit":
                    self.backed = merge_ranges([*self.backed, args])
                elif name == "decommit":
                    self.backed = subtract_ranges(self.backed, [args])
            return call

        backing.commit, backing.decommit, pool.resize = (seam_of(n) for n in real)

    def state(self):
        kv = self.kv
        return (kv.num_blocks, kv.block_pool.num_blocks, kv.zeroer.num_blocks, kv.committed_bytes,
                kv.block_pool.num_free_blocks)

    def check(self):
        """One size everywhere, every block below it backed, committed_bytes the memory backed."""
        kv = self.kv
        n = kv.num_blocks
        assert kv.block_pool.num_blocks == kv.zeroer.num_blocks == n
        need = block_byte_ranges(views_with_rows(kv), n, kv.elastic.backing.granularity)
        assert not subtract_ranges(need, self.backed), "a block below num_blocks has no memory"
        assert kv.committed_bytes == sum(e - s for s, e in self.backed)
