"""The options of ``kvcore plan`` and of the benchmarks, and their argparse types, without torch.

``kvcore bench NAME --help`` builds its parser from here, so help (and a usage
error) comes back at once; the benchmark module itself (which imports torch,
and maybe transformers) is imported only when the benchmark runs. Each type
raises ``argparse.ArgumentTypeError`` naming the value and what is accepted;
argparse adds the option's name. This sits below ``kvcore.cli``, so that
benchmarks never import the command line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcore._units import parse_size

if TYPE_CHECKING:
    import torch

    from kvcore.memory.layout import KVCacheLayout

# NOTE: KVCacheLayout's member names, so that help text needs no torch; a test checks they match.
LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
#: Parts of ``kvcore bench hf`` that ``--skip`` may leave out.
HF_PARTS = ("eager", "generate_batch", "static", "prefix", "check", "profile")
#: Most blocks ``kvcore bench pool`` handles per round (requests x blocks): a
#: few seconds a round on one core; a larger run would be silent for minutes.
POOL_MAX_BLOCKS = 1 << 20
#: NIXL memory kinds and peers of ``kvcore bench transfer``.
MEMORY_KINDS = ("DRAM", "VRAM", "VRAM-DRAM")
PEER_KINDS = ("local", "process")
#: ``kvcore bench transfer``'s model and measurement sizes on a GPU (2 MiB blocks) and, so a
#: run takes seconds, on a CPU.
GPU_TRANSFER_DEFAULTS = {"layers": 32, "kv_heads": 8, "head_size": 128, "blocks": [16, 256],
                         "nixl_blocks": [64, 256], "repeats": 10, "warmup": 2}
CPU_TRANSFER_DEFAULTS = {"layers": 4, "kv_heads": 2, "head_size": 32, "blocks": [4, 32],
                         "nixl_blocks": [8], "repeats": 3, "warmup": 1}
_D = " (default: %(default)s)"


def size_arg(text: str) -> int:
    """argparse type: a byte size such as ``40GiB`` (see :mod:`kvcore._units`)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def layout_arg(text: str) -> KVCacheLayout:
    from kvcore.memory.layout import KVCacheLayout

    try:
        return KVCacheLayout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _comma_separated(item: Callable[[str], object], what: str) -> Callable[[str], list]:
    """argparse type: comma-separated values, each read by ``item``."""

    def parse(text: str) -> list:
        values = [item(v.strip()) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values

    return parse


positive_ints_arg = _comma_separated(positive_int_arg, "positive integers")
layouts_arg = _comma_separated(layout_arg, "layout names")


def hf_parts_arg(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = sorted(set(parts) - set(HF_PARTS))
    if bad:
        raise argparse.ArgumentTypeError(f"unknown parts {bad}; choose from {list(HF_PARTS)}")
    return parts


def memory_kinds_arg(text: str) -> list[str]:
    kinds = [k.strip().upper() for k in text.split(",") if k.strip()]
    if not kinds or not set(kinds) <= set(MEMORY_KINDS):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated {' / '.join(MEMORY_KINDS)}, got {text!r}"
        )
    return list(dict.fromkeys(kinds))


def device_arg(text: str) -> torch.device:
    """argparse type: a torch device this machine has, ``cpu`` or ``cuda[:N]``."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(
            f"{text!r}: kvcore runs on 'cpu' or 'cuda[:N]' devices, not {device.type!r}"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has no CUDA device; use --device cpu"
        )
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {count} CUDA device{'s' * (count > 1)} "
            f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); pick one of them"
        )
    return device


def _int(group, flag: str, default: int | None, help: str, **kwargs) -> None:
    """A positive-integer option; help shows a default that is not None."""
    shown = help if default is None else help + _D
    group.add_argument(flag, type=positive_int_arg, default=default, help=shown, **kwargs)


def _json(group, json_out: bool = False, help: str = "print the results as JSON") -> None:
    group.add_argument("--json", action="store_true", help=help)
    if json_out:
        group.add_argument("--json-out", default=None, metavar="PATH",
                           help="also write the JSON to PATH (default: none)")


def _dtype(group, help: str) -> None:
    group.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help=help + _D)


def zero_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model whose KV cache is zeroed")
    _int(model, "--layers", 32, "attention layers")
    _int(model, "--kv-heads", 8, "KV heads per layer")
    _int(model, "--head-size", 128, "values per head, for K and for V")
    _int(model, "--block-size", 16, "tokens per block")
    _dtype(model, "cache dtype")
    measured = parser.add_argument_group("what is measured")
    measured.add_argument("--blocks", type=positive_ints_arg, default="1,8,64,512,4096",
                          help="comma-separated counts of blocks zeroed per call" + _D)
    measured.add_argument("--layouts", type=layouts_arg, default="LBNHC,BLNHC,LHBNC",
                          help="comma-separated layouts" + _D)
    _int(measured, "--pool-blocks", None, "blocks allocated (default: twice the largest --blocks)",
         metavar="N")
    _int(measured, "--repeats", 20, "timed repeats; medians are reported")
    _int(measured, "--one-block-repeats", 300,
         "repeats of the one-block zeroer/memset pair, at least --repeats", metavar="N")
    _int(measured, "--warmup", 3, "untimed calls before each measurement")
    _json(parser.add_argument_group("output"), json_out=True,
          help="print the results as JSON instead of tables")
    tune = parser.add_argument_group("kernel tuning (defaults are the library's)")
    _int(tune, "--programs-per-sm", None, "grid cap: programs per SM (default: the library's)",
         metavar="N")
    _int(tune, "--chunk-kib", None, "largest work item, KiB (default: the library's)",
         metavar="KIB")


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    _int(parser, "--layers", 200, "layers of the hybrid model")
    _int(parser, "--repeat", 100, "timed plans per layout; the median is reported")
    parser.add_argument("--memory", type=size_arg, default="80GiB", metavar="SIZE",
                        help="KV cache budget of every plan" + _D)
    parser.add_argument("--layouts", type=layouts_arg, default=",".join(LAYOUT_NAMES),
                        help="comma-separated layouts to time" + _D)
    _json(parser)


def pool_arguments(parser: argparse.ArgumentParser) -> None:
    _int(parser, "--requests", 64,
         f"requests per round; requests x blocks at most {POOL_MAX_BLOCKS:,}")
    _int(parser, "--blocks", 32, "blocks per request")
    _int(parser, "--block-size", 16, "tokens per block, for hashing")
    _int(parser, "--repeat", 50, "timed rounds")
    _json(parser, help="print the rows as JSON")


def hf_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (random weights, Llama architecture)")
    model.add_argument("--model", choices=("llama", "hybrid"), default="llama",
                       help="llama, or hybrid: Granite-4.0-H-like Mamba2 mixers, one attention "
                       "layer in 8" + _D)
    for flag, default, help in (
        ("--hidden", 2048, "hidden size"), ("--intermediate", 5632, "MLP size"),
        ("--layers", 16, "decoder layers"), ("--heads", 32, "query heads"),
        ("--kv-heads", 8, "KV heads"), ("--vocab", 32000, "vocabulary size"),
    ):
        _int(model, flag, default, help)
    _dtype(model, "weights and cache")
    work = parser.add_argument_group("workload")
    _int(work, "--requests", 256, "prompts served")
    _int(work, "--prompt-len", 256, "tokens per prompt")
    _int(work, "--new-tokens", 128, "tokens generated per prompt")
    work.add_argument("--shared-prefix", type=int, default=1024, help="common prefix of the "
                      "prefix-caching run, tokens; 0 skips that run" + _D)
    engine = parser.add_argument_group("kvcore engine")
    engine.add_argument("--backend", default="auto", help="attention backend: auto, flashinfer, "
                        "triton, torch, or any registered name" + _D)
    _int(engine, "--block-size", None,
         "tokens per block (default: the backend's preference, as kvcore.hf.Engine)")
    _int(engine, "--max-num-seqs", 256, "requests at once")
    _int(engine, "--max-batched-tokens", None,
         "tokens per step (default: kvcore.hf.Engine's, 4096 on a GPU)")
    engine.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    check = parser.add_argument_group("float32 token check (a smaller model)")
    _int(check, "--check-requests", 16, "prompts checked")
    _int(check, "--check-prompt-len", 64, "tokens per prompt")
    _int(check, "--check-new-tokens", 32, "tokens generated")
    parser.add_argument("--skip", type=hf_parts_arg, default=[], help="comma-separated parts to "
                        f"leave out: {','.join(HF_PARTS)} (default: none)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="matrix peak of the roofline" + _D)
    parser.add_argument("--hbm-tbps", type=float, default=4.8,
                        help="memory bandwidth of the roofline, TB/s" + _D)
    parser.add_argument("--device", type=device_arg, default=None,
                        help="torch device, cpu or cuda[:N] (default: cuda when present, else cpu)")
    _json(parser, json_out=True)


def transfer_arguments(parser: argparse.ArgumentParser) -> None:
    def sized(key: str) -> str:
        gpu, cpu = GPU_TRANSFER_DEFAULTS[key], CPU_TRANSFER_DEFAULTS[key]
        shown = [",".join(map(str, v)) if isinstance(v, list) else str(v) for v in (gpu, cpu)]
        return f"(default: {shown[0]} on CUDA, {shown[1]} on CPU)"

    model = parser.add_argument_group("the model whose KV cache blocks move")
    _int(model, "--layers", None, f"attention layers {sized('layers')}")
    _int(model, "--kv-heads", None, f"KV heads per layer {sized('kv_heads')}")
    _int(model, "--head-size", None, f"values per head, for K and for V {sized('head_size')}")
    _int(model, "--block-size", 16,
         "tokens per block; with the GPU defaults 16 makes 2 MiB blocks")
    _dtype(model, "cache dtype")
    measured = parser.add_argument_group("what is measured")
    measured.add_argument("--layouts", type=layouts_arg, default=",".join(LAYOUT_NAMES),
                          help="comma-separated layouts (default: all six)")
    measured.add_argument("--blocks", type=positive_ints_arg, default=None, help="comma-separated "
                          f"counts of blocks moved per host call {sized('blocks')}")
    measured.add_argument("--device", type=device_arg, default=None,
                          help="cache device (default: cuda when present, else cpu)")
    measured.add_argument("--no-host", action="store_true",
                          help="skip the host offload / restore rows")
    measured.add_argument("--nixl-blocks", type=positive_ints_arg, default=None, help="comma-"
                          f"separated counts of blocks per NIXL transfer {sized('nixl_blocks')}")
    measured.add_argument("--nixl-memory", type=memory_kinds_arg, default=None,
                          help="NIXL memory kinds: DRAM, VRAM, VRAM-DRAM (this cache on the GPU, "
                          "the peer's in host memory) (default: all three on CUDA, else DRAM)")
    measured.add_argument("--nixl-peer", choices=PEER_KINDS, default=None,
                          help="the NIXL peer: a second agent of this process, or one in a "
                          "spawned process (default: process on CUDA, local on CPU)")
    measured.add_argument("--nixl-no-progress-thread", dest="nixl_progress_thread",
                          action="store_false", help="let NIXL progress transfers only when "
                          "polled, in the caller's thread (default: NIXL's progress thread does "
                          "it)")
    measured.add_argument("--no-nixl", action="store_true", help="skip the NIXL rows")
    _int(measured, "--descriptors", None, "instead of moving bytes, count the NIXL descriptors "
         "of N blocks per layout and time building them (runs on a CPU; head size 1)",
         metavar="N")
    _int(measured, "--repeats", None, f"timed repeats; medians are reported {sized('repeats')}")
    _int(measured, "--warmup", None, f"untimed calls before each measurement {sized('warmup')}")
    _json(parser.add_argument_group("output"), json_out=True,
          help="print the results as JSON instead of tables")


def elastic_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b",
                        help="preset name or TOML file (default: llama-3-8b)")
    _int(parser, "--max-blocks", 2048, "blocks reserved")
    parser.add_argument("--granularity", type=size_arg, default=2 * 2**20,
                        help="commit unit (default: 2MiB)")
    parser.add_argument("--measure", action="store_true",
                        help="also time grow / shrink on --device")
    parser.add_argument("--device", type=device_arg, default=None,
                        help="cuda or cpu (default: cuda when present)")
    _int(parser, "--gib", 1, "GiB committed at once")
    _int(parser, "--repeat", 20, "granules timed one by one")
    _json(parser, help="print one JSON object")


#: Benchmark name -> the function that adds its options.
ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "zero": zero_arguments,
    "plan": plan_arguments,
    "transfer": transfer_arguments,
    "hf": hf_arguments,
    "pool": pool_arguments,
    "elastic": elastic_arguments,
}
