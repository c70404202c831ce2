"""vllm-router 0.1.17, as pdfleet renders it, in front of the built-in runtime speaking vLLM's PD contract
(``pod/vllm_contract.py``, issue 44): NIXL's two steps and Mooncake's one step, end to end on loopback.

The router is the vLLM check venv's ``vllm-router`` running the rendered command of the NIXL and the Mooncake
example, with only its port changed and its Kubernetes discovery swapped for ``--prefill URL [BOOTSTRAP_PORT]
--decode URL`` (a prefill and a decode ``serve`` process of this checkout, seeded state over pdfleet's NIXL
and Mooncake engines). Each chat through the router must come back from the decode with every byte of its
state verified and the text derived from it; with Mooncake the router reads the prefill's engine id from the
bootstrap's ``/query`` and sends it with the ``transfer_id``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import yaml

from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.router import router_deployment
from pdfleet_runtime.pod.openai_api import request_state_bytes
from tests.server.test_worker_api import MODEL, Pair
from tests.vllm.harness import REPO, vllm_python
from tests.vllm.test_vllm_router_probes import DISCOVERY, _free_port, _get, _process, _value, _with, _without

pytestmark = pytest.mark.slow

EXAMPLES = {"nixl": REPO / "examples" / "valid" / "vllm-qwen3.8-flash-next-nixl.yaml",
            "mooncake": REPO / "examples" / "valid" / "vllm-qwen3-next-mooncake.yaml"}
MSGS = [{"role": "user", "content": "x" * 38}]  # 11 tokens


def _router_cmd(kind: str, pair: Pair, port: int) -> list[str]:
    doc = yaml.safe_load(EXAMPLES[kind].read_text())["spec"]
    # The Mooncake example has no router: admission denies vllm-router's discovery with Mooncake (it never asks a
    # discovered prefill's bootstrap); its static --prefill URL PORT form, which this test runs, does ask.
    doc.setdefault("router", {"image": "ghcr.io/pdfleet/runtime:0.1.0"})
    spec = PDDeploymentSpec.model_validate(doc)
    rendered = router_deployment("demo", "ns", spec)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert rendered[0] == "vllm-router" and "--vllm-pd-disaggregation" in rendered
    assert _value(rendered, "--kv-connector") == kind
    cmd = [str(Path(vllm_python()).parent / "vllm-router"), *rendered[1:]]
    cmd = _with(cmd, "--port", str(port))
    cmd = _with(cmd, "--prometheus-host", "127.0.0.1")
    cmd = _with(cmd, "--prometheus-port", str(_free_port()))
    bootstrap = [pair.prefill.bootstrap.rsplit(":", 1)[1]] if kind == "mooncake" else []
    return [*_without(cmd, DISCOVERY), "--prefill", pair.prefill.url, *bootstrap, "--decode", pair.decode.url]


@contextmanager
def _routed(tmp: Path, kind: str, prefill_args: tuple[str, ...] = (),
            decode_args: tuple[str, ...] = ()) -> Iterator[tuple[Pair, str]]:
    pair = Pair(tmp, kind, prefill_args=prefill_args, decode_args=decode_args).ready()
    try:
        port = _free_port()
        with _process(_router_cmd(kind, pair, port)) as router:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while _get(url + "/readiness")[0] != 200 and _get(url + "/health")[0] != 200:
                assert router.poll() is None, router.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "vllm-router did not get ready"
                time.sleep(0.3)
            try:
                yield pair, url
            except BaseException:
                router.terminate()
                print("vllm-router:", router.communicate(timeout=30)[0][-4000:])
                print("prefill:", pair.prefill.log()[-3000:], "decode:", pair.decode.log()[-3000:])
                raise
    finally:
        pair.stop()


@pytest.mark.parametrize("kind", ["nixl", "mooncake"])
def test_chats_through_vllm_router_move_and_verify_the_state(tmp_path: Path, kind: str) -> None:
    with _routed(tmp_path, kind) as (pair, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        layout = request_state_bytes(pair.decode.cfg, 11, decode_side=True)
        rooms = set()
        for _ in range(3):
            chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8)
            assert chat.choices[0].message.content, chat
            extra = chat.model_extra.get("pdfleet") if chat.model_extra else None
            assert extra is not None and extra["verified"] and extra["transferBytes"] == layout, chat
            rooms.add(extra["room"])
        assert len(rooms) == 3  # one room per request
        metrics = pair.prefill.metrics()
        moved = sum(v for k, v in metrics.items() if k.startswith("pdfleet_room_transfer_bytes_total"))
        assert moved == 3 * request_state_bytes(pair.prefill.cfg, 11, decode_side=False), json.dumps(metrics)[:500]


@pytest.mark.parametrize("pinned", [False, True], ids=["fresh-id", "pinned-id"])
def test_a_prefill_restarted_in_place_behind_vllm_router_keeps_serving_only_with_a_pinned_engine_id(
        tmp_path: Path, pinned: bool) -> None:
    """vllm-router 0.1.17 (Mooncake) reads a prefill's engine id from its ``/query`` once per worker. A prefill
    restarted in place (same address, as a container restart keeps its pod's) with a fresh id, as vLLM draws
    one: the router keeps sending the old id and the decode refuses every request (``unknown_engine_id``,
    counted), until the router restarts. With the id pinned to the pod's name (``--pin-engine-id``, what the
    operator renders for vllm-router fleets) the restarted prefill serves at once."""
    with _routed(tmp_path, "mooncake", ("--pin-engine-id",) if pinned else ()) as (pair, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        before = pair.prefill.metrics()
        for _ in range(2):
            assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4).choices[0].message.content
        pair.prefill.stop()
        pair.prefill.start()  # the same ports and pod name: a container restarted in place
        pair.prefill.wait_ready(True, 120)  # its ranks up and a decode canary through it

        def once() -> str:
            try:
                client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
                return "ok"
            except openai.APIStatusError as e:
                return f"{e.status_code} {str(e.message)[:160]}"

        # The router marked the prefill unhealthy while it was down: wait until it sends to it again.
        deadline, first = time.monotonic() + 90, once()
        while first.startswith("503") and time.monotonic() < deadline:
            time.sleep(1)
            first = once()
        outcomes = [first] + [once() for _ in range(3)]
        refused = sum(v for k, v in pair.decode.metrics().items()
                      if k.startswith("pdfleet_vllm_handshake_refusals_total{") and "engine_id" in k)
        print(f"{'pinned' if pinned else 'fresh'} engine id, after the restart: {outcomes}, refused {refused}")
        if pinned:
            assert outcomes == ["ok"] * 4 and refused == 0, (outcomes, refused)
        else:
            assert all(o.startswith("502") for o in outcomes) and refused >= 4, (outcomes, refused)
        assert before  # the prefill answered its metrics before the restart


@pytest.mark.parametrize("versions", [("0.33.0", "0.33.0"), ("0.33.0", "0.33.1")], ids=["same", "two-versions"])
def test_a_decode_refuses_a_prefill_of_another_engine_version_as_vllms_handshake_does(
        tmp_path: Path, versions: tuple[str, str]) -> None:
    """vLLM's NIXL handshake refuses a peer whose compatibility hash differs (its version among the fields), so
    every request a router pairs across two generations fails. The built-in runtime standing in for two vLLM
    versions does the same (``HandshakeKey``, counted as ``reason="compatibility"``): what a rollout test counts
    when the router pairs two generations. The same version pairs and serves."""
    pre, dec = (("--stand-in-for", f"vllm=={v}") for v in versions)
    with _routed(tmp_path, "nixl", pre, dec) as (pair, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        outcomes = []
        for _ in range(3):
            try:
                client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
                outcomes.append("ok")
            except openai.APIStatusError as e:
                outcomes.append(f"{e.status_code} {str(e.message)[:200]}")
        refused = sum(v for k, v in pair.decode.metrics().items()
                      if k.startswith("pdfleet_vllm_handshake_refusals_total{") and "compatibility" in k)
        print(f"prefill vllm=={versions[0]}, decode vllm=={versions[1]}: {outcomes}, refused {refused}")
        if versions[0] == versions[1]:
            assert outcomes == ["ok"] * 3 and refused == 0, (outcomes, refused)
        else:
            assert not any(o == "ok" for o in outcomes) and refused >= 3, (outcomes, refused)
            assert "engine: 'vllm==0.33.1' here, 'vllm==0.33.0' at the prefill" in pair.decode.log(), \
                pair.decode.log()[-2000:]
