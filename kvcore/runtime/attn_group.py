"""Attention groups: the layers of one KV cache group that one backend serves, a read-only view
of their frozen negotiation record plus the per-step buffers (metadata builders, kernel block
table)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import pluggy
import torch

from kvcore._validate import non_negative_int, positive_int
from kvcore.memory.config import KVCacheConfig
from kvcore.memory.views import to_kernel_blocks, to_manager_blocks
from kvcore.plugins.answers import HookAnswers, label
from kvcore.plugins.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from kvcore.plugins.block_sizes import get_block_table_width, select_common_block_size
from kvcore.plugins.negotiation import BackendNegotiation, backend_groups, can_split, cannot_split
from kvcore.settings import Settings
from kvcore.specs import KVCacheSpec


class AttentionGroup:
    """Layers of one KV cache group that share a backend and a (customized) spec.

    With ``kernel_block_size`` set, kernel block ``j`` of manager block ``b`` is ``b * ratio + j``
    (dense pages) or ``b * kernel_block_stride + j`` (a packed, block-outermost cache). Every
    decision is read from :attr:`record`, a frozen negotiation record the group never replaces;
    builders and tables are its per-step buffers. A group made by hand (no negotiation) is given
    its kernel block size by ``create_metadata_builders(kernel_block_size=...)`` and, in a packed
    cache, follows the block stride of the view ``map_kv_caches_to_kernel_blocks`` maps for it.
    """

    def __init__(self, backend: type[AttentionBackend], layer_names: Sequence[str], kv_cache_spec: KVCacheSpec,
                 kv_cache_group_id: int, kernel_block_size: int | None = None) -> None:
        kernel_block_size = None if kernel_block_size is None else positive_int("kernel_block_size", kernel_block_size)
        record = BackendNegotiation(backend, tuple(layer_names), kv_cache_spec, None, kernel_block_size)
        self._record, self._group_id = record, kv_cache_group_id
        #: a hand-made group's kernel block size and packed stride, as it was wired
        self._wired = (record.kernel_block_size, record.kernel_block_stride)
        # NOTE: persistent per micro-batch, so CUDA graphs capture the mapped table.
        self.kernel_block_table: torch.Tensor | None = None
        self.kernel_block_offsets: torch.Tensor | None = None
        self.metadata_builders: list[AttentionMetadataBuilder] = []
        self.settings = Settings()

    @classmethod
    def from_record(cls, record: BackendNegotiation, kv_cache_group_id: int) -> AttentionGroup:
        """The group a negotiation record describes (kernel blocks already decided)."""
        group = cls(record.backend, record.layer_names, record.kv_cache_spec, kv_cache_group_id)
        group._record, group._wired = record, (record.kernel_block_size, record.kernel_block_stride)
        return group

    record = property(lambda self: self._record, doc="The frozen negotiation record of this group.")
    kv_cache_group_id = property(lambda self: self._group_id, doc="The KV cache group of these layers.")
    backend = property(lambda self: self._record.backend, doc="The backend serving this group's layers.")
    layer_names = property(lambda self: list(self._record.layer_names), doc="The layers, in model order.")
    kv_cache_spec = property(lambda self: self._record.kv_cache_spec, doc="The spec as the backend stores it.")
    kernel_block_size = property(lambda self: self._wired[0],
                                 doc="Tokens per kernel block; None when kernel blocks are the manager blocks.")
    kernel_block_stride = property(lambda self: self._wired[1],
                                   doc="Kernel pages between two manager blocks of a packed cache (0: dense).")

    @property
    def negotiated(self) -> bool:
        """Whether a negotiation decided this group's kernel blocks (else it is wired by hand)."""
        return self._record.group_kernel_block_size is not None

    def __repr__(self) -> str:
        return (f"AttentionGroup({label(self.backend)!r}, {self.layer_names!r}, {self.kv_cache_spec!r}, "
                f"kv_cache_group_id={self.kv_cache_group_id}, kernel_block_size={self.kernel_block_size}, "
                f"kernel_block_stride={self.kernel_block_stride})")

    @property
    def blocks_per_manager_block(self) -> int:
        kernel = self.kernel_block_size
        return 1 if kernel is None else self.kv_cache_spec.block_size // kernel

    def create_metadata_builders(
        self,
        device: torch.device | str,
        *,
        max_num_seqs: int,
        max_model_len: int,
        kernel_block_size: int | None = None,
        num_metadata_builders: int = 1,
        plugin_manager: pluggy.PluginManager | None = None,
        settings: Settings | None = None,
    ) -> None:
        """Create one metadata builder per micro-batch and the kernel block table.

        ``kernel_block_size`` is the KV cache group's (None: the record's); a group made by hand
        takes the largest size its backend accepts that divides it.
        """
        max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
        max_model_len = positive_int("max_model_len", max_model_len)
        num_metadata_builders = positive_int("num_metadata_builders", num_metadata_builders)
        if settings is not None and not isinstance(settings, Settings):
            raise TypeError(f"settings must be a kvcore.settings.Settings or None: {settings!r}")
        self.settings = settings or Settings()
        spec = self.kv_cache_spec
        if kernel_block_size is not None:
            kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
            agreed = self._record.group_kernel_block_size
            if agreed is not None and kernel_block_size != agreed:
                raise ValueError(f"attention group of {self.layer_names} was negotiated with kernel block size "
                                 f"{agreed}, not {kernel_block_size}; pass {agreed} or None")
            if agreed is None and can_split(spec):
                own = select_common_block_size(kernel_block_size, [self.backend], [spec], plugin_manager=plugin_manager)
                self._wired = (None if own == spec.block_size else own, self._wired[1])
        own = self.kernel_block_size
        builder_cls = self.backend.get_builder_cls()
        alignment = None if spec.tokens_per_state <= 0 else 128  # NOTE: state slots are not tokens
        max_blocks = spec.max_num_blocks_per_req(max_model_len)
        width = get_block_table_width(max_blocks, spec.block_size, own, token_alignment=alignment)
        kwargs: dict[str, Any] = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len}
        if builder_cls.requires_block_table_width:
            kwargs["block_table_width"] = width
        if own is not None:
            shape = (num_metadata_builders, max_num_seqs, width)
            self.kernel_block_table = torch.zeros(shape, dtype=torch.int32, device=device)
            ratio = self.blocks_per_manager_block
            self.kernel_block_offsets = torch.arange(ratio, dtype=torch.int32, device=device)
        builder_spec = spec if own is None else spec.copy_with_new_block_size(own)
        self.metadata_builders = [builder_cls(builder_spec, self.layer_names, device, **kwargs)
                                  for _ in range(num_metadata_builders)]

    def get_metadata_builder(self, ubatch_idx: int = 0) -> AttentionMetadataBuilder:
        if not 0 <= ubatch_idx < len(self.metadata_builders):
            raise ValueError(f"micro-batch {ubatch_idx} has no metadata builder ({len(self.metadata_builders)} built); "
                             "call create_metadata_builders(num_metadata_builders=...) first")
        return self.metadata_builders[ubatch_idx]

    def build_metadata(self, common_attn_metadata: CommonAttentionMetadata, ubatch_idx: int = 0,
                       common_prefix_len: int = 0, **kwargs: Any) -> Any:
        """The backend's metadata for one step, with block tables in kernel blocks."""
        builder = self.get_metadata_builder(ubatch_idx)
        changes: dict[str, Any] = {}
        if self.kernel_block_size is not None:
            changes["block_table_tensor"] = self.map_to_kernel_block_table(common_attn_metadata.block_table_tensor,
                                                                           ubatch_idx)
        if common_attn_metadata.debug_checks is None and self.settings.debug_checks is not None:
            changes["debug_checks"] = self.settings.debug_checks
        if changes:
            common_attn_metadata = attrs.evolve(common_attn_metadata, **changes)
        return builder.build(common_prefix_len, common_attn_metadata, **kwargs)

    def map_to_kernel_block_table(self, block_table: torch.Tensor, ubatch_idx: int = 0) -> torch.Tensor:
        """Manager block table ``[rows, cols]`` -> kernel block table ``[rows, cols * ratio]``: one fused ``add``
        into the persistent buffer, so the result keeps its address across steps (CUDA-graph safe)."""
        if self.kernel_block_size is None:
            return block_table
        if self.kernel_block_table is None or self.kernel_block_offsets is None:
            raise ValueError("call create_metadata_builders() before mapping block tables")
        if block_table.dim() != 2:
            raise ValueError(f"block_table must be 2-D [requests, manager blocks], got shape "
                             f"{tuple(block_table.shape)}")
        num_ubatches, max_rows, width = self.kernel_block_table.shape
        if not 0 <= ubatch_idx < num_ubatches:
            raise ValueError(f"micro-batch {ubatch_idx} has no kernel block table ({num_ubatches} built); "
                             "call create_metadata_builders(num_metadata_builders=...) with more")
        ratio = self.blocks_per_manager_block
        rows, cols = block_table.shape
        if rows > max_rows or cols * ratio > width:
            raise ValueError(f"block table of shape {(rows, cols)} exceeds the kernel block table ({max_rows} rows, "
                             f"{width // ratio} manager blocks per row); raise max_num_seqs / max_model_len")
        out = self.kernel_block_table[ubatch_idx, :rows, : cols * ratio]
        torch.add(self.kernel_block_offsets, block_table.unsqueeze(-1), alpha=self.kernel_block_stride or ratio,
                  out=out.unflatten(1, (cols, ratio)))
        return out

    def map_kv_cache_to_kernel_blocks(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The kernel view of a layer's view as allocated (already one for a dense group); a packed
        view is addressed by the kernel pages its own block stride holds."""
        if self.kernel_block_size is None:
            raise ValueError(f"group {self.kv_cache_group_id} does not split blocks")
        spec, kernel = self.kv_cache_spec, self.kernel_block_size
        kernel_rows = spec.get_num_kernel_states(kernel)
        if kv_cache.shape[-2] == kernel_rows:
            return kv_cache
        page = kernel_rows * kv_cache.stride(-2)  # NOTE: in the view's own elements
        if spec.tokens_per_state <= 1 or kv_cache.shape[1] != 1 or kv_cache.stride(0) % page:
            raise ValueError(cannot_split(label(self.backend), spec, kernel, self.layer_names))
        stride = kv_cache.stride(0) // page
        expected = self.kernel_block_stride or (self.blocks_per_manager_block if self.negotiated else stride)
        if stride != expected:
            raise ValueError(f"a view with block stride {kv_cache.stride(0)} elements is not the view group "
                             f"{self.kv_cache_group_id} was negotiated for ({self.kernel_block_stride} kernel pages "
                             "per block); pass the views allocate_kv_cache made for this config")
        if not self.negotiated:  # NOTE: a group wired by hand follows the view it is given
            self._wired = (kernel, stride)
        return to_kernel_blocks(kv_cache, kernel_rows, stride)

    def map_kv_cache_to_manager_blocks(self, kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """View a packed cache addressed by kernel blocks as manager blocks."""
        if not self.kernel_block_stride:
            raise ValueError(f"group {self.kv_cache_group_id} has no packed kernel view; "
                             "map_kv_cache_to_kernel_blocks() sets one")
        num_blocks = non_negative_int("num_blocks", num_blocks)
        rows = self.kv_cache_spec.get_num_kernel_states(self.kv_cache_spec.block_size)
        return to_manager_blocks(kv_cache, rows, self.kernel_block_stride, num_blocks)


def build_attention_groups(kv_cache_config: KVCacheConfig, layer_backends: Mapping[str, type[AttentionBackend] | str],
                           *, plugin_manager: pluggy.PluginManager | None = None) -> list[list[AttentionGroup]]:
    """Per KV cache group, one :class:`AttentionGroup` per (backend, customized spec).

    Specs are customized here through the hooks; state-cache layers may be left out of
    ``layer_backends``; groups without layer views get an empty list.
    """
    if not isinstance(layer_backends, Mapping):
        raise TypeError(f"layer_backends must map layer names to backends, got {layer_backends!r}")
    answers = HookAnswers(plugin_manager)
    classes = {name: answers.backend(backend) for name, backend in layer_backends.items()}
    by_group = backend_groups(kv_cache_config, classes, answers.customized_spec)
    return [
        [AttentionGroup(backend, names, spec, gid) for (backend, spec), names in by_key.items()]
        for gid, by_key in enumerate(by_group)
    ]


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


def map_kv_caches_to_kernel_blocks(
    kv_caches: Mapping[str, torch.Tensor],
    attn_groups: Iterable[AttentionGroup] | Iterable[Iterable[AttentionGroup]],
) -> dict[str, torch.Tensor]:
    """The views kernels read: each split group's layers addressed by kernel blocks
    (``kv_caches`` is not changed; ``attn_groups`` may be flat or nested per KV cache group)."""
    mapped = dict(kv_caches)
    for group in flatten_attention_groups(attn_groups):
        if group.kernel_block_size is None:
            continue
        for name in group.layer_names:
            if name in kv_caches:
                mapped[name] = group.map_kv_cache_to_kernel_blocks(kv_caches[name])
    return mapped
