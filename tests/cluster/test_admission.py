"""Admission on the real control plane, with the operator running as a subprocess (dev webhook).

Covers: every example's verdict through `kubectl apply` and `--dry-run=server` (naming the rule);
an UPDATE that breaks a rule is denied; without the webhook the apiserver's schema and CEL still
reject structural errors by field path; `pdfleet validate` and the apiserver agree on random
specs (hypothesis); fuzzed AdmissionReview bodies sent straight to the webhook always get a
well-formed answer, never a 500; and the re-check writes Admitted/Degraded when the running matrix
becomes stricter (the `--test-deny-cell` hook simulates an operator upgrade).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.local_operator import WEBHOOK_CONFIGURATION
from pdfleet_operator.admission import VALIDATE_WEBHOOK_ID, response_problems
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.validation import validate_text
from pdfleet_runtime.layouts import PRESETS
from tests.cluster.conftest import OperatorProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CEL_IDS = {r.id for r in CEL_RULES}
CLIENT_SIDE = {"yaml", "document"}  # kubectl itself refuses these before any server is asked
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))
VALID = sorted((EXAMPLES / "valid").glob("*.yaml"))


def _expected(path: Path) -> list[tuple[str, str]]:
    return re.findall(r"^# expect-violation: (\S+) ?(\S*)$", path.read_text(), re.M)


def _assert_names_rules(path: Path, stderr: str) -> None:
    expected = _expected(path)
    structural = any(rule in CEL_IDS or rule == "schema" for rule, _ in expected)
    for rule, field in expected:
        if rule in CEL_IDS:
            assert f"{rule}:" in stderr, stderr
        elif rule == "schema":
            assert field in stderr, stderr
        elif rule not in CLIENT_SIDE and not structural:  # the apiserver calls the webhook only after CEL
            assert f"[{rule}]" in stderr, stderr
            assert field in stderr, stderr
            assert "why:" in stderr and "fix:" in stderr, stderr


def _conditions(cluster: LocalCluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    proc = cluster.kubectl("-n", namespace, "get", "pdd", name, "-o", "json", check=False)
    if proc.returncode != 0:
        return {}
    conds = json.loads(proc.stdout).get("status", {}).get("conditions") or []
    return {c["type"]: c for c in conds}


def _wait_condition(cluster: LocalCluster, namespace: str, name: str, kind: str, status: str,
                    reason: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        c = _conditions(cluster, namespace, name).get(kind)
        return c if c and c["status"] == status and c.get("reason") == reason else None

    return wait_until(ready, what=f"{kind}={status} ({reason}) on pdd/{name}", timeout=45)


# -- examples -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_ns(cluster: LocalCluster) -> Iterator[str]:
    """One namespace for the denied examples: nothing is ever created in it."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_example_is_denied(
    cluster: LocalCluster, operator: OperatorProcess, shared_ns: str, path: Path
) -> None:
    namespace = shared_ns
    for dry_run in ("--dry-run=server", None):
        args = ["-n", namespace, "apply", "-f", str(path)] + ([dry_run] if dry_run else [])
        proc = cluster.kubectl(*args, check=False)
        assert proc.returncode != 0, f"{path.name} admitted by kubectl apply {dry_run or ''}"
        _assert_names_rules(path, proc.stderr)
    assert cluster.kubectl("-n", namespace, "get", "pdd", "-o", "name").stdout.strip() == ""


def test_valid_examples_are_admitted_and_marked(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    for path in VALID:
        dry = cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(path), check=False)
        assert dry.returncode == 0, f"{path.name}: {dry.stderr}"
        proc = cluster.kubectl("-n", namespace, "apply", "-f", str(path), check=False)
        assert proc.returncode == 0, f"{path.name}: {proc.stderr}"
    name = yaml.safe_load((EXAMPLES / "valid" / "llama-dense.yaml").read_text())["metadata"]["name"]
    admitted = _wait_condition(cluster, namespace, name, "Admitted", "True", "MatrixAdmits")
    assert admitted["observedGeneration"] == 1 and "matrix 1" in admitted["message"]
    obj = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", name, "-o", "json").stdout)
    assert obj["status"]["matrixVersion"] == "1"
    assert "kopf" not in obj["status"]  # kopf's progress lives in pdfleet.io annotations


