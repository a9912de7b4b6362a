"""The benchmarks' options as tables, and their argparse types, without torch.

So ``kvcore bench NAME --help`` and usage errors come back at once; the benchmark module is
imported only when it runs. A type's error names the value and what is accepted.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcore.cli import KV_CACHE_DTYPES, LAYOUT_NAMES, layout_arg, positive_int_arg, size_arg

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("bfloat16", "float16", "float32")
#: Parts of ``kvcore bench hf`` that ``--skip`` may leave out.
#: ``reference``: with ``--kv-cache-dtype``, the model-dtype cache again through the torch backend.
HF_PARTS = ("eager", "generate_batch", "static", "llama", "prefix", "check", "profile", "reference")
#: Most blocks ``kvcore bench pool`` handles per round: seconds a round on one core.
POOL_MAX_BLOCKS = 1 << 20
#: NIXL memory kinds and peers of ``kvcore bench transfer``.
MEMORY_KINDS = ("DRAM", "VRAM", "VRAM-DRAM")
PEER_KINDS = ("local", "process")
#: ``kvcore bench transfer``'s sizes on a GPU (2 MiB blocks) and on a CPU (a run of seconds).
GPU_TRANSFER_DEFAULTS = {"layers": 32, "kv_heads": 8, "head_size": 128, "blocks": [16, 256],
                         "nixl_blocks": [64, 256], "repeats": 10, "warmup": 2}
CPU_TRANSFER_DEFAULTS = {"layers": 4, "kv_heads": 2, "head_size": 32, "blocks": [4, 32],
                         "nixl_blocks": [8], "repeats": 3, "warmup": 1}


def _comma_separated(item: Callable[[str], object], what: str) -> Callable[[str], list]:
    """argparse type: comma-separated values, each read by ``item``."""

    def parse(text: str) -> list:
        values = [item(v.strip()) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values

    return parse


def _names_arg(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names of ``choices`` (any case), each once."""
    names = {c.upper(): c for c in choices}

    def item(text: str) -> str:
        if text.upper() not in names:
            raise argparse.ArgumentTypeError(f"unknown {text!r}; choose from {list(choices)}")
        return names[text.upper()]

    parse = _comma_separated(item, " / ".join(choices))
    return lambda text: list(dict.fromkeys(parse(text)))


positive_ints_arg = _comma_separated(positive_int_arg, "positive integers")
layouts_arg = _comma_separated(layout_arg, "layout names")


