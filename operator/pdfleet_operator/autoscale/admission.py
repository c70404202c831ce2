"""The autoscaling checks that need a loop over replica counts, beside the matrix (``validation``).

The CEL rules (``api.rules``) catch what one expression can; these give the exact integer answers.
"""

from __future__ import annotations

from pdfleet_operator.api.autoscaling import AUTOSCALING_RULES, cheapest_in_band
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_runtime.matrix import Severity, Violation

__all__ = ["autoscaling_violations", "gpus_per_replica"]


def gpus_per_replica(spec: PDDeploymentSpec, role: str) -> int:
    """GPUs one replica of ``role`` holds: tensor x pipeline (over all its nodes)."""
    p = (spec.prefill if role == "prefill" else spec.decode).parallelism
    return int(p.tensor * p.pipeline)



def _violation(rule: str, message: str, path: str, severity: Severity = Severity.ERROR) -> Violation:
    r = AUTOSCALING_RULES[rule]
    return Violation(rule, message, (path,), r.reason, r.fix, severity)


def autoscaling_violations(spec: PDDeploymentSpec) -> tuple[list[Violation], list[Violation]]:
    """(errors, warnings) of the loop-needing checks of ``spec.autoscaling``: none when it is absent or
    its bounds are already wrong (the CEL rules report those)."""
    a = spec.autoscaling
    if a is None or a.prefill.min_replicas > a.prefill.max_replicas or a.decode.min_replicas > a.decode.max_replicas:
        return [], []
    band = (a.prefill_decode_ratio.min, a.prefill_decode_ratio.max) if a.prefill_decode_ratio else None
    if band is not None and band[0] > band[1]:
        return [], []
    gpus = (gpus_per_replica(spec, "prefill"), gpus_per_replica(spec, "decode"))
    bounds = ((a.prefill.min_replicas, a.prefill.max_replicas), (a.decode.min_replicas, a.decode.max_replicas))
    best = cheapest_in_band(*bounds, band, gpus)
    if best is None:
        assert band is not None
        return [_violation(
            "autoscaling-ratio-feasible",
            f"no prefill count in [{bounds[0][0]}, {bounds[0][1]}] and decode count in [{bounds[1][0]}, "
            f"{bounds[1][1]}] has a prefill/decode ratio in [{band[0]:g}, {band[1]:g}]",
            "spec.autoscaling.prefillDecodeRatio",
        )], []
    need = best[0] * gpus[0] + best[1] * gpus[1]
    minimums = bounds[0][0] * gpus[0] + bounds[1][0] * gpus[1]
    if a.gpu_budget is None:
        return [], []
    if need > a.gpu_budget and minimums <= a.gpu_budget:
        return [_violation(
            "autoscaling-budget-feasible",
            f"gpuBudget {a.gpu_budget} is below the cheapest counts that keep the ratio band: prefill "
            f"{best[0]} x {gpus[0]} + decode {best[1]} x {gpus[1]} = {need} GPUs",
            "spec.autoscaling.gpuBudget",
        )], []
    warnings = []
    for i, role in enumerate(("prefill", "decode")):
        top = bounds[i][1] * gpus[i] + bounds[1 - i][0] * gpus[1 - i]
        if top > a.gpu_budget:
            warnings.append(_violation(
                "autoscaling-max-unreachable",
                f"{role} maxReplicas {bounds[i][1]} holds {bounds[i][1] * gpus[i]} GPUs: with the other role at "
                f"its minimum that is {top} GPUs, above gpuBudget {a.gpu_budget}, so the budget caps {role} first",
                f"spec.autoscaling.{role}.maxReplicas",
                Severity.WARNING,
            ))
    return [], warnings
