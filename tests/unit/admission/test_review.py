"""The pure webhook function ``review``: the same verdict as ``pdfleet validate`` on every example,
every violation in one message, warnings, UPDATE ratcheting, and a well-formed answer (never an
exception) for any bytes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfleet_operator.admission import Verdicts, response_problems, review, scan_uid
from pdfleet_operator.validation import iter_objects, validate_object
from tests.unit.admission.builders import EXAMPLES, Review, example

OBJECT_EXAMPLES = [
    p for p in sorted(EXAMPLES.rglob("*.yaml"))
    if all(not isinstance(o, Exception) for _, o in iter_objects(p.read_text(), str(p)))
]


@pytest.fixture
def verdicts() -> Verdicts:
    return Verdicts()


@pytest.mark.parametrize("path", OBJECT_EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_review_gives_validates_verdict(verdicts: Verdicts, path: Path) -> None:
    (_, obj), = list(iter_objects(path.read_text(), str(path)))
    offline = validate_object(obj)
    resp = review(Review(obj).uid("abc").body(), verdicts)
    assert response_problems(resp, "abc") == []
    assert resp["response"]["allowed"] is offline.admitted
    if not offline.admitted:
        message = resp["response"]["status"]["message"]
        assert resp["response"]["status"]["code"] == 403
        for v in offline.violations:  # every violation, in one message
            assert f"[{v.rule}]" in message
            assert all(p in message for p in v.paths)
        for rule, field in re.findall(r"^# expect-violation: (\S+) ?(\S*)$", path.read_text(), re.M):
            assert f"[{rule}]" in message and field in message


def test_denial_lists_reason_fix_and_causes(verdicts: Verdicts) -> None:
    obj = example("kv-heads-tp", "invalid")
    resp = review(Review(obj).body(), verdicts)["response"]
    lines = resp["status"]["message"].splitlines()
    assert lines[0].startswith("pdd/") and "violation(s) (matrix 1)" in lines[0]
    assert len(lines) == 1 + len(validate_object(obj).violations) >= 3
    assert all("; why: " in line and "; fix: " in line for line in lines[1:])
    causes = resp["status"]["details"]["causes"]
    assert {c["field"] for c in causes} >= {"spec.prefill.parallelism.tensor"}


def test_warnings_for_risky_choices(verdicts: Verdicts) -> None:
    obj = example("llama-dense")
    obj["spec"]["transfer"]["protocol"] = "tcp"
    resp = review(Review(obj).body(), verdicts)["response"]
    assert resp["allowed"] is True
    assert any(w.startswith("[warn-tcp-transfer] spec.transfer.protocol") for w in resp["warnings"])
    assert all(len(w) <= 250 for w in resp["warnings"])


def test_update_denies_new_violations_only(verdicts: Verdicts) -> None:
    good = example("llama-dense")  # nixl, TP 4 -> 2
    broken = json.loads(json.dumps(good))
    broken["spec"]["model"]["layout"] = {"preset": "qwen3.8-flash-next"}
    resp = review(Review(broken).update(good).body(), verdicts)["response"]
    assert resp["allowed"] is False and "[nixl.replicated-hetero-tp]" in resp["status"]["message"]
    # the stored object already had the violation: a further edit passes, with a warning
    scaled = json.loads(json.dumps(broken))
    scaled["spec"]["decode"]["replicas"] = 5
    resp = review(Review(scaled).update(broken).body(), verdicts)["response"]
    assert resp["allowed"] is True
    assert any(w.startswith("stored spec already violates [nixl.replicated-hetero-tp]") for w in resp["warnings"])
    # ...but a new violation on top of an old one is still denied, naming only the new one
    worse = json.loads(json.dumps(scaled))
    worse["spec"]["decode"]["parallelism"]["data"] = 2
    resp = review(Review(worse).update(broken).body(), verdicts)["response"]
    assert resp["allowed"] is False
    assert "[builtin-no-attention-dp]" in resp["status"]["message"]
    assert "[nixl.replicated-hetero-tp]" not in resp["status"]["message"]


def test_create_of_same_broken_spec_is_denied(verdicts: Verdicts) -> None:
    obj = example("nixl.replicated-hetero-tp", "invalid")
    assert review(Review(obj).body(), verdicts)["response"]["allowed"] is False


@pytest.mark.parametrize("op", ["DELETE", "CONNECT"])
def test_other_operations_are_allowed(verdicts: Verdicts, op: str) -> None:
    resp = review(Review(None).operation(op).body(), verdicts)
    assert response_problems(resp, "uid-1") == [] and resp["response"]["allowed"] is True


@pytest.mark.parametrize(
    ("body", "uid", "needle"),
    [
        (b"", "", "not valid JSON"),
        (b"[1, 2]", "", "must be a JSON object"),
        (b'{"request": {"uid": "u-7", "object": {', "u-7", "not valid JSON"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "", "no request object"),
        (Review({}).uid(7).body(), "", "request.uid"),
        (Review({}).operation(["CREATE"]).body(), "uid-1", "request.operation"),
        (Review("a string").body(), "uid-1", "request.object must be an object"),
        (b"[" * 100_000, "", "not valid JSON"),
    ],
)
def test_unreadable_requests_are_denied_with_a_reason(verdicts: Verdicts, body: bytes, uid: str, needle: str) -> None:
    resp = review(body, verdicts)
    assert response_problems(resp, uid) == []
    assert resp["response"]["allowed"] is False and needle in resp["response"]["status"]["message"]


def test_v1beta1_is_answered_in_kind(verdicts: Verdicts) -> None:
    r = Review(example("llama-dense"))
    r.doc["apiVersion"] = "admission.k8s.io/v1beta1"
    assert review(r.body(), verdicts)["apiVersion"] == "admission.k8s.io/v1beta1"


def test_internal_error_becomes_a_denial(monkeypatch: pytest.MonkeyPatch, verdicts: Verdicts) -> None:
    def boom(obj: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(verdicts, "of", boom)
    resp = review(Review(example("llama-dense")).uid("u-9").body(), verdicts)
    assert response_problems(resp, "u-9") == []
    assert "internal error: RuntimeError: bug" in resp["response"]["status"]["message"]


def test_scan_uid_reads_broken_json() -> None:
    body = Review({}).uid("4c6b-11").body()
    assert scan_uid(body[: body.index(b"4c6b-11") + 9]) == "4c6b-11"  # cut right after the uid
    assert scan_uid(b"garbage") == ""


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(body=st.one_of(st.binary(max_size=400), _JSON.map(lambda v: json.dumps(v).encode())))
def test_any_bytes_get_a_well_formed_answer(body: bytes) -> None:
    assert response_problems(review(body, Verdicts())) == []


@settings(max_examples=200, deadline=None)
@given(spec=_JSON, op=st.sampled_from(["CREATE", "UPDATE"]), old=_JSON)
def test_any_object_gets_a_well_formed_answer(spec: Any, op: str, old: Any) -> None:
    obj = example("llama-dense")
    obj["spec"] = spec
    r = Review(obj).operation(op)
    r.doc["request"]["oldObject"] = old
    assert response_problems(review(r.body(), Verdicts()), "uid-1") == []
