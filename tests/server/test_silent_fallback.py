"""A decode whose engine runs without its KV connector (``--kv-connector none``, as SGLang without its decode mode
or vLLM without ``--kv-transfer-config``): real ``serve`` processes driven with vllm-router's and sglang-router's
bodies. Its readiness gate stays open (the canary's path works) and every answer comes, the text a client reads
the same as PD's; nothing moved. What says so: the silent-fallback counters on both pods, the pod condition's
verdict, and the doctor's checks run on the pods' real ``/metrics`` text (``state-received`` on the decode,
``unclaimed-state`` on the prefill)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.commands.doctor import parse_metrics
from pdfleet_operator.doctor import PodMetrics, Verdict, diagnose
from pdfleet_operator.observed import ObservedPod
from pdfleet_runtime.pod.openai_api import request_state_bytes
from tests.server.harness import http, metric
from tests.server.test_vllm_contract import MSGS, NIXL_STEP_ONE, _until, _want
from tests.server.test_worker_api import MODEL, Pair

pytestmark = pytest.mark.slow


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path, "mooncake", decode_args=("--kv-connector", "none"))
    try:
        yield p.ready()  # the canary's path works: the gate opens as on a healthy pair
    finally:
        p.stop()


def _read(url: str) -> PodMetrics:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return PodMetrics(now=parse_metrics(resp.read().decode()))


def test_a_decode_without_its_kv_connector_answers_and_is_caught(pair: Pair) -> None:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8}
    layout = request_state_bytes(pair.decode.cfg, 11, decode_side=True)
    answered = 0
    for _ in range(2):  # vllm-router's NIXL steps: the prefill pins its state, the decode ignores it
        code, first = http("POST", pair.prefill.url + "/v1/chat/completions",
                           {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_STEP_ONE}, 30)
        assert code == 200, first
        params = first["kv_transfer_params"]
        chat = pair.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8,
                                                     extra_body={"kv_transfer_params": params})
        room = int(params["remote_request_id"])
        assert chat.choices[0].message.content == _want(body, room, layout).text  # what the client reads: fine
        extra = chat.model_extra["pdfleet"]
        assert extra["transferBytes"] == 0 and extra["recomputed"] is True and extra["verified"] is False
        answered += 1
    # sglang-router's one step: both bodies at once; the prefill's room is never claimed (--room-ttl 2)
    (pcode, _), dec = pair.send("/v1/chat/completions", {**body, **pair.room_fields()},
                                lambda: pair.client().chat.completions.create(
                                    model=MODEL, messages=MSGS, max_tokens=8, extra_body=pair.room_fields()))
    assert dec.choices[0].message.content and pcode >= 400
    answered += 1

    dec_m, pre_m = pair.decode.metrics(), pair.prefill.metrics()
    assert metric(dec_m, "pdfleet_silent_fallbacks_total", role="decode", reason="no_state_received") == answered
    assert metric(dec_m, "pdfleet_transfers_total", role="decode", kind="request", outcome="success") == 0
    _until(lambda: metric(pair.prefill.metrics(), "pdfleet_silent_fallbacks_total", role="prefill",
                          reason="unclaimed_state") == answered, 20, "every unclaimed room expired and counted")
    assert metric(pre_m, "pdfleet_transfers_total", role="prefill", kind="request", outcome="success") == 0
    pair.decode.wait_ready(True, 10)  # still ready: the gate proves the path, not that requests use it
    _until(lambda: "silent fallback: True (NoStateReceived)" in pair.decode.log(), 10, "the decode's condition")
    _until(lambda: "silent fallback: True (UnclaimedState)" in pair.prefill.log(), 10, "the prefill's condition")

    pods = [ObservedPod(name="p-0", role=Role.PREFILL, revision="r", index=0, ready=True, gate="True"),
            ObservedPod(name="d-0", role=Role.DECODE, revision="r", index=0, ready=True, gate="True")]
    results = diagnose(pods, {"p-0": _read(pair.prefill.metrics_url), "d-0": _read(pair.decode.metrics_url)})
    verdicts = {(r.subject, r.check): r for r in results}
    received = verdicts[("d-0", "state-received")]
    assert received.verdict is Verdict.FAIL and f"{answered:g} requests answered, 0 received" in received.detail
    assert "kv_consumer" in (received.fix or "")
    unclaimed = verdicts[("p-0", "unclaimed-state")]
    assert unclaimed.verdict is Verdict.FAIL and f"{answered:g}" in unclaimed.detail
    assert verdicts[("d-0", "transfer-path")].verdict is Verdict.OK  # the gate alone reads healthy
