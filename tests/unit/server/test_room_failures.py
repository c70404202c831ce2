"""A room's failure reaches the worker API's client as the typed failure it was, one case per kind (issue 40).

Prefill side: the real ``WorkerApi`` (over aiohttp's test server) holds the room in its ``RoomTable``, wired to
a real ``BootstrapState`` as the pod server wires them (``admit`` and ``settled``); the test plays the ranks by
sending the bootstrap their messages (registrations, the decode ranks' claims, the prefill rank's statuses,
a rank registering again, a lost group member). The answer is awaited per room, no polling: it comes at once
when the last leg ends. Decode side: the same ``WorkerApi`` whose pod's ``pull`` answers each ``FailureReason``.
A live pair of pods covers the same paths in ``tests/server/test_worker_api.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from pdfleet_runtime.pod.drain import DrainPhase
from pdfleet_runtime.pod.openai_api import WorkerApi, room_error
from pdfleet_runtime.pod.options import ServeOptions
from pdfleet_runtime.pod.rooms import Expired
from pdfleet_runtime.pod.routing import SyntheticResult
from pdfleet_runtime.protocol.bootstrap import BootstrapState
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.messages import (
    RankKey,
    RequestKind,
    StatusReport,
    StatusReports,
    TransferRequest,
)
from pdfleet_runtime.protocol.states import FailureReason as F
from pdfleet_runtime.protocol.states import RequestState
from pdfleet_runtime.protocol.virtual import decode_register, prefill_register, transfer_request
from pdfleet_runtime.records import ParallelShape
from tests.server.harness import config

ROOM = 5
BODY = {"prompt": "x" * 40, "bootstrap_room": ROOM, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
DECODE = ParallelShape(2)  # two decode ranks claim each room: it ends with the second one's legs


@dataclass
class Serving:
    admitting: bool = True
    serving: bool = True
    phase: DrainPhase = DrainPhase.SERVING


class Pod:
    """What ``WorkerApi`` asks of its pod server (``WorkerPod``): a prefill's bootstrap state, a decode's pull."""

    def __init__(self, role: str, *, ttl_s: float = 30.0, pulled: SyntheticResult | None = None) -> None:
        self.opts = ServeOptions(config=config(role, peer_tp=DECODE.tp if role == "prefill" else 1),
                                 room_ttl_s=ttl_s)
        self.drain = Serving()
        self.bootstrap_state = BootstrapState(ParallelShape(1)) if role == "prefill" else None
        self.pulled, self.pulls = pulled, list[tuple[int, str]]()

    def ranks_up(self) -> int:
        return self.opts.config.shape.world

    def ranks_died(self) -> bool:
        return False

    async def rank_stats(self, timeout_s: float) -> list[Any]:
        return []

    def health_checked(self, request: web.Request | None, ok: bool) -> None:
        pass

    async def read_body(self, request: web.Request) -> bytes:
        return await request.read()

    async def known_prefill(self, ep: Endpoint) -> bool:
        return True

    async def pull(self, ep: Endpoint, room: int, tokens: int, request_id: str, seed: int, timeout_s: float, *,
                   retry_refused_s: float) -> SyntheticResult:
        self.pulls.append((room, request_id))
        assert self.pulled is not None
        return self.pulled


async def answer(pod: Pod, ranks: Callable[[BootstrapState, WorkerApi], Awaitable[None]] | None = None
                 ) -> tuple[int, dict[str, Any]]:
    """POST the body to the worker API of ``pod``; on a prefill, ``ranks`` plays its and the decode's ranks
    once the room is held. The answer's status and body."""
    api = WorkerApi(pod, CollectorRegistry())
    state = pod.bootstrap_state
    if state is not None:
        state.admit, state.settled = api.rooms.admit, api.rooms.settle  # as the pod server wires them
        state.handle(prefill_register(ParallelShape(1), 0, 0))
        for tp in range(DECODE.tp):
            state.handle(decode_register(DECODE, tp, 0))
    app = web.Application()
    api.add_routes(app)
    async with TestClient(TestServer(app)) as client:
        post = asyncio.create_task(client.post("/v1/completions", data=json.dumps(BODY)))
        if state is not None and ranks is not None:
            while ROOM not in api.rooms.rooms:
                await asyncio.sleep(0.01)  # the test waits for the body to arrive; the answer is awaited
            await ranks(state, api)
        resp = await asyncio.wait_for(post, 10)
        return resp.status, await resp.json()


def claims() -> list[TransferRequest]:
    """Each decode rank's claim of the room (one id for all; a name only: the kind and the room say it)."""
    return [transfer_request("any-name", tp, kind=RequestKind.ROOM, room=ROOM) for tp in range(DECODE.tp)]


def status(msg: TransferRequest, nbytes: int, failure: F | None = None) -> StatusReports:
    failed = failure is not None
    return StatusReports(reports=(StatusReport(
        request_id=msg.request_id, instance=msg.instance, src=RankKey(tp=0, pp=0), dst=msg.dst,
        state=RequestState.FAILED if failed else RequestState.SUCCESS, failure=failure,
        reason=f"the leg failed ({failure})" if failed else "", bytes=nbytes),))


