"""The memory model, fuzzed: random hybrid models through the public API.

For random models (full, sliding-window, chunked-local, MLA and Mamba layers;
random shapes, dtypes, padding, layouts and budgets) and random backends
(fixed kernel block sizes from an in-process test plugin, and the torch
reference backend), every model kvcore accepts keeps the memory model:

- every view byte lies inside the one allocation;
- within a KV cache group, distinct (layer, block) pairs never share a byte;
  across groups, block b shares bytes only with block b;
- the kernel block rows of manager block b cover exactly b's bytes, in the
  views as allocated and in the kernel views through the kernel block table;
- zeroing clears exactly the listed blocks in every attention and state view
  and nothing else;
- every accepted plan allocates, and every refusal is a ValueError or
  TypeError that names a remedy (a layout it names as able really plans).

"Manager block b's bytes" of a layer are taken from ``allocate_kv_cache``
without kernel splitting: the views as the plan lays them out.
"""

from __future__ import annotations

import re
from fractions import Fraction

import attrs
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import kvcore
import kvcore_torch.plugin
from kvcore import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCache,
    KVCacheLayout,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    allocate_kv_cache,
    plan_kv_cache,
)

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# An imperative that tells the user what to do instead.
REMEDY = re.compile(
    r"\b(use|pass|choose|pick|plan|set|give|add|raise|change|lower|order|pad|call|register|"
    r"reduce|increase|make|align|drop|remove|install|request|split)\b",
    re.IGNORECASE,
)


def _backend(name: str) -> type[kvcore.AttentionBackend]:
    def forward(query, key, value, kv_cache_view, metadata, *, head_size, scale, sliding_window=None, out=None):
        raise NotImplementedError("memory-model tests never run attention")

    return type(name, (kvcore.AttentionBackend,), {"name": name, "forward": staticmethod(forward)})


# Backends whose kernels take only fixed block sizes (as Triton/FlashAttention kernels do).
FIXED = {
    _backend("fixed4"): [4],
    _backend("fixed8"): [8],
    _backend("fixed16"): [16],
    _backend("fixed8or16"): [8, 16],
    _backend("fixed64"): [64],
}


class FixedSizes:
    """A test plugin: registers the fixed-size backends and declares their sizes."""

    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        for backend in FIXED:
            register(backend)

    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return FIXED.get(backend)


def plugin_manager():
    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(kvcore_torch.plugin, name="torch")
    pm.register(FixedSizes(), name="fixed-sizes")
    return pm


