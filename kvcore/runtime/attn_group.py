"""Attention groups: the layers of one KV cache group served by one backend.

A group maps the scheduler's manager block tables and cache views to the
kernel blocks its backend accepts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import pluggy
import torch

from kvcore._validate import non_negative_int, positive_int
from kvcore.plugins.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from kvcore.plugins.negotiation import HookAnswers, backend_kernel_block_size
from kvcore.plugins.records import BackendNegotiation
from kvcore.plugins.selection import get_block_table_width
from kvcore.specs import KVCacheSpec


@attrs.define(eq=False)
class AttentionGroup:
    """Layers of one KV cache group that share a backend and a (customized) spec.

    When the backend needs blocks smaller than the manager's, ``kernel_block_size``
    is set and block tables / cache views address kernel blocks: kernel block
    ``j`` of manager block ``b`` is ``b * ratio + j`` for dense pages
    (``kernel_block_stride`` 0), or ``b * kernel_block_stride + j`` where the
    stride is the number of kernel pages between two blocks of a packed
    (block-outermost) cache. Groups built by ``KVCache.create`` carry their
    ``negotiated`` record and never ask the plugin hooks again.
    """

    backend: type[AttentionBackend]
    layer_names: list[str] = attrs.field(converter=list)
    kv_cache_spec: KVCacheSpec
    kv_cache_group_id: int
    kernel_block_size: int | None = None
    kernel_block_stride: int = 0
    # Persistent per micro-batch so CUDA graphs capture the mapped table.
    kernel_block_table: torch.Tensor | None = attrs.field(default=None, repr=False)
    kernel_block_offsets: torch.Tensor | None = attrs.field(default=None, repr=False)
    metadata_builders: list[AttentionMetadataBuilder] = attrs.field(factory=list, repr=False)
    negotiated: BackendNegotiation | None = attrs.field(default=None, repr=False)

    @classmethod
    def from_negotiation(cls, record: BackendNegotiation, kv_cache_group_id: int) -> AttentionGroup:
        """The group a negotiation record describes (kernel blocks already decided)."""
        return cls(
            record.backend,
            list(record.layer_names),
            record.kv_cache_spec,
            kv_cache_group_id,
            kernel_block_size=record.kernel_block_size,
            kernel_block_stride=record.kernel_block_stride,
            negotiated=record,
        )

    @property
    def blocks_per_manager_block(self) -> int:
        if self.kernel_block_size is None:
            return 1
        return self.kv_cache_spec.block_size // self.kernel_block_size

    def create_metadata_builders(
        self,
        device: torch.device | str,
        *,
        max_num_seqs: int,
        max_model_len: int,
        kernel_block_size: int | None = None,
        num_metadata_builders: int = 1,
        plugin_manager: pluggy.PluginManager | None = None,
    ) -> None:
        """Create one metadata builder per micro-batch and the kernel block table.

        ``kernel_block_size`` is the KV cache group's kernel block size. A
        negotiated group (from ``KVCache.create``) takes its own size from its
        record; otherwise the backend is asked for the largest size it accepts
        that divides ``kernel_block_size`` (its own, smaller one in a packed
        group). Specs storing one state per block are never split.
        """
        max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
        max_model_len = positive_int("max_model_len", max_model_len)
        num_metadata_builders = positive_int("num_metadata_builders", num_metadata_builders)
        spec = self.kv_cache_spec
        if self.negotiated is not None:
            agreed = self.negotiated.group_kernel_block_size
            if kernel_block_size is not None and kernel_block_size != agreed:
                raise ValueError(
                    f"attention group of {self.layer_names} was negotiated with kernel block "
                    f"size {agreed}, not {kernel_block_size}; pass {agreed} or None"
                )
            own = self.negotiated.kernel_block_size
        elif kernel_block_size is not None:
            answers = HookAnswers(plugin_manager)
            own = backend_kernel_block_size(answers, self.backend, spec, kernel_block_size)
        else:
            own = None
        self.kernel_block_size = own
        builder_spec = spec if own is None else spec.copy_with_new_block_size(own)
        builder_cls = self.backend.get_builder_cls()
        width = get_block_table_width(
            spec.max_num_blocks_per_req(max_model_len),
            spec.block_size,
            own,
            token_alignment=None if spec.tokens_per_state <= 0 else 128,
        )
        kwargs: dict[str, Any] = {}
        if builder_cls.requires_block_table_width:
            kwargs["block_table_width"] = width
        if own is not None:
            self.kernel_block_table = torch.zeros(
                num_metadata_builders, max_num_seqs, width, dtype=torch.int32, device=device
            )
            self.kernel_block_offsets = torch.arange(
                self.blocks_per_manager_block, dtype=torch.int32, device=device
            )
        self.metadata_builders = [
            builder_cls(
                builder_spec,
                self.layer_names,
                device,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                **kwargs,
            )
            for _ in range(num_metadata_builders)
        ]

    def get_metadata_builder(self, ubatch_idx: int = 0) -> AttentionMetadataBuilder:
        if not 0 <= ubatch_idx < len(self.metadata_builders):
            raise ValueError(
                f"micro-batch {ubatch_idx} has no metadata builder ({len(self.metadata_builders)} "
                "built); call create_metadata_builders(num_metadata_builders=...) first"
            )
        return self.metadata_builders[ubatch_idx]

    def build_metadata(
        self,
        common_attn_metadata: CommonAttentionMetadata,
        ubatch_idx: int = 0,
        common_prefix_len: int = 0,
        **kwargs: Any,
    ) -> Any:
        """The backend's metadata for one step, with block tables in kernel blocks."""
        builder = self.get_metadata_builder(ubatch_idx)
        if self.kernel_block_size is not None:
            common_attn_metadata = attrs.evolve(
                common_attn_metadata,
                block_table_tensor=self.map_to_kernel_block_table(
                    common_attn_metadata.block_table_tensor, ubatch_idx
                ),
            )
        return builder.build(common_prefix_len, common_attn_metadata, **kwargs)

    def map_to_kernel_block_table(self, block_table: torch.Tensor, ubatch_idx: int = 0) -> torch.Tensor:
        """Manager block table ``[rows, cols]`` -> kernel block table ``[rows, cols * ratio]``.

        One fused ``add`` into a slice of the persistent buffer, so the result
        keeps its address across steps (CUDA-graph safe).
        """
        if self.kernel_block_size is None:
            return block_table
        if self.kernel_block_table is None or self.kernel_block_offsets is None:
            raise ValueError("call create_metadata_builders() before mapping block tables")
        ratio = self.blocks_per_manager_block
        if block_table.dim() != 2:
            raise ValueError(
                f"block_table must be 2-D [requests, manager blocks], got shape {tuple(block_table.shape)}"
            )
        num_ubatches, max_rows, width = self.kernel_block_table.shape
        if not 0 <= ubatch_idx < num_ubatches:
            raise ValueError(
                f"micro-batch {ubatch_idx} has no kernel block table ({num_ubatches} built); "
                "call create_metadata_builders(num_metadata_builders=...) with more"
            )
        rows, cols = block_table.shape
        if rows > max_rows or cols * ratio > width:
            raise ValueError(
                f"block table of shape {(rows, cols)} exceeds the kernel block table "
                f"({max_rows} rows, {width // ratio} manager blocks per row); raise "
                "max_num_seqs / max_model_len"
            )
        out = self.kernel_block_table[ubatch_idx, :rows, : cols * ratio]
        torch.add(
            self.kernel_block_offsets,
            block_table.unsqueeze(-1),
            alpha=self.kernel_block_stride or ratio,
            out=out.unflatten(1, (cols, ratio)),
        )
        return out

    def map_kv_cache_to_kernel_blocks(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The kernel view of a layer's view as allocated.

        A dense group was split at allocation, so its view is returned as is. A
        packed cache addressed by manager blocks is viewed as kernel blocks:
        only compressed caches (``tokens_per_state > 1``, one head) whose block
        stride is a whole number of kernel pages can be; the view spans other
        layers' pages between blocks without addressing them.
        """
        if self.kernel_block_size is None:
            raise ValueError(f"group {self.kv_cache_group_id} does not split blocks")
        spec = self.kv_cache_spec
        kernel_rows = spec.get_num_kernel_states(self.kernel_block_size)
        if self.negotiated is not None and not self.kernel_block_stride:
            return kv_cache
        if self.negotiated is None and kv_cache.shape[-2] == kernel_rows:
            return kv_cache
        if (
            spec.tokens_per_state <= 1
            or kv_cache.shape[1] != 1
            or kv_cache.stride(0) % (kernel_rows * kv_cache.stride(-2))
        ):
            raise ValueError(
                f"{self.backend.get_name()} needs {self.kernel_block_size}-token kernel "
                f"blocks, which packed {spec.block_size}-token blocks cannot be split "
                f"into; use a manager block size of {self.kernel_block_size} or a "
                "layer-compact layout such as LBNHC"
            )
        page_stride = kernel_rows * kv_cache.stride(-2)
        stride = kv_cache.stride(0) // page_stride
        if self.negotiated is not None and stride != self.kernel_block_stride:
            raise ValueError(
                f"a view with block stride {kv_cache.stride(0)} elements is not the view group "
                f"{self.kv_cache_group_id} was negotiated for ({self.kernel_block_stride} kernel "
                "pages per block); pass the views allocate_kv_cache made for this config"
            )
        self.kernel_block_stride = stride
        num_pages = (kv_cache.shape[0] - 1) * stride + kv_cache.shape[-2] // kernel_rows
        return kv_cache.as_strided(
            (num_pages, *kv_cache.shape[1:-2], kernel_rows, kv_cache.shape[-1]),
            (page_stride, *kv_cache.stride()[1:]),
        )

    def map_kv_cache_to_manager_blocks(self, kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """View a packed cache addressed by kernel blocks as manager blocks."""
        if not self.kernel_block_stride:
            raise ValueError(
                f"group {self.kv_cache_group_id} has no packed kernel view; "
                "map_kv_cache_to_kernel_blocks() sets one"
            )
        num_blocks = non_negative_int("num_blocks", num_blocks)
        rows = self.kv_cache_spec.get_num_kernel_states(self.kv_cache_spec.block_size)
        return kv_cache.as_strided(
            (num_blocks, *kv_cache.shape[1:-2], rows, kv_cache.shape[-1]),
            (kv_cache.stride(0) * self.kernel_block_stride, *kv_cache.stride()[1:]),
        )


def flatten_attention_groups(attn_groups: Iterable[Any]) -> list[AttentionGroup]:
    """``attn_groups`` flat or nested per KV cache group, as one flat list."""
    out: list[AttentionGroup] = []
    for item in attn_groups:
        if isinstance(item, AttentionGroup):
            out.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            out.extend(flatten_attention_groups(item))
        else:
            raise TypeError(f"attn_groups must hold AttentionGroup objects (or lists of them), got {item!r}")
    return out
