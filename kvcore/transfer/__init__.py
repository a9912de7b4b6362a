"""KV transfer: describe where every block lives, plan exact byte runs, move blocks.

``describe(kv_cache)`` gives a JSON-serializable :class:`KVCacheDescriptor`;
``plan_transfer`` turns manager block ids into the fewest contiguous
:class:`Region` runs; :class:`HostKVPool` offloads blocks to a host mirror
and :class:`NixlAgent` moves them (or, for ranks of another tensor-parallel
size, some of their KV heads) between processes through NIXL.
"""

from kvcore.transfer.describe import describe
from kvcore.transfer.descriptor import (
    Allocation,
    ContentMap,
    GroupDescriptor,
    KVCacheDescriptor,
    LayerDescriptor,
    StateSlice,
)
from kvcore.transfer.host_pool import HostKVPool
from kvcore.transfer.nixl import IncompatiblePeerError, NixlAgent
from kvcore.transfer.nixl_api import NixlUnavailableError, TransferError, TransferHandle
from kvcore.transfer.plan import Region, plan_transfer
from kvcore.transfer.transport import Transport

__all__ = [
    "Allocation",
    "ContentMap",
    "describe",
    "GroupDescriptor",
    "HostKVPool",
    "IncompatiblePeerError",
    "KVCacheDescriptor",
    "LayerDescriptor",
    "NixlAgent",
    "NixlUnavailableError",
    "plan_transfer",
    "Region",
    "StateSlice",
    "TransferError",
    "TransferHandle",
    "Transport",
]
