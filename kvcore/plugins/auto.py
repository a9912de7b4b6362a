"""The backend a device gets: ``"auto"`` weighs every registered backend once per spec
(requirements say which can serve it, priority which wins), and says why."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import pluggy
import torch

from kvcore.errors import KernelRequirementError, PluginError, PluginWarning
from kvcore.plugins.answers import HookAnswers, label
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.manager import collect_backends
from kvcore.plugins.mixer_backend import MixerBackend, is_mixer_backend
from kvcore.specs import KVCacheSpec, MambaSpec

#: The backend name that means "the one :func:`select_backend` picks".
AUTO = "auto"

Backends = dict[str, type[AttentionBackend]]


def serves(answers: HookAnswers, backend: type, spec: KVCacheSpec | None, device: torch.device) -> str | None:
    """Why ``backend`` cannot serve ``spec`` on ``device``; None when it can."""
    requirements = answers.requirements(backend, spec)
    if isinstance(spec, MambaSpec):  # NOTE: a mixer backend, for the mixer the spec names
        if not is_mixer_backend(backend):
            return "is an attention backend, not a mixer backend (rule: kind)"
        if spec.mamba_type not in backend.mamba_types:
            return f"runs mixers {list(backend.mamba_types)}, not {spec.mamba_type!r} (rule: mamba_types)"
        return next(filter(None, (requirements.why_not(device.type, d, None) for d in spec.dtypes)), None)
    if is_mixer_backend(backend):
        return "is a mixer backend, not an attention backend (rule: kind)"
    return requirements.why_not(device.type, getattr(spec, "dtype", None), getattr(spec, "head_size", None),
                                getattr(spec, "kv_quant", None))


@attrs.frozen
class Choice:
    """What ``"auto"`` picked for one spec: ``weighed`` holds every backend's name with its
    priority (an int) or why it cannot serve (a str)."""

    backend: type[AttentionBackend] | type[MixerBackend]
    weighed: tuple[tuple[str, int | str], ...]

    def explain(self) -> str:
        others = "; ".join(f"{name}: {'priority ' + str(w) if isinstance(w, int) else w}" for name, w in self.weighed)
        return f"the highest priority of those that can serve it ({others})"


def select_backend(spec: KVCacheSpec | None, device: torch.device | str, *,
                   plugin_manager: pluggy.PluginManager | None = None) -> type[AttentionBackend]:
    """The registered backend that serves ``spec`` on ``device``: what ``"auto"`` means.

    Among unambiguous backends whose requirements admit the device type, dtype and head size, the
    highest ``kvcore_backend_priority`` wins (ties: first name); none: ``ValueError`` saying why.
    A plugin whose requirements or priority hook fails is reported (``PluginWarning``) and skipped.
    A ``MambaSpec`` gets a mixer backend whose ``mamba_types`` lists its ``mamba_type``.
    """
    if spec is not None and not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {spec!r}")
    return choose_backend(HookAnswers(plugin_manager), spec, as_device(device)).backend


def as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` (it need not exist on this machine)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or a string such as 'cuda', got {device!r}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"invalid device {device!r} ({exc}); pass 'cpu', 'cuda' or 'cuda:N'") from None


def _weigh(answers: HookAnswers, backend: type, spec: KVCacheSpec | None, device: torch.device) -> int | str:
    """``backend``'s priority for ``spec`` on ``device``, or why it cannot serve it."""
    try:
        why = serves(answers, backend, spec, device)
        return why if why is not None else answers.priority(backend, spec, device)
    except PluginError as err:  # NOTE: its own plugin failed: the others are still weighed
        answers.unhealthy.setdefault(getattr(err, "plugin_name", None) or label(backend), err)
        warnings.warn(f"{err} (kvcore skips that backend)", PluginWarning, stacklevel=3)
        return f"its plugin is unhealthy ({err})"


def choose_backend(answers: HookAnswers, spec: KVCacheSpec | None, device: torch.device) -> Choice:
    table = collect_backends(answers.pm)
    weighed: dict[str, int | str] = dict.fromkeys(
        table.conflicts(),
        "its name is registered by several plugins (block all but one with KVCORE_BLOCK_PLUGINS)",
    )
    mixer = isinstance(spec, MambaSpec)
    for name, (backend, _) in sorted(table.unambiguous().items()):
        if is_mixer_backend(backend) == mixer:  # NOTE: the other kind is never a candidate, nor listed
            weighed[name] = _weigh(answers, backend, spec, device)
    able = [(w, name) for name, w in weighed.items() if isinstance(w, int)]
    if able:
        best = max(able, key=lambda found: found[0])[1]  # NOTE: max keeps the first name of a tie
        return Choice(table.unambiguous()[best][0], tuple(sorted(weighed.items())))
    listed = "; ".join(f"{name}: {why}" for name, why in sorted(weighed.items()))
    # NOTE: when a failing plugin left nothing to serve the spec, the error is that plugin's.
    raise (PluginError if answers.unhealthy else ValueError)(
        f"no registered {'mixer' if mixer else 'attention'} backend can serve {spec!r} on {device} "
        f"({listed or 'none is registered'}). Install or enable a plugin whose backend runs "
        "there, or pick a device and dtype one supports"
    )


def preferred_block_size(backend: type[AttentionBackend] | str, spec: KVCacheSpec | None = None, *,
                         plugin_manager: pluggy.PluginManager | None = None) -> int | None:
    """The block size ``backend`` prefers for ``spec``: the first ``int`` its plugin declares."""
    answers = HookAnswers(plugin_manager)
    return answers.preferred_block_size(answers.backend(backend), spec)


def resolve_backends(layer_specs: Mapping[str, KVCacheSpec], layer_backends: Mapping[str, type[AttentionBackend] | str],
                     answers: HookAnswers, device: torch.device) -> tuple[Backends, dict[str, str]]:
    """Each layer's backend class (a name looked up, ``"auto"`` chosen once per distinct spec) and
    how it was chosen."""
    chosen: dict[Any, tuple[type[AttentionBackend], str]] = {}
    for layer, backend in layer_backends.items():
        if not isinstance(backend, (str, type)):
            raise TypeError(f"layer_backends[{layer!r}] is {backend!r}; pass a "
                            "backend class, a registered backend name or 'auto'")
        key = (layer_specs[layer], backend)
        if key not in chosen and backend == AUTO:
            choice = choose_backend(answers, layer_specs[layer], device)
            chosen[key] = choice.backend, f'picked by "auto": {choice.explain()}'
        elif key not in chosen:
            chosen[key] = answers.backend(backend), "named"
    found = {layer: chosen[(layer_specs[layer], b)] for layer, b in layer_backends.items()}
    return {n: b for n, (b, _) in found.items()}, {n: rule for n, (_, rule) in found.items()}


def check_abilities(specs: Mapping[str, KVCacheSpec], answers: HookAnswers, device: torch.device,
                    backends: Backends) -> None:
    """Refuse a layer whose backend cannot serve its spec on ``device``, naming one that can."""
    first: dict[tuple[type, KVCacheSpec], str] = {}
    for name, backend in backends.items():
        first.setdefault((backend, specs[name]), name)
    for (backend, spec), layer in first.items():
        why = serves(answers, backend, spec, device)
        if why is None:
            continue
        try:
            other = choose_backend(answers, spec, device).backend
            remedy = f"serve it with backend {label(other)!r} (or 'auto')"
        except ValueError:
            remedy = "no registered backend can serve it there; use another device or dtype"
        raise KernelRequirementError(f"backend {label(backend)!r} cannot serve layer {layer!r}: it {why}; {remedy}")
