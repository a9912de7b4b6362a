"""The negotiation stage: one pass decides, for every layer, its backend (``"auto"`` resolved once per
distinct spec), the spec it stores, its kernel block size, the layout and the plan. Each candidate
layout is planned once; a refused one is kept as a value with its reason, and errors are worded
from the reasons collected."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import pluggy
import torch

from kvcore._validate import positive_int
from kvcore.distributed import agree_layout, agree_num_blocks
from kvcore.errors import KernelRequirementError
from kvcore.memory.config import KVCacheConfig
from kvcore.memory.elastic import checked_max_blocks, checked_num_blocks
from kvcore.memory.layout import KVCacheLayout, checked_request, layout_candidates, requested_layout
from kvcore.memory.pages import check_hashable
from kvcore.memory.planner import PagePlan, checked_budget, lay_out, state_region_blocks
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.auto import Backends, as_device, check_abilities, resolve_backends
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.mixer_backend import is_mixer_backend
from kvcore.plugins.negotiation import Candidate, Declared, Negotiation, Refused, accepts, group_records
from kvcore.plugins.rules import view_checks
from kvcore.settings import Settings
from kvcore.specs import AttentionSpec, KVCacheSpec
from kvcore.specs.quant import quantize_specs


def default_block_size(layer_specs: Mapping[str, KVCacheSpec], layer_backends: Mapping[str, Any], answers: HookAnswers,
                       fallback: int, *, separate_state_pages: bool = False) -> int:
    """The manager block size for these layers when the caller names none: the first ``int`` the
    first attention layer's backend declares (else ``fallback``), grown for a hybrid in the unified
    plan until an attention page holds a state page (pages are unified to the largest, and growing
    the attention block wastes less than padding it unless the state page is under two of them)."""
    attention = [n for n, s in layer_specs.items() if s.is_attention]
    if not attention:
        return fallback
    first = attention[0]
    size = answers.preferred_block_size(answers.backend(layer_backends[first]), layer_specs[first]) or fallback
    states = [s.real_page_size_bytes for s in layer_specs.values() if not s.is_attention and s.has_cache_pages]
    page = max(layer_specs[n].real_page_size_bytes for n in attention)
    if states and not separate_state_pages and max(states) >= 2 * page:
        size *= -(-max(states) // page)
    return size


def _checked_layers(layer_specs: Any, layer_backends: Any) -> None:
    if not isinstance(layer_specs, Mapping):
        raise TypeError(f"layer_specs must map layer names to KVCacheSpecs, got {layer_specs!r}")
    if not isinstance(layer_backends, Mapping):
        raise TypeError(f"layer_backends must map layer names to backends, got {layer_backends!r}")
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"layer_specs[{name!r}] is {spec!r} ({type(spec).__name__}), not a KVCacheSpec; "
                            "describe the layer with a spec such as kvcore.FullAttentionSpec(...)")
        check_hashable(f"layer_specs[{name!r}]", spec)
    unknown = sorted(set(layer_backends) - set(layer_specs))
    if unknown:
        raise ValueError(f"layer_backends names layers without a spec: {unknown}; add their specs")
    # NOTE: AttentionSpec, not is_attention: a grouped spec here is refused by the planner
    missing = [n for n, s in layer_specs.items() if isinstance(s, AttentionSpec) and n not in layer_backends]
    if missing:
        raise ValueError(f"attention layers {missing} have no backend; add them to layer_backends")


class _Pass:
    """The served specs and backends of one negotiation, and each layout's pages (laid out once)."""

    def __init__(self, specs: dict[str, KVCacheSpec], backends: Backends, answers: HookAnswers,
                 num_state_blocks: int | None = None) -> None:
        self.specs = specs
        self.backends = backends
        self.answers = answers
        self._num_state_blocks = num_state_blocks  # NOTE: a separate state region's blocks, or None
        self._laid_out: dict[KVCacheLayout, PagePlan] = {}

    def _pages(self, layout: KVCacheLayout) -> PagePlan:
        """The pages of ``layout``, laid out once."""
        if layout not in self._laid_out:
            self._laid_out[layout] = lay_out(self.specs, layout, self._num_state_blocks)
        return self._laid_out[layout]

    def bought(self, layout: KVCacheLayout, available_memory: int) -> int:
        """Blocks ``available_memory`` holds under ``layout``, else ``ValueError`` saying why too few."""
        bought = self._pages(layout).blocks_for(available_memory)
        if isinstance(bought, str):
            raise ValueError(bought)
        return bought

    def plan(self, layout: KVCacheLayout, num_blocks: int | None, available_memory: int | None) -> Candidate:
        """``layout`` planned once: its plan, records and rule checks, or why it is refused."""
        pages = self._pages(layout)
        if pages.refusal is not None:
            error = pages.error()
            return Candidate(layout, str(error), error=error)
        num_blocks = pages.blocks_for(available_memory) if num_blocks is None else num_blocks
        if isinstance(num_blocks, str):
            return Candidate(layout, num_blocks, error=ValueError(num_blocks))
        config = pages.place(num_blocks)
        groups = group_records(config, self.backends, self.answers)
        if isinstance(groups, Refused):
            return Candidate(layout, groups, error=ValueError(groups))
        checks = tuple(view_checks(config, groups))
        refusal = next(filter(None, (c.violation() for c in checks)), None)
        return Candidate(layout, refusal, config=config, groups=groups, checks=checks)


