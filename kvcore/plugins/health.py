"""The plugin health check behind ``kvcore plugins``: every hook of every backend, asked once."""

from __future__ import annotations

import pluggy
import torch

from kvcore.errors import PluginError
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.auto import choose_backend
from kvcore.plugins.manager import PluginInfo, collect_backends
from kvcore.plugins.mixer_backend import is_mixer_backend
from kvcore.plugins.registry import list_plugins, resolve_plugin_manager
from kvcore.specs import FullAttentionSpec, MambaSpec, MultipleOf

#: The spec every backend is asked about: 16-token blocks, 8 KV heads of 128, bf16.
REPRESENTATIVE = FullAttentionSpec(16, 8, 128, torch.bfloat16)

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
            spec = REPRESENTATIVE
            if mixer:  # NOTE: asked about a state cache of a mixer it runs
                spec = MambaSpec(16, [(8, 4)], [torch.bfloat16], mamba_type=backend.mamba_types[0])
            try:
                sizes = answers.kernel_block_sizes(backend, spec)
                layouts = answers.stated_layouts(backend, spec)
                answers.customized_spec(backend, spec)
                answers.requirements(backend, spec)
                answers.priority(backend, spec, torch.device("cpu"))
            except PluginError as exc:
                _flag(by_name, getattr(exc, "plugin_name", None) or owner, exc)
                continue
            if mixer:  # NOTE: state caches keep one block per sequence in any layout
                continue
            by_name[owner].kernel_block_sizes[name] = [
                {"multiple_of": s.base} if isinstance(s, MultipleOf) else s for s in sizes
            ]
            by_name[owner].layouts[name] = None if layouts is None else [x.name for x in layouts]
    for culprit, exc in answers.unhealthy.items():  # NOTE: skipped while another backend was asked
        _flag(by_name, culprit, exc)
    return infos


def _flag(by_name: dict[str, PluginInfo], culprit: str, exc: PluginError) -> None:
    info = by_name.get(culprit)
    if info is not None:
        info.flag("unhealthy" if info.status == "loaded" else info.status, str(exc))


def is_healthy(infos: list[PluginInfo]) -> bool:
    """No plugin failed, conflicts with another or answered a hook badly."""
    return not any(info.status in BAD_STATUSES for info in infos)


def auto_picks(answers: HookAnswers) -> dict[str, str | None]:
    """Device type (CPU, and CUDA when present) -> what ``"auto"`` picks (None: nothing)."""
    out: dict[str, str | None] = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        try:
            out[device] = choose_backend(answers, REPRESENTATIVE, torch.device(device)).backend.name
        except ValueError:  # NOTE: PluginError too; check_plugins already reported it
            out[device] = None
    return out
