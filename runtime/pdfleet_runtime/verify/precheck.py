"""Before any byte moves: the capability matrix's verdict, then the runtime's own shape limits."""

from __future__ import annotations

from pdfleet_runtime import matrix
from pdfleet_runtime.layouts import PRESETS, LayoutError, rank_buffers
from pdfleet_runtime.planner import PlanError, check_shapes
from pdfleet_runtime.records import ParallelShape

from .results import ParityConfig, Rejection

__all__ = ["MATRIX_PROTOCOL", "PRECHECK_RULE", "check_matrix", "precheck"]

MATRIX_PROTOCOL = "rdma"
"""The link a parity run asks the matrix about: every backend's column serves RDMA, and the in-process
run checks what a backend can move, not its link (the engine runs' own protocol is checked at start)."""

PRECHECK_RULE = "runtime-precheck"
"""Rule id of a rejection by the runtime's own shape checks rather than by the matrix."""


def check_matrix(cfg: ParityConfig) -> Rejection | None:
    """The first error the capability matrix reports for this combination, or None if admitted."""
    named = cfg.layout_name in PRESETS and PRESETS[cfg.layout_name] == cfg.layout
    backend = "mooncake" if cfg.backend == "local" else cfg.backend
    # Capacity of the run; the GPU memory default is the matrix's own. A preset's real model is never loaded
    # here (seeded pools, or a small model), so its weights are not counted.
    def role(s: ParallelShape) -> matrix.RoleInput:
        return matrix.RoleInput(tensor=s.tp, pipeline=s.pp, max_requests=cfg.requests, kv_tokens=cfg.tokens)

    inp = matrix.matrix_input(cfg.layout_name if named else cfg.layout, backend, MATRIX_PROTOCOL, role(cfg.prefill),
                              role(cfg.decode), count_weights=False)
    verdict = matrix.evaluate(inp)
    if verdict.admitted:
        return None
    v = verdict.violations[0]
    return Rejection(v.rule, v.message, v.reason)


def precheck(cfg: ParityConfig, *, check_with_matrix: bool = True) -> Rejection | None:
    """The matrix's verdict, then the runtime's own limits (in case the matrix admits what the layout
    cannot be split into); None when the combination may run."""
    if check_with_matrix:
        rejection = check_matrix(cfg)
        if rejection is not None:
            return rejection
    try:
        check_shapes(cfg.prefill, cfg.decode)
        for shape in (cfg.prefill, cfg.decode):
            for k in range(shape.pp):
                rank_buffers(cfg.layout, shape.tp, shape.pp, 0, k)
    except (LayoutError, PlanError) as e:
        return Rejection(PRECHECK_RULE, str(e), "the runtime cannot split this layout over these shapes "
                         "(the matrix admitted it)")
    return None
