"""KV transfer: where every block lives (``describe``), its exact byte runs (``plan_transfer``),
and moving blocks to a host mirror (``HostKVPool``) or another process (``NixlAgent``)."""

from kvcore.transfer.compat import IncompatiblePeerError
from kvcore.transfer.descriptor import (
    Allocation,
    ContentMap,
    GroupDescriptor,
    KVCacheDescriptor,
    LayerDescriptor,
    StateSlice,
    describe,
)
from kvcore.transfer.host_pool import HostKVPool
from kvcore.transfer.nixl import NixlAgent
from kvcore.transfer.nixl_api import NixlUnavailableError, TransferError, TransferHandle
from kvcore.transfer.regions import Region, plan_transfer
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
