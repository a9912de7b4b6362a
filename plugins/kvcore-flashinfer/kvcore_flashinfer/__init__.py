"""kvcore-flashinfer: FlashInfer's paged-attention kernels as a kvcore backend.

Importing this package (and its hooks) never imports FlashInfer; the backend
imports it on its first ``forward`` or plan.
"""

from kvcore_flashinfer.backend import FlashInferAttentionBackend
from kvcore_flashinfer.builder import FlashInferMetadata, FlashInferMetadataBuilder, PlanKey
from kvcore_flashinfer.paging import PageTable, page_table

__all__ = [
    "FlashInferAttentionBackend", "FlashInferMetadata", "FlashInferMetadataBuilder", "PageTable", "PlanKey",
    "page_table",
]
__version__ = "0.1.0"
