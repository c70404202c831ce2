"""vLLM's PD worker contract on real ``serve`` processes (``pod/vllm_contract.py``, issue 44): a prefill and a
decode pod driven with the bodies vllm-router 0.1.17 sends (docs/vllm.md), the decode's answer read with the
official ``openai`` client and checked against the derivation from the verified state.

- NIXL, two steps: the prefill answers at once with ``kv_transfer_params`` (its room, its bootstrap, this
  start's engine id); those go verbatim to the decode with the original request, which pulls and verifies the
  state. A step one no decode follows expires (counted, pools freed).
- Mooncake, one step: a router-made ``transfer_id`` names the room on both pods at once; the decode pulls from
  ``remote_bootstrap_addr``; the prefill bootstrap's ``GET /query`` gives the engine id as vLLM's does.
- Parameters that name no transfer are a 400 naming the keys, never a silent recompute.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfleet_runtime.pod.openai_api import request_state_bytes
from pdfleet_runtime.pod.vllm_contract import room_of_transfer
from pdfleet_runtime.pod.worker_api import Endpoint, completion, parse_request
from tests.server.harness import http, metric
from tests.server.test_worker_api import MODEL, Pair, pools

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "x" * 38}]  # "user: " + 38 = 44 bytes -> 11 tokens
NIXL_STEP_ONE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}  # as vllm-router sends it


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    started: list[Pair] = []
    yield started
    for p in started:
        p.stop()


def _want(body: dict[str, Any], room: int, moved: int) -> Any:
    req = parse_request(Endpoint.CHAT, json.dumps(body).encode()).model_copy(update={"room": room})
    return completion(req.seed, req.prompt_tokens, moved, req.max_tokens)


def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _query(pair: Pair) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{pair.prefill.bootstrap}/query", timeout=10) as r:
        return json.loads(r.read())


def test_nixl_two_steps_move_and_verify_the_state(tmp_path: Path, pairs: list[Pair]) -> None:
    pair = Pair(tmp_path, "nixl")
    pairs.append(pair)
    pair.ready()
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8}
    code, first = http("POST", pair.prefill.url + "/v1/chat/completions",
                       {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_STEP_ONE}, 30)
    assert code == 200, first
    params = first["kv_transfer_params"]
    engine = _query(pair)["0"]["engine_id"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert f"{params['remote_host']}:{params['remote_port']}" == pair.prefill.bootstrap
    assert params["remote_engine_id"] == engine and params["tp_size"] == 1 and params["remote_request_id"].isdigit()

    chat = pair.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8,
                                                 extra_body={"kv_transfer_params": params})
    layout = request_state_bytes(pair.decode.cfg, 11, decode_side=True)
    extra = chat.model_extra["pdfleet"]
    assert extra["transferBytes"] == layout == extra["layoutBytes"] and extra["room"] == int(params["remote_request_id"])
    want = _want(body, int(params["remote_request_id"]), layout)
    assert chat.choices[0].message.content == want.text and chat.usage.prompt_tokens == 11

    # The same step two again: the room was claimed and ended, so nothing is moved twice.
    code, again = http("POST", pair.decode.url + "/v1/chat/completions", {**body, "kv_transfer_params": params}, 30)
    assert code >= 400, again

    # A step one no decode follows: the room expires (Pair's --room-ttl 2), counted, and its items are freed.
    before = metric(pair.prefill.metrics(), "pdfleet_rooms_expired_total")
    code, lone = http("POST", pair.prefill.url + "/v1/chat/completions",
                      {**body, "max_tokens": 1, "kv_transfer_params": NIXL_STEP_ONE}, 30)
    assert code == 200 and lone["kv_transfer_params"]["remote_request_id"] != params["remote_request_id"]
    _until(lambda: metric(pair.prefill.metrics(), "pdfleet_rooms_expired_total") == before + 1, 20,
           "the unclaimed room expired")
    assert pools(pair.prefill)["held"] == 0


def test_mooncake_one_step_through_a_transfer_id(tmp_path: Path, pairs: list[Pair]) -> None:
    pair = Pair(tmp_path, "mooncake")
    pairs.append(pair)
    pair.ready()
    query = _query(pair)
    assert list(query) == ["0"] and query["0"]["worker_addr"] == {"0": {"0": pair.prefill.bootstrap}}
    engine = query["0"]["engine_id"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8}
    transfer = "cmpl-router-made-0001"
    # vllm-router's order: the prefill's answer first (its room held), then the decode's request.
    pcode, pbody = http("POST", pair.prefill.url + "/v1/chat/completions",
                        {**body, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer}}, 30)
    assert pcode == 200 and pbody["kv_transfer_params"] is None, pbody  # vLLM's Mooncake prefill returns none
    assert pbody["pdfleet"]["room"] == room_of_transfer(transfer)
    before = sum(v for k, v in pair.prefill.metrics().items() if k.startswith("pdfleet_room_transfer_bytes_total"))
    chat = pair.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, extra_body={
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer, "remote_engine_id": engine,
                               "remote_bootstrap_addr": f"http://{pair.prefill.bootstrap}"}})
    layout = request_state_bytes(pair.decode.cfg, 11, decode_side=True)
    extra = chat.model_extra["pdfleet"]
    assert extra["room"] == room_of_transfer(transfer) and extra["transferBytes"] == layout
    assert chat.choices[0].message.content == _want(body, room_of_transfer(transfer), layout).text
    _until(lambda: sum(v for k, v in pair.prefill.metrics().items()
                       if k.startswith("pdfleet_room_transfer_bytes_total")) == before + layout, 10,
           "the prefill counting the room's bytes once it ended")


@pytest.mark.parametrize(("role", "params", "words"), [
    ("decode", {"do_remote_prefill": True}, "needs remote_request_id, remote_host, remote_port, remote_engine_id"),
    ("decode", {"do_remote_prefill": True, "transfer_id": "t"}, "also needs remote_bootstrap_addr"),
    ("decode", {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e",
                "remote_bootstrap_addr": "prefill:8998"}, "is not http://HOST:PORT"),
    ("decode", {"do_remote_decode": True}, "do_remote_prefill must be true on a decode worker"),
    ("prefill", {"do_remote_prefill": True}, "do_remote_decode must be true on a prefill worker"),
])
def test_parameters_that_name_no_transfer_are_refused(tmp_path: Path, pairs: list[Pair], role: str,
                                                      params: dict[str, Any], words: str) -> None:
    if not pairs:
        pairs.append(Pair(tmp_path, "mooncake").ready())
    pod = getattr(pairs[0], role)
    code, err = http("POST", pod.url + "/v1/chat/completions",
                     {"model": MODEL, "messages": MSGS, "kv_transfer_params": params}, 30)
    assert code == 400 and err["error"]["code"] == "invalid_kv_transfer_params", err
    assert words in err["error"]["message"] and err["error"]["param"] == "kv_transfer_params"
    code, err = http("POST", pod.url + "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "bootstrap_room": 7,
                                                                "kv_transfer_params": params}, 30)
    assert code == 400 and err["error"]["code"] == "conflicting_pd_fields", err