def test_warnings_are_returned(cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> None:
    doc = yaml.safe_load((EXAMPLES / "valid" / "llama-dense.yaml").read_text())
    doc["spec"]["transfer"]["protocol"] = "tcp"
    proc = cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", "-", input=json.dumps(doc))
    assert "Warning: [warn-tcp-transfer] spec.transfer.protocol" in proc.stderr, proc.stderr


def test_update_that_breaks_a_rule_is_denied(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    path = EXAMPLES / "valid" / "llama-dense.yaml"  # nixl, TP 4 -> 2
    cluster.kubectl("-n", namespace, "apply", "-f", str(path))
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    patch = json.dumps({"spec": {"model": {"layout": {"preset": "qwen3.8-flash-next"}}}})
    proc = cluster.kubectl("-n", namespace, "patch", "pdd", name, "--type=merge", "-p", patch, check=False)
    assert proc.returncode != 0
    assert "denied the request" in proc.stderr and "[nixl.replicated-hetero-tp]" in proc.stderr, proc.stderr
    assert "[nixl.qsa-hetero-tp-mha]" in proc.stderr, proc.stderr  # every violation in one message
    stored = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", name, "-o", "json").stdout)
    assert stored["spec"]["model"]["layout"] == {"preset": "llama-dense"}
    fine = json.dumps({"spec": {"decode": {"replicas": 3}}})
    cluster.kubectl("-n", namespace, "patch", "pdd", name, "--type=merge", "-p", fine)


# -- the apiserver alone ----------------------------------------------------------------------------


def test_structural_errors_are_rejected_without_the_webhook(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    matrix_only = EXAMPLES / "invalid" / "nixl.replicated-hetero-tp.yaml"
    operator.stop()
    try:
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK_CONFIGURATION)
        # the matrix rule was the webhook's: without it the apiserver admits the spec
        wait_until(
            lambda: cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(matrix_only),
                                    check=False).returncode == 0,
            what="admission without the webhook", timeout=20,
        )
        structural = [p for p in INVALID if _expected(p) and all(r in CEL_IDS | {"schema"} for r, _ in _expected(p))]
        assert len(structural) >= 15
        for path in structural:
            proc = cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(path), check=False)
            assert proc.returncode != 0, f"{path.name} admitted without the webhook"
            assert "denied the request" not in proc.stderr
            for rule, field in _expected(path):
                assert (f"{rule}:" in proc.stderr) if rule in CEL_IDS else True, proc.stderr
                assert field in proc.stderr, f"{path.name}: {field} not named in {proc.stderr}"
    finally:
        operator.start()


# -- the same verdict everywhere ---------------------------------------------------------------------

# field -> (legal values, bad values); a spec corrupts at most two fields, so about half the specs
# reach the matrix clean and are admitted or denied by it alone.
_ROLE_FIELDS: dict[str, tuple[list[Any], list[Any]]] = {
    "tensor": ([1, 2, 4, 8], [3, 6, 0, 128]),
    "pipeline": ([None, None, 1, 2], [4, 64]),
    "data": ([None, 1], [2]),
    "expert": ([None, 1], [4]),
    "nodesPerReplica": ([None, 1], [2]),
    "replicas": ([1, 2, 0], [-1, "2"]),
    "image": (["ghcr.io/pdfleet/runtime:0.1.0"], [""]),
    "runtimeVersion": ([None, "0.1.0", "0.1.0+cu13"], ["0.2.0", "v1"]),
    "gpuMemoryGiB": ([None, 80, 141], [0.5, 8]),
    "kvTokensPerReplica": ([None, 4096, 131072, 1 << 20], [1 << 29, 0]),
    "maxConcurrentRequests": ([None, 1, 64, 512], [70000]),
}
_SPEC_FIELDS: dict[str, tuple[list[Any], list[Any]]] = {
    "preset": (sorted(PRESETS), ["no-such-model"]),
    "backend": (["mooncake", "nixl", "mori"], ["ucx"]),
    "protocol": ([None, "rdma", "rdma", "tcp", "nvlink", "shm"], ["udp"]),
    "maxSurge": ([None, 1, "25%"], [-1, 0]),
    "maxUnavailable": ([None, 0, 1, "10%"], ["101%"]),
    "drainTimeoutSeconds": ([None, 60, 600], [2000]),
    "progressDeadlineSeconds": ([None, 900, 1200], [30]),
}
_FAULTS = [*_SPEC_FIELDS, *(f"{r}.{f}" for r in ("prefill", "decode") for f in _ROLE_FIELDS)]


def _role(draw: st.DrawFn, role: str, faults: set[str]) -> dict[str, Any]:
    def v(name: str) -> Any:
        good, bad = _ROLE_FIELDS[name]
        return draw(st.sampled_from(bad if f"{role}.{name}" in faults else good))

    return {
        "replicas": v("replicas"),
        "parallelism": {k: v(k) for k in ("tensor", "pipeline", "data", "expert", "nodesPerReplica")},
        "image": v("image"),
        "runtimeVersion": v("runtimeVersion"),
        "gpuMemoryGiB": v("gpuMemoryGiB"),
        "pool": {k: v(k) for k in ("kvTokensPerReplica", "maxConcurrentRequests")},
    }


