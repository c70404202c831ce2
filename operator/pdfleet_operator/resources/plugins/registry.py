"""The engine and router kinds the operator renders, by ``EngineKind`` and ``RouterKind``.

The only module of the generic rendering that names the plug-ins: adding an engine or a router adds its
module and a line here (a unit test checks every kind has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pdfleet_operator.api.models import EngineKind, PDDeploymentSpec, RouterKind
from pdfleet_operator.resources.plugins.builtin import BUILTIN
from pdfleet_operator.resources.plugins.contract import EnginePlugin, RouterPlugin
from pdfleet_operator.resources.plugins.sglang import SGLANG
from pdfleet_operator.resources.plugins.sglang_router import SGLANG_ROUTER
from pdfleet_operator.resources.plugins.vllm import VLLM
from pdfleet_operator.resources.plugins.vllm_router import VLLM_ROUTER

__all__ = ["ENGINES", "ROUTERS", "engine_plugin", "router_kind", "router_plugin"]

ENGINES: Mapping[EngineKind, EnginePlugin] = MappingProxyType({p.kind: p for p in (BUILTIN, SGLANG, VLLM)})
ROUTERS: Mapping[RouterKind, RouterPlugin] = MappingProxyType({p.kind: p for p in (SGLANG_ROUTER, VLLM_ROUTER)})


def engine_plugin(spec: PDDeploymentSpec) -> EnginePlugin:
    """The plug-in of spec.engine.kind (no spec.engine: the built-in runtime)."""
    return ENGINES[EngineKind.PDFLEET if spec.engine is None else spec.engine.kind]


def router_kind(spec: PDDeploymentSpec) -> RouterKind:
    """spec.router.kind, defaulting to the engine's own router (admission denies another engine's)."""
    assert spec.router is not None
    if spec.router.kind is not None:
        return spec.router.kind
    return RouterKind(engine_plugin(spec).rules.own_router)


def router_plugin(spec: PDDeploymentSpec) -> RouterPlugin:
    """The plug-in of the spec's router kind (``router_kind``)."""
    return ROUTERS[router_kind(spec)]
