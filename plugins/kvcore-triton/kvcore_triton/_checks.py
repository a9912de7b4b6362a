"""Launcher-side checks: shapes, dtypes and devices before any kernel runs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvcore.plugins.paged_inputs import (
    check_batch,
    check_batch_shapes,
    check_block_ids,
    check_heads_and_window,
    check_index,
    check_tokens,
    value_checks,
)
from kvcore.plugins.paged_inputs import check_cache_view as _check_cache_view
from kvcore.plugins.paged_inputs import check_kv_write as _check_kv_write

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _probe():
    pass


@triton.jit
def _loop_probe(out, n):
    for i in range(0, n):
        tl.store(out + i, i + 1)


def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run these kernels here (None: it can, or it is off). Some
    pairs of Triton and NumPy cannot loop to a bound given at run time (Triton 3.6, NumPy 2.4)."""
    if not isinstance(_probe, InterpretedFunction):
        return None
    out = torch.zeros(2, dtype=torch.int32)
    try:
        _loop_probe[(1,)](out, 2)
    except Exception as exc:  # noqa: BLE001 - whatever the interpreter raises, it cannot serve
        return f"the interpreter of Triton {triton.__version__} fails on a kernel loop here ({exc})"
    return None if out.tolist() == [1, 2] else f"the interpreter of Triton {triton.__version__} ran a loop wrong"


#: Why the interpreter is on but cannot run these kernels (None: it runs them, or it is off).
INTERPRETER_PROBLEM = _interpreter_problem()
#: Whether this package's kernels run through Triton's interpreter (CPU tensors). Triton decides it
#: itself, from ``TRITON_INTERPRET``, when ``triton.jit`` decorates a kernel (at this package's import),
#: so the answer is read off a kernel once, never from the environment per call.
INTERPRETED = isinstance(_probe, InterpretedFunction) and INTERPRETER_PROBLEM is None
#: Whether kernels are run by the interpreter at all (what they may compile to depends on it).
INTERPRETER_ON = isinstance(_probe, InterpretedFunction)


def cpu_note() -> str:
    """Why CPU tensors are not served, and the remedy (messages and the plugin's requirements)."""
    if INTERPRETER_PROBLEM:
        return (f"{INTERPRETER_PROBLEM}; use the 'torch' backend on CPU, or a Triton and NumPy whose "
                "interpreter runs loops (on a CUDA device, unset TRITON_INTERPRET)")
    return "set TRITON_INTERPRET=1 before triton is imported to run these kernels on CPU tensors"


__all__ = [
    "DTYPES", "INTERPRETED", "INTERPRETER_ON", "check_batch", "check_device", "check_batch_shapes", "check_block_ids",
    "check_cache_view", "check_heads_and_window",
    "check_index", "check_kv_write", "check_tokens", "value_checks",
]


def check_device(kv_cache_view: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors through the Triton interpreter only."""
    if INTERPRETER_PROBLEM:  # NOTE: when on, the interpreter runs CUDA tensors' kernels too
        raise ValueError(f"kvcore-triton got {kv_cache_view.device.type} tensors, but {cpu_note()}")
    if kv_cache_view.device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "kvcore-triton got CPU tensors, but the Triton interpreter is off: set "
            "TRITON_INTERPRET=1 before triton is first imported to run its kernels on the CPU, "
            "or use a CUDA device, or the 'torch' backend"
        )


def check_cache_view(kv_cache_view: torch.Tensor, head_size: int, head_size_v: int | None, kv_quant=None) -> int:
    """Validate a kernel-block view ``[B, H, N, C]`` of a dtype the kernels take; return ``head_size_v``."""
    check_device(kv_cache_view)
    return _check_cache_view(kv_cache_view, head_size, head_size_v, DTYPES, kv_quant)


def check_kv_write(kv_cache_view, key, value, slot_mapping, head_size: int, *, check_slots: bool,
                   kv_quant=None) -> int:
    """Validate a K/V write into a view of a dtype the kernels take; return the slot count."""
    check_device(kv_cache_view)
    return _check_kv_write(kv_cache_view, key, value, slot_mapping, head_size, DTYPES, check_slots=check_slots,
                           kv_quant=kv_quant)
