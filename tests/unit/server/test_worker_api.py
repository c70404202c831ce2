"""The worker API's pure half: rooms (bounds, expiry, claims by kind and room, outcomes) and the documented
derivations."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdfleet_runtime.pod.rooms import Expired, LegFailed, RoomError, RoomOutcome, RoomTable
from pdfleet_runtime.pod.worker_api import ApiError, Endpoint, completion, parse_request
from pdfleet_runtime.protocol.messages import RankKey, RequestKind, StatusReport, TransferRequest
from pdfleet_runtime.protocol.states import FailureReason, RequestState
from pdfleet_runtime.protocol.virtual import transfer_request
from pdfleet_runtime.seeded import request_seed


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_rooms_are_bounded_expire_and_claim_once() -> None:
    clock = Clock()
    t = RoomTable(max_rooms=2, max_bytes=100, ttl_s=5, legs=1, max_per_source=2, clock=clock)
    t.hold(1, 11, 4, 40)
    with pytest.raises(RoomError) as e:
        t.hold(1, 11, 4, 40)
    assert e.value.status == 409
    with pytest.raises(RoomError) as e:
        t.hold(2, 11, 4, 70)  # 110 bytes > 100
    assert e.value.code == "busy" and "100 bytes" in str(e.value)
    t.hold(2, 11, 4, 60)
    with pytest.raises(RoomError):
        t.hold(3, 11, 4, 1)  # count
    assert t.claim(1, "dec", "room-1").seed == 11
    assert t.claim(1, "dec", "room-1").claimed == 0.0  # every rank of the decode claims
    with pytest.raises(RoomError) as e:
        t.claim(1, "other", "room-1")
    assert e.value.status == 409
    # the same decode under another id is refused too: every rank of a decode claims under the room's one id
    with pytest.raises(RoomError) as e:
        t.claim(1, "dec", "room-1.1")
    assert e.value.code == "room_conflict"
    clock.t = 6
    assert t.expire() == 1 and t.expired == 1  # room 2 unclaimed; room 1 was claimed
    with pytest.raises(RoomError) as e:
        t.claim(2, "dec", "room-2")
    assert e.value.code == "room_not_found"
    assert t.rooms[2].outcome == RoomOutcome(0, Expired(claimed=False, after_s=6))
    t.drop(2)
    assert t.held_bytes == 40


def test_one_source_holds_at_most_half_the_rooms_unclaimed() -> None:
    """Issue 39: 80 direct posts with new rooms took every room of a prefill for 30 s. One caller now waits
    with at most half the rooms unclaimed (two routers each half), and unclaimed rooms expire in ttl_s."""
    clock = Clock()
    t = RoomTable(max_rooms=8, max_bytes=1 << 20, ttl_s=10, legs=1, clock=clock)
    assert t.max_per_source == 4
    for room in range(4):
        t.hold(room, 1, 4, 10, "10.0.0.9")
    with pytest.raises(RoomError) as e:
        t.hold(4, 1, 4, 10, "10.0.0.9")
    assert e.value.code == "busy" and "10.0.0.9" in str(e.value) and e.value.status == 503
    t.hold(5, 1, 4, 10, "10.0.0.7")  # another source (a router) still gets rooms
    t.claim(0, "dec", "room-0")
    t.hold(6, 1, 4, 10, "10.0.0.9")  # a claimed room no longer counts against its source
    clock.t = 10.5
    assert t.expire() == 5  # the unclaimed ones (1, 2, 3, 5, 6) go after ttl_s; the claimed one stays
    assert sorted(r for r, x in t.rooms.items() if not x.done) == [0]


def claim(room: int | None, rid: str, tp: int = 0, instance: str = "dec") -> TransferRequest:
    kind = RequestKind.REQUEST if room is None else RequestKind.ROOM
    return transfer_request(rid, tp, instance=instance, kind=kind, room=room)


def report(msg: TransferRequest, nbytes: int, failure: FailureReason | None = None, src: int = 0) -> StatusReport:
    return StatusReport(request_id=msg.request_id, instance=msg.instance, src=RankKey(tp=src, pp=0), dst=msg.dst,
                        state=RequestState.FAILED if failure else RequestState.SUCCESS, failure=failure,
                        reason="it broke" if failure else "", bytes=nbytes)


def test_a_claim_is_a_room_request_by_its_kind_never_by_its_id() -> None:
    """Issue 40: a request named ``room-7`` (or ``canary-x``) is a request like any other; a claim says its room."""
    t = RoomTable(max_rooms=4, max_bytes=1 << 20, ttl_s=10, legs=2, clock=Clock())
    t.hold(7, 77, 16, 10)
    for rid in ("room-7", "canary-x"):
        plain = claim(None, rid)
        assert t.admit(plain) is plain and t.rooms[7].claimed is None  # passes as it is, claims nothing
    claimed = t.admit(claim(7, "any-name"))
    assert claimed.fill is not None and (claimed.fill.seed, claimed.fill.tokens) == (77, 16)
    assert (t.rooms[7].claimant, t.rooms[7].request_id) == ("dec", "any-name")
    with pytest.raises(ValidationError):  # a room request names its room, the other kinds none
        TransferRequest.model_validate({**claim(7, "x").model_dump(), "room": None})
    with pytest.raises(ValidationError):
        TransferRequest.model_validate({**claim(None, "x").model_dump(), "room": 7})


def test_a_room_ends_with_its_last_claim_and_the_first_failure() -> None:
    t = RoomTable(max_rooms=4, max_bytes=1 << 20, ttl_s=10, legs=2, clock=Clock())
    room = t.hold(3, 1, 16, 10)
    first, second = claim(3, "r", tp=0), claim(3, "r", tp=1)
    t.admit(first)
    assert room.changed.is_set() and room.outcome is None  # the claim wakes its request: it runs now
    t.settle(claim(None, "r"), (report(first, 999),))  # another kind's request of the same id: not the room's
    t.settle(claim(3, "r", instance="other"), (report(first, 999),))  # not the claimant
    t.settle(first, (report(first, 100), report(first, 5, FailureReason.ENGINE, src=1)))
    assert room.outcome is None
    t.settle(second, (report(second, 50, FailureReason.PEER_LOST),))
    assert room.outcome == RoomOutcome(155, LegFailed(FailureReason.ENGINE, "it broke"))
    t.settle(second, (report(second, 50),))  # ended: the first outcome stands
    assert room.outcome == RoomOutcome(155, LegFailed(FailureReason.ENGINE, "it broke"))


def test_a_claimed_room_whose_legs_never_end_expires_later() -> None:
    clock = Clock()
    t = RoomTable(max_rooms=4, max_bytes=1 << 20, ttl_s=10, legs=1, clock=clock)
    room = t.hold(4, 1, 16, 10)
    t.admit(claim(4, "r"))
    assert t.remaining(room) == 80  # twice the ttl plus a minute
    clock.t = 79
    assert t.expire() == 0 and room.outcome is None
    clock.t = 80
    assert t.expire() == 1 and room.outcome == RoomOutcome(0, Expired(claimed=True, after_s=80))
    assert t.expired == 0  # the metric counts rooms no decode claimed


def test_the_documented_derivations() -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "bootstrap_room": 5, "max_tokens": 3,
            "temperature": 0.2, "frobnicate": 1}
    req = parse_request(Endpoint.CHAT, json.dumps(body).encode())
    assert req.prompt_tokens == 3  # "user: hello" = 11 bytes -> ceil(11 / 4)
    assert req.ignored == ("temperature", "frobnicate")
    assert req.seed == request_seed("room-5", req.prompt_key)
    c = completion(req.seed, req.prompt_tokens, 1000, req.max_tokens)
    natural = 4 + req.seed % 29
    assert len(c.ids) == min(3, natural) and c.finish_reason == ("stop" if natural <= 3 else "length")
    assert c.text == " ".join(f"t{i}" for i in c.ids)
    assert completion(req.seed, req.prompt_tokens, 1001, 3) != c  # the state's bytes enter the completion
    ids = parse_request(Endpoint.GENERATE, b'{"input_ids": [1, 2, 3, 4, 5], "bootstrap_room": 1}')
    assert ids.prompt_tokens == 5 and ids.max_tokens == 16


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    (Endpoint.CHAT, {"messages": []}, "messages"),
    (Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (Endpoint.COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    (Endpoint.GENERATE, {"input_ids": [[1], [2]]}, "input_ids"),
    (Endpoint.GENERATE, {"text": "a", "bootstrap_room": -1}, "bootstrap_room"),
])
def test_bad_bodies_name_the_field(endpoint: Endpoint, body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(endpoint, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": NaN}',
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": Infinity}',
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": 1e400}',
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": 9223372036854775808}',
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": 1, "max_tokens": NaN}',
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": 1, "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": 1, "bootstrap_port": 70000}',
    b'{"messages": [{"role": "user", "content": "x"}], "bootstrap_room": 1, "max_tokens": 1e9}',
    b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "bootstrap_room": 1}',
    b'"\\udfff"',
])
def test_numbers_out_of_range_deep_nesting_and_lone_surrogates_are_400(raw: bytes) -> None:
    """Issue 39: NaN, inf and out-of-range numbers were refused (held: kept as a regression test); deeply nested
    JSON and a lone surrogate gave 500 and are now 400 naming the problem."""
    with pytest.raises(ApiError) as e:
        parse_request(Endpoint.CHAT, raw)
    assert e.value.status == 400, e.value.message
