"""Lazy backend registry: names to adapter classes, imported only when asked for.

Importing this module (or ``pdfleet_runtime.engines``) imports no engine library; an adapter
module imports its engine inside ``start``. So the runtime's pure modules and the operator stay
importable on hosts without Mooncake, NIXL or ROCm (import-linter keeps the operator clean).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType

from pdfleet_runtime.engines.base import TransferEngine
from pdfleet_runtime.engines.errors import SettingsError
from pdfleet_runtime.engines.settings import LOCAL_BACKEND, EngineConfig
from pdfleet_runtime.links import Backend

__all__ = ["ADAPTERS", "adapter_class", "create_engine"]

ADAPTERS: Mapping[str, str] = MappingProxyType({
    LOCAL_BACKEND: "pdfleet_runtime.engines.local:LocalEngine",
    Backend.MOONCAKE.value: "pdfleet_runtime.engines.mooncake:MooncakeEngine",
    Backend.NIXL.value: "pdfleet_runtime.engines.nixl:NixlEngine",
    Backend.MORI.value: "pdfleet_runtime.engines.mori:MoriEngine",
})
"""Backend name -> ``module:class`` of its adapter."""


def adapter_class(backend: str | Backend) -> type[TransferEngine]:
    """The adapter class of a backend (imports the adapter module, not the engine)."""
    name = backend.value if isinstance(backend, Backend) else backend
    target = ADAPTERS.get(name)
    if target is None:
        raise SettingsError(f"unknown backend {name!r}; known: {sorted(ADAPTERS)}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def create_engine(config: EngineConfig) -> TransferEngine:
    """A new, not yet started adapter for ``config.backend`` (settings resolved and checked)."""
    return adapter_class(config.backend)(config)
