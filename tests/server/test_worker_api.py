"""The worker API against real ``serve`` processes: a prefill + decode pair driven as SGLang's router drives
PD workers (the same body to both at once, with ``bootstrap_host``/``port``/``room``), the decode's answer
read with the official ``openai`` client.

Covers issue 22's acceptance: chat, completions and streaming on both engines (Mooncake, NIXL), bounded
concurrency, bad requests, unclaimed rooms expiring (pools freed, metric), a prefill killed after it
accepted a room (a clean error, pools freed on both sides), a corrupted byte sent by the prefill or
received by the decode (500 naming the buffer), and per-request transfer bytes equal on both pods and to
the layout's bytes.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from pdfleet_runtime.pod.openai_api import request_state_bytes
from pdfleet_runtime.pod.worker_api import Endpoint, completion, parse_request
from tests.server.harness import Pod, config, free_offset, http, metric

pytestmark = pytest.mark.slow

FAST = ("--retry-period", "0.3", "--canary-timeout", "3", "--canary-tokens", "64",
        "--floor-gbps", "0")  # the throughput floor is test_serve's: a loaded host's slow canary is no fault here
MODEL = "pdfleet-test-model"


class Pair:
    """A prefill and a decode pod, and a router's way of sending them one request."""

    def __init__(self, tmp: Path, backend: str, *, prefill_args: tuple[str, ...] = (),
                 decode_args: tuple[str, ...] = ()) -> None:
        off = free_offset()
        self.prefill = Pod(tmp, f"pre-{backend}", cfg("prefill", backend), offset=off,
                           args=("--room-ttl", "2", *prefill_args))
        self.decode = Pod(tmp, f"dec-{backend}", cfg("decode", backend), args=(*FAST, *decode_args),
                          env={"PDFLEET_PREFILL_ADDRESSES": self.prefill.bootstrap})
        self.prefill.start()
        self.decode.start()

    def ready(self) -> Pair:
        self.decode.wait_ready(True, 90)
        return self

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.decode.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def room_fields(self, room: int | None = None) -> dict[str, Any]:
        host, port = self.prefill.bootstrap.split(":")
        return {"bootstrap_host": host, "bootstrap_port": int(port),
                "bootstrap_room": room if room is not None else random.getrandbits(63)}

    def send(self, path: str, body: dict[str, Any], decode_call: Any) -> tuple[tuple[int, Any], Any]:
        """The router's step: the same body to the prefill (raw HTTP) and the decode (``decode_call``) at once."""
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(p=http("POST", self.prefill.url + path, body, 60)))
        t.start()
        try:
            dec = decode_call()
        except openai.APIStatusError as e:
            dec = e
        t.join(70)
        return out["p"], dec

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()


