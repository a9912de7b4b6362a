"""``kvcore.hf.Engine``: serve a transformers causal LM from a kvcore paged KV cache.

Construction plans one :class:`~kvcore.KVCache` for the model's layers
(``specs_from_config``), binds every attention module to its backend and
cache view, and builds the scheduler. Each step schedules requests
(:mod:`kvcore.hf.scheduler`), packs their tokens and metadata
(:mod:`kvcore.hf.step_inputs`), zeroes new blocks (``KVCache.begin_step``), runs
the model once with kvcore's attention function and samples greedily. A
hybrid model's mixers run per request on their state slots
(:mod:`kvcore.hf.mixers`). When anything raises inside a step, every queued
request is dropped and its blocks freed before the exception propagates.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from kvcore.runtime.kv_cache import KVCache
from kvcore.specs.attention import ChunkedLocalAttentionSpec
from kvcore.specs.state import MambaSpec
from kvcore._validate import positive_int
from kvcore.errors import KVCoreError
from kvcore.hf.attention_interface import ATTENTION_NAME, STEP_KWARG, LayerBinding, StepContext, register_attention
from kvcore.hf.step_inputs import StepInputs, build_step_inputs
from kvcore.hf.model_checks import attention_modules, check_hybrid_options, check_model, default_memory, eos_ids
from kvcore.hf.defaults import resolve as resolve_defaults
from kvcore.hf.defaults import warm_prefill, warm_up
from kvcore.hf.graphs import DecodeGraphs, graphs_wanted
from kvcore.hf.mixers import MixerRunner
from kvcore.hf.requests import Request, check_prompt
from kvcore.hf.scheduler import Scheduler
from kvcore.hf.specs import layer_specs
from kvcore.hf.stats import PHASES, EngineStats
from kvcore.hf.tp import resolve_tp, shard_specs

@attrs.define
class _Counts:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_finished: int = 0
    blocks_zeroed: int = 0
    graph_steps: int = 0
    times: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(PHASES, 0.0))


class Engine:
    """Continuous batching of greedy generation for a transformers model over one KV cache.

    :param model: a ``*ForCausalLM`` of a served architecture (``SERVED_MODEL_TYPES``), on its device;
        a hybrid's mixers keep their states in state groups (:mod:`kvcore.hf.mixers`), without prefix
        caching, CUDA graphs or tensor parallelism (each refused with ``ValueError``).
    :param backend: registered attention backend name (``"torch"``, ``"triton"``, ``"flashinfer"``),
        class, or ``"auto"``: :func:`kvcore.select_backend`'s pick per layer (``kvcore.hf.defaults``).
    :param block_size: tokens per manager block; None: the backend's preferred size (16 if none).
    :param layout: KV cache layout (default: the backend's preference).
    :param num_blocks: blocks to plan; or ``available_memory`` bytes (default: 90% of the
        free GPU memory, or 256 MiB on a CPU).
    :param max_num_seqs: requests running at once; others wait.
    :param max_num_batched_tokens: tokens per step (prefill chunks and decodes together); None:
        4,096 on a GPU, 2,048 elsewhere.
    :param enable_prefix_caching: share cached blocks of common prompt prefixes.
    :param group: a ``torch.distributed`` group for a tensor-parallel model (``kvcore.hf.tp``).
    :param cuda_graphs: replay decode steps from CUDA graphs (``kvcore.hf.graphs``); None: on
        for the ``triton`` and ``flashinfer`` backends on a CUDA device. Every batch size is
        captured when the engine is built (:meth:`warmup`), not in the first ``generate``.
    :param max_num_blocks: make the cache elastic (``KVCache.resize``): requests that fit this
        many blocks are admitted, the cache grows instead of preempting while memory allows,
        and ``generate`` shrinks it back to its starting size before returning.
    """

    def __init__(
        self,
        model: Any,
        *,
        backend: Any = "auto",
        block_size: int | None = None,
        layout: Any = None,
        num_blocks: int | None = None,
        available_memory: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = False,
        group: Any = None,
        cuda_graphs: bool | None = None,
        max_num_blocks: int | None = None,
    ) -> None:
        check_model(model)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
        config = model.config
        self.model = model
        self.device = torch.device(model.device)
        self.vocab_size = positive_int("config.vocab_size", config.vocab_size)
        self.max_model_len = positive_int("config.max_position_embeddings", config.max_position_embeddings)
        tp_rank, tp_size = resolve_tp(model, group)
        settings = resolve_defaults(
            lambda size: shard_specs(layer_specs(config, model.dtype, size), tp_rank, tp_size),
            self.device, backend, None if block_size is None else positive_int("block_size", block_size),
            max_num_batched_tokens,
        )
        max_num_batched_tokens = positive_int("max_num_batched_tokens", settings.max_num_batched_tokens)
        specs = settings.specs
        chunked = [n for n, s in specs.items() if isinstance(s, ChunkedLocalAttentionSpec)]
        if chunked:
            raise ValueError(f"{chunked[0]} uses chunked local attention, which no kvcore backend implements")
        attention = [n for n, s in specs.items() if not isinstance(s, MambaSpec)]
        mixers = [n for n, s in specs.items() if isinstance(s, MambaSpec)]
        if mixers:
            cuda_graphs = check_hybrid_options(config, len(attention), enable_prefix_caching, tp_size, cuda_graphs)
        modules = attention_modules(model, attention)
        attention_modules(model, mixers)
        if num_blocks is None and available_memory is None:
            available_memory = default_memory(self.device)
        self.kv = KVCache.create(
            specs, settings.layer_backends, device=self.device, layout=layout,
            num_blocks=num_blocks, available_memory=available_memory,
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, group=group,
            max_num_blocks=max_num_blocks, enable_prefix_caching=enable_prefix_caching,
        )
        self._start_blocks = self.kv.num_blocks
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            prefix_caching=enable_prefix_caching,
        )
        if max_num_blocks is not None:
            self.scheduler.grow = self._grow_cache
        self._layers = {module: self._bind(name, module) for name, module in modules.items()}
        self._block_sizes = [info.block_size for info in self.scheduler.groups]
        #: The hybrid model's mixers on their state groups (None for attention-only models).
        self.mixers = MixerRunner(model, self.kv, mixers) if mixers else None
        self._state_groups = [info.state for info in self.scheduler.groups]
        self._eos = eos_ids(model)
        self._counts = _Counts()
        self._next_id = 0
        self._done: dict[int, list[int]] = {}
        #: Synchronize the device at every phase boundary so that ``stats()`` times are device-true.
        self.sync_timing = False
        self.graphs: DecodeGraphs | None = None
        backend_name = self.kv.group_of(attention[0]).backend.get_name()
        if graphs_wanted(cuda_graphs, self.device, backend_name):
            widths = [t.shape[1] for t in self.scheduler.tables]
            self.graphs = DecodeGraphs(model, self.kv, self._layers, widths, self._block_sizes,
                                       max_num_seqs=max_num_seqs)
        register_attention()
        self.warmup()

    def warmup(self, *, progress: bool = True) -> None:
        """Compile now what the first ``generate`` would: on a GPU, one padding prefill step (kernel
        JIT, nothing written) and every decode CUDA graph (a progress bar)."""
        if self.device.type != "cuda":
            return
        with self.serving():
            with self.mixers.scratch() if self.mixers is not None else contextlib.nullcontext():
                warm_prefill(self.model, self.kv, self._layers)
            if self.graphs is not None and self.graphs.capture:
                warm_up(self.graphs, progress=progress)

    def _bind(self, name: str, module: torch.nn.Module) -> LayerBinding:
        attn_group = self.kv.group_of(name)
        window = self.scheduler.groups[attn_group.kv_cache_group_id].sliding_window
        declared = getattr(module, "sliding_window", window)
        if declared != window:
            raise ValueError(
                f"{name} attends with sliding_window={declared} but its KV cache spec has {window}; "
                "the model and its config disagree"
            )
        return LayerBinding(name, attn_group.backend, self.kv.layer_kv_caches[name],
                            attn_group.kv_cache_spec.head_size, window)

    # -- requests --------------------------------------------------------------------------

    def _request(self, index: int, prompt: Any, max_new_tokens: Any) -> Request:
        tokens = check_prompt(index, prompt, max_new_tokens, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        total = len(tokens) + max_new_tokens
        need, have = self.scheduler.peak_blocks(total), self.kv.max_num_blocks - 1
        if need > have:
            raise ValueError(
                f"prompt {index} ({len(tokens)} tokens, max_new_tokens={max_new_tokens}) needs up to "
                f"{need} KV cache blocks but the whole cache has {have}; plan more blocks "
                "(num_blocks / available_memory) or shorten the request"
            )
        return Request(self._next_id + index, tokens, len(tokens), max_new_tokens)

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue one request; returns its id. A bad request raises and queues nothing."""
        request = self._request(0, prompt, max_new_tokens)
        self._next_id += 1
        self.scheduler.add(request)
        return request.req_id

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation for every prompt; the generated token ids of each, in prompt order.

        Every prompt is checked before anything runs: an empty prompt, ids
        outside the vocabulary, ``max_new_tokens < 1``, or a request longer
        than the model or than the whole cache raises ``ValueError`` naming
        that prompt, and nothing is queued. A request stops after
        ``max_new_tokens`` or at the generation config's EOS token (kept).
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
            self._shrink_back()
        return [done[r.req_id] for r in requests]

    def _shrink_back(self) -> None:
        """An elastic cache goes back to its starting size once no request is left (cached blocks above are evicted)."""
        kv = self.kv
        if kv.elastic is None or self.scheduler.has_work or kv.num_blocks == self._start_blocks:
            return
        try:
            kv.resize(self._start_blocks)
        except ValueError:  # NOTE: blocks above it are held outside generate (say, an exported prefix)
            pass

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
            except KVCoreError:  # NOTE: no memory for that many; try the bare need, then preempt
                continue
        return False

    def run(self) -> dict[int, list[int]]:
        """Step until every queued request is done; returns the tokens of those finished meanwhile, by id."""
        with self.serving():
            while self.scheduler.has_work:
                self._step()
        done, self._done = self._done, {}
        return done

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Route the model's attention through kvcore for the duration (restored afterwards)."""
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

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> int:
        """Run one step (inside :meth:`serving` when called in a loop); returns the tokens it computed."""
        with self.serving():
            return self._step()

    def _step(self) -> int:
        try:
            return self._run_step()
        except BaseException:
            # NOTE: a step that raised may have written part of its K/V and mixer states; no
            # request can resume from that, so every queued one is dropped with its blocks.
            self.scheduler.abort_all()
            self._done = {}
            if self.mixers is not None:
                self.mixers.step = None
            raise

    def _run_step(self) -> int:
        times, clock = self._counts.times, self._clock
        t0 = clock()
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("the scheduler found nothing to run although requests are waiting")
        t1 = clock()
        graphed = self.graphs is not None and all(r.num_new_tokens == 1 for r, _ in batch)
        if graphed:
            size = self.graphs.prepare(batch, self.scheduler.tables)
            sampling, num_tokens = [r for r, _ in batch], len(batch)
            self._counts.graph_steps += 1
        else:
            inputs = build_step_inputs(batch, self.scheduler.tables, self._block_sizes, self.device,
                                       self._state_groups)
            if self.mixers is not None:
                self.mixers.step = self.mixers.plan(batch, self.scheduler.tables)
            metadata = self.kv.build_metadata(inputs.common)
            sampling, num_tokens = inputs.sampled, inputs.num_tokens
        t2 = clock()
        self._counts.blocks_zeroed += len(self.kv.begin_step())
        t3 = clock()
        next_tokens = self.graphs.replay(size, len(batch)) if graphed else self._forward(inputs, metadata)
        if self.mixers is not None:
            self.mixers.step = None
        t4 = clock()
        sampled = next_tokens.tolist()
        t5 = clock()
        self._account(batch)
        self.scheduler.finish_step(batch)
        for request, token in zip(sampling, sampled):
            request.tokens.append(token)
            if token in self._eos or len(request.tokens) - request.prompt_len >= request.max_new_tokens:
                self.scheduler.finish(request)
                self._done[request.req_id] = request.output
                self._counts.requests_finished += 1
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times[phase] += seconds
        return num_tokens

    def _clock(self) -> float:
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, inputs: StepInputs, metadata: dict[str, Any]) -> torch.Tensor:
        return self._logits(inputs, metadata).argmax(-1)

    def _logits(self, inputs: StepInputs, metadata: dict[str, Any]) -> torch.Tensor:
        """``[sampling requests, vocab]`` logits of one eager step (``inputs.sampled`` order)."""
        step = StepContext(self._layers, metadata)
        with torch.inference_mode():
            out = self.model(
                input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False,
                logits_to_keep=inputs.logits_indices, **{STEP_KWARG: step},
            )
            return out.logits[0]

    def _account(self, batch: list[tuple[Request, int]]) -> None:
        counts = self._counts
        counts.steps += 1
        for request, n in batch:
            if n == 1 and request.num_computed >= request.prompt_len:
                counts.decode_tokens += 1
            else:
                counts.prefill_tokens += n

    def stats(self) -> EngineStats:
        """Counts since construction: steps, tokens, blocks, preemptions, prefix-cache hits, phase times."""
        c, s, prefix = self._counts, self.scheduler.counters, self.scheduler.prefix
        return EngineStats(
            steps=c.steps, prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
            requests_finished=c.requests_finished, blocks_allocated=s.blocks_allocated,
            blocks_zeroed=c.blocks_zeroed, window_freed_blocks=s.window_freed_blocks, preemptions=s.preemptions,
            prefix_cache_hits=prefix.hits if prefix else 0, prefix_cache_hit_tokens=prefix.hit_tokens if prefix else 0,
            graph_steps=c.graph_steps,
            **{f"{phase}_s": c.times[phase] for phase in PHASES},
        )