def test_a_room_whose_legs_all_succeed_answers_their_bytes() -> None:
    async def ranks(state: BootstrapState, api: WorkerApi) -> None:
        first, second = claims()
        for msg in (first, second):
            state.handle(msg)
        state.handle(status(first, 300))
        await asyncio.sleep(0.1)
        assert api.running == 1 and api.queued == 0  # claimed: it runs, until its last leg
        state.handle(status(second, 200))

    code, body = asyncio.run(answer(Pod("prefill"), ranks))
    assert code == 200 and body["pdfleet"]["transferBytes"] == 500, body


@pytest.mark.parametrize("failure", [F.ENGINE, F.PLAN, F.TIMEOUT, F.CANCELLED, F.SOURCE_FAILED])
def test_a_leg_failed_by_the_prefill_rank_is_a_transfer_failure_naming_its_kind(failure: F) -> None:
    async def ranks(state: BootstrapState, _: WorkerApi) -> None:
        first, second = claims()
        for msg in (first, second):
            state.handle(msg)
        state.handle(status(first, 100, failure))
        state.handle(status(second, 200))

    code, body = asyncio.run(answer(Pod("prefill"), ranks))
    err = body["error"]
    assert (code, err["code"]) == (500, "transfer_failed"), body
    assert f"failed: {failure.value}: the leg failed" in err["message"], err


def test_a_prefill_rank_registering_again_fails_the_room_peer_restarted() -> None:
    async def ranks(state: BootstrapState, _: WorkerApi) -> None:
        for msg in claims():
            state.handle(msg)
        state.handle(prefill_register(ParallelShape(1), 0, 0))  # the rank restarted: its legs are lost

    code, body = asyncio.run(answer(Pod("prefill"), ranks))
    assert (code, body["error"]["code"]) == (500, "transfer_failed") and "peer_restarted" in body["error"]["message"]


def test_a_lost_group_member_fails_the_room_peer_lost() -> None:
    async def ranks(state: BootstrapState, _: WorkerApi) -> None:
        for msg in claims():
            state.handle(msg)
        state.fail_sources([(0, 0)], "group member 1 went away")

    code, body = asyncio.run(answer(Pod("prefill"), ranks))
    assert (code, body["error"]["code"]) == (500, "transfer_failed"), body
    assert "peer_lost: group member 1 went away" in body["error"]["message"]


def test_a_room_nobody_claims_expires_504() -> None:
    pod = Pod("prefill", ttl_s=0.3)
    code, body = asyncio.run(answer(pod))
    assert (code, body["error"]["code"], body["error"]["param"]) == (504, "room_expired", "bootstrap_room"), body
    assert "no decode claimed" in body["error"]["message"]


def test_a_request_named_like_a_room_does_not_claim_it() -> None:
    """Issue 40: ids are opaque. A plain request named ``room-5`` is served as itself; the room waits for its claim."""
    async def ranks(state: BootstrapState, api: WorkerApi) -> None:
        for tp in range(DECODE.tp):
            state.handle(transfer_request(f"room-{ROOM}", tp))
        assert api.rooms.rooms[ROOM].claimed is None
        first, second = claims()
        for msg in (first, second):
            state.handle(msg)
        state.handle(status(first, 1))
        state.handle(status(second, 2))

    code, body = asyncio.run(answer(Pod("prefill"), ranks))
    assert code == 200 and body["pdfleet"]["transferBytes"] == 3, body


# The decode's answer to each kind a pull can end with (``WorkerApi._failure``).
DECODE_ANSWERS: dict[F, tuple[int, str]] = {
    F.VERIFY: (500, "state_mismatch"),
    **{f: (503, "prefill_unreachable") for f in (F.PEER_UNREACHABLE, F.PEER_LOST, F.PEER_RESTARTED, F.NO_PEER)},
    F.CONFLICT: (409, "room_conflict"),
    F.BUSY: (503, "busy"),
    F.DRAINING: (503, "draining"),
    **{f: (502, "transfer_failed") for f in (F.TIMEOUT, F.REFUSED, F.ENGINE, F.PLAN, F.CANCELLED, F.SOURCE_FAILED,
                                             F.RANK, F.GROUP_MEMBER_LOST)},
}


@pytest.mark.parametrize("failure", list(F))
def test_each_failure_a_decode_pull_ends_with_is_its_own_answer(failure: F) -> None:
    pulled = SyntheticResult(f"room-{ROOM}", False, failure, "why", 0, 0.0, 0.1, -1, "127.0.0.1:8998",
                             mismatched_buffers=("kv/0",) if failure is F.VERIFY else ())
    pod = Pod("decode", pulled=pulled)
    code, body = asyncio.run(answer(pod))
    assert (code, body["error"]["code"]) == DECODE_ANSWERS[failure], body
    assert pod.pulls == [(ROOM, f"room-{ROOM}")]  # the room, typed; the id as both pods derive it


def test_a_claimed_room_whose_legs_never_end_expires_504() -> None:
    """Its deadline (twice the ttl plus a minute) is the table's (``test_worker_api``); the answer is its own."""
    err = room_error(ROOM, Expired(claimed=True, after_s=80.2), 10.0)
    assert (err.status, err.code, err.param) == (504, "room_expired", "bootstrap_room")
    assert "was claimed but did not end within 80s" in err.message
