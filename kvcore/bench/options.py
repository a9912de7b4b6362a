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


ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "zero": zero_arguments,
    "plan": plan_arguments,
    "pool": pool_arguments,
    "hf": hf_arguments,
}
