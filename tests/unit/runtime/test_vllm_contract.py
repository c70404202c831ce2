"""vLLM's ``kv_transfer_params`` -> this runtime's room (``pod/vllm_contract.py``): each of vllm-router's shapes
maps to one leg, both pods of a Mooncake step derive the same room, and what names no transfer is refused with
the keys it lacks."""

from __future__ import annotations

import pytest

from pdfleet_runtime.config import Role
from pdfleet_runtime.pod.vllm_contract import (
    KvTransferParams,
    LegError,
    LegKind,
    engine_id,
    handshake_key,
    leg_of,
    names_engine,
    nixl_prefill_params,
    query_answer,
    room_of_transfer,
)


def test_nixl_step_one_takes_a_new_room_and_step_two_reads_it_back() -> None:
    one = leg_of(KvTransferParams(do_remote_decode=True), Role.PREFILL)
    assert one.kind is LegKind.NIXL_PREFILL and 0 <= one.room < 2**63
    assert leg_of(KvTransferParams(do_remote_decode=True), Role.PREFILL).room != one.room
    params = nixl_prefill_params(one, engine="e1", host="10.0.0.7", port=8998, tp=2, pp=1, tokens=11)
    two = leg_of(KvTransferParams.model_validate(params), Role.DECODE)
    assert (two.kind, two.room, two.host, two.port, two.engine_id) == (LegKind.NIXL_DECODE, one.room, "10.0.0.7",
                                                                        8998, "e1")


def test_a_mooncake_transfer_id_names_one_room_on_both_pods() -> None:
    pre = leg_of(KvTransferParams(do_remote_decode=True, transfer_id="x-1"), Role.PREFILL)
    dec = leg_of(KvTransferParams(do_remote_prefill=True, transfer_id="x-1", remote_engine_id="e",
                                  remote_bootstrap_addr="http://10.0.0.7:8998"), Role.DECODE)
    assert pre.kind is LegKind.MOONCAKE_PREFILL and dec.kind is LegKind.MOONCAKE_DECODE
    assert pre.room == dec.room == room_of_transfer("x-1") != room_of_transfer("x-2")
    assert (dec.host, dec.port) == ("10.0.0.7", 8998)


@pytest.mark.parametrize(("params", "role", "words"), [
    ({}, Role.PREFILL, "do_remote_decode must be true"),
    ({"do_remote_prefill": True}, Role.PREFILL, "do_remote_decode must be true"),
    ({"do_remote_decode": True}, Role.DECODE, "do_remote_prefill must be true"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}, Role.DECODE,
     "needs remote_request_id, remote_engine_id"),
    ({"do_remote_prefill": True, "remote_request_id": "cmpl-1", "remote_host": "h", "remote_port": 1,
      "remote_engine_id": "e"}, Role.DECODE, "is not a room this runtime's prefill handed out"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "http://h:1"}, Role.DECODE,
     "also needs remote_engine_id"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e", "remote_bootstrap_addr": "h:1"},
     Role.DECODE, "is not http://HOST:PORT"),
])
def test_what_names_no_transfer_is_refused_with_the_missing_keys(params: dict, role: Role, words: str) -> None:
    with pytest.raises(LegError, match=words):
        leg_of(KvTransferParams.model_validate(params), role)


def test_engine_ids_are_fresh_per_start_and_query_answers_as_vllms_bootstrap() -> None:
    a, b = engine_id("pod-a"), engine_id("pod-a")
    assert a != b and a.startswith("pod-a-")
    assert query_answer(a, 2, 1, "10.0.0.7:8998") == {
        "0": {"engine_id": a, "worker_addr": {"0": {"0": "10.0.0.7:8998"}, "1": {"0": "10.0.0.7:8998"}}}}


def test_a_pinned_engine_id_is_the_pods_name_and_a_decode_names_only_the_current_engine() -> None:
    assert engine_id("pod-a", pinned=True) == engine_id("pod-a", pinned=True) == "pod-a"
    now = query_answer("pod-a-1234", 1, 1, "10.0.0.7:8998")
    assert names_engine("pod-a-1234", now) and names_engine("pod-a-1234_dp0", now)  # vllm-router's DP suffix
    for stale in ("pod-a-9999", "pod-a-1234_dpx", "pod-a", ""):
        assert not names_engine(stale, now), stale
    for junk in (None, [], "x", {"0": "x"}, {"0": {}}):
        assert not names_engine("pod-a-1234", junk), junk


def test_the_handshake_key_names_what_differs_between_a_prefill_and_a_decode() -> None:
    """vLLM's NIXL handshake refuses peers whose compatibility hash differs (its version, model, dtypes, ...): the
    built-in runtime's decode compares the prefill's ``HandshakeKey`` the same way. Prefill and decode of one
    fleet share it; a changed engine version, layout or backend on one side shows as that field."""
    from tests.server.harness import config

    pre, dec = config("prefill", backend="nixl"), config("decode", backend="nixl")
    assert handshake_key(pre, "vllm==0.33.0", "0.1.0") == handshake_key(dec, "vllm==0.33.0", "0.1.0")
    mine = handshake_key(dec, "vllm==0.33.1", "0.1.0")
    assert mine.differences(handshake_key(pre, "vllm==0.33.0", "0.1.0")) == [
        "engine: 'vllm==0.33.1' here, 'vllm==0.33.0' at the prefill"]
    # Without a stand-in the runtime's own version is the engine's: a runtime upgrade is a new generation.
    assert handshake_key(dec, None, "0.1.0").engine == "pdfleet-runtime==0.1.0"
    assert [d.split(":")[0] for d in handshake_key(dec, None, "0.1.1").differences(handshake_key(pre, None, "0.1.0"))] \
        == ["engine"]
    other = handshake_key(config("prefill", backend="mooncake", layout="qwen3-next-hybrid"), None, "0.1.0")
    fields = [d.split(":")[0] for d in handshake_key(dec, None, "0.1.0").differences(other)]
    assert fields == ["layout", "transfer", "hybrid"], fields  # both layouts bf16: kv_dtype the same
