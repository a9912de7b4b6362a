"""kvcore-triton: Triton paged-attention kernels as a kvcore backend."""

from kvcore_triton.attention import KernelConfig, paged_attention
from kvcore_triton.backend import TritonAttentionBackend
from kvcore_triton.mixers import TritonMixerBackend
from kvcore_triton.store import write_kv

__all__ = ["KernelConfig", "TritonAttentionBackend", "TritonMixerBackend", "paged_attention", "write_kv"]
__version__ = "0.1.0"