def device_arg(text: str) -> torch.device:
    """argparse type: a torch device this machine has, ``cpu`` or ``cuda[:N]``."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        device = None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        problem = " is not a device; use 'cpu', 'cuda' or 'cuda:N'"
    elif device.type not in ("cpu", "cuda"):
        problem = f": kvcore runs on 'cpu' or 'cuda[:N]' devices, not {device.type!r}"
    elif device.type == "cuda" and count == 0:
        problem = ": this machine has no CUDA device; use --device cpu"
    elif device.type == "cuda" and device.index is not None and device.index >= count:
        problem = (f": this machine has {count} CUDA device{'s' * (count > 1)} "
                   f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); pick one of them")
    else:
        return device
    raise argparse.ArgumentTypeError(f"{text!r}{problem}")


# NOTE: an option is (flag, type, default, help[, extra add_argument keywords]); the type is an
# argparse type, a tuple of choices or "flag" (store_true). Help gains "(default: ...)" when the
# default is set and the help does not say it already.
INT, INTS, FLAG = positive_int_arg, positive_ints_arg, "flag"
_JSON = ("--json", FLAG, False, "print the results as JSON")
_JSON_TABLES = ("--json", FLAG, False, "print the results as JSON instead of tables")
_JSON_OUT = ("--json-out", None, None, "also write the JSON to PATH (default: none)",
             {"metavar": "PATH"})


def _dtype(help: str) -> tuple:
    return ("--dtype", DTYPE_NAMES, "bfloat16", help)


def _sized(key: str) -> str:
    """Help text for a transfer option whose default depends on the device."""
    shown = [",".join(map(str, v)) if isinstance(v, list) else str(v)
             for v in (GPU_TRANSFER_DEFAULTS[key], CPU_TRANSFER_DEFAULTS[key])]
    return f"(default: {shown[0]} on CUDA, {shown[1]} on CPU)"


_ZERO = {
    "the model whose KV cache is zeroed": [
        ("--layers", INT, 32, "attention layers"),
        ("--kv-heads", INT, 8, "KV heads per layer"),
        ("--head-size", INT, 128, "values per head, for K and for V"),
        ("--block-size", INT, 16, "tokens per block"),
        _dtype("cache dtype"),
    ],
    "what is measured": [
        ("--blocks", INTS, "1,8,64,512,4096", "comma-separated counts of blocks zeroed per call"),
        ("--layouts", layouts_arg, "LBNHC,BLNHC,LHBNC", "comma-separated layouts"),
        ("--pool-blocks", INT, None, "blocks allocated (default: twice the largest --blocks)",
         {"metavar": "N"}),
        ("--repeats", INT, 20, "timed repeats; medians are reported"),
        ("--one-block-repeats", INT, 300,
         "repeats of the one-block zeroer/memset pair, at least --repeats", {"metavar": "N"}),
        ("--warmup", INT, 3, "untimed calls before each measurement"),
    ],
    "output": [_JSON_TABLES, _JSON_OUT],
    "kernel tuning (defaults are the library's)": [
        ("--programs-per-sm", INT, None, "grid cap: programs per SM (default: the library's)",
         {"metavar": "N"}),
        ("--chunk-kib", INT, None, "largest work item, KiB (default: the library's)",
         {"metavar": "KIB"}),
    ],
}
_PLAN = {None: [
    ("--layers", INT, 200, "layers of the hybrid model"),
    ("--repeat", INT, 100, "timed plans per layout; the median is reported"),
    ("--memory", size_arg, "80GiB", "KV cache budget of every plan", {"metavar": "SIZE"}),
    ("--layouts", layouts_arg, ",".join(LAYOUT_NAMES), "comma-separated layouts to time"),
    _JSON,
]}
_POOL = {None: [
    ("--requests", INT, 64, f"requests per round; requests x blocks at most {POOL_MAX_BLOCKS:,}"),
    ("--blocks", INT, 32, "blocks per request"),
    ("--block-size", INT, 16, "tokens per block, for hashing"),
    ("--repeat", INT, 50, "timed rounds"),
    ("--json", FLAG, False, "print the rows as JSON"),
]}
_HF = {
    "model (random weights, Llama architecture)": [
        ("--model", ("llama", "hybrid"), "llama", ("llama, or hybrid: Granite-4.0-H-like "
         "Mamba2 mixers, one attention layer in 8")),
        ("--hidden", INT, 2048, "hidden size"),
        ("--intermediate", INT, 5632, "MLP size"),
        ("--layers", INT, 16, "decoder layers"),
        ("--heads", INT, 32, "query heads"),
        ("--kv-heads", INT, 8, "KV heads"),
        ("--vocab", INT, 32000, "vocabulary size"),
        _dtype("weights and cache"),
    ],
    "workload": [
        ("--requests", INT, 256, "prompts served"),
        ("--prompt-len", INT, 256, "tokens per prompt"),
        ("--new-tokens", INT, 128, "tokens generated per prompt"),
        ("--shared-prefix", int, 1024,
         "common prefix of the prefix-caching run, tokens; 0 skips that run"),
    ],
    "kvcore engine": [
        ("--backend", str, "auto",
         "attention backend: auto, flashinfer, triton, torch, or any registered name"),
        ("--block-size", INT, None,
         "tokens per block (default: the backend's preference, as kvcore.hf.Engine)"),
        ("--max-num-seqs", INT, 256, "requests at once"),
        ("--max-batched-tokens", INT, None,
         "tokens per step (default: kvcore.hf.Engine's, 4096 on a GPU)"),
        ("--no-cuda-graphs", FLAG, False, "run decode steps eagerly"),
        ("--mixer-backend", str, "auto",
         "a hybrid's mixer backend: auto, triton-mixer, torch-mixer, or any registered name"),
        ("--kv-cache-dtype", KV_CACHE_DTYPES, "auto",
         f"KV cache mode: {', '.join(KV_CACHE_DTYPES)}; other than auto, the same requests also run "
         "on the model-dtype cache, for the speed ratio and the share of requests whose greedy "
         "tokens are the same", {"metavar": "MODE"}),
    ],
    "float32 token check (a smaller model)": [
        ("--check-requests", INT, 16, "prompts checked"),
        ("--check-prompt-len", INT, 64, "tokens per prompt"),
        ("--check-new-tokens", INT, 32, "tokens generated"),
    ],
    None: [
        ("--skip", _names_arg(HF_PARTS), [],
         f"comma-separated parts to leave out: {','.join(HF_PARTS)} (default: none)"),
        ("--peak-tflops", float, None, "matrix peak of the roofline, TFLOP/s (default: the GPU's where known)"),
        ("--hbm-tbps", float, None, "memory bandwidth of the roofline, TB/s (default: the GPU's where known)"),
        ("--device", device_arg, None,
         "torch device, cpu or cuda[:N] (default: cuda when present, else cpu)"),
        _JSON, _JSON_OUT,
    ],
}
_TRANSFER = {
    "the model whose KV cache blocks move": [
        ("--layers", INT, None, f"attention layers {_sized('layers')}"),
        ("--kv-heads", INT, None, f"KV heads per layer {_sized('kv_heads')}"),
        ("--head-size", INT, None, f"values per head, for K and for V {_sized('head_size')}"),
        ("--block-size", INT, 16, "tokens per block; with the GPU defaults 16 makes 2 MiB blocks"),
        _dtype("cache dtype"),
    ],
    "what is measured": [
        ("--layouts", layouts_arg, ",".join(LAYOUT_NAMES),
         "comma-separated layouts (default: all six)"),
        ("--blocks", INTS, None,
         f"comma-separated counts of blocks moved per host call {_sized('blocks')}"),
        ("--device", device_arg, None, "cache device (default: cuda when present, else cpu)"),
        ("--no-host", FLAG, False, "skip the host offload / restore rows"),
        ("--nixl-blocks", INTS, None,
         f"comma-separated counts of blocks per NIXL transfer {_sized('nixl_blocks')}"),
        ("--nixl-memory", _names_arg(MEMORY_KINDS), None, (
            "NIXL memory kinds: DRAM, VRAM, VRAM-DRAM (this cache on the GPU, the peer's in host "
            "memory) (default: all three on CUDA, else DRAM)")),
        ("--nixl-peer", PEER_KINDS, None, ("the NIXL peer: a second agent of this process, "
         "or one in a spawned process (default: process on CUDA, local on CPU)")),
        ("--nixl-no-progress-thread", FLAG, True, ("let NIXL progress transfers only "
         "when polled, in the caller's thread (default: NIXL's progress thread does it)"),
         {"dest": "nixl_progress_thread", "action": "store_false"}),
        ("--no-nixl", FLAG, False, "skip the NIXL rows"),
        ("--descriptors", INT, None, ("instead of moving bytes, count the NIXL "
         "descriptors of N blocks per layout and time building them (runs on a CPU; head size 1)"),
         {"metavar": "N"}),
        ("--repeats", INT, None, f"timed repeats; medians are reported {_sized('repeats')}"),
        ("--warmup", INT, None, f"untimed calls before each measurement {_sized('warmup')}"),
    ],
    "output": [_JSON_TABLES, _JSON_OUT],
}
_ELASTIC = {None: [
    ("--model", str, "llama-3-8b", "preset name or TOML file"),
    ("--max-blocks", INT, 2048, "blocks reserved"),
    ("--granularity", size_arg, 2 * 2**20, "commit unit (default: 2MiB)"),
    ("--measure", FLAG, False, "also time grow / shrink on --device"),
    ("--device", device_arg, None, "cuda or cpu (default: cuda when present)"),
    ("--gib", INT, 1, "GiB committed at once"),
    ("--repeat", INT, 20, "granules timed one by one"),
    ("--json", FLAG, False, "print one JSON object"),
]}


def _add_options(table: dict, parser: argparse.ArgumentParser) -> None:
    """Add the options of ``table`` (group title or None -> options) to ``parser``."""
    for title, options in table.items():
        group = parser.add_argument_group(title) if title else parser
        for flag, kind, default, help, *extra in options:
            kwargs = {"action": "store_true"} if kind == FLAG else (
                {"choices": kind} if isinstance(kind, tuple) else {"type": kind})
            kwargs.update(extra[0] if extra else {})
            if default is not None and not isinstance(default, bool) and "(default" not in help:
                help += " (default: %(default)s)"
            group.add_argument(flag, default=default, help=help, **kwargs)


#: Benchmark name -> the function that adds its options.
ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    name: functools.partial(_add_options, table)
    for name, table in (("zero", _ZERO), ("plan", _PLAN), ("transfer", _TRANSFER), ("hf", _HF),
                        ("pool", _POOL), ("elastic", _ELASTIC))
}
