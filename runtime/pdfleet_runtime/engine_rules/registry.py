"""The engine kinds the rules know, by ``spec.engine.kind`` (one ``EngineRules`` plug-in each).

The only module of the generic code that names the plug-ins: adding an engine adds its module and a line
here. ``PARALLEL_CELLS`` gathers the plug-ins' parallelism cells in this order (``pdfleet matrix``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pdfleet_runtime.engine_rules.builtin import BUILTIN
from pdfleet_runtime.engine_rules.contract import EngineRules
from pdfleet_runtime.engine_rules.parallel import ParallelCell
from pdfleet_runtime.engine_rules.sglang_plugin import SGLANG
from pdfleet_runtime.engine_rules.vllm_plugin import VLLM

__all__ = ["ENGINES", "PARALLEL_CELLS", "checked_kinds", "own_router", "routers_of", "rules_of"]

ENGINES: Mapping[str, EngineRules] = MappingProxyType({r.kind: r for r in (BUILTIN, SGLANG, VLLM)})

PARALLEL_CELLS: tuple[ParallelCell, ...] = tuple(c for r in ENGINES.values() for c in r.parallel_cells)


def rules_of(kind: str) -> EngineRules | None:
    """The plug-in of ``spec.engine.kind``; None for a kind no plug-in serves."""
    return ENGINES.get(kind)


def checked_kinds() -> tuple[str, ...]:
    """The kinds whose engine container admission checks (``pdfleet matrix --engine KIND==VERSION``)."""
    return tuple(k for k, r in ENGINES.items() if r.checked)


def own_router(kind: str) -> str:
    """The router kind whose PD protocol ``kind`` speaks; a kind without a plug-in: the built-in runtime's."""
    return ENGINES.get(kind, BUILTIN).own_router


def routers_of(kind: str) -> frozenset[str]:
    """Every router kind whose PD protocol ``kind`` speaks; a kind without a plug-in: the built-in runtime's."""
    return ENGINES.get(kind, BUILTIN).routers
