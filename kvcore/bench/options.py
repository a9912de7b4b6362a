"""The options of the benchmarks, defined without importing torch.

``kvcore bench NAME --help`` builds its parser from here, so help (and a
usage error) comes back at once; the benchmark module itself (which imports
torch, and maybe transformers) is imported only when the benchmark runs.
``ARGUMENTS`` maps a benchmark name to the function that adds its options; a
benchmark missing from it is asked for ``add_arguments`` on its own module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvcore.bench._args import (
    LAYOUT_NAMES,
    device_arg,
    layouts_arg,
    positive_int_arg,
    positive_ints_arg,
    size_arg,
)

#: Cache / weight dtypes the benchmarks take, by torch name.
DTYPE_NAMES = ("bfloat16", "float16", "float32")
#: Parts of ``kvcore bench hf`` that ``--skip`` may leave out.
HF_PARTS = ("eager", "generate_batch", "static", "prefix", "check", "profile")
#: Most blocks ``kvcore bench pool`` handles per round (requests x blocks): a
#: few seconds a round on one core; a larger run would be silent for minutes.
POOL_MAX_BLOCKS = 1 << 20
_D = " (default: %(default)s)"
#: NIXL memory kinds and peers of ``kvcore bench transfer``.
MEMORY_KINDS = ("DRAM", "VRAM", "VRAM-DRAM")
PEER_KINDS = ("local", "process")
#: ``kvcore bench transfer``'s model and measurement sizes on a GPU (2 MiB blocks) and, so a
#: run takes seconds, on a CPU.
GPU_TRANSFER_DEFAULTS = {"layers": 32, "kv_heads": 8, "head_size": 128, "blocks": [16, 256],
                         "nixl_blocks": [64, 256], "repeats": 10, "warmup": 2}
CPU_TRANSFER_DEFAULTS = {"layers": 4, "kv_heads": 2, "head_size": 32, "blocks": [4, 32], "nixl_blocks": [8],
                         "repeats": 3, "warmup": 1}
ALL_LAYOUTS = ",".join(LAYOUT_NAMES)


def hf_parts_arg(text: str) -> list[str]:
    """argparse type: comma-separated parts of ``bench hf``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = sorted(set(parts) - set(HF_PARTS))
    if bad:
        raise argparse.ArgumentTypeError(f"unknown parts {bad}; choose from {list(HF_PARTS)}")
    return parts


