"""The transport NixlAgent reports: inferred from memory kinds, process placement and UCX_TLS."""

from __future__ import annotations

import attrs
import pytest
from _transfer_caches import cached_cache

from kvcore.transfer import describe
from kvcore.transfer.transport import pick, process_info, transport_between

HOST = describe(cached_cache("uniform", "LBNHC"))
GPU = attrs.evolve(HOST, allocations=(attrs.evolve(HOST.allocations[0], device="cuda:0"),))
HERE = process_info()
OTHER_PROCESS = {**HERE, "pid": HERE["pid"] + 1}
OTHER_HOST = {"host": HERE["host"] + "-elsewhere", "pid": 1}


@pytest.mark.parametrize("local, remote, peer, tls, expected", [
    (GPU, GPU, OTHER_PROCESS, "", "cuda_ipc"),
    (GPU, GPU, HERE, "", "cuda_copy"),  # cuda_ipc cannot reach an agent of the same process
    (GPU, GPU, OTHER_PROCESS, "^cuda_ipc", "cuda_copy+tcp"),
    (GPU, GPU, OTHER_PROCESS, "cuda_ipc,cuda_copy,tcp", "cuda_ipc"),
    (GPU, GPU, OTHER_PROCESS, "cuda,tcp", "cuda_ipc"),
    (GPU, GPU, OTHER_PROCESS, "rc,cuda_copy", "cuda_copy+tcp"),
    (GPU, HOST, HERE, "", "cuda_copy"),
    (HOST, GPU, OTHER_PROCESS, "", "cuda_copy+cma"),
    (HOST, HOST, OTHER_PROCESS, "", "cma"),
    (HOST, HOST, OTHER_PROCESS, "tcp", "tcp"),
    (HOST, HOST, OTHER_HOST, "", "rc"),
    (HOST, HOST, OTHER_HOST, "tcp,cuda_copy", "tcp"),
])
def test_the_inferred_transport_follows_memory_placement_and_ucx_tls(local, remote, peer, tls, expected):
    transport = transport_between(local, remote, peer, tls=tls)
    assert transport.name == str(transport) == expected
    assert transport.source == "inferred"
    assert ("two hosts" in transport.detail) == (peer is OTHER_HOST)
    assert (f"UCX_TLS={tls}" in transport.detail) == bool(tls)


def test_ucx_tls_reads_aliases_and_negation():
    assert pick(("cma", "tcp"), "sm") == "cma"
    assert pick(("cma", "tcp"), "^sm") == "tcp"
    assert pick(("cuda_ipc", "tcp"), "all") == "cuda_ipc"
    assert pick(("rc",), "ud") == "tcp"