def _prune(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _prune(x) for k, x in v.items() if x is not None}
    return v


@st.composite
def _manifest(draw: st.DrawFn) -> dict[str, Any]:
    faults = draw(st.sets(st.sampled_from(_FAULTS), max_size=2))

    def v(name: str) -> Any:
        good, bad = _SPEC_FIELDS[name]
        return draw(st.sampled_from(bad if name in faults else good))

    spec: dict[str, Any] = {
        "model": {"layout": {"preset": v("preset")}},
        "transfer": {"backend": v("backend"), "protocol": v("protocol")},
        "prefill": _role(draw, "prefill", faults),
        "decode": _role(draw, "decode", faults),
        "rollout": {k: v(k) for k in ("maxSurge", "maxUnavailable", "drainTimeoutSeconds",
                                      "progressDeadlineSeconds")},
    }
    if draw(st.integers(0, 19)) == 19:
        spec["transfer"]["compression"] = "zstd"  # unknown field: strict field validation refuses it
    doc = {"apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "prop"}, "spec": spec}
    return _prune(doc)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_manifest())
def test_pdfleet_validate_agrees_with_the_apiserver(
    cluster: LocalCluster, operator: OperatorProcess, doc: dict[str, Any]
) -> None:
    text = json.dumps(doc)
    offline = validate_text(text, "<prop>")
    assert len(offline) == 1
    proc = cluster.kubectl("-n", "default", "apply", "--dry-run=server", "-f", "-", input=text, check=False)
    server_admits = proc.returncode == 0
    assert server_admits == offline[0].admitted, (
        f"apiserver {'admits' if server_admits else 'denies'}; pdfleet validate says "
        f"{[v.as_dict() for v in offline[0].violations]}\n{proc.stderr}"
    )


# -- the webhook on bad input ------------------------------------------------------------------------