def raw(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], str]:
    """POST JSON; the status, headers and body text (streams and headers the harness's ``http`` drops)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def cfg(role: str, backend: str) -> Any:
    return config(role, backend=backend, requests=4, tokens=512).model_copy(update={"served_model_name": MODEL})


@pytest.fixture
def pairs(tmp_path: Path) -> Iterator[list[Pair]]:
    started: list[Pair] = []
    yield started
    for p in started:
        p.stop()


def expected(path: Endpoint, body: dict[str, Any], moved: int) -> Any:
    req = parse_request(path, json.dumps(body).encode())
    return req, completion(req.seed, req.prompt_tokens, moved, req.max_tokens)


def pools(pod: Pod) -> dict[str, Any]:
    """Items held and free over the pod's ranks (``/server_info``'s ``pools``)."""
    code, body = pod.get("/server_info")
    assert code == 200, body
    return body["pools"]


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_chat_completions_and_streaming_through_a_pd_pair(tmp_path: Path, pairs: list[Pair], backend: str) -> None:
    pair = Pair(tmp_path, backend)
    pairs.append(pair)
    pair.ready()
    client = pair.client()
    layout_bytes = request_state_bytes(pair.decode.cfg, 0 + 11, decode_side=True)

    # Registration, as the router calls it.
    assert http("GET", pair.decode.url + "/health", None, 10)[0] == 200
    code, info = pair.decode.get("/server_info")
    assert code == 200 and info["served_model_name"] == MODEL and info["runtime_version"] == "0.1.0"
    assert info["disaggregation_mode"] == "decode"
    assert pair.prefill.get("/server_info")[1]["disaggregation_mode"] == "prefill"
    assert pair.decode.get("/model_info")[1]["model_path"] == MODEL
    assert [m.id for m in client.models.list()] == [MODEL]

    # Chat: 44 bytes of prompt text -> 11 tokens (ceil(bytes / 4)).
    msgs = [{"role": "user", "content": "x" * 38}]  # "user: " + 38 = 44 bytes
    fields = pair.room_fields()
    body = {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0.7, **fields}
    (pcode, pbody), chat = pair.send("/v1/chat/completions", body, lambda: client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0.7, extra_body=fields))
    assert pcode == 200, pbody
    assert isinstance(chat, openai.types.chat.ChatCompletion), chat
    extra = chat.model_extra["pdfleet"]
    assert extra["transferBytes"] == pbody["pdfleet"]["transferBytes"] == layout_bytes == extra["layoutBytes"]
    assert "temperature" in extra["ignored"]
    _, want = expected(Endpoint.CHAT, body, layout_bytes)
    assert chat.model == MODEL and chat.id == f"cmpl-room-{fields['bootstrap_room']}"
    assert chat.choices[0].message.content == want.text and chat.choices[0].finish_reason == want.finish_reason
    assert chat.usage.prompt_tokens == 11 and chat.usage.completion_tokens == len(want.ids) <= 8

    # Completions, with token ids.
    fields = pair.room_fields()
    ids = list(range(100, 140))
    body = {"model": MODEL, "prompt": ids, "max_tokens": 64, **fields}
    (pcode, pbody), comp = pair.send("/v1/completions", body, lambda: client.completions.create(
        model=MODEL, prompt=ids, max_tokens=64, extra_body=fields))
    assert pcode == 200 and isinstance(comp, openai.types.Completion), comp
    nbytes = request_state_bytes(pair.decode.cfg, 40, decode_side=True)
    _, want = expected(Endpoint.COMPLETIONS, body, nbytes)
    assert comp.choices[0].text == want.text and comp.usage.prompt_tokens == 40
    assert comp.model_extra["pdfleet"]["transferBytes"] == pbody["pdfleet"]["transferBytes"] == nbytes

    # Streaming chat: deltas add up to the completion, the stream ends (the client saw data: [DONE]).
    fields = pair.room_fields()
    body = {"model": MODEL, "messages": msgs, "stream": True, "stream_options": {"include_usage": True}, **fields}
    _, stream = pair.send("/v1/chat/completions", body, lambda: list(client.chat.completions.create(
        model=MODEL, messages=msgs, stream=True, stream_options={"include_usage": True}, extra_body=fields)))
    assert isinstance(stream, list), stream
    _, want = expected(Endpoint.CHAT, body, layout_bytes)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == want.finish_reason
    assert stream[-1].usage.completion_tokens == len(want.ids)
    raw_body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}, "stream": True, **pair.room_fields()}
    (pcode, _), lines = pair.send("/generate", raw_body,
                                  lambda: raw(pair.decode.url + "/generate", raw_body)[2].split("\n\n"))
    assert pcode == 200 and lines[-2] == "data: [DONE]", lines

    # /generate in SGLang's shape.
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 4}, **pair.room_fields()}
    (pcode, pbody), (dcode, gen) = pair.send("/generate", body, lambda: http("POST", pair.decode.url + "/generate",
                                                                                body, 60))
    assert pcode == dcode == 200, (pbody, gen)
    _, want = expected(Endpoint.GENERATE, body, gen["meta_info"]["transfer_bytes"])
    assert gen["text"] == want.text and gen["output_ids"] == list(want.ids)
    assert gen["meta_info"]["prompt_tokens"] == 3 and gen["meta_info"]["transfer_bytes"] == pbody["meta_info"][
        "transfer_bytes"] == request_state_bytes(pair.decode.cfg, 3, decode_side=True)

    # Concurrent, bounded: 8 requests, 4 at a time (the pools hold 4).
    def one(i: int) -> Any:
        f = pair.room_fields()
        b = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 5, **f}
        return pair.send("/v1/completions", b, lambda: client.completions.create(
            model=MODEL, prompt=f"request {i}", max_tokens=5, extra_body=f)), b

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, range(8)))
    for ((pcode, _), comp), b in results:
        assert pcode == 200 and isinstance(comp, openai.types.Completion), comp
        _, want = expected(Endpoint.COMPLETIONS, b, comp.model_extra["pdfleet"]["transferBytes"])
        assert comp.choices[0].text == want.text
    m = pair.decode.metrics()
    assert f"sglang:num_running_reqs{{engine_type=decode,model_name={MODEL}}}" in m  # the key the next line reads
    assert metric(m, "sglang:num_running_reqs", model_name=MODEL, engine_type="decode") == 0
    assert metric(m, "pdfleet_room_transfer_bytes_total") > 0

    # The CLI as a router and a checking client.
    out = subprocess.run([sys.executable, "-m", "pdfleet_runtime", "synthetic", "--url", pair.decode.url,
                          "--prefill-url", pair.prefill.url, "--bootstrap", pair.prefill.bootstrap, "--count", "3",
                          "--concurrency", "2", "--json"], capture_output=True, text=True, timeout=120)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert out.returncode == 0 and len(lines) == 3 and all(x["ok"] for x in lines), (out.stdout, out.stderr)


def test_bad_requests_are_openai_errors(tmp_path: Path, pairs: list[Pair]) -> None:
    pair = Pair(tmp_path, "mooncake")
    pairs.append(pair)
    pair.ready()
    client = pair.client()
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, n=2, extra_body=pair.room_fields())
    assert e.value.body["param"] == "n" and "n=1" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="other", messages=msgs, extra_body=pair.room_fields())
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs)
    assert e.value.body["param"] == "bootstrap_room"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], extra_body=pair.room_fields())
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0, extra_body=pair.room_fields())
    assert e.value.body["param"] == "max_tokens"
    code, body = http("POST", pair.decode.url + "/v1/completions", None, 10)
    assert code == 400 and body["error"]["param"] == "prompt"
    # A bootstrap address the decode's discovery does not name: refused before any dial, nothing held.
    fields = {**pair.room_fields(), "bootstrap_port": 1}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body=fields)
    assert e.value.body["code"] == "unknown_prefill" and e.value.body["param"] == "bootstrap_host"
    assert pools(pair.decode)["held"] == 0
    # No prefill holds the room (the router never sent it there): refused, a clean error after the wait.
    with pytest.raises(openai.APIStatusError) as ae:
        client.completions.create(model=MODEL, prompt="x", extra_body=pair.room_fields())
    assert ae.value.status_code == 502 and "not held" in ae.value.body["message"]
    # Draining: 503 with Retry-After.
    assert pair.decode.admin("POST", "/drain")[0] == 200  # the admin port (loopback), as the preStop hook does
    code, headers, text = raw(pair.decode.url + "/v1/completions", {"prompt": "x", **pair.room_fields()})
    assert code == 503 and headers["Retry-After"] and json.loads(text)["error"]["code"] == "draining"


def test_request_ids_are_opaque_names(tmp_path: Path, pairs: list[Pair]) -> None:
    """Issue 40: a client's request named ``room-7`` or ``canary-x`` is served and counted as a request on both
    pods (what a request is for travels as its kind, never in its id), beside a router's room request."""
    pair = Pair(tmp_path, "mooncake")
    pairs.append(pair)
    pair.ready()

    def requests(pod: Pod, role: str) -> float:
        return metric(pod.metrics(), "pdfleet_transfers_total", role=role, kind="request", outcome="success")

    before = requests(pair.decode, "decode"), requests(pair.prefill, "prefill")
    for rid in ("room-7", "canary-x"):
        code, body = pair.decode.synthetic(64, 30, requestId=rid)
        assert code == 200 and body["ok"] and body["requestId"] == rid and body["mismatchedBytes"] == 0, body
    client, f = pair.client(), pair.room_fields()
    (pcode, _), comp = pair.send("/v1/completions", {"prompt": "named", **f}, lambda: client.completions.create(
        model=MODEL, prompt="named", extra_body=f))
    assert pcode == 200 and isinstance(comp, openai.types.Completion), comp
    after = requests(pair.decode, "decode"), requests(pair.prefill, "prefill")
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3), (before, after)  # tp 1: one leg per request


