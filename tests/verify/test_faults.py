"""Faults across processes, through the real engines and the serving rank processes: ranks killed with
SIGKILL mid-transfer, a prefill pod restarted elsewhere, garbage posted to a live pod.

One decode pod per backend (llama-dense, prefill tp 1 -> decode tp 1), driven step by step over the
rank pipe, because each step starts from what the previous one left (a dead prefill, a decode that
still holds a link to it). Each step asserts on what the ranks report: request states and reasons,
how long a failure took, and the pools' free counts (pages, slots and rows given back).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
import urllib.request

import pytest

from pdfleet_runtime.layouts import PRESETS, pool_counts
from pdfleet_runtime.pod.launcher import RankCallError
from pdfleet_runtime.protocol.bootstrap import MESSAGES_PATH
from pdfleet_runtime.protocol.decode import DecodeSettings
from pdfleet_runtime.protocol.states import FailureReason, RequestState
from pdfleet_runtime.rank.pipe import FaultOptions
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.seeded import request_lengths
from pdfleet_runtime.verify.cases import CaseSpec, GroupSpec
from pdfleet_runtime.verify.group import CasePods, run_case

pytestmark = pytest.mark.slow

LAYOUT, REQUESTS, TOKENS = "llama-dense", 2, 48
TIMEOUT_S = 12.0
FULL = {k.value: v for k, v in pool_counts(PRESETS[LAYOUT], REQUESTS, TOKENS).items()}
FILL_DELAY_S = 4.0
"""Step 3's prefill input is this late: the decode is killed meanwhile (well under the request timeout)."""


def post_garbage(host: str, port: int) -> list[int]:
    """Unsigned, malformed and oversized posts: each must get a 4xx answer, none may hurt the pod."""
    codes = []
    for body, headers in [(b"\x00\xff" * 50, {}), (b'{"version": "1.0"}', {"X-Pdfleet-Signature": "ab" * 32}),
                          (b"{" * 5000, {"X-Pdfleet-Signature": "00"}), (b"x" * (5 << 20), {})]:
        req = urllib.request.Request(f"http://{host}:{port}{MESSAGES_PATH}", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                codes.append(resp.status)
        except urllib.error.HTTPError as e:
            codes.append(e.code)
        except (urllib.error.URLError, ConnectionError):
            codes.append(413)  # the server may close the connection on an oversized body: also a refusal
    return codes


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_kill_restart_and_garbage(backend: str) -> None:
    spec = GroupSpec(backend, S(1), S(1), (CaseSpec(LAYOUT, REQUESTS, TOKENS, seed=3),), request_timeout_s=TIMEOUT_S,
                     lease_s=2.0, write_timeout_s=5.0)
    asyncio.run(_scenario(spec))


def _requests(attempt: str) -> list[tuple[str, int]]:
    return [(f"{attempt}-{q}", n) for q, n in enumerate(request_lengths(TOKENS, REQUESTS, 3))]


async def _scenario(spec: GroupSpec) -> None:
    async with CasePods(spec, spec.cases[0]) as g:
        # 1. A prefill killed mid-transfer: the decode request fails with a reason within its timeout,
        #    and the decode rank frees its pages, slots and rows.
        ep = await g.open_pod(FaultOptions(write_delay_s=60))
        reqs = _requests("k")
        assert g.prefill is not None
        sending = asyncio.ensure_future(g.transfer(reqs))
        await g.wait_states([r for r, _ in reqs], RequestState.TRANSFERRING)  # both sides: the write is in flight
        t0 = time.monotonic()
        g.kill(g.prefill)
        [out] = await sending
        took = time.monotonic() - t0
        assert {o.state for o in out} == {RequestState.FAILED}, out
        assert all("prefill rank (0, 0)" in o.reason for o in out), out
        assert all(o.failure is FailureReason.SOURCE_FAILED and "stopped polling" in o.reason for o in out), out
        assert took < TIMEOUT_S, took  # the lease (2 s) noticed it, not the request timeout
        # The decode's late-write fence: the prefill's announced write timeout plus the decode's margin
        # (issue 25), then the items come back.
        [stats] = await g.wait_idle(g.decode, spec.write_timeout_s + DecodeSettings().fence_margin_s + 5.0)
        assert stats.free == FULL, "decode kept items of failed requests"

        # 2. The pod is gone for good and a new one starts elsewhere (a new port, as a new pod IP): the
        #    decode handshakes again, and new requests succeed byte-exact (its whole arena checked).
        #    Garbage posted to the new pod first changes nothing.
        ep2 = await g.open_pod()
        assert ep2.port != ep.port
        assert all(400 <= c < 500 for c in await asyncio.to_thread(post_garbage, ep2.host, ep2.port))
        res = await run_case(g, attempt="r")
        assert res.ok, res
        assert res.mismatched_bytes == 0 and res.details is not None
        [dec] = res.details.decode
        assert all(r.ok and len(r.reports) == 1 for r in dec.results)  # every source reported
        assert dec.stats.handshakes == 2
        [served] = res.details.prefill
        assert served.released == REQUESTS and served.free_after == FULL

        # 3. A decode killed mid-transfer frees the prefill side: the prefill's input is late (the request
        #    waits for input), the decode dies, then the prefill's write fails and its items are freed.
        await g.open_pod(FaultOptions(fill_delay_s=FILL_DELAY_S))
        reqs = _requests("d")
        rids = [r for r, _ in reqs]
        sending = asyncio.ensure_future(g.transfer(reqs))
        await g.wait_states(rids, RequestState.WAITING_FOR_INPUT)
        g.kill(g.decode)
        with contextlib.suppress(RankCallError):
            await sending
        [after] = await g.wait_idle(g.prefill, TIMEOUT_S + 30)
        states, failures = g.leg_outcomes(rids)
        assert set(states.values()) == {RequestState.FAILED} and set(states) == set(rids), states
        assert after.held == 0 and after.free == FULL
        assert all("decode rank (0, 0)" in reason for reason in failures.values()), failures
