"""KVBlockZeroer on CPU: the Triton kernel through the interpreter, and the torch fallback.

Invariants, checked on buffers of random non-zero bytes against masks built
from the layer views in plain torch (never from the zeroer's segments):
- zeroing ids clears exactly the bytes of those blocks in every zeroed layer;
- bad ids raise ValueError and leave every byte unchanged;
- zeroing block b changes exactly the bytes of block b.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides
from kvcore.memory.views import allocate_kv_cache
from kvcore.plugins.backend import AttentionBackend
from kvcore.runtime.attn_group import AttentionGroup
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="CPU runs of the Triton kernel need TRITON_INTERPRET=1 (the Makefile sets it)"
)
BACKENDS = [pytest.param("triton", marks=needs_interpreter), "torch"]


class _Backend(AttentionBackend):
    name = "zeroer-test"


class Case:
    """A random multi-group config over one allocation, and the views to check it with."""

    def __init__(self, rng: random.Random, device: str, max_blocks: int = 6) -> None:
        self.num_blocks = rng.randint(2, max_blocks)
        self.layout = rng.choice(list(KVCacheLayout))
        block_size = rng.choice([4, 8])
        plans, sizes = [], []
        for gid in range(rng.randint(1, 3)):
            spec = self._spec(rng, block_size)
            layers = [f"g{gid}.l{i}" for i in range(rng.randint(1, 3))]
            strides = compute_layout_strides(spec, self.num_blocks, len(layers), self.layout)
            kernel = None
            dense = spec.page_size_padded is None and strides[1] == spec.real_page_size_bytes
            if not isinstance(spec, MambaSpec) and dense:
                kernel = rng.choice([None, block_size // 2, block_size // 4])
            extents = (len(layers), self.num_blocks, spec.num_heads, spec.num_states)
            sizes.append(sum((n - 1) * s for n, s in zip(extents, strides)) + spec.state_content_size_bytes)
            plans.append((spec, layers, strides, kernel))
        size = max(sizes)
        tensors = [KVCacheTensor(size, layers, s[0], s[1]) for _, layers, s, _ in plans]
        groups = [KVCacheGroupSpec(layers, spec) for spec, layers, _, _ in plans]
        config = KVCacheConfig(self.num_blocks, tensors, groups, self.layout)
        self.kernel_block_sizes = [k or spec.block_size for spec, _, _, k in plans]
        self.kv_caches = allocate_kv_cache(config, device, kernel_block_sizes=self.kernel_block_sizes)
        self.groups = [
            [AttentionGroup(_Backend, layers, spec, gid, kernel_block_size=k)]
            for gid, (spec, layers, _, k) in enumerate(plans)
        ]
        self.ratios = {n: spec.block_size // (k or spec.block_size) for spec, ls, _, k in plans for n in ls}
        names = list(self.ratios)
        self.runner_only = set(rng.sample(names, rng.randint(0, len(names) - 1)))
        self.raw = raw_bytes(next(iter(self.kv_caches.values())))

    @staticmethod
    def _spec(rng: random.Random, block_size: int):
        kind = rng.choice(["full", "sliding", "mla", "mamba"])
        dtype = rng.choice([torch.bfloat16, torch.float32])
        heads, head_size = rng.randint(1, 3), rng.choice([2, 4, 8])
        if kind == "mamba":
            return MambaSpec(block_size, [(rng.randint(1, 3), 4), (2 * rng.randint(1, 3),)], [dtype, dtype])
        if kind == "mla":
            return MLAAttentionSpec(block_size, 1, head_size, dtype)
        if kind == "sliding":
            return SlidingWindowSpec(block_size, heads, head_size, dtype, sliding_window=8)
        return FullAttentionSpec(block_size, heads, head_size, dtype)

    def zeroer(self, backend: str, device: str = "cpu", *, from_views: bool = False) -> KVBlockZeroer:
        if from_views:
            zeroer = KVBlockZeroer.from_views(device, self.views(), self.num_blocks, backend=backend)
        else:
            zeroer = KVBlockZeroer(
                device, self.groups, self.kernel_block_sizes, self.kv_caches, self.num_blocks,
                runner_only_attn_layers=self.runner_only, backend=backend,
            )
        assert zeroer.backend == backend
        return zeroer

    def views(self) -> dict:
        """``{layer: (view as allocated, rows per manager block)}`` of the zeroed layers."""
        return {n: (v, self.ratios[n]) for n, v in self.kv_caches.items() if n not in self.runner_only}

    def expected_after(self, before: torch.Tensor, ids: list[int]) -> torch.Tensor:
        names = [n for n in self.kv_caches if n not in self.runner_only]
        views = {n: (self.kv_caches[n], self.ratios[n]) for n in names}
        return expected_after(before, views, ids)


def raw_bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole allocation under ``view`` as uint8."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


def expected_after(before: torch.Tensor, views: dict, ids: list[int]) -> torch.Tensor:
    """``before`` with the bytes of manager blocks ``ids`` of every ``(view, ratio)`` cleared."""
    mask = torch.zeros(before.numel(), dtype=torch.bool, device=before.device)
    for view, ratio in views.values():
        as_bytes = view.view(torch.uint8)
        manager = as_bytes.unflatten(0, (as_bytes.shape[0] // ratio, ratio))
        offset = view.data_ptr() - view.untyped_storage().data_ptr()
        marks = mask.as_strided(manager.shape, manager.stride(), offset)
        for block in ids:
            marks[block] = True
    out = before.clone()
    out[mask] = 0
    return out


def fill_random(raw: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(1, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return raw.clone()


@pytest.mark.parametrize("from_views", [False, True], ids=["groups", "from_views"])
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30, deadline=None, derandomize=True)
@given(rng=st.randoms(use_true_random=False), data=st.data())
def test_zeroes_exactly_the_listed_blocks(backend, from_views, rng, data):
    case = Case(rng, "cpu")
    zeroer = case.zeroer(backend, from_views=from_views)
    ids = data.draw(st.lists(st.integers(0, case.num_blocks - 1), max_size=2 * case.num_blocks))
    before = fill_random(case.raw, rng.randrange(1 << 30))
    zeroer.zero_block_ids(ids)
    assert torch.equal(case.raw, case.expected_after(before, ids))


@needs_interpreter
@settings(max_examples=25, deadline=None, derandomize=True)
@given(rng=st.randoms(use_true_random=False), data=st.data())
def test_zeroing_block_b_changes_exactly_block_b(rng, data):
    case = Case(rng, "cpu")
    zeroer = case.zeroer("triton")
    block = data.draw(st.integers(0, case.num_blocks - 1))
    before = fill_random(case.raw, rng.randrange(1 << 30))
    zeroer.zero_block_ids(torch.tensor([block]))
    expected = case.expected_after(before, [block])
    assert torch.equal(case.raw, expected)
    assert not torch.equal(expected, before)  # block b has bytes in some layer


#: Every form of a non-integer or out-of-range id (#14: a bool is not a block id).
BAD_IDS = [
    [-1], [6], [0, 2**70], [1.0], [True], [0, 1.5], 7, "1", None, 2.0, True, np.True_, np.float64(1.0),
    torch.tensor([0.0]), torch.tensor([True]), torch.tensor([1, 6]), torch.tensor([-3, 1]),
    [torch.tensor(True)], [2, torch.tensor(False)], [np.bool_(True)], [3, np.False_], [torch.tensor([1, 2])],
    [torch.tensor(1.0)], torch.tensor(True), torch.tensor([[True, False]]), torch.ones(2, 2, 2, dtype=torch.bool),
    np.array([True]), np.array([1.0, 2.0]), [np.float32(2)], [2, [3]], [b"1"], (1, True), object(),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_bad_ids_raise_and_write_nothing(backend, bad):
    case = _fixed_case(6)
    zeroer = case.zeroer(backend)
    before = fill_random(case.raw, 11)
    with pytest.raises((ValueError, TypeError), match="block id"):
        zeroer.zero_block_ids(bad)
    assert torch.equal(case.raw, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "good, expected",
    [(5, [5]), (np.int64(3), [3]), ([np.int32(1), 2], [1, 2]), (torch.tensor(4), [4]), ([torch.tensor(2), 0], [2, 0]),
     (np.array([[1], [3]]), [1, 3]), ((1, 2), [1, 2]), (range(2), [0, 1]),
     (torch.tensor([[5, 1]], dtype=torch.int32), [5, 1])],
    ids=repr,
)
def test_every_integer_form_zeroes_its_blocks(backend, good, expected):
    case = _fixed_case(6)
    zeroer = case.zeroer(backend)
    before = fill_random(case.raw, 12)
    zeroer.zero_block_ids(good)
    assert torch.equal(case.raw, case.expected_after(before, expected))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mapping", [{0: 1}, {}, {"a": 2}], ids=repr)
def test_a_mapping_is_no_id_list(backend, mapping):
    case = _fixed_case(6)
    zeroer = case.zeroer(backend)
    before = fill_random(case.raw, 13)
    with pytest.raises(TypeError, match="block ids must be integers.*dict"):
        zeroer.zero_block_ids(mapping)
    assert torch.equal(case.raw, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_blocks_can_shrink_and_grow_back_without_new_segments(backend):
    case = _fixed_case(6)
    zeroer = case.zeroer(backend)
    segments = zeroer.segments
    zeroer.num_blocks = 3
    before = fill_random(case.raw, 14)
    with pytest.raises(ValueError, match=r"block id 4 is not in \[0, 3\)"):
        zeroer.zero_block_ids([1, 4])
    assert torch.equal(case.raw, before)
    zeroer.zero_block_ids([2])
    assert torch.equal(case.raw, case.expected_after(before, [2]))
    zeroer.num_blocks = 6
    after_two = case.raw.clone()
    zeroer.zero_block_ids([5])
    assert torch.equal(case.raw, case.expected_after(after_two, [5]))
    assert zeroer.segments == segments and zeroer.max_num_blocks == 6
    for bad, error in ((7, ValueError), (0, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="num_blocks"):
            zeroer.num_blocks = bad
    assert zeroer.num_blocks == 6


def _fixed_case(num_blocks: int) -> Case:
    for seed in range(100):
        case = Case(random.Random(seed), "cpu")
        if case.num_blocks == num_blocks:
            return case
    raise AssertionError("no seed gives the block count")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_ids_and_warmup_zero_write_nothing(backend):
    case = _fixed_case(5)
    zeroer = case.zeroer(backend)
    before = fill_random(case.raw, 5)
    zeroer.zero_block_ids([])
    zeroer.zero_block_ids(torch.empty(0, dtype=torch.int64))
    zeroer.warmup(0)
    assert torch.equal(case.raw, before)
    zeroer.warmup(3)  # zeroes block 0 only
    assert torch.equal(case.raw, case.expected_after(before, [0]))
    with pytest.raises(ValueError):
        zeroer.warmup(-1)


def _packed_case(device: str = "cpu"):
    """Compressed single-head layers packed block-outermost, split into kernel blocks."""
    spec = FullAttentionSpec(16, 1, 4, torch.float32, tokens_per_state=4)  # 4 states per block
    layout, num_blocks, layers = KVCacheLayout.BLNHC, 5, ["a", "b"]
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout)
    tensor = KVCacheTensor(num_blocks * strides[1], layers, strides[0], strides[1])
    config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(layers, spec)], layout)
    manager = allocate_kv_cache(config, device)
    group = AttentionGroup(_Backend, layers, spec, 0, kernel_block_size=8)
    kernel_views = {n: group.map_kv_cache_to_kernel_blocks(v) for n, v in manager.items()}
    assert group.kernel_block_stride == 4
    return num_blocks, group, manager, kernel_views


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_kernel_views_are_zeroed_by_manager_block(backend):
    num_blocks, group, manager, kernel_views = _packed_case()
    zeroer = KVBlockZeroer("cpu", [group], [16], kernel_views, num_blocks, backend=backend)
    raw = raw_bytes(manager["a"])
    before = fill_random(raw, 1)
    zeroer.zero_block_ids([1, 3])
    assert torch.equal(raw, expected_after(before, {n: (v, 1) for n, v in manager.items()}, [1, 3]))


def test_segments_merge_adjacent_and_overlaid_layers():
    case = _fixed_case(4)
    zeroer = case.zeroer("torch")
    # Merged runs of one stride never touch, so no byte is zeroed twice.
    by_stride: dict[int, list] = {}
    for seg in zeroer.segments:
        by_stride.setdefault(seg.block_stride, []).append(seg)
    for segs in by_stride.values():
        segs.sort(key=lambda s: s.offset)
        assert all(a.offset + a.page < b.offset for a, b in zip(segs, segs[1:]))


def test_bytes_not_multiple_of_four_are_refused():
    spec = FullAttentionSpec(1, 1, 1, torch.int8)  # 2-byte pages
    strides = compute_layout_strides(spec, 4, 1, "LBNHC")
    tensor = KVCacheTensor(4 * strides[1], ["x"], strides[0], strides[1])
    config = KVCacheConfig(4, [tensor], [KVCacheGroupSpec(["x"], spec)], "LBNHC")
    kv = allocate_kv_cache(config, "cpu")
    with pytest.raises(ValueError, match="multiple of 4"):
        KVBlockZeroer("cpu", [AttentionGroup(_Backend, ["x"], spec, 0)], [1], kv, 4, backend="torch")


def test_construction_errors_name_the_problem():
    case = _fixed_case(4)
    with pytest.raises(ValueError, match="Supported"):
        case.zeroer("cuda-magic")
    with pytest.raises(ValueError, match="num_blocks"):
        KVBlockZeroer("cpu", case.groups, case.kernel_block_sizes, case.kv_caches, 40, backend="torch")
    with pytest.raises(TypeError):
        KVBlockZeroer("cpu", ["not a group"], [], {}, 4)


def test_layers_without_views_or_tensors_are_skipped():
    case = _fixed_case(4)
    raw = case.raw
    # A raw-buffer layer and a missing layer: neither adds segments nor errors.
    kv = dict(case.kv_caches)
    kv.pop(next(iter(kv)))
    zeroer = KVBlockZeroer("cpu", case.groups, case.kernel_block_sizes, kv, 4, backend="torch")
    before = fill_random(raw, 2)
    zeroer.zero_block_ids([2])
    views = {n: (v, case.ratios[n]) for n, v in kv.items()}
    assert torch.equal(raw, expected_after(before, views, [2]))
    empty = KVBlockZeroer("cpu", [], [], {}, 4)
    empty.zero_block_ids([1])
    empty.warmup(2)
    with pytest.raises(ValueError):
        empty.zero_block_ids([4])


@needs_interpreter
@pytest.mark.parametrize("by_value", [False, True], ids=["ids in memory", "ids by value"])
@pytest.mark.parametrize("vec", [1, 2, 4])
def test_kernel_matches_reference_and_skips_ids_out_of_range(vec, by_value):
    from kvcore.runtime.zeroer.kernel import ROWS, launch_table, pack_words

    gen = torch.Generator().manual_seed(vec)
    num_blocks, stride = 5, ROWS * 3 + 7  # runs longer than one inner step, odd tails
    base = torch.randint(1, 1 << 30, ((num_blocks * stride + 2) * vec,), generator=gen, dtype=torch.int32)
    before = base.clone()
    runs = [(0, ROWS + 1), (ROWS + 3, 1), (2 * ROWS + 4, ROWS + 3)]  # (start, length) in vectors
    table = torch.tensor([[r[0] for r in runs], [stride] * len(runs), [r[1] for r in runs]])
    if by_value:  # ids below 2**31 only; 5 and 7 are out of range
        listed = [4, 5, 1, 7, 1]
        launch_table(base, table, num_blocks, table, vec, 3, num_ids=len(listed), words=pack_words(listed))
    else:
        ids = torch.tensor([4, -1, 1, num_blocks, 2**40, -(2**40)], dtype=torch.int64)
        launch_table(base, ids, num_blocks, table, vec, programs=3)
    expected = before.clone()
    for block in (4, 1):
        for s, n in runs:
            first = (s + block * stride) * vec
            expected[first : first + n * vec] = 0
    assert torch.equal(base, expected)


@needs_interpreter
def test_launcher_rejects_bad_tables():
    from kvcore.runtime.zeroer.kernel import launch_table

    base = torch.ones(64, dtype=torch.int32)
    table = torch.zeros(3, 1, dtype=torch.int64)
    ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="int32"):
        launch_table(base.view(torch.float32), ids, 1, table, 1, 1)
    with pytest.raises(ValueError, match="vec"):
        launch_table(base, ids, 1, table, 3, 1)
    with pytest.raises(ValueError, match="ids"):
        launch_table(base, ids.float(), 1, table, 1, 1)
    with pytest.raises(ValueError, match="aligned"):
        launch_table(base[1:], ids, 1, table, 4, 1)
    with pytest.raises(ValueError, match="chunk table"):
        launch_table(base, ids, 1, table[:2], 1, 1)
    with pytest.raises(ValueError, match="ids to zero"):
        launch_table(base, ids, 1, table, 1, 1, num_ids=2)
    assert torch.equal(base, torch.ones(64, dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_views_zeroes_packed_caches_by_manager_block(backend):
    num_blocks, _, manager, _ = _packed_case()
    zeroer = KVBlockZeroer.from_views("cpu", {n: (v, 1) for n, v in manager.items()}, num_blocks, backend=backend)
    raw = raw_bytes(manager["a"])
    before = fill_random(raw, 4)
    zeroer.zero_block_ids([0, 4])
    assert torch.equal(raw, expected_after(before, {n: (v, 1) for n, v in manager.items()}, [0, 4]))


def test_from_views_overlaid_layers_keep_the_widest_page():
    # Two groups overlaid from byte 0: a small full-attention page and a wider Mamba state page.
    attn = FullAttentionSpec(4, 1, 2, torch.float32)  # 64-byte pages
    state = MambaSpec(4, [(40,)], [torch.float32])  # 160-byte pages
    num_blocks, layout = 5, KVCacheLayout.LBNHC
    groups, tensors = [], []
    for name, spec in (("a", attn), ("m", state)):
        s = compute_layout_strides(spec, num_blocks, 1, layout)
        tensors.append(KVCacheTensor(num_blocks * 160, [name], s[0], 160))
        groups.append(KVCacheGroupSpec([name], spec))
    kv = allocate_kv_cache(KVCacheConfig(num_blocks, tensors, groups, layout), "cpu")
    zeroer = KVBlockZeroer.from_views("cpu", {n: (v, 1) for n, v in kv.items()}, num_blocks, backend="torch")
    assert [(s.block_stride, s.page) for s in zeroer.segments] == [(160, 160)]
    raw = raw_bytes(kv["a"])
    before = fill_random(raw, 3)
    zeroer.zero_block_ids([3])
    assert torch.equal(raw, expected_after(before, {n: (v, 1) for n, v in kv.items()}, [3]))


def test_from_views_refuses_bad_entries_naming_the_layer():
    case = _fixed_case(4)
    name, view = next(iter(case.kv_caches.items()))
    ratio = case.ratios[name]
    with pytest.raises(TypeError, match="views must map"):
        KVBlockZeroer.from_views("cpu", [(view, ratio)], 4)
    with pytest.raises(TypeError, match=repr(name)):
        KVBlockZeroer.from_views("cpu", {name: view}, 4)
    with pytest.raises(TypeError, match="rows_per_block"):
        KVBlockZeroer.from_views("cpu", {name: (view, True)}, 4)
    with pytest.raises(ValueError, match="rows_per_block"):
        KVBlockZeroer.from_views("cpu", {name: (view, 0)}, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        KVBlockZeroer.from_views("cpu", {name: (view, ratio + 1)}, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        KVBlockZeroer.from_views("cpu", {name: (view, ratio)}, 3)
    with pytest.raises(ValueError, match="raw buffer"):
        KVBlockZeroer.from_views("cpu", {name: (raw_bytes(view), 1)}, 4)
    with pytest.raises(ValueError, match="device"):
        KVBlockZeroer.from_views("meta", {name: (view, ratio)}, 4)


@needs_interpreter
@pytest.mark.parametrize("by_value", [False, True], ids=["ids in memory", "ids by value"])
def test_later_launches_pass_every_kernel_argument_in_order_to_the_compiled_launcher(monkeypatch, by_value):
    """The fast path (a CUDA stream, a compiled kernel) hands the launcher the kernel's own parameter list."""
    import inspect

    from kvcore.runtime.zeroer import kernel

    calls = []

    class Compiled:  # NOTE: what Triton's JIT returns on a GPU: .run is its compiled launcher
        function, packed_metadata = "fn", "meta"

        def __getitem__(self, grid):
            return None

        def run(self, *args):
            calls.append(args)

    monkeypatch.setattr(kernel, "launch_table", lambda *a, **k: calls.append("jit") or Compiled())
    base, table = torch.zeros(64, dtype=torch.int32), torch.tensor([[0, 4], [8, 8], [2, 2]])
    launcher = kernel.ZeroLauncher(base, [table, table], 8, 1, 4)
    ids = torch.tensor([3, 1, 5])
    words = kernel.pack_words([3, 1, 5]) if by_value else None
    for _ in range(2):
        launcher.launch(ids, 3, 1234, words)
    assert calls[0] == "jit" and len(calls) == 2
    names = list(inspect.signature(kernel._zero_blocks_kernel.fn).parameters)
    grid, one, also_one, stream = calls[1][:4]
    passed = dict(zip(names, calls[1][9:], strict=True))
    assert (grid, one, also_one, stream) == (min(4, 3 * 2), 1, 1, 1234)
    assert passed["base_ptr"] == base.data_ptr() and passed["table_ptr"] == table.data_ptr()
    assert (passed["num_ids"], passed["num_blocks"], passed["num_chunks"]) == (3, 8, 2)
    assert passed["ids_ptr"] == (table.data_ptr() if by_value else ids.data_ptr())
    assert [passed[f"p{k}"] for k in range(32)] == list(words or kernel.NO_WORDS)
    assert (passed["VEC"], passed["ROWS"], passed["BY_VALUE"]) == (1, kernel.ROWS, by_value)


