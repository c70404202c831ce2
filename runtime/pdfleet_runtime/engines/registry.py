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
from pdfleet_runtime.engines.settings import LOCAL_BACKEND, EngineBackend, EngineConfig, engine_backend
from pdfleet_runtime.links import Backend

__all__ = ["ADAPTERS", "adapter_class", "create_engine"]

ADAPTERS: Mapping[EngineBackend, str] = MappingProxyType({
    LOCAL_BACKEND: "pdfleet_runtime.engines.local:LocalEngine",
    Backend.MOONCAKE: "pdfleet_runtime.engines.mooncake:MooncakeEngine",
    Backend.NIXL: "pdfleet_runtime.engines.nixl:NixlEngine",
    Backend.MORI: "pdfleet_runtime.engines.mori:MoriEngine",
})
"""Backend -> ``module:class`` of its adapter (every ``EngineBackend`` has one)."""


def adapter_class(backend: EngineBackend | str) -> type[TransferEngine]:
    """The adapter class of a backend, or of its name (imports the adapter module, not the engine)."""
    module, _, name = ADAPTERS[engine_backend(backend)].partition(":")
    cls: type[TransferEngine] = getattr(importlib.import_module(module), name)
    return cls


def create_engine(config: EngineConfig) -> TransferEngine:
    """A new, not yet started adapter for ``config.backend`` (settings resolved and checked)."""
    return adapter_class(config.backend)(config)
