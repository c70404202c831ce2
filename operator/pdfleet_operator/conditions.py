"""Pure: the PDDeployment's conditions as typed ``Condition``s: build, fold a problem into ``Degraded``, merge.

The reconcile pass's one status holds every writer's conditions: admission's ``Admitted``/``Degraded``
(passed in), placement, a missing key and a failed rollout folded into ``Degraded``, and the pass's own
``Progressing``/``Available``. Merging keeps ``lastTransitionTime`` when a condition's status did not
change, so watchers see real transitions only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from pdfleet_operator.api.constants import ConditionStatus, ConditionType
from pdfleet_operator.api.models import Condition

__all__ = ["condition", "merge_conditions", "with_degraded"]


def condition(kind: ConditionType, ok: bool, reason: str, message: str, generation: int) -> Condition:
    """A condition of this pass's ``generation`` (its transition time is set when merged)."""
    return Condition(type=kind, status=ConditionStatus.TRUE if ok else ConditionStatus.FALSE, reason=reason,
                     message=message, observed_generation=generation)


def with_degraded(conditions: Sequence[Condition], reason: str, message: str, generation: int) -> list[Condition]:
    """``Degraded`` True with ``reason``; an earlier Degraded reason is kept and gains the message."""
    out, found = [], False
    for cond in conditions:
        if cond.type is ConditionType.DEGRADED:
            found = True
            if cond.status is ConditionStatus.TRUE:
                cond = cond.model_copy(update={"message": f"{cond.message or ''}\n{message}"})
            else:
                cond = cond.model_copy(update={"status": ConditionStatus.TRUE, "reason": reason, "message": message})
        out.append(cond)
    if not found:
        out.append(condition(ConditionType.DEGRADED, True, reason, message, generation))
    return out


def merge_conditions(old: Sequence[Condition], new: Iterable[Condition], now: datetime) -> list[Condition]:
    """New conditions replace old ones of the same type; unchanged statuses keep their time."""
    previous = {c.type: c for c in old}
    merged = dict(previous)
    for cond in new:
        before = previous.get(cond.type)
        stamp = before.last_transition_time if before is not None and before.status is cond.status else None
        merged[cond.type] = cond.model_copy(update={"last_transition_time": stamp or now})
    order = list(ConditionType)
    return sorted(merged.values(), key=lambda c: order.index(c.type))