BACKEND_WEIGHTS = ["torch", "torch", *(b.name for b in FIXED for _ in range(2) if b.name != "fixed64"), "fixed64"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # NOTE: the tensors here are a few KiB; on a busy 2-core runner torch's
    # intra-op threads only add contention (30 ms for a 40 KiB compare).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- strategies

DTYPES = [torch.int8, torch.float16, torch.bfloat16, torch.float32]
KINDS = ["full", "full", "sliding", "chunked", "mla", "mamba"]
BLOCK_SIZES = [4, 8, 16, 16, 32, 32, 64]


@st.composite
def models(draw):
    """(layer specs in model order, layer backends).

    Half the models are hybrid (any kind and block size per layer); the other
    half keep one kind and block size with random shapes and dtypes, which
    plans as one group of several tensors (a uniform-type group).
    """
    num_layers = draw(st.integers(1, 5))
    kind = block_size = None
    if draw(st.booleans()):
        kind, block_size = draw(st.sampled_from(KINDS)), draw(st.sampled_from(BLOCK_SIZES))
    # NOTE: one or two backends per model, as engines use; a 64-token-only
    # kernel is drawn rarely since most block sizes cannot feed it.
    pool = draw(st.lists(st.sampled_from(BACKEND_WEIGHTS), min_size=1, max_size=2))
    specs, backends = {}, {}
    for i in range(num_layers):
        spec = draw(_layer_spec(kind, block_size))
        name = f"model.layers.{i}"
        specs[name] = spec
        if not isinstance(spec, MambaSpec):
            backends[name] = draw(st.sampled_from(pool))
    return specs, backends


@st.composite
def _layer_spec(draw, kind=None, block_size=None):
    kind = kind or draw(st.sampled_from(KINDS))
    block_size = block_size or draw(st.sampled_from(BLOCK_SIZES))
    dtype = draw(st.sampled_from(DTYPES))
    if kind == "mamba":
        n = draw(st.integers(1, 2))
        shapes = [tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))) for _ in range(n)]
        spec = MambaSpec(block_size, shapes, [draw(st.sampled_from(DTYPES)) for _ in range(n)])
    elif kind == "mla":
        spec = MLAAttentionSpec(block_size, 1, draw(st.sampled_from([2, 4, 8])), dtype)
    else:
        extra = {
            "tokens_per_state": draw(st.sampled_from([1, 1, 1, 2, Fraction(1, 2), 0])),
            "num_head_slots": draw(st.sampled_from([None, None, 4])),
        }
        if kind == "sliding":
            cls, extra["sliding_window"] = SlidingWindowSpec, draw(st.integers(1, 64))
        elif kind == "chunked":
            cls, extra["attention_chunk_size"] = ChunkedLocalAttentionSpec, draw(st.sampled_from([16, 32]))
        else:
            cls = FullAttentionSpec
        spec = cls(block_size, draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4, 8])), dtype, **extra)
    if kind != "mla" and draw(st.integers(0, 4)) == 0:
        align = spec.dtype_alignment
        whole = -(-spec.real_page_size_bytes // align) * align
        spec = attrs.evolve(spec, page_size_padded=whole + draw(st.integers(0, 3)) * align)
    return spec


budgets = st.one_of(
    st.integers(2, 6).map(lambda n: {"num_blocks": n}),
    st.integers(0, 40_000).map(lambda m: {"available_memory": m}),
)
layouts = st.sampled_from(list(KVCacheLayout))
# None lets KVCache.create resolve the layout from the backends and the specs.
create_layouts = st.sampled_from([None, None, None, *KVCacheLayout])


# ---------------------------------------------------------------- the checks


def _raw_of(view: torch.Tensor) -> torch.Tensor:
    """The whole backing allocation of ``view`` as a 1-D int8 tensor."""
    return torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())


