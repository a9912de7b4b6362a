"""The plugin health check behind ``kvcore plugins``: every hook of every backend, asked once."""

from __future__ import annotations

from typing import Any

import attrs
import pluggy
import torch

from kvcore._table import format_ranges
from kvcore.errors import PluginError
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.auto import choose_backend
from kvcore.plugins.manager import PluginInfo, collect_backends
from kvcore.plugins.mixer_backend import is_mixer_backend
from kvcore.plugins.registry import list_plugins, resolve_plugin_manager
from kvcore.plugins.requirements import KernelRequirements
from kvcore.specs import FullAttentionSpec, MambaSpec, MultipleOf

#: The spec every backend is asked about: 16-token blocks, 8 KV heads of 128, bf16.
REPRESENTATIVE_SPEC = FullAttentionSpec(16, 8, 128, torch.bfloat16)

#: Statuses that make ``kvcore plugins`` exit 1.
BAD_STATUSES = ("failed", "conflict", "unhealthy")


def check_plugins(
    plugin_manager: pluggy.PluginManager | None = None, answers: HookAnswers | None = None
) -> list[PluginInfo]:
    """:func:`~kvcore.plugins.registry.list_plugins` with what each backend declares; a hook
    that raises or answers the wrong type marks its plugin ``unhealthy``."""
    pm = resolve_plugin_manager(plugin_manager)
    infos = list_plugins(pm)
    by_name = {info.name: info for info in infos}
    try:
        entries = collect_backends(pm).entries
    except PluginError:
        entries = {}  # NOTE: list_plugins already marked the plugin that failed
    answers = answers or HookAnswers(pm)
    for name, found in entries.items():
        for backend, owner in found:
            mixer = is_mixer_backend(backend)
            spec = REPRESENTATIVE_SPEC
            if mixer:  # NOTE: asked about a state cache of a mixer it runs
                spec = MambaSpec(16, [(8, 4)], [torch.bfloat16], mamba_type=backend.mamba_types[0])
            try:
                sizes = answers.kernel_block_sizes(backend, spec)
                layouts = answers.stated_layouts(backend, spec)
                answers.customized_spec(backend, spec)
                answers.requirements(backend, spec)
                answers.priority(backend, spec, torch.device("cpu"))
            except PluginError as exc:
                culprit = by_name.get(getattr(exc, "plugin_name", None) or owner)
                if culprit is not None:
                    status = "unhealthy" if culprit.status == "loaded" else culprit.status
                    culprit.flag(status, str(exc))
                continue
            if mixer:  # NOTE: state caches keep one block per sequence in any layout
                continue
            by_name[owner].kernel_block_sizes[name] = [
                {"multiple_of": s.base} if isinstance(s, MultipleOf) else s for s in sizes
            ]
            by_name[owner].layouts[name] = None if layouts is None else [x.name for x in layouts]
    return infos


def is_healthy(infos: list[PluginInfo]) -> bool:
    """No plugin failed, conflicts with another or answered a hook badly."""
    return not any(info.status in BAD_STATUSES for info in infos)


def _dtype_name(value: Any) -> Any:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def requirements_json(req: KernelRequirements) -> dict[str, Any]:
    """A backend's requirements as JSON values (None: no rule)."""
    return attrs.asdict(
        req, filter=lambda a, _: a.name != "note", value_serializer=lambda _, __, v: _dtype_name(v)
    )


def describe_requirements(req: KernelRequirements) -> str:
    """One line of what a backend requires ("none" when nothing)."""
    parts = []
    if req.devices is not None:
        parts.append("devices " + ", ".join(req.devices))
    if req.dtypes is not None:
        parts.append("dtypes " + ", ".join(_dtype_name(d) for d in req.dtypes))
    if req.head_sizes is not None:
        parts.append("head sizes " + format_ranges(sorted(set(req.head_sizes))))
    if req.max_stride_elements is not None:
        parts.append(f"strides below {req.max_stride_elements} elements")
    if req.alignment_bytes > 1:
        parts.append(f"{req.alignment_bytes}-byte aligned strides and offsets")
    return "; ".join(parts) or "none"


def auto_picks(answers: HookAnswers) -> dict[str, str | None]:
    """Device type (CPU, and CUDA when present) -> what ``"auto"`` picks (None: nothing)."""
    out: dict[str, str | None] = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        try:
            out[device] = choose_backend(answers, REPRESENTATIVE_SPEC, torch.device(device)).name
        except ValueError:  # NOTE: PluginError too; check_plugins already reported it
            out[device] = None
    return out