@needs_interpreter
def test_a_triton_launch_hook_sends_launches_through_the_jit_and_an_empty_hook_chain_does_not(monkeypatch):
    import types

    from kvcore.runtime.zeroer import kernel

    calls = []
    compiled = type("Compiled", (), {"function": "fn", "packed_metadata": "meta", "__getitem__": lambda self, g: None,
                                     "run": lambda self, *a: calls.append("run")})()
    monkeypatch.setattr(kernel, "launch_table", lambda *a, **k: calls.append("jit") or compiled)
    runtime = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None)
    monkeypatch.setattr(kernel.triton, "knobs", types.SimpleNamespace(runtime=runtime), raising=False)
    table = torch.tensor([[0], [8], [2]])
    launcher = kernel.ZeroLauncher(torch.zeros(64, dtype=torch.int32), [table, table], 8, 1, 4)
    ids = torch.tensor([3])
    for hook_set in (False, False, True, False):
        runtime.launch_exit_hook = print if hook_set else None  # a profiler's hook, then none again
        launcher.launch(ids, 1, 99)
    runtime.launch_enter_hook.calls.append(print)  # a chain with a hook in it
    launcher.launch(ids, 1, 99)
    assert calls == ["jit", "run", "jit", "run", "jit"]


@needs_interpreter
def test_an_interpreter_that_cannot_run_the_kernel_leaves_zeroing_to_torch(monkeypatch):
    from kvcore.runtime.zeroer import kernel

    assert kernel.interpreter_runs()  # NOTE: this machine's interpreter runs it (the probe zeroes a word)
    case = _fixed_case(5)
    monkeypatch.setattr(kernel, "interpreter_runs", lambda: False)
    zeroer = KVBlockZeroer.from_views("cpu", case.views(), case.num_blocks)
    assert zeroer.backend == "torch"
    before = fill_random(case.raw, 7)
    zeroer.zero_block_ids([1, 3])
    assert torch.equal(case.raw, case.expected_after(before, [1, 3]))
    with pytest.raises(ValueError, match="interpreter runs its loops.*backend='torch'"):
        KVBlockZeroer.from_views("cpu", case.views(), case.num_blocks, backend="triton")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(-3, 70), st.booleans(), st.floats(0, 5)), max_size=70),
       st.integers(1, 70))
def test_listed_ids_are_packed_only_when_every_check_passes(values, num_blocks):
    """The launch's fast path (checked as packed) agrees with the id checks and the packing."""
    from kvcore.runtime.zeroer.inputs import id_list
    from kvcore.runtime.zeroer.kernel import LISTED, listed_words, pack_words

    words = listed_words(values, num_blocks)
    try:
        ids = id_list(values, num_blocks)
    except ValueError:
        assert words is None
        return
    plain = all(type(v) is int for v in values)
    if not plain or not 0 < len(ids) <= LISTED:
        assert words is None
        return
    assert words == pack_words(ids)
    unpacked = [w >> shift & 0xFFFFFFFF for w in words for shift in (0, 32)]
    assert unpacked[: len(ids)] == ids and not any(unpacked[len(ids):])
