"""examples/quickstart.py says what each stride it prints is, and the numbers are the layout's."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

from kvcore import FullAttentionSpec, KVCacheLayout, compute_layout_strides

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def _numbers(cells: dict[str, str]) -> dict[str, int]:
    return {k: int(v.replace(",", "")) for k, v in cells.items()}


def test_quickstart_names_every_stride(capsys):
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    spec = FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    dims = ("layer", "block", "head", "token", "value")
    for layout in KVCacheLayout:
        section = out.split(f"\n{layout.name}: ")[1].split("\n\n")[0].splitlines()
        order = [d.strip() for d in section[0].split("outermost first:")[1].split(",")]
        assert order == [dims["LBHNC".index(c)] for c in layout.name]
        header = next(line for line in section if "to the next" in line).split()[3:]
        assert header == list(dims)
        byte_line = dict(zip(header, next(line for line in section if line.split()[0] == "bytes").split()[1:]))
        want = compute_layout_strides(spec, 32, 4, layout)
        # Bytes between neighbours: the layout's strides, whose C dim counts bytes; the next
        # bf16 value is 2 bytes away (issue #22: it was labelled 1).
        assert _numbers(byte_line) == {**dict(zip(dims[:4], want[:4])), "value": 2}
        assert want[4] == 1
        element_line = dict(zip(header, next(line for line in section if line.split()[0] == "elements").split()[1:]))
        assert element_line.pop("layer") == "-"
        # Element strides of a layer's [B, H, N, C] view: its byte strides over 2 (bf16),
        # values next to each other.
        assert _numbers(element_line) == {**{d: s // 2 for d, s in zip(dims[1:4], want[1:4])}, "value": 1}
