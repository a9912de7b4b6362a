"""Compile the decode kernel for an H100/H200 (sm_90) without a GPU.

The argument specialization mimics Triton's launcher (ints divisible by 16 and
pointers are marked 16-divisible, ints equal to 1 become constants), so the
result is the code a real launch of the benchmark shape would build. Used by
the tests to check that both read paths lower, and by hand to read their IR:

    TRITON_INTERPRET=0 python plugins/kvcore-triton/tests/sm90_compile.py pointer 64 16 4 3 [--dump]
    TRITON_INTERPRET=0 python plugins/kvcore-triton/tests/sm90_compile.py pointer 64 16 2 3 --kv fp8e4nv --quant 2
"""

from __future__ import annotations

import json
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcore_triton.attention import DECODE_VARIANTS, DECODE_WARPS, KernelConfig
from kvcore_triton.decode import _decode_split_kernel


def uses_tma(config: KernelConfig, block_size: int) -> bool:
    """Whether the launcher would read this shape's K/V tiles with TMA on an sm_90 device."""
    return config.tma and config.tile <= block_size


def decode_args(config: KernelConfig, block_size: int, *, splits: int = 1, layout_strides=None, quant: int = 0,
                kv: str = "bf16"):
    """Argument values of a decode launch: 4096 tokens, 32/8 heads, D=128 (LBNHC strides by default); a
    per-token-head cache (``quant=2``) keeps each block's scales after its data, in elements of 1 byte."""
    kv_heads, head = 8, 128
    page = block_size * kv_heads * (2 * head + (8 if quant == 2 else 0))
    strides = layout_strides or (page, 2 * head, kv_heads * 2 * head, 1)  # LBNHC
    runtime = dict(
        qk_scale=0.127, v_scale=1.0, window=0, tokens_per_split=4096 // splits, num_splits=splits,
        num_kv_heads=kv_heads, table_hi=4096,
        stride_qt=32 * head, stride_qh=head, stride_kb=strides[0], stride_kh=strides[1], stride_kn=strides[2],
        stride_kc=strides[3], stride_bt=4096 // block_size, stride_ot=32 * head, stride_oh=head,
        stride_sb=page // 4 if quant == 2 else 0, stride_sh=2, stride_sn=2 * kv_heads,
    )
    constexprs = dict(
        GROUP=4, GROUP_PAD=16, HEAD=head, HEAD_V=head, D_PAD=head, DV_PAD=head, BLOCK_N=block_size,
        TILE=config.tile, SINGLE=splits == 1, WINDOWED=False, DOT_PRECISION=None,
        DOT_DTYPE=tl.float16 if kv.startswith("fp8") else tl.bfloat16,  # NOTE: as attention._dot_dtype picks
        TMA=uses_tma(config, block_size), QUANT=quant,
    )
    return runtime, constexprs


def compile_decode(config: KernelConfig, block_size: int, *, splits: int = 1, capability: int = 90,
                   kv: str = "bf16", quant: int = 0):
    """``triton.compile`` the split kernel for ``cuda:capability`` over a ``kv`` cache (``bf16``,
    ``fp8e4nv``, ``fp8e5``, ``i8``; ``quant`` 1 per tensor, 2 per token and head); the compiled kernel."""
    runtime, constexprs = decode_args(config, block_size, splits=splits, quant=quant, kv=kv)
    pointers = {"q_ptr": "*bf16", "kv_ptr": f"*{kv}", "block_table_ptr": "*i32", "query_start_loc_ptr": "*i32",
                "seq_lens_ptr": "*i32", "part_ml_ptr": "*fp32", "part_acc_ptr": "*fp32", "out_ptr": "*bf16",
                "scale_ptr": "*fp32" if quant == 2 else f"*{kv}"}
    if uses_tma(config, block_size):
        pointers["kv_desc"] = f"tensordesc<{kv}[1, 1, {config.tile}, 128]>"
    else:
        pointers["kv_desc"] = f"*{kv}"  # NOTE: an unused placeholder on the pointer path
    signature, attrs = {}, {}
    for i, name in enumerate(_decode_split_kernel.arg_names):
        if name == "kv_desc" and uses_tma(config, block_size):
            signature[name] = pointers[name]
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(runtime[name], float):
            signature[name] = "fp32"
        elif runtime[name] == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if runtime[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(_decode_split_kernel, signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=config.num_warps or DECODE_WARPS, num_stages=config.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def summary(kernel) -> dict:
    """Shared memory, K/V buffers and async-copy / vector-load counts of a compiled kernel."""
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    return {
        "shared": kernel.metadata.shared,
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "ld_v4": ptx.count("ld.global.v4") + ptx.count("ld.global.L1::evict_first.v4"),
        "evict_first": ptx.count("evict_first"),
        "tma_copies": ptx.count("cp.async.bulk.tensor"),
        "fp8_converts": ptx.count("cvt.rn.f16x2.e4m3x2") + ptx.count("cvt.rn.f16x2.e5m2x2")
        + ptx.count("cvt.rn.bf16x2.e4m3x2"),
        "mma": ptx.count("mma.sync") + ptx.count("wgmma"),
        # NOTE: the head-major grid is 1-D; the request-major one reads its KV head from ctaid.y.
        "grid_dims": 1 + ("%ctaid.y" in ptx) + ("%ctaid.z" in ptx),
    }


if __name__ == "__main__":
    # NOTE: needs the compiler, not the interpreter: run with TRITON_INTERPRET=0.
    name, tile, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    numbers = [a for a in sys.argv[4:] if a.isdigit() and sys.argv[sys.argv.index(a) - 1] != "--quant"]
    warps = int(numbers[0]) if numbers else 4
    stages = int(numbers[1]) if len(numbers) > 1 else 3
    kv = sys.argv[sys.argv.index("--kv") + 1] if "--kv" in sys.argv else "bf16"
    quant = int(sys.argv[sys.argv.index("--quant") + 1]) if "--quant" in sys.argv else 0
    cfg = KernelConfig(tile=tile, num_warps=warps, num_stages=stages, **DECODE_VARIANTS[name])
    k = compile_decode(cfg, block, kv=kv, quant=quant)
    print(json.dumps({"variant": name, "tile": tile, "block_size": block, "num_warps": warps,
                      "num_stages": stages, "kv": kv, "quant": quant, **summary(k)}))
    if "--dump" in sys.argv:
        print(k.asm["ttgir"])
