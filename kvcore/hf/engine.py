"""``kvcore.hf.Engine``: continuous batching of a transformers causal LM over one kvcore KV cache
(schedule, pack, zero new blocks, one forward or a CUDA graph replay, greedy sampling per step)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvcore._validate import positive_int
from kvcore.distributed import shard_spec
from kvcore.errors import InsufficientMemoryError
from kvcore.hf import profile
from kvcore.hf.attention_interface import ATTENTION_NAME, STEP_KWARG, LayerBinding, StepContext, register_attention
from kvcore.hf.mixers import MixerRunner, is_decode
from kvcore.hf.scheduler import Request, Scheduler, check_prompt
from kvcore.hf.specs import check_checkpoint_tokens as checked_checkpoint_tokens
from kvcore.hf.specs import check_hybrid_options, check_model, layer_specs, model_modules
from kvcore.hf.step import DecodeGraphs, Step, StepBuilder, graphs_wanted, uncapturable
from kvcore.hf.tp import resolve_tp
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.auto import AUTO
from kvcore.plugins.negotiate import default_block_size, resolve_backends
from kvcore.runtime.kv_cache import KVCache
from kvcore.specs import KVCacheSpec, MambaSpec
from kvcore.specs.quant import quantize_specs

#: Block size when the backend prefers none.
BLOCK_SIZE = 16
#: Tokens per step by device type (others: the CPU figure; what ``kvcore bench hf`` found fastest).
BATCHED_TOKENS = {"cuda": 4096, "cpu": 2048}
#: Phases of a step, in order, timed on the host.
PHASES = ("schedule", "prepare", "zero", "forward", "sample")


@attrs.frozen
class EngineStats(Mapping):
    """A snapshot of :meth:`Engine.stats`, read as attributes or keys; ``prefill_tokens`` include
    recomputed ones, ``*_s`` are host seconds per step phase (``sample_s`` waits for the device)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_finished: int = 0
    blocks_allocated: int = 0
    blocks_zeroed: int = 0
    window_freed_blocks: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    graph_steps: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    zero_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0

    def __getitem__(self, key: str) -> int | float:
        return attrs.asdict(self)[key]

    def __iter__(self) -> Iterator[str]:
        return iter(attrs.fields_dict(type(self)))

    def __len__(self) -> int:
        return len(attrs.fields(type(self)))


@attrs.frozen
class EngineDefaults:
    """An engine's settings with ``"auto"`` and unset sizes resolved, and its layer specs."""

    block_size: int
    max_num_batched_tokens: int
    layer_backends: dict[str, Any]
    specs: Mapping[str, KVCacheSpec] = attrs.field(repr=False, factory=dict)


def resolve_defaults(
    make_specs: Callable[[int], Mapping[str, KVCacheSpec]], device: torch.device, backend: Any,
    block_size: int | None, max_num_batched_tokens: int | None, *, unified_states: bool = False,
) -> EngineDefaults:
    """The negotiation stage's answers for an engine: each attention layer's backend (``"auto"``
    asked once per distinct spec), the block size the backends prefer (16 when none states one;
    grown for a hybrid's ``unified_states`` plan until an attention page holds a state page) and the
    step budget. ``make_specs(block_size)`` gives the layer specs."""
    answers = HookAnswers()
    specs = make_specs(BLOCK_SIZE if block_size is None else block_size)
    chosen = dict.fromkeys((n for n, s in specs.items() if s.is_attention), backend)
    if block_size is None:
        backends = resolve_backends(specs, chosen, answers, device)[0]
        block_size = default_block_size(specs, backends, answers, BLOCK_SIZE, separate_state_pages=not unified_states)
        if block_size != BLOCK_SIZE:
            specs = make_specs(block_size)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = BATCHED_TOKENS.get(device.type, BATCHED_TOKENS["cpu"])
    budget = positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if isinstance(backend, str) and backend == AUTO:
        chosen = resolve_backends(specs, chosen, answers, device)[0]
    return EngineDefaults(block_size, budget, chosen, specs)


