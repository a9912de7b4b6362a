"""kvcore-torch: a reference paged-attention backend for kvcore in plain PyTorch."""

from kvcore_torch.attention import paged_attention
from kvcore_torch.backend import TorchAttentionBackend
from kvcore_torch.cache_write import write_kv
from kvcore_torch.mixers import TorchMixerBackend

__all__ = ["TorchAttentionBackend", "TorchMixerBackend", "paged_attention", "write_kv"]
__version__ = "0.1.0"
