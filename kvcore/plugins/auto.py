"""The backend a device gets (``"auto"``: requirements say which can, priority which wins) and
the block size a backend prefers."""

from __future__ import annotations

from typing import Any

import pluggy
import torch

from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.manager import collect_backends
from kvcore.plugins.mixer_backend import MixerBackend, is_mixer_backend
from kvcore.specs import KVCacheSpec, MambaSpec, MultipleOf

#: The backend name that means "the one :func:`select_backend` picks".
AUTO = "auto"


def serves(
    answers: HookAnswers, backend: type, spec: KVCacheSpec | None, device: torch.device
) -> str | None:
    """Why ``backend`` cannot serve ``spec`` on ``device``; None when it can."""
    requirements = answers.requirements(backend, spec)
    if isinstance(spec, MambaSpec):  # NOTE: a mixer backend, for the mixer the spec names
        if not is_mixer_backend(backend):
            return "is an attention backend, not a mixer backend (rule: kind)"
        if spec.mamba_type not in backend.mamba_types:
            return f"runs mixers {list(backend.mamba_types)}, not {spec.mamba_type!r} (rule: mamba_types)"
        whys = (requirements.why_not(device.type, dtype, None) for dtype in spec.dtypes)
        return next((why for why in whys if why is not None), None)
    if is_mixer_backend(backend):
        return "is a mixer backend, not an attention backend (rule: kind)"
    return requirements.why_not(
        device.type, getattr(spec, "dtype", None), getattr(spec, "head_size", None)
    )


def select_backend(
    spec: KVCacheSpec | None,
    device: torch.device | str,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> type[AttentionBackend] | type[MixerBackend]:
    """The registered backend that serves ``spec`` on ``device``: what ``"auto"`` means.

    Among unambiguous backends whose requirements admit the device type, dtype and head size, the
    highest ``kvcore_backend_priority`` wins (ties: first name); none: ``ValueError`` saying why.
    A ``MambaSpec`` gets a mixer backend whose ``mamba_types`` lists its ``mamba_type``.
    """
    if spec is not None and not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {spec!r}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or a string such as 'cuda', got {device!r}")
    try:
        device = torch.device(device)  # NOTE: it need not exist on this machine
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"invalid device {device!r} ({exc}); pass 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    return choose_backend(HookAnswers(plugin_manager), spec, device)


def choose_backend(
    answers: HookAnswers, spec: KVCacheSpec | None, device: torch.device
) -> type[AttentionBackend]:
    table = collect_backends(answers.pm)
    reasons = dict.fromkeys(
        table.conflicts(),
        "its name is registered by several plugins (block all but one with KVCORE_BLOCK_PLUGINS)",
    )
    mixer = isinstance(spec, MambaSpec)
    able: list[tuple[int, type[AttentionBackend]]] = []
    for name, (backend, _) in sorted(table.unambiguous().items()):
        if is_mixer_backend(backend) != mixer:
            continue  # NOTE: the other kind is never a candidate, nor listed
        reasons[name] = serves(answers, backend, spec, device)
        if reasons[name] is None:
            able.append((answers.priority(backend, spec, device), backend))
    if able:
        return max(able, key=lambda found: found[0])[1]  # NOTE: max keeps the first name of a tie
    listed = "; ".join(f"{name}: {why}" for name, why in sorted(reasons.items()))
    kind = "mixer" if mixer else "attention"
    raise ValueError(
        f"no registered {kind} backend can serve {spec!r} on {device} "
        f"({listed or 'none is registered'}). Install or enable a plugin whose backend runs "
        "there, or pick a device and dtype one supports"
    )


def resolve_auto(
    answers: HookAnswers, backend: Any, spec: KVCacheSpec | None, device: torch.device
) -> Any:
    """``backend`` itself, or the backend :func:`select_backend` picks when it is ``"auto"``."""
    if isinstance(backend, str) and backend == AUTO:
        return choose_backend(answers, spec, device)
    return backend


def preferred_block_size(
    backend: type[AttentionBackend] | str,
    spec: KVCacheSpec | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> int | None:
    """The block size ``backend`` prefers for ``spec``: the first ``int`` its plugin declares."""
    answers = HookAnswers(plugin_manager)
    sizes = answers.kernel_block_sizes(answers.backend(backend), spec)
    return next((s for s in sizes if not isinstance(s, MultipleOf)), None)
