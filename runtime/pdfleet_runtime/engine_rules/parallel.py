"""A cell of ``pdfleet matrix``'s parallelism table: what one engine does with attention data parallelism,
expert parallelism and replicas across nodes in PD, per transfer backend, each "no" with its rule and reason.

The rules themselves live where admission evaluates them (``matrix.GENERAL_RULES`` and the CRD's CEL
rules); the cells are their per-backend summary, declared by each engine plug-in (``EngineRules.
parallel_cells``) and gathered in registry order by ``registry.PARALLEL_CELLS``. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfleet_runtime.links import Backend

__all__ = ["ParallelCell"]


@dataclass(frozen=True, slots=True)
class ParallelCell:
    engine: str  # "pdfleet" (built-in runtime) or "KIND==VERSION"
    feature: str  # "attention-dp", "expert-parallel", "multi-node"
    backend: Backend | None  # None: every backend
    supported: bool
    reason: str
    rule: str | None = None