def zero_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model whose KV cache is zeroed")
    model.add_argument("--layers", type=positive_int_arg, default=32, help="attention layers" + _D)
    model.add_argument("--kv-heads", type=positive_int_arg, default=8, help="KV heads per layer" + _D)
    model.add_argument("--head-size", type=positive_int_arg, default=128,
                       help="values per head, for K and for V" + _D)
    model.add_argument("--block-size", type=positive_int_arg, default=16, help="tokens per block" + _D)
    model.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="cache dtype" + _D)
    measured = parser.add_argument_group("what is measured")
    measured.add_argument("--blocks", type=positive_ints_arg, default="1,8,64,512,4096",
                          help="comma-separated counts of blocks zeroed per call" + _D)
    measured.add_argument("--layouts", type=layouts_arg, default="LBNHC,BLNHC,LHBNC",
                          help="comma-separated layouts" + _D)
    measured.add_argument("--pool-blocks", type=positive_int_arg, default=None, metavar="N",
                          help="blocks allocated (default: twice the largest --blocks)")
    measured.add_argument("--repeats", type=positive_int_arg, default=20,
                          help="timed repeats; medians are reported" + _D)
    measured.add_argument("--one-block-repeats", type=positive_int_arg, default=300, metavar="N",
                          help="repeats of the one-block zeroer/memset pair, at least --repeats" + _D)
    measured.add_argument("--warmup", type=positive_int_arg, default=3,
                          help="untimed calls before each measurement" + _D)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    out.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON to PATH (default: none)")
    tune = parser.add_argument_group("kernel tuning (defaults are the library's)")
    tune.add_argument("--programs-per-sm", type=positive_int_arg, default=None, metavar="N",
                      help="grid cap: programs per SM (default: the library's)")
    tune.add_argument("--chunk-kib", type=positive_int_arg, default=None, metavar="KIB",
                      help="largest work item, KiB (default: the library's)")


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=positive_int_arg, default=200, help="layers of the hybrid model" + _D)
    parser.add_argument("--repeat", type=positive_int_arg, default=100,
                        help="timed plans per layout; the median is reported" + _D)
    parser.add_argument("--memory", type=size_arg, default="80GiB", metavar="SIZE",
                        help="KV cache budget of every plan" + _D)
    parser.add_argument("--layouts", type=layouts_arg, default=",".join(LAYOUT_NAMES),
                        help="comma-separated layouts to time" + _D)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def pool_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int_arg, default=64,
                        help=f"requests per round; requests x blocks at most {POOL_MAX_BLOCKS:,}" + _D)
    parser.add_argument("--blocks", type=positive_int_arg, default=32, help="blocks per request" + _D)
    parser.add_argument("--block-size", type=positive_int_arg, default=16, help="tokens per block, for hashing" + _D)
    parser.add_argument("--repeat", type=positive_int_arg, default=50, help="timed rounds" + _D)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def hf_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (random weights, Llama architecture)")
    model.add_argument("--model", choices=("llama", "hybrid"), default="llama",
                       help="llama, or hybrid: Granite-4.0-H-like Mamba2 mixers, one attention layer in 8" + _D)
    model.add_argument("--hidden", type=positive_int_arg, default=2048, help="hidden size" + _D)
    model.add_argument("--intermediate", type=positive_int_arg, default=5632, help="MLP size" + _D)
    model.add_argument("--layers", type=positive_int_arg, default=16, help="decoder layers" + _D)
    model.add_argument("--heads", type=positive_int_arg, default=32, help="query heads" + _D)
    model.add_argument("--kv-heads", type=positive_int_arg, default=8, help="KV heads" + _D)
    model.add_argument("--vocab", type=positive_int_arg, default=32000, help="vocabulary size" + _D)
    model.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="weights and cache" + _D)
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=positive_int_arg, default=256, help="prompts served" + _D)
    work.add_argument("--prompt-len", type=positive_int_arg, default=256, help="tokens per prompt" + _D)
    work.add_argument("--new-tokens", type=positive_int_arg, default=128, help="tokens generated per prompt" + _D)
    work.add_argument("--shared-prefix", type=int, default=1024,
                      help="common prefix of the prefix-caching run, tokens; 0 skips that run" + _D)
    engine = parser.add_argument_group("kvcore engine")
    engine.add_argument("--backend", default="auto",
                        help="attention backend: auto, flashinfer, triton, torch, or any registered name" + _D)
    engine.add_argument("--block-size", type=positive_int_arg, default=None,
                        help="tokens per block (default: the backend's preference, as kvcore.hf.Engine)")
    engine.add_argument("--max-num-seqs", type=positive_int_arg, default=256, help="requests at once" + _D)
    engine.add_argument("--max-batched-tokens", type=positive_int_arg, default=None,
                        help="tokens per step (default: kvcore.hf.Engine's, 4096 on a GPU)")
    engine.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    check = parser.add_argument_group("float32 token check (a smaller model)")
    check.add_argument("--check-requests", type=positive_int_arg, default=16, help="prompts checked" + _D)
    check.add_argument("--check-prompt-len", type=positive_int_arg, default=64, help="tokens per prompt" + _D)
    check.add_argument("--check-new-tokens", type=positive_int_arg, default=32, help="tokens generated" + _D)
    parser.add_argument("--skip", type=hf_parts_arg, default=[],
                        help=f"comma-separated parts to leave out: {','.join(HF_PARTS)} (default: none)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="matrix peak of the roofline" + _D)
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="memory bandwidth of the roofline, TB/s" + _D)
    parser.add_argument("--device", type=device_arg, default=None,
                        help="torch device, cpu or cuda[:N] (default: cuda when present, else cpu)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON to PATH")

def memory_kinds_arg(text: str) -> list[str]:
    """argparse type: comma-separated NIXL memory kinds (``DRAM``, ``VRAM``, ``VRAM-DRAM``)."""
    kinds = [k.strip().upper() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in MEMORY_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"expected comma-separated {' / '.join(MEMORY_KINDS)}, got {text!r}")
    return list(dict.fromkeys(kinds))