def byte_rows(view: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Byte addresses (into ``raw``) of every row of ``view``: ``[rows, bytes per row]``.

    Asserts first that the view shares ``raw``'s storage and lies inside it.
    """
    assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr(), "a view outside the allocation"
    as_bytes = view.view(torch.int8) if view.dtype != torch.int8 else view
    start = as_bytes.data_ptr() - raw.data_ptr()
    end = start + sum((n - 1) * s for n, s in zip(as_bytes.shape, as_bytes.stride()))
    assert 0 <= start and end < raw.numel(), (
        f"view of shape {tuple(view.shape)} spans bytes [{start}, {end}] of a {raw.numel()}-byte allocation"
    )
    index = torch.arange(raw.numel()).as_strided(as_bytes.shape, as_bytes.stride(), start)
    return index.reshape(as_bytes.shape[0], -1)


def manager_bytes(config) -> dict[str, torch.Tensor]:
    """Each viewed layer's ``[num_blocks, bytes]`` addresses, as the plan lays blocks out."""
    views = allocate_kv_cache(config, "cpu")
    out = {}
    for name, view in views.items():
        if view.dim() == 4:
            out[name] = byte_rows(view, _raw_of(view))
            assert out[name].shape[0] == config.num_blocks
    return out


def check_layout(config, blocks: dict[str, torch.Tensor]) -> None:
    """No byte shared within a group; across groups block b meets only block b."""
    size = config.kv_cache_tensors[0].size
    owners = []
    for group in config.kv_cache_groups:
        rows = [blocks[n] for n in group.layer_names if n in blocks]
        if not rows:
            continue
        flat = torch.cat([r.flatten() for r in rows])
        shared = f"two (layer, block) pairs of {group.layer_names} share a byte"
        assert int(torch.bincount(flat, minlength=size).max()) == 1, shared
        if len(config.kv_cache_groups) > 1:
            owner = torch.full((size,), -1, dtype=torch.int64)
            block_of = torch.cat([torch.arange(r.shape[0]).repeat_interleave(r.shape[1]) for r in rows])
            owner[flat] = block_of
            owners.append(owner)
    for i in range(len(owners)):
        for j in range(i):
            both = (owners[i] >= 0) & (owners[j] >= 0)
            assert torch.equal(owners[i][both], owners[j][both]), "block b of one group overlays another block"


def _same_bytes(rows: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(torch.sort(rows.flatten()).values, torch.sort(expected.flatten()).values)


def check_kernel_blocks(kv: KVCache, blocks: dict[str, torch.Tensor]) -> None:
    """Kernel rows of manager block b cover exactly b's bytes (views and block tables)."""
    nb = kv.num_blocks
    raw = _raw_of(next(iter(kv.kv_caches.values())))
    for name, expected in blocks.items():
        allocated = byte_rows(kv.kv_caches[name], raw)
        assert allocated.shape[0] % nb == 0, f"{name}: {allocated.shape[0]} rows for {nb} blocks"
        ratio = allocated.shape[0] // nb
        for b in range(nb):
            assert _same_bytes(allocated[b * ratio : (b + 1) * ratio], expected[b]), f"{name}: block {b} as allocated"
    table = torch.arange(nb, dtype=torch.int32).unsqueeze(1)
    for groups in kv.attn_groups:
        for group in groups:
            kernel_table = group.map_to_kernel_block_table(table)
            spec = group.kv_cache_spec
            kernel_size = group.kernel_block_size or spec.block_size
            assert kernel_table.shape == (nb, spec.block_size // kernel_size)
            for builder in group.metadata_builders:
                assert builder.kv_cache_spec.block_size == kernel_size, "builder and kernel table disagree"
            for name in group.layer_names:
                view = kv.layer_kv_caches[name]
                assert view.shape[2] == spec.get_num_kernel_states(kernel_size), f"{name}: kernel view rows"
                assert int(kernel_table.max()) < view.shape[0], (
                    f"{name}: kernel block {int(kernel_table.max())} past a {view.shape[0]}-row kernel view"
                )
                rows = byte_rows(view, raw)
                for b in range(nb):
                    got = rows[kernel_table[b].long()]
                    assert _same_bytes(got, blocks[name][b]), f"{name}: kernel rows of manager block {b}"


def check_zeroing(kv: KVCache, blocks: dict[str, torch.Tensor], ids: list[int], seed: int) -> None:
    """Zeroing ``ids`` clears their bytes in every view, and no byte of any other block."""
    raw = _raw_of(next(iter(kv.kv_caches.values())))
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(1, 128, raw.shape, generator=gen, dtype=torch.int8))
    before = raw.clone()
    kv.zeroer.zero_block_ids(ids)
    listed = torch.zeros(raw.numel(), dtype=torch.bool)
    hull = torch.zeros(raw.numel(), dtype=torch.bool)
    viewed = torch.zeros(raw.numel(), dtype=torch.bool)
    for rows in blocks.values():
        viewed[rows.flatten()] = True
        for b in ids:
            listed[rows[b]] = True
            hull[int(rows[b].min()) : int(rows[b].max()) + 1] = True
    assert bool((raw[listed] == 0).all()), "a listed block's byte was not cleared"
    unlisted = viewed & ~listed
    assert torch.equal(raw[unlisted], before[unlisted]), "a byte of an unlisted block changed"
    outside = ~viewed & ~hull
    assert torch.equal(raw[outside], before[outside]), "a byte outside every listed block changed"


def check_refusal(exc: Exception) -> None:
    assert isinstance(exc, (ValueError, TypeError)), f"{type(exc).__name__} reached the user: {exc}"
    assert REMEDY.search(str(exc)), f"the refusal names no remedy: {exc}"


# ---------------------------------------------------------------- properties


@SETTINGS
@given(specs_backends=models(), layout=layouts, budget=budgets)
def test_every_accepted_plan_allocates_and_keeps_blocks_apart(specs_backends, layout, budget):
    specs, _ = specs_backends
    try:
        config = plan_kv_cache(specs, layout, **budget)
    except (ValueError, TypeError) as exc:
        check_refusal(exc)
        able = re.search(r"all that can: ([A-Z, ]+)\)$", str(exc))
        event(f"plan refused: {str(exc)[:50]}")
        for name in able.group(1).split(", ") if able else ():
            other = plan_kv_cache(specs, name, num_blocks=2)
            check_layout(other, manager_bytes(other))
        return
    event(f"planned: {len(config.kv_cache_groups)} group(s), {len(config.kv_cache_tensors)} tensor(s)")
    blocks = manager_bytes(config)
    assert set(blocks) == set(config.layer_names)  # no encoder-only layers here: all are viewed
    check_layout(config, blocks)
    check_states(config)


def check_states(config) -> None:
    """Every state tensor of every state cache is aligned to its element size."""
    views = allocate_kv_cache(config, "cpu")
    for name, view in views.items():
        spec = config.group_of(name)[1].spec_of(name)
        if isinstance(spec, MambaSpec):
            states = spec.split_states(view)
            assert [s.dtype for s in states] == list(spec.dtypes)


@SETTINGS
@given(
    specs_backends=models(),
    layout=create_layouts,
    num_blocks=st.integers(2, 5),
    pick=st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True),
    seed=st.integers(0, 2**16),
)
def test_kv_cache_keeps_the_memory_model(specs_backends, layout, num_blocks, pick, seed):
    specs, backends = specs_backends
    pm = plugin_manager()
    try:
        kv = KVCache.create(
            specs, backends, device="cpu", layout=layout, num_blocks=num_blocks,
            max_num_seqs=num_blocks, max_model_len=64, plugin_manager=pm,
        )
    except (ValueError, TypeError) as exc:
        check_refusal(exc)
        event(f"create refused: {str(exc)[:50]}")
        return
    event("created" + (" with kernel splits" if any(g.kernel_block_size for gs in kv.attn_groups for g in gs) else ""))
    blocks = manager_bytes(kv.config)
    check_layout(kv.config, blocks)
    check_kernel_blocks(kv, blocks)
    ids = sorted({p % num_blocks for p in pick})
    check_zeroing(kv, blocks, ids, seed)


# ---------------------------------------------------------------- the reproductions


def test_packed_one_state_cache_kernel_table_stays_inside_its_block():
    # #14 item 1: a block-outermost cache of one state per block and a fixed-size backend
    spec = FullAttentionSpec(128, 1, 64, torch.bfloat16, tokens_per_state=0)
    specs = {"l0": spec, "l1": spec}
    try:
        kv = KVCache.create(
            specs, dict.fromkeys(specs, "fixed64"), device="cpu", layout="BLHNC", num_blocks=4,
            max_num_seqs=4, max_model_len=512, plugin_manager=plugin_manager(),
        )
    except (ValueError, TypeError) as exc:
        check_refusal(exc)
        return
    blocks = manager_bytes(kv.config)
    check_kernel_blocks(kv, blocks)
    check_zeroing(kv, blocks, [3], seed=1)


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_mixed_element_sizes_keep_the_memory_model(layout):
    # #14 item 3: float16 state pages beside float32 attention and state pages
    specs = {
        "m.0": MambaSpec(16, [(5,)], [torch.float16]),
        "a.1": FullAttentionSpec(16, 1, 1, torch.float32),
        "m.2": MambaSpec(16, [(2,)], [torch.float32]),
    }
    try:
        kv = KVCache.create(
            specs, {"a.1": "fixed8"}, device="cpu", layout=layout, num_blocks=5,
            max_num_seqs=5, max_model_len=64, plugin_manager=plugin_manager(),
        )
    except (ValueError, TypeError) as exc:
        check_refusal(exc)
        return
    blocks = manager_bytes(kv.config)
    check_layout(kv.config, blocks)
    check_kernel_blocks(kv, blocks)
    check_zeroing(kv, blocks, [1, 4], seed=2)


@pytest.mark.parametrize("budget", [{"available_memory": 0}, {"num_blocks": 3}])
def test_encoder_only_model_creates_a_usable_pool(budget):
    # #14 item 4: an encoder-only model planned one block and KVCache.create failed in BlockPool
    enc = kvcore.EncoderOnlyAttentionSpec(16, 2, 8, torch.float16)
    specs = {"enc.0": enc, "enc.1": enc}
    kv = KVCache.create(
        specs, dict.fromkeys(specs, "torch"), device="cpu", max_num_seqs=2, max_model_len=64,
        plugin_manager=plugin_manager(), **budget,
    )
    assert kv.num_blocks == budget.get("num_blocks", 2) and kv.kv_caches == {}
    ids = kv.block_pool.allocate(kv.num_blocks - 1)
    assert kv.begin_step() == ids  # nothing to zero, and nothing fails