def test_unclaimed_rooms_expire_and_free(tmp_path: Path, pairs: list[Pair]) -> None:
    pair = Pair(tmp_path, "mooncake")
    pairs.append(pair)
    pair.ready()
    body = {"prompt": "never claimed", **pair.room_fields()}
    t0 = time.monotonic()
    code, err = http("POST", pair.prefill.url + "/v1/completions", body, 30)
    assert code == 504 and err["error"]["code"] == "room_expired", err
    assert 1.5 < time.monotonic() - t0 < 10
    m = pair.prefill.metrics()
    assert metric(m, "pdfleet_rooms_expired_total") == 1
    assert metric(m, "pdfleet_rooms_held") == 0
    assert metric(m, "sglang:num_queue_reqs", model_name=MODEL, engine_type="prefill") == 0
    assert pools(pair.prefill)["held"] == 0
    # Its room is gone: a decode asking now gets a clean error, and the pair still serves.
    client = pair.client()
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model=MODEL, prompt="never claimed",
                                  extra_body={k: body[k] for k in ("bootstrap_host", "bootstrap_port",
                                                                   "bootstrap_room")})
    f = pair.room_fields()
    b = {"prompt": "after", **f}
    (pcode, _), comp = pair.send("/v1/completions", b, lambda: client.completions.create(
        model=MODEL, prompt="after", extra_body=f))
    assert pcode == 200 and isinstance(comp, openai.types.Completion), comp


