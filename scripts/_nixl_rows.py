"""The NIXL rows of ``kvcore bench transfer``, printed layout by layout as each finishes.

For a short lease: a command stopped at its time limit still returns the
layouts already measured. Takes ``kvcore bench transfer``'s options.

    python scripts/_nixl_rows.py --nixl-memory VRAM --nixl-blocks 16,64 --repeats 3 --warmup 1
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from kvcore_bench import transfer
from kvcore_bench.transfer_nixl import nixl_rows, print_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    transfer.add_arguments(parser)
    args = transfer.resolve(parser.parse_args())
    transfer._quiet_nixl()
    memories = args.nixl_memory or (["VRAM"] if args.device.type == "cuda" else ["DRAM"])
    gen = torch.Generator().manual_seed(0)
    every = []
    for memory in memories:
        for layout in args.layouts:
            start = time.perf_counter()
            make = functools.partial(transfer.build_cache, transfer.model_of(args), layout.name)
            try:
                rows = nixl_rows(args, make, memory, args.device, gen, args.nixl_peer)
            except Exception as exc:  # NOTE: NIXL/UCX raise their own types; report and go on
                print(f"({memory} {layout.name} failed: {type(exc).__name__}: {exc})", flush=True)
                continue
            print_rows(rows, 80)
            print(f"({memory} {layout.name}: {time.perf_counter() - start:.1f} s with setup)", flush=True)
            every += rows
            if args.json_out:
                with open(args.json_out, "w") as f:
                    json.dump(every, f, indent=2)


if __name__ == "__main__":
    main()