def _remedy(outcomes: list[Candidate], layer_specs: Mapping[str, KVCacheSpec], run: _Pass) -> str:
    """A layout, else a block size (with a layout), that meets every rule, from the checks made."""
    good = [o.layout for o in outcomes if o.refusal is None]
    if good:
        return f"layout {good[0].name} meets every rule (pass layout={good[0].name!r} or None)"
    sizes = sorted({s.block_size for s in layer_specs.values() if isinstance(s, AttentionSpec)})
    offers = [run.answers.kernel_block_sizes(b, run.specs[n]) for n, b in run.backends.items()]
    # NOTE: strides of undivided pages scale with the block size; split or packed kernel pages do not.
    plain = [o for o in outcomes if o.checks and all(g.ratio == 1 and not any(e.kernel_block_stride for e in g.backends)
                                                     for g in o.groups)]
    for size in [sizes[0] // 2, sizes[0] // 4, sizes[0] * 2, sizes[0] * 4] if len(sizes) == 1 else []:
        if size < 1 or not all(accepts(offer, size) for offer in offers):
            continue
        for outcome in plain:
            if all(c.violation(Fraction(size, sizes[0])) is None for c in outcome.checks):
                return f"{size}-token blocks in layout {outcome.layout.name} meet every rule"
    return "no layout or block size tried meets it; plan fewer blocks or serve these layers with another backend"


def _refuse(outcomes: list[Candidate], candidates: list[KVCacheLayout], explicit: bool,
            layer_specs: Mapping[str, KVCacheSpec], run: _Pass) -> Exception:
    ruled = [o for o in outcomes if o.error is None and o.refusal is not None]
    if not ruled or outcomes[0].error is not None and explicit:
        return next(o.error for o in outcomes if o.error is not None)
    names = ", ".join(c.name for c in candidates)
    prefix = "" if explicit else f"no layout of [{names}] meets every kernel rule: "
    return KernelRequirementError(f"{prefix}{ruled[0].refusal}; {_remedy(outcomes, layer_specs, run)}")


def negotiate(layer_specs: Mapping[str, KVCacheSpec], layer_backends: Mapping[str, type[AttentionBackend] | str], *,
              device: torch.device | str, layout: KVCacheLayout | str | None = None,
              available_memory: int | None = None, num_blocks: int | None = None, max_num_seqs: int, max_model_len: int,
              plugin_manager: pluggy.PluginManager | None = None, group: Any = None, max_num_blocks: int | None = None,
              enable_prefix_caching: bool = False, settings: Settings | None = None, separate_state_pages: bool = False,
              num_state_blocks: int | None = None, kv_cache_dtype: str = "auto") -> Negotiation:
    """Decide what every layer of ``layer_specs`` (model order) gets, as :meth:`KVCache.create
    <kvcore.KVCache.create>` would with the same arguments, allocating nothing.

    ``device`` need not exist here (it is asked about, not used). ``settings``: the environment's
    (``Settings.from_env()``) when None.
    """
    settings = Settings.from_env() if settings is None else settings
    device = as_device(device)
    max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
    max_model_len = positive_int("max_model_len", max_model_len)
    answers = HookAnswers(plugin_manager)
    _checked_layers(layer_specs, layer_backends)
    layer_specs = quantize_specs(layer_specs, kv_cache_dtype)  # NOTE: before backends customize them
    backends, backend_rules = resolve_backends(layer_specs, layer_backends, answers, device)
    specs = {n: answers.customized_spec(backends[n], s) if n in backends else s for n, s in layer_specs.items()}
    check_abilities(specs, answers, device, backends)
    pairs = list(dict.fromkeys((b, specs[n]) for n, b in backends.items()))
    ruled = any(answers.requirements(b, s).has_memory_rules for b, s in pairs)
    stated = answers.common_layouts(pairs)
    region = state_region_blocks(specs, separate_state_pages, num_state_blocks, max_num_seqs, enable_prefix_caching)
    candidates = layout_candidates([stated], specs.values())
    # NOTE: mixer layers' backends run on state views: no attention group, kernel block or layout of theirs
    run = _Pass(specs, {n: b for n, b in backends.items() if not is_mixer_backend(b)}, answers, region)
    requested = requested_layout(layout, settings)
    elastic = max_num_blocks is not None
    # NOTE: an elastic cache is planned for all its blocks and commits the first ones
    memory, blocks = (None, checked_max_blocks(max_num_blocks)) if elastic else checked_budget(
        available_memory, num_blocks)
    if group is None:
        tried = _pass(run, candidates, requested, ruled, blocks, memory)
        rule = "requested" if requested is not None else (
            "the first candidate that meets every kernel rule" if ruled else "the first candidate")
    else:  # NOTE: every rank agrees on one layout and one block count
        planned = [run.plan(c, blocks, memory) for c in candidates] if ruled else []
        requested = agree_layout([c.layout for c in planned if c.refusal is None] or stated, specs.values(), group,
                                 requested)
        if num_blocks is None:
            num_blocks = blocks if available_memory is None else run.bought(requested, available_memory)
        num_blocks, available_memory = agree_num_blocks(num_blocks, group), None
        tried = [run.plan(requested, blocks if elastic else num_blocks, None)]
        tried += [c for c in planned if c.layout is not requested]
        rule = "agreed by every rank"
    accepted = tried[0] if requested is not None else next((c for c in tried if c.refusal is None), None)
    if accepted is None or accepted.refusal is not None:
        raise _refuse(tried, candidates, requested is not None, layer_specs, run)
    config = accepted.config
    committed = _first_blocks(run, config, num_blocks, available_memory) if elastic else config.num_blocks
    by_layout = {c.layout: c for c in tried}
    return Negotiation(accepted.groups, config.layout, config, dict(backends), committed, elastic, device, max_num_seqs,
                       max_model_len, enable_prefix_caching,
                       tuple(by_layout.get(c, Candidate(c, tried=False)) for c in candidates), rule, backend_rules,
                       tuple(Declared.of(answers, b, s, device) for b, s in pairs))


def _pass(run: _Pass, candidates: list[KVCacheLayout], requested: KVCacheLayout | None, ruled: bool,
          blocks: int | None, memory: int | None) -> list[Candidate]:
    """The candidates planned, in order, until one is accepted (each once). A requested layout is
    the only one that may be accepted; when kernel rules refuse it the others are planned too, to
    name one that meets them."""
    if requested is not None:
        tried = [run.plan(checked_request(requested, candidates), blocks, memory)]
        if tried[0].refusal is not None and tried[0].error is None:
            tried += [run.plan(c, blocks, memory) for c in candidates if c is not requested]
        return tried
    tried = []
    for candidate in candidates if ruled else candidates[:1]:
        tried.append(run.plan(candidate, blocks, memory))
        if tried[-1].refusal is None:
            break
    return tried


def _first_blocks(run: _Pass, config: KVCacheConfig, num_blocks: int | None, available_memory: int | None) -> int:
    """Blocks an elastic cache commits at creation: ``num_blocks``, what ``available_memory`` buys,
    or (neither) all of them."""
    max_blocks = config.num_blocks
    if num_blocks is None:
        return max_blocks if available_memory is None else min(run.bought(config.layout, available_memory), max_blocks)
    return checked_num_blocks(num_blocks, max_blocks)