@pytest.mark.parametrize(("backend", "side"), [("mooncake", "received"), ("mooncake", "sent"), ("nixl", "sent")])
def test_a_corrupted_byte_is_a_500_naming_the_buffer(tmp_path: Path, pairs: list[Pair], backend: str,
                                                     side: str) -> None:
    """``sent``: the prefill flips a byte before its engine write (the wire carries it); ``received``: the
    decode flips one after arrival. Either way the decode's byte check answers 500, never a completion."""
    faults = {"prefill_args" if side == "sent" else "decode_args": (f"--fault-corrupt-{side}",)}
    pair = Pair(tmp_path, backend, **faults)
    pairs.append(pair)
    pair.decode.wait_ready(False, 60, until=lambda b: b.get("problem") == "BytesMismatched")
    client = pair.client()
    f = pair.room_fields()
    (pcode, _), err = pair.send("/v1/completions", {"prompt": "abc", **f}, lambda: client.completions.create(
        model=MODEL, prompt="abc", extra_body=f))
    assert isinstance(err, openai.InternalServerError) and err.status_code == 500, err
    assert err.body["code"] == "state_mismatch" and "kv/" in err.body["message"], err.body
    assert pcode == 200  # the prefill wrote its state; the decode found it changed


def test_a_prefill_killed_after_accepting_a_room(tmp_path: Path, pairs: list[Pair]) -> None:
    pair = Pair(tmp_path, "mooncake", prefill_args=("--fault-write-delay", "3", "--write-timeout", "5"),
                decode_args=("--retry-period", "30", "--fence-timeout", "5"))
    pairs.append(pair)
    # A 3 s write: the canary times out (or is below the floor); the ranks are up, which is all this needs.
    pair.decode.wait_ready(False, 60, until=lambda b: b.get("problem") in ("TransfersFailing",
                                                                           "BelowThroughputFloor"))
    client = pair.client()
    deadline = time.monotonic() + 30
    while (before := pools(pair.decode))["held"] and time.monotonic() < deadline:
        time.sleep(0.2)  # a canary in flight holds items
    assert before["held"] == 0
    f = pair.room_fields()
    def prefill_leg() -> None:  # the router's prefill half: the prefill is killed under it, so no answer comes
        with contextlib.suppress(OSError):
            http("POST", pair.prefill.url + "/v1/completions", {"prompt": "k", **f}, 30)

    threading.Thread(target=prefill_leg, daemon=True).start()
    killer = threading.Timer(1.5, lambda: pair.prefill.stop(timeout_s=0.1))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="k", extra_body=f)
    killer.join()
    assert e.value.status_code in (502, 503) and e.value.body["code"] in ("prefill_unreachable", "transfer_failed")
    assert time.monotonic() - t0 < 60
    # Pools freed on the decode: every item back once the late-write fence lets them go (the prefill's
    # announced --write-timeout 5 plus 5 s: a dead prefill never confirms that its write ended).
    assert metric(pair.decode.metrics(), "sglang:num_running_reqs", model_name=MODEL, engine_type="decode") == 0
    deadline = time.monotonic() + 60
    while pools(pair.decode) != before and time.monotonic() < deadline:  # the late-write fence may hold them
        time.sleep(0.5)
    assert pools(pair.decode) == before  # the prefill side went with its process