class Engine:
    """Continuous batching of greedy generation for a transformers model over one KV cache.

    :param model: a ``*ForCausalLM`` of a served architecture (``SERVED_MODEL_TYPES``) on its
        device; a hybrid (mixers with state groups) runs on one device.
    :param backend: attention backend name or class, or ``"auto"``: :func:`kvcore.select_backend`.
    :param block_size: tokens per manager block; None: the backend's preferred size (16 if none).
    :param num_blocks: blocks to plan; or ``available_memory`` bytes (default on a GPU: 90% of the
        free memory left beside the largest step, measured before the cache exists; 256 MiB on a CPU).
    :param max_num_seqs: requests running at once; 256, as vLLM: admission already waits for free
        blocks, so a smaller cap only idles the device (64 ran 256 requests at 0.49x on an H200).
    :param max_num_batched_tokens: tokens per step; None: 4,096 on a GPU, 2,048 elsewhere.
    :param group: a ``torch.distributed`` group for a tensor-parallel model (``kvcore.hf.tp``).
    :param cuda_graphs: replay decode steps from CUDA graphs captured when the engine is built;
        None: on for the ``triton`` and ``flashinfer`` backends on a CUDA device.
    :param max_num_blocks: an elastic cache, grown instead of preempting while memory allows and
        shrunk back when ``generate`` returns.
    :param mixer_backend: a hybrid's mixer backend name or class, or ``"auto"``.
    :param separate_state_pages: a hybrid's states in a region of their own with their own page
        size (``block_size`` sizes attention blocks alone); None: True for hybrids.
    :param state_checkpoint_tokens: with prefix caching, a hybrid keeps its states at each multiple
        of this many prompt tokens (a multiple of the block size; None: the block size).
    :param kv_cache_dtype: "auto" (the model's dtype) or a quantized cache (docs/quantized-cache.md); per-tensor
        scales come from the attention modules' ``k_scale`` / ``v_scale`` when they have them.
    """

    def __init__(
        self, model: Any, *, backend: Any = "auto", block_size: int | None = None, layout: Any = None,
        num_blocks: int | None = None, available_memory: int | None = None, max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = False, group: Any = None,
        cuda_graphs: bool | None = None, max_num_blocks: int | None = None, mixer_backend: Any = "auto",
        separate_state_pages: bool | None = None, state_checkpoint_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        check_model(model)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        for option, value in (("cuda_graphs", cuda_graphs), ("separate_state_pages", separate_state_pages)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{option} must be True, False or None, got {value!r}")
        max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
        config = model.config
        self.model = model
        self.device = torch.device(model.device)
        self.vocab_size = positive_int("config.vocab_size", config.vocab_size)
        self.max_model_len = positive_int("config.max_position_embeddings", config.max_position_embeddings)
        tp_rank, tp_size = resolve_tp(model, group)
        settings = resolve_defaults(
            lambda size: quantize_specs({n: shard_spec(s, tp_rank, tp_size)
                                         for n, s in layer_specs(config, model.dtype, size).items()}, kv_cache_dtype),
            self.device, backend, block_size, max_num_batched_tokens,
            unified_states=separate_state_pages is False,
        )
        specs = settings.specs
        mixers = [n for n, s in specs.items() if isinstance(s, MambaSpec)]
        attention = [n for n in specs if n not in mixers]
        separate = bool(mixers) and separate_state_pages is not False
        checkpoint = settings.block_size if state_checkpoint_tokens is None else state_checkpoint_tokens
        if mixers:
            check_hybrid_options(config, len(attention), enable_prefix_caching, tp_size, cuda_graphs, separate)
            cuda_graphs = cuda_graphs if separate else False  # NOTE: padding rows need a slot nothing reads
            checkpoint = checked_checkpoint_tokens(checkpoint, settings.block_size)
        modules = model_modules(model, list(specs))
        budget = settings.max_num_batched_tokens
        if num_blocks is None and available_memory is None and self.device.type != "cuda":
            available_memory = 256 << 20
        elif num_blocks is None and available_memory is None:  # NOTE: what the largest step leaves free
            found = resolve_backends(specs, dict.fromkeys(mixers, mixer_backend), HookAnswers(), self.device)[0]
            scratch = MixerRunner.unbound({n: modules[n] for n in mixers}, specs, found, self.device)
            # NOTE: a mixer call may pad beyond the budget (MixerLayer): the measured step includes that
            extra = scratch.extra_tokens if mixers else 0
            peak = profile.step_peak(model, budget + extra, min(budget, max_num_seqs), scratch if mixers else None)
            available_memory = profile.cache_share(torch.cuda.mem_get_info(self.device)[0], peak, budget)
        self.kv = KVCache.create(
            specs, {**settings.layer_backends, **dict.fromkeys(mixers, mixer_backend)}, device=self.device,
            layout=layout, separate_state_pages=separate, num_blocks=num_blocks, available_memory=available_memory,
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, group=group, max_num_blocks=max_num_blocks,
            enable_prefix_caching=enable_prefix_caching)
        self.kv.load_kv_scales({name: modules[name] for name in attention})
        self._start_blocks = self.kv.num_blocks
        self._no_memory: InsufficientMemoryError | None = None  # NOTE: why this step's grow failed
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=budget, state_checkpoint_tokens=checkpoint)
        if max_num_blocks is not None:
            self.scheduler.grow = self._grow_cache
        self.counts = self.scheduler.counts
        self._layers = {modules[name]: self._bind(name, modules[name]) for name in attention}
        self.mixers = MixerRunner(self.kv, {n: modules[n] for n in mixers}, budget) if mixers else None
        self.steps = StepBuilder(self.kv, self.scheduler.groups, self.scheduler.tables)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self._eos = frozenset([eos] if isinstance(eos, int) else eos or ())
        self._next_id = 0
        self._done: dict[int, list[int]] = {}
        #: Synchronize the device at every phase boundary so that ``stats()`` times are device-true.
        self.sync_timing = False
        self.graphs: DecodeGraphs | None = None
        self._graphs_asked = cuda_graphs is True
        backends = {self.kv.group_of(attention[0]).backend, *self.kv.mixer_backends.values()}
        if graphs_wanted(cuda_graphs, self.device, [b.get_name() for b in backends]):
            self.graphs = DecodeGraphs(self.device, max_num_seqs)
        register_attention()
        self.warmup()

    def _bind(self, name: str, module: torch.nn.Module) -> LayerBinding:
        attn_group = self.kv.group_of(name)
        window = self.scheduler.groups[attn_group.kv_cache_group_id].sliding_window
        declared = getattr(module, "sliding_window", window)
        if declared != window:
            raise ValueError(f"{name} attends with sliding_window={declared} but its KV cache spec has {window}; "
                             "the model and its config disagree")
        return LayerBinding(name, attn_group.backend, self.kv.layer_kv_caches[name],
                            attn_group.kv_cache_spec.head_size, window)

    def warmup(self, *, progress: bool = True) -> None:
        """On a GPU, compile now every kernel variant a later step launches (kernels take one per step
        size): a padding prefill step, and the decode graphs or else a padding decode step."""
        if self.device.type != "cuda":
            return
        from rich.console import Console

        status = Console(stderr=True).status("kvcore: compiling attention kernels")
        with status if progress else contextlib.nullcontext():
            for zeroer in (z for z in (self.kv.zeroer, self.kv.state_zeroer) if z is not None):
                zeroer.warmup(0)  # NOTE: both id paths compiled, nothing written
            self._warm_prefill()
        if self.graphs is not None and self.graphs.capture:
            try:
                with self.serving():
                    self.graphs.capture_all(self.steps, self._forward, progress=progress)
            except RuntimeError as exc:  # NOTE: e.g. a model op that copies from unpinned host memory
                self.graphs = uncapturable(exc, asked=self._graphs_asked)
                self._warm_prefill(num_tokens=0)

    def _warm_prefill(self, num_tokens: int = 32) -> None:
        """One step of a padding request (reads the null block, writes nothing); a hybrid's mixers
        run on scratch states, their decode path too. ``num_tokens=0``: the decode step only."""
        if num_tokens:
            with self.serving(), (self.mixers.scratch() if self.mixers else contextlib.nullcontext()):
                self._forward(self.steps.build([(None, num_tokens)]))
        if self.graphs is None or self.mixers is not None:  # NOTE: eager decode steps: the decode kernels
            with self.serving(), (self.mixers.scratch(decodes=1) if self.mixers else contextlib.nullcontext()):
                self._forward(self.steps.build([(None, 1)]))

    def _request(self, index: int, prompt: Any, max_new_tokens: Any) -> Request:
        tokens = check_prompt(index, prompt, max_new_tokens, vocab_size=self.vocab_size,
                              max_model_len=self.max_model_len)
        need, have = self.scheduler.peak_blocks(len(tokens) + max_new_tokens), self.kv.max_num_blocks - 1
        if need > have:
            raise ValueError(
                f"prompt {index} ({len(tokens)} tokens, max_new_tokens={max_new_tokens}) needs up to {need} KV "
                f"cache blocks but the whole cache has {have}; plan more blocks (num_blocks / available_memory) "
                "or shorten the request"
            )
        return Request(self._next_id + index, tokens, len(tokens), max_new_tokens)

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue one request; returns its id. A bad request raises and queues nothing."""
        request = self._request(0, prompt, max_new_tokens)
        self._next_id += 1
        self.scheduler.add(request)
        return request.req_id

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation for every prompt (all checked first); the generated ids of each, in order.

        A request stops after ``max_new_tokens`` or at the generation config's EOS token.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        requests = [self._request(i, p, max_new_tokens) for i, p in enumerate(prompts)]
        self._next_id += len(requests)
        for request in requests:
            self.scheduler.add(request)
        try:
            done = self.run()
        finally:
            kv = self.kv
            if kv.elastic is not None and not self.scheduler.has_work and kv.num_blocks != self._start_blocks:
                with contextlib.suppress(ValueError):  # NOTE: blocks above it are held (an exported prefix)
                    kv.resize(self._start_blocks)
        return [done[r.req_id] for r in requests]

    def _grow_cache(self, short: int) -> bool:
        """Grow the elastic cache by at least ``short`` blocks (a quarter more when memory allows)."""
        kv = self.kv
        room = kv.max_num_blocks - kv.num_blocks
        if short > room:
            return False
        for extra in dict.fromkeys((min(room, max(short, kv.num_blocks // 4)), short)):
            try:
                kv.resize(kv.num_blocks + extra)
                return True
            except InsufficientMemoryError as exc:  # NOTE: no memory for that many: the bare need, then preempt
                self._no_memory = exc
        return False

    def run(self) -> dict[int, list[int]]:
        """Step until every queued request is done; the tokens of those finished meanwhile, by id."""
        with self.serving():
            while self.scheduler.has_work:
                try:
                    self._step()
                except BaseException:
                    # NOTE: a step that raised may have written part of its K/V and mixer states;
                    # no request can resume from that, so every queued one is dropped with its blocks.
                    self.scheduler.abort_all()
                    self._done = {}
                    raise
        done, self._done = self._done, {}
        return done

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Route the model's attention (and a hybrid's mixers) through kvcore for the duration."""
        previous = self.model.config._attn_implementation
        if previous == ATTENTION_NAME:
            yield
            return
        self.model.set_attn_implementation(ATTENTION_NAME)
        try:
            with self.mixers.installed() if self.mixers is not None else contextlib.nullcontext():
                yield
        finally:
            self.model.set_attn_implementation(previous)

    def _step(self) -> None:
        counts, clock = self.counts, self._clock
        t0 = clock()
        self._no_memory = None
        batch = self.scheduler.schedule()
        if not batch and self._no_memory is not None:
            raise InsufficientMemoryError(
                f"the elastic KV cache cannot grow to hold the next request ({self._no_memory}); free memory, "
                "or create the Engine with a larger num_blocks (memory committed at the start)") from self._no_memory
        if not batch:
            raise RuntimeError("the scheduler found nothing to run although requests are waiting")
        t1 = clock()
        graphed = self.graphs is not None and all(r.num_new_tokens == 1 and is_decode(r, n) for r, n in batch)
        size = self.graphs.bucket(len(batch)) if graphed else None
        if self.mixers is not None:
            batch.sort(key=lambda entry: not is_decode(*entry))  # NOTE: decodes first, one mixer call for them all
        step = self.steps.build(batch, pad_to=size)
        metadata = mixer_step = None
        if not graphed:
            metadata = self.kv.build_metadata(step.common)
            if self.mixers is not None:
                mixer_step = self.mixers.plan(batch, self.scheduler.tables, step.common)
        t2 = clock()
        counts["blocks_zeroed"] += len(self.kv.begin_step())
        if self.scheduler.checkpoints is not None:  # NOTE: restored checkpoints, after zeroing the slots
            tables, groups = self.scheduler.tables, self.scheduler.checkpoints.groups
            rows = [(r, {g: int(tables[g][r.row, 0]) for g in groups}) for r, _ in batch if r.restore]
            self.mixers.copy_states(self.scheduler.checkpoints.take_restores(rows))
        t3 = clock()
        if graphed:
            counts["graph_steps"] += 1
            next_tokens = self.graphs.run(size, lambda: self._forward(step))
        else:
            next_tokens = self._forward(step, metadata, mixer_step)
        t4 = clock()
        sampled = next_tokens[: len(step.sampled)].tolist()
        t5 = clock()
        counts["steps"] += 1
        for request, n in batch:
            decode = n == 1 and request.num_computed >= request.prompt_len
            counts["decode_tokens" if decode else "prefill_tokens"] += n
        self.scheduler.finish_step(batch)
        for request, token in zip(step.sampled, sampled):
            request.tokens.append(token)
            if token in self._eos or len(request.tokens) - request.prompt_len >= request.max_new_tokens:
                self.scheduler.finish(request)
                self._done[request.req_id] = request.output
                counts["requests_finished"] += 1
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            counts[f"{phase}_s"] += seconds

    def _clock(self) -> float:
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, step: Step, metadata: dict[str, Any] | None = None, mixer_step: Any = None) -> torch.Tensor:
        """The greedy next token of each logits row of ``step`` (metadata built now if not given; a
        hybrid's ``mixer_step`` planned now as a padded decode step if not given)."""
        if metadata is None:
            metadata = self.kv.build_metadata(step.common)
        mixers = self.mixers
        if mixers is None or mixers.step is not None:  # NOTE: set already: a warm-up pass
            return self._logits(step, metadata).argmax(-1)
        with mixers.running(mixer_step or mixers.plan([(None, 1)] * step.common[0].num_reqs, (), step.common)):
            return self._logits(step, metadata).argmax(-1)

    def _logits(self, step: Step, metadata: dict[str, Any]) -> torch.Tensor:
        """``[logits rows, vocab]``: the sampling requests' rows first, in ``step.sampled`` order."""
        with torch.inference_mode():
            out = self.model(
                input_ids=step.input_ids, position_ids=step.position_ids, use_cache=False,
                logits_to_keep=step.logits_indices, **{STEP_KWARG: StepContext(self._layers, metadata)},
            )
            return out.logits[0]

    def stats(self) -> EngineStats:
        """Counts since construction: steps, tokens, blocks, preemptions, prefix-cache hits, phase times."""
        return EngineStats(**self.counts)