def _post(operator: OperatorProcess, body: bytes) -> tuple[int, Any]:
    ctx = ssl.create_default_context(cafile=str(operator.ca_file))
    req = urllib.request.Request(
        f"{operator.url}/{VALIDATE_WEBHOOK_ID}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post_unfinished(operator: OperatorProcess, first: bytes, declared: int) -> tuple[int, Any]:
    """POST ``first`` of a body declared ``declared`` bytes long, then read the answer (over TLS, raw)."""
    ctx = ssl.create_default_context(cafile=str(operator.ca_file))
    host, _, port = operator.url.removeprefix("https://").partition(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        # The server may answer and close before all of ``first`` is written; its answer is still read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLEOFError):
            tls.sendall(f"POST /{VALIDATE_WEBHOOK_ID} HTTP/1.1\r\nHost: {host}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode() + first)
        answer = b""
        with contextlib.suppress(ConnectionResetError, ssl.SSLEOFError):  # closed after the answer
            while chunk := tls.recv(1 << 16):
                answer += chunk
    assert answer, "the webhook closed the connection without an answer"
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _review_doc(uid: str, obj: Any, operation: Any = "CREATE", old: Any = None) -> dict[str, Any]:
    req: dict[str, Any] = {"uid": uid, "operation": operation, "object": obj,
                           "resource": {"group": "pdfleet.io", "version": "v1alpha1", "resource": "pddeployments"}}
    if old is not None:
        req["oldObject"] = old
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_VALID_DOC = yaml.safe_load((EXAMPLES / "valid" / "all-fields.yaml").read_text())


@st.composite
def _fuzzed_body(draw: st.DrawFn) -> tuple[bytes, str | None]:
    uid = str(uuid.UUID(int=draw(st.integers(0, 2**128 - 1))))
    kind = draw(st.sampled_from(["valid", "truncated", "wrong-type", "missing", "junk", "mutated"]))
    doc = _review_doc(uid, _VALID_DOC)
    if kind == "valid":
        return json.dumps(doc).encode(), uid
    if kind == "truncated":
        raw = json.dumps(doc).encode()
        return raw[: draw(st.integers(0, len(raw) - 1))], None
    if kind == "wrong-type":
        where = draw(st.sampled_from(["request", "uid", "operation", "object", "oldObject", "apiVersion", "root"]))
        value = draw(_JSON)
        if where == "root":
            return json.dumps(value).encode(), None
        target = doc if where in ("request", "apiVersion") else doc["request"]
        target[where] = value
        if where == "oldObject":
            doc["request"]["operation"] = "UPDATE"
        return json.dumps(doc).encode(), (uid if where not in ("request", "uid") else None)
    if kind == "missing":
        for key in draw(st.lists(st.sampled_from(["uid", "operation", "object", "kind", "resource"]), max_size=3)):
            (doc if key == "kind" else doc["request"]).pop(key, None)
        return json.dumps(doc).encode(), None
    if kind == "mutated":
        obj = json.loads(json.dumps(_VALID_DOC))
        path = draw(st.lists(st.sampled_from(["spec", "transfer", "prefill", "parallelism", "tensor", "model",
                                              "layout", "metadata", "name", "rollout"]), min_size=1, max_size=4))
        node = obj
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[path[-1]] = draw(_JSON)
        return json.dumps(_review_doc(uid, obj)).encode(), uid
    return draw(st.binary(max_size=300)), None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_fuzzed_body())
def test_fuzzed_reviews_get_well_formed_answers(operator: OperatorProcess, case: tuple[bytes, str | None]) -> None:
    body, uid = case
    status, resp = _post(operator, body)
    assert status == 200, (status, resp)
    assert response_problems(resp, uid) == [], resp


def test_huge_and_deep_bodies(operator: OperatorProcess) -> None:
    env = [{"name": f"V{i}", "value": "x" * 200} for i in range(6000)]  # ~1.5 MB, over aiohttp's 1 MiB default
    obj = json.loads(json.dumps(_VALID_DOC))
    obj["spec"]["decode"]["env"] = env
    status, resp = _post(operator, json.dumps(_review_doc("huge", obj)).encode())
    assert status == 200 and response_problems(resp, "huge") == []
    assert resp["response"]["allowed"] is False and "spec.decode.env" in resp["response"]["status"]["message"]
    # Over the body limit: denied from its declared length and first bytes, answered while the client is still
    # sending (the rest is never read); the API server's client reads that answer as it writes.
    big = json.dumps(_review_doc("too-big", "x" * (17 << 20))).encode()
    status, resp = _post_unfinished(operator, big[:1 << 12], len(big))
    assert status == 200 and response_problems(resp, "too-big") == [] and resp["response"]["status"]["code"] == 413
    status, resp = _post(operator, b'{"request": {"uid": "deep", "object": ' + b"[" * 200_000)
    assert status == 200 and response_problems(resp, "deep") == []
    status, resp = _post(operator, json.dumps(_review_doc("ok", _VALID_DOC)).encode())
    assert status == 200 and resp["response"]["allowed"] is True  # still serving


# -- re-check after an upgrade ------------------------------------------------------------------------


def test_stricter_matrix_marks_stored_object_degraded(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str
) -> None:
    path = EXAMPLES / "valid" / "llama-dense.yaml"  # nixl, TP 4 -> 2: sharded state across TP sizes
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    cluster.kubectl("-n", namespace, "apply", "-f", str(path))
    _wait_condition(cluster, namespace, name, "Degraded", "False", "MatrixAdmits")
    operator.restart("--test-deny-cell", "nixl.sharded-hetero-tp")
    try:
        degraded = _wait_condition(cluster, namespace, name, "Degraded", "True", "MatrixRejects")
        assert "[nixl.sharded-hetero-tp]" in degraded["message"] and "spec.transfer.backend" in degraded["message"]
        assert "why:" in degraded["message"] and "fix:" in degraded["message"]
        assert _conditions(cluster, namespace, name)["Admitted"]["status"] == "False"
        # the stored object stays editable: metadata and spec edits that add no violation pass, with a warning
        proc = cluster.kubectl("-n", namespace, "label", "pdd", name, "team=infra")
        assert "stored spec already violates [nixl.sharded-hetero-tp]" in proc.stderr, proc.stderr
        cluster.kubectl("-n", namespace, "patch", "pdd", name, "--type=merge", "-p",
                        json.dumps({"spec": {"decode": {"replicas": 4}}}))
        # a new object with that spec is refused by the running matrix
        doc = yaml.safe_load(path.read_text())
        doc["metadata"]["name"] = "fresh"
        proc = cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(doc), check=False)
        assert proc.returncode != 0 and "[nixl.sharded-hetero-tp]" in proc.stderr, proc.stderr
    finally:
        operator.restart()
    _wait_condition(cluster, namespace, name, "Degraded", "False", "MatrixAdmits")
    assert _conditions(cluster, namespace, name)["Admitted"]["status"] == "True"
