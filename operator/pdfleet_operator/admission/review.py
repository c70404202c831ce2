"""The pure request-to-response function of the validating webhook: bytes in, AdmissionReview out.

``review(body, verdicts)`` answers every input with a well-formed AdmissionReview response and
never raises: truncated JSON, wrong types, missing fields and huge objects all get ``allowed:
false`` with a message saying what could not be read, and the request's uid when one can be found
(the apiserver rejects a response whose uid does not match, so an unreadable request still fails
closed). The verdict itself is ``Verdicts.of`` = ``pdfleet validate``'s.

UPDATE ratchets, as the apiserver does for CEL rules on unchanged fields: an update is denied for
the violations it introduces; violations the stored object already had (for example after an
operator upgrade made the matrix stricter) come back as warnings, so that metadata edits, finalizer
removal and scaling still work on an object that is reported ``Degraded``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdfleet_operator.admission.verdicts import Verdicts, violation_key
from pdfleet_operator.api.constants import GROUP, PLURAL
from pdfleet_operator.validation import ObjectVerdict
from pdfleet_runtime.matrix import Violation

__all__ = [
    "REVIEW_API_VERSIONS",
    "Judgement",
    "Operation",
    "deny",
    "format_denial",
    "format_warning",
    "judge",
    "response_problems",
    "review",
    "scan_uid",
]

REVIEW_API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
_WARNING_CHARS = 250  # the apiserver may truncate warnings over 256 characters
_MESSAGE_CHARS = 32 << 10
# The apiserver writes request.uid first; a scan of the raw bytes finds it even in broken JSON.
_UID_RE = re.compile(rb'"request"\s*:\s*\{\s*"uid"\s*:\s*"([A-Za-z0-9._:-]{1,128})"')


class Operation(StrEnum):
    CREATE = "CREATE"
    UPDATE = "UPDATE"
    DELETE = "DELETE"
    CONNECT = "CONNECT"


_OPERATIONS = frozenset(Operation)


def scan_uid(body: bytes) -> str:
    """request.uid from the first 64 KiB of raw bytes, or ``""``."""
    m = _UID_RE.search(body[: 64 << 10])
    return m.group(1).decode("ascii") if m else ""


def _response(api_version: str, uid: str, allowed: bool) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": allowed},
    }


def deny(message: str, uid: str = "", api_version: str = REVIEW_API_VERSIONS[0], code: int = 400) -> dict:
    """A denial for a request that could not be judged (code 400: the review itself was bad)."""
    out = _response(api_version, uid, False)
    out["response"]["status"] = {"code": code, "reason": "BadRequest", "message": message[:_MESSAGE_CHARS]}
    return out


def _line(v: Violation) -> str:
    where = ", ".join(p for p in v.paths if p) or "(object)"
    text = f"[{v.rule}] {where}: {v.message}"
    if v.reason:
        text += f"; why: {v.reason}"
    if v.fix:
        text += f"; fix: {v.fix}"
    return text


def format_denial(verdict: ObjectVerdict, violations: Iterable[Violation]) -> str:
    """Every violation in one message: rule id, field paths, message, reason and fix, one per line."""
    found = list(violations)
    matrix = f" (matrix {', '.join(verdict.matrix_versions)})" if verdict.matrix_versions else ""
    head = f"pdd/{verdict.name}: {len(found)} violation(s){matrix}:"
    return "\n".join([head, *(f"- {_line(v)}" for v in found)])[:_MESSAGE_CHARS]


def format_warning(v: Violation, prefix: str = "") -> str:
    where = ", ".join(p for p in v.paths if p)
    text = f"{prefix}[{v.rule}] {where}: {v.message}" + (f" (fix: {v.fix})" if v.fix else "")
    return text if len(text) <= _WARNING_CHARS else text[: _WARNING_CHARS - 3] + "..."


def _causes(violations: Iterable[Violation]) -> list[dict[str, str]]:
    return [
        {"reason": "FieldValueInvalid", "field": p, "message": f"{v.rule}: {v.message}"}
        for v in violations
        for p in (v.paths or ("",))
    ][:64]


@dataclass(frozen=True, slots=True)
class Judgement:
    """What admission decides: the verdict, the violations that deny, and the warning lines."""

    verdict: ObjectVerdict
    denied: tuple[Violation, ...]
    warnings: tuple[str, ...]

    @property
    def allowed(self) -> bool:
        return not self.denied


def judge(verdicts: Verdicts, obj: object, old: object = None) -> Judgement:
    """The decision on ``obj``; with ``old`` (UPDATE), violations ``old`` already had only warn."""
    verdict = verdicts.of(obj)
    denied: list[Violation] = list(verdict.violations)
    carried: list[Violation] = []
    if isinstance(old, dict) and denied:
        before = {violation_key(v) for v in verdicts.of(old).violations}
        carried = [v for v in denied if violation_key(v) in before]
        denied = [v for v in denied if violation_key(v) not in before]
    warnings = [format_warning(v) for v in verdict.warnings]
    warnings += [format_warning(v, "stored spec already violates ") for v in carried]
    return Judgement(verdict, tuple(denied), tuple(warnings))


def review(body: bytes, verdicts: Verdicts) -> dict[str, Any]:
    """The AdmissionReview response to a raw request body. Never raises."""
    try:
        return _review(body, verdicts)
    except Exception as exc:  # totality: the apiserver must get an answer, never a 500
        return deny(f"pdfleet webhook internal error: {type(exc).__name__}: {exc}", scan_uid(body))


def _review(body: bytes, verdicts: Verdicts) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return deny(f"the AdmissionReview is not valid JSON: {str(exc)[:200]}", scan_uid(body))
    if not isinstance(data, dict):
        return deny(f"the AdmissionReview must be a JSON object, got {type(data).__name__}", scan_uid(body))
    api_version = data.get("apiVersion")
    answer_as = api_version if api_version in REVIEW_API_VERSIONS else REVIEW_API_VERSIONS[0]
    request = data.get("request")
    if not isinstance(request, dict):
        return deny("the AdmissionReview has no request object", scan_uid(body), answer_as)
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        return deny("request.uid must be a non-empty string", "", answer_as)
    if api_version not in REVIEW_API_VERSIONS or data.get("kind") != "AdmissionReview":
        return deny(
            f"expected an AdmissionReview of {' or '.join(REVIEW_API_VERSIONS)}, got "
            f"{_short(api_version)} {_short(data.get('kind'))}",
            uid,
            answer_as,
        )
    operation = request.get("operation")
    if not isinstance(operation, str) or operation not in _OPERATIONS:
        return deny(f"request.operation must be one of {', '.join(Operation)}, got {_short(operation)}", uid,
                    answer_as)
    if operation not in (Operation.CREATE, Operation.UPDATE):
        return _response(answer_as, uid, True)  # the configuration sends only CREATE and UPDATE
    obj = request.get("object")
    if not isinstance(obj, dict):
        return deny(f"request.object must be an object for {operation}, got {type(obj).__name__}", uid,
                    answer_as)
    judged = judge(verdicts, obj, request.get("oldObject") if operation == Operation.UPDATE else None)
    verdict, denied = judged.verdict, judged.denied
    out = _response(answer_as, uid, not denied)
    if judged.warnings:
        out["response"]["warnings"] = list(judged.warnings)
    if denied:
        name = verdict.name if verdict.name != "?" else ""
        out["response"]["status"] = {
            "code": 403,
            "reason": "Forbidden",
            "message": format_denial(verdict, denied),
            "details": {"group": GROUP, "kind": PLURAL, "name": name, "causes": _causes(denied)},
        }
    return out


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def response_problems(resp: object, uid: str | None = None) -> list[str]:
    """Why ``resp`` is not a well-formed AdmissionReview response (empty when it is); for tests."""
    problems = []
    if not isinstance(resp, Mapping):
        return [f"not an object: {type(resp).__name__}"]
    if resp.get("apiVersion") not in REVIEW_API_VERSIONS or resp.get("kind") != "AdmissionReview":
        problems.append(f"bad apiVersion/kind: {resp.get('apiVersion')!r} {resp.get('kind')!r}")
    r = resp.get("response")
    if not isinstance(r, Mapping):
        return [*problems, "no response object"]
    if not isinstance(r.get("uid"), str) or (uid is not None and r.get("uid") != uid):
        problems.append(f"uid {r.get('uid')!r} (want {uid!r})")
    if not isinstance(r.get("allowed"), bool):
        problems.append(f"allowed is {r.get('allowed')!r}")
    status = r.get("status")
    if r.get("allowed") is False and not (isinstance(status, Mapping) and isinstance(status.get("message"), str)
                                          and status["message"]):
        problems.append("a denial without a message")
    warnings = r.get("warnings", [])
    if not (isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)):
        problems.append("warnings are not a list of strings")
    return problems