def _shown(defaults: dict, key: str) -> str:
    value = defaults[key]
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def transfer_arguments(parser: argparse.ArgumentParser) -> None:
    def sized(key: str) -> str:
        return f"(default: {_shown(GPU_TRANSFER_DEFAULTS, key)} on CUDA, {_shown(CPU_TRANSFER_DEFAULTS, key)} on CPU)"

    model = parser.add_argument_group("the model whose KV cache blocks move")
    model.add_argument("--layers", type=positive_int_arg, default=None, help=f"attention layers {sized('layers')}")
    model.add_argument("--kv-heads", type=positive_int_arg, default=None,
                       help=f"KV heads per layer {sized('kv_heads')}")
    model.add_argument("--head-size", type=positive_int_arg, default=None,
                       help=f"values per head, for K and for V {sized('head_size')}")
    model.add_argument("--block-size", type=positive_int_arg, default=16,
                       help="tokens per block; with the GPU defaults 16 makes 2 MiB blocks (default: %(default)s)")
    model.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16",
                       help="cache dtype (default: %(default)s)")
    measured = parser.add_argument_group("what is measured")
    measured.add_argument("--layouts", type=layouts_arg, default=ALL_LAYOUTS,
                          help="comma-separated layouts (default: all six)")
    measured.add_argument("--blocks", type=positive_ints_arg, default=None,
                          help=f"comma-separated counts of blocks moved per host call {sized('blocks')}")
    measured.add_argument("--device", type=device_arg, default=None,
                          help="cache device (default: cuda when present, else cpu)")
    measured.add_argument("--no-host", action="store_true", help="skip the host offload / restore rows")
    measured.add_argument("--nixl-blocks", type=positive_ints_arg, default=None,
                          help=f"comma-separated counts of blocks per NIXL transfer {sized('nixl_blocks')}")
    measured.add_argument("--nixl-memory", type=memory_kinds_arg, default=None,
                          help="NIXL memory kinds: DRAM, VRAM, VRAM-DRAM (this cache on the GPU, the peer's in host "
                               "memory) (default: all three on CUDA, else DRAM)")
    measured.add_argument("--nixl-peer", choices=PEER_KINDS, default=None,
                          help="the NIXL peer: a second agent of this process, or one in a spawned process "
                               "(default: process on CUDA, local on CPU)")
    measured.add_argument("--nixl-no-progress-thread", dest="nixl_progress_thread", action="store_false",
                          help="let NIXL progress transfers only when polled, in the caller's thread "
                               "(default: NIXL's progress thread does it)")
    measured.add_argument("--no-nixl", action="store_true", help="skip the NIXL rows")
    measured.add_argument("--descriptors", type=positive_int_arg, default=None, metavar="N",
                          help="instead of moving bytes, count the NIXL descriptors of N blocks per layout "
                               "and time building them (runs on a CPU; head size 1)")
    measured.add_argument("--repeats", type=positive_int_arg, default=None,
                          help=f"timed repeats; medians are reported {sized('repeats')}")
    measured.add_argument("--warmup", type=positive_int_arg, default=None,
                          help=f"untimed calls before each measurement {sized('warmup')}")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    out.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON to PATH (default: none)")


def elastic_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b", help="preset name or TOML file (default: llama-3-8b)")
    parser.add_argument("--max-blocks", type=positive_int_arg, default=2048, help="blocks reserved (default: 2048)")
    parser.add_argument("--granularity", type=size_arg, default=2 * 2**20, help="commit unit (default: 2MiB)")
    parser.add_argument("--measure", action="store_true", help="also time grow / shrink on --device")
    parser.add_argument("--device", type=device_arg, default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--gib", type=positive_int_arg, default=1, help="GiB committed at once (default: 1)")
    parser.add_argument("--repeat", type=positive_int_arg, default=20, help="granules timed one by one (default: 20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "zero": zero_arguments,
    "plan": plan_arguments,
    "pool": pool_arguments,
    "hf": hf_arguments,
    "transfer": transfer_arguments,
    "elastic": elastic_arguments,
}
