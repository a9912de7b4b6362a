"""The NIXL rows of ``kvcore bench transfer``, printed layout by layout as each finishes.

For a short lease: a command stopped at its time limit still returns the
layouts already measured. Takes ``kvcore bench transfer``'s options.

    python scripts/gpu_nixl_rows.py --nixl-memory VRAM --nixl-blocks 16,64 --repeats 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcore.bench import transfer
from kvcore.bench.transfer_nixl import nixl_rows, print_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    transfer.add_arguments(parser)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    memories = args.nixl_memory or (["VRAM"] if device.type == "cuda" else ["DRAM"])
    gen = torch.Generator().manual_seed(0)
    every = []
    for memory in memories:
        for layout in args.layouts:
            start = time.perf_counter()
            rows = nixl_rows(args, lambda lay, n, on: transfer._cache(args, lay, n, on), layout, memory, device, gen)
            print_rows(rows)
            print(f"({memory} {layout.name}: {time.perf_counter() - start:.1f} s with setup)", flush=True)
            every += rows
            if args.json_out:
                with open(args.json_out, "w") as f:
                    json.dump(every, f, indent=2)


if __name__ == "__main__":
    main()
