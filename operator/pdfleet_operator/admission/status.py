"""Pure: a stored object's verdict -> its ``Admitted`` and ``Degraded`` conditions.

The re-check handlers write these through the status subresource. ``Degraded`` has other writers
later (rollouts); this module only sets it True for a matrix rejection and only clears it when the
reason is its own, so it never hides someone else's Degraded.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from pdfleet_operator.api.constants import ConditionStatus, ConditionType
from pdfleet_operator.api.models import Condition
from pdfleet_operator.validation import ObjectVerdict
from pdfleet_runtime.matrix import Violation

__all__ = ["REASON_ADMITTED", "REASON_REJECTED", "admission_conditions", "merge_conditions"]

REASON_ADMITTED = "MatrixAdmits"
REASON_REJECTED = "MatrixRejects"
_MESSAGE_CHARS = 8192


def _message(violations: Sequence[Violation]) -> str:
    lines = []
    for v in violations:
        where = ", ".join(p for p in v.paths if p)
        lines.append(f"[{v.rule}] {where}: {v.message}; why: {v.reason}; fix: {v.fix}")
    text = "\n".join(lines)
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _condition(kind: ConditionType, ok: bool, reason: str, message: str, generation: int | None) -> Condition:
    return Condition(
        type=kind,
        status=ConditionStatus.TRUE if ok else ConditionStatus.FALSE,
        observed_generation=generation,
        reason=reason,
        message=message,
    )


def admission_conditions(verdict: ObjectVerdict, generation: int | None) -> list[Condition]:
    """Admitted (and Degraded when rejected, or its clearing) for the running matrix's verdict."""
    versions = ", ".join(verdict.matrix_versions) or "?"
    if verdict.admitted:
        return [
            _condition(ConditionType.ADMITTED, True, REASON_ADMITTED, f"admitted by matrix {versions}",
                       generation),
            _condition(ConditionType.DEGRADED, False, REASON_ADMITTED, f"matrix {versions} admits the spec",
                       generation),
        ]
    head = f"the running operator's matrix {versions} rejects the stored spec ({len(verdict.violations)}):\n"
    text = head + _message(verdict.violations)
    return [
        _condition(ConditionType.ADMITTED, False, REASON_REJECTED, text, generation),
        _condition(ConditionType.DEGRADED, True, REASON_REJECTED, text, generation),
    ]


def merge_conditions(
    existing: object, updates: Sequence[Condition], now: dt.datetime
) -> list[dict[str, Any]] | None:
    """The full new conditions list (a merge patch replaces lists), or None when nothing changes.

    Keeps other writers' conditions; keeps ``lastTransitionTime`` when a status did not flip; does not
    clear a ``Degraded`` that another writer set.
    """
    current = [dict(c) for c in existing if isinstance(c, Mapping)] if isinstance(existing, list) else []
    by_type = {c.get("type"): i for i, c in enumerate(current)}
    out = [dict(c) for c in current]
    for cond in updates:
        i = by_type.get(cond.type.value)
        old = current[i] if i is not None else None
        if (
            cond.type is ConditionType.DEGRADED
            and cond.status is ConditionStatus.FALSE
            and old is not None
            and old.get("status") == ConditionStatus.TRUE
            and old.get("reason") != REASON_REJECTED
        ):
            continue  # someone else's Degraded
        flipped = old is None or old.get("status") != cond.status.value
        when = now if flipped else old.get("lastTransitionTime") or now
        new = cond.model_copy(update={"last_transition_time": when}) if isinstance(when, dt.datetime) else cond
        doc = new.model_dump(by_alias=True, mode="json", exclude_none=True)
        if not isinstance(when, dt.datetime):
            doc["lastTransitionTime"] = when
        if i is None:
            by_type[cond.type.value] = len(out)
            out.append(doc)
        else:
            out[i] = doc
    return None if out == current else out
