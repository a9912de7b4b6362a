"""examples/custom_backend: a plugin found through its entry point changes kvcore's choices.

The example is made importable without installing it: its directory goes on
sys.path next to a generated ``.dist-info`` whose entry points are read from
the example's own pyproject.toml.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvcore import (
    CommonAttentionMetadata,
    FullAttentionSpec,
    KVCache,
    KVCacheLayout,
    get_plugin_manager,
    select_common_block_size,
)
from kvcore.plugins import list_plugins

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PACKAGE = EXAMPLES / "custom_backend"


@pytest.fixture
def example_pm(tmp_path, monkeypatch):
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    info = tmp_path / f"kvcore_example-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
             for group, eps in project["entry-points"].items()]
    (info / "entry_points.txt").write_text("\n".join(lines))
    monkeypatch.syspath_prepend(str(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KVCORE_PLUGINS", raising=False)
    monkeypatch.delenv("KVCORE_BLOCK_PLUGINS", raising=False)
    yield get_plugin_manager()
    sys.modules.pop("kvcore_example", None)


def test_plugin_is_discovered_with_its_distribution(example_pm):
    info = {p.name: p for p in list_plugins(example_pm)}["example"]
    assert (info.distribution, info.version, info.status) == ("kvcore-example", "0.1.0", "loaded")
    assert info.backends == ["example"]


def test_declared_block_size_changes_the_kernel_block_size(example_pm):
    assert select_common_block_size(64, ["example"], plugin_manager=example_pm) == 16
    assert select_common_block_size(64, ["torch"], plugin_manager=example_pm) == 64
    specs = {f"layers.{i}": FullAttentionSpec(64, 2, 8, torch.float32) for i in range(2)}
    sizes = {}
    for backend in ("example", "torch"):
        kv = KVCache.create(specs, dict.fromkeys(specs, backend), device="cpu", num_blocks=5,
                            max_num_seqs=2, max_model_len=128, plugin_manager=example_pm)
        sizes[backend] = kv.kernel_block_sizes
        assert kv.layout is KVCacheLayout.LBNHC
    assert sizes == {"example": [16], "torch": [64]}
    assert kv.layer_kv_caches["layers.0"].shape == (5, 2, 64, 16)


def test_example_backend_serves_the_engine(example_pm):
    sys.path.insert(0, str(EXAMPLES))
    try:
        from tiny_engine import Engine
        from tiny_model import ModelConfig, TinyTransformer
    finally:
        sys.path.remove(str(EXAMPLES))
    config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=8)
    kv = KVCache.create(config.kv_cache_specs(64, torch.float32),
                        {config.layer_name(i): "example" for i in range(2)}, device="cpu", num_blocks=3,
                        max_num_seqs=2, max_model_len=128, plugin_manager=example_pm)
    assert kv.kernel_block_sizes == [16]
    model = TinyTransformer(config, dtype=torch.float32, device=torch.device("cpu"))
    engine = Engine(model, kv, kv.group_of(config.layer_name(0)).backend, token_budget=32, max_num_seqs=2)
    gen = torch.Generator().manual_seed(0)
    for length in (50, 20, 35):
        engine.add_request(torch.randint(64, (length,), generator=gen).tolist(), 3)
    while engine.has_work:
        engine.step()
    assert len(engine.finished) == 3 and engine.recycled_blocks > 0
    assert engine.max_abs_error < 1e-4


def _attend(kv, q, k, v):
    blocks = kv.block_pool.allocate(2)
    kv.begin_step()
    n = q.shape[0]
    block = kv.block_size(0)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table_tensor=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor([blocks[p // block] * block + p % block for p in range(n)]),
        num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=n,
    )
    meta = kv.build_metadata([common])["a"]
    return kv.group_of("a").backend.forward(q, k, v, kv.layer_kv_caches["a"], meta, head_size=4, scale=0.5)


def test_customize_hook_pads_rows_and_attention_is_unchanged(example_pm):
    specs = {"a": FullAttentionSpec(64, 2, 4, torch.float32)}  # rows of 32 bytes: padded to 64
    made = {b: KVCache.create(specs, {"a": b}, device="cpu", num_blocks=4, max_num_seqs=1,
                              max_model_len=128, plugin_manager=example_pm) for b in ("example", "torch")}
    padded = made["example"].config.kv_cache_groups[0].kv_cache_spec
    assert padded.state_content_size_bytes == 64 and made["example"].group_of("a").kv_cache_spec == padded
    assert made["example"].layer_kv_caches["a"].shape == (16, 2, 16, 16)  # C = 16 floats, kernel blocks of 16
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(70, h, 4, generator=gen) for h in (4, 2, 2))
    torch.testing.assert_close(_attend(made["example"], q, k, v), _attend(made["torch"], q, k, v))
