"""Request routing on a decode pod: which prefill pod a synthetic request goes to, and what its outcome means.

A request goes through every rank of this pod (one ``TransferOp`` each, over the rank pipe) towards
one prefill pod: canaried pods first (round robin), then the others known, then those that refused
a request as draining or did not answer since their last canary (``shunned``). A refusal as
draining, or an unreachable pod before anything accepted the request, tries the next (up to 3).
The outcome keeps its ``FailureReason`` (and cause) from the ranks; readiness decides on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from pdfleet_runtime.model.state import RankShare
from pdfleet_runtime.protocol.discovery import Endpoint, ResolveError, Resolver
from pdfleet_runtime.protocol.messages import RequestKind
from pdfleet_runtime.protocol.states import FailureReason
from pdfleet_runtime.rank.pipe import Generated, GenerateOp, TransferOp, TransferResult
from pdfleet_runtime.seeded import request_seed

from .group import GroupRanks
from .launcher import RankCallError, RankLauncher
from .metrics import ServerMetrics
from .readiness import CanaryResult, Problem, Readiness, busy, classify

__all__ = ["CALLER_FAULT", "NOT_THE_PATH", "RequestRouter", "SyntheticResult", "canary_result"]

log = logging.getLogger("pdfleet_runtime.server")

NOT_THE_PATH = frozenset({FailureReason.BUSY, FailureReason.NO_PEER, FailureReason.DRAINING})
"""Failures that say nothing about a transfer path: no metric failure, no readiness fact, HTTP 503."""
CALLER_FAULT = frozenset({FailureReason.CONFLICT})
"""The caller's mistake (a request id in use or used moments ago): refused before anything was allocated,
no metric failure, no readiness fact, HTTP 409."""


@dataclass(frozen=True)
class SyntheticResult:
    """One synthetic request through every rank of this decode pod."""

    request_id: str
    ok: bool
    failure: FailureReason | None
    reason: str
    bytes: int
    write_s: float
    seconds: float
    mismatched: int
    prefill: str | None
    released: bool = False
    """Failed with every rank's items given back at once (nothing accepted it): another pod may take it."""
    cause: FailureReason | None = None
    """Under ``failure``: the failed prefill rank's kind (``SOURCE_FAILED``) or ``DRAINING`` (``REFUSED``)."""
    mismatched_buffers: tuple[str, ...] = ()
    """Under ``VERIFY``: the buffers whose bytes differ."""
    shares: tuple[RankShare, ...] = ()
    """A prompt request that succeeded: every decode rank's share of the model's state, in rank order."""
    first_tokens: tuple[int, ...] = ()
    """A prompt request that succeeded: the first tokens the prefill ranks carried (all must agree)."""
    expected: tuple[tuple[int, ...], ...] = ()
    """A model canary that succeeded: the aggregate continuations the prefill ranks carried (all must agree)."""

    def as_json(self) -> dict[str, Any]:
        return {"requestId": self.request_id, "ok": self.ok, "failure": self.failure, "reason": self.reason,
                "bytes": self.bytes, "writeSeconds": self.write_s, "seconds": self.seconds,
                "mismatchedBytes": self.mismatched, "prefill": self.prefill}


def canary_result(res: SyntheticResult) -> CanaryResult | None:
    """A canary's answer as readiness takes it; None when it says nothing about the path (pools full)."""
    if res.failure is FailureReason.BUSY:
        return None
    return CanaryResult(res.ok, res.failure, res.reason, res.bytes, res.write_s, max(0, res.mismatched), res.cause)


DISCOVERY_WAIT_S = 5.0
"""How long a request naming a prefill pod discovery does not name yet waits for discovery to name it (a pod
the router's watch found first): scaling out adds prefill pods the router sends to before the DNS names them."""


class RequestRouter:
    """Routes this decode pod's synthetic requests (canaries and requests) to prefill pods.

    ``endpoints`` is what discovery found last (the canary loop sets it); ``recheck`` is set when a
    request failed or a pod was shunned, so the canary loop runs again at once.
    """

    def __init__(self, readiness: Readiness, metrics: ServerMetrics, recheck: asyncio.Event) -> None:
        self.readiness, self.metrics, self._recheck = readiness, metrics, recheck
        self.launcher: RankLauncher | GroupRanks | None = None
        self.endpoints: list[Endpoint] = []
        self.shunned: set[str] = set()  # prefill pods that refused a request as draining or did not answer
        self.active = 0
        """Requests admitted and not answered (the decode pod's in-flight count)."""
        self._rr = itertools.count()
        self._resolved_at = 0.0

    async def known(self, ep: Endpoint, resolver: Resolver, wait_s: float = DISCOVERY_WAIT_S) -> bool:
        """Whether ``ep`` is a prefill pod discovery names: the last answer, else discovery asked again (at most
        once a second, shared by every caller) until it names ``ep`` or ``wait_s`` passed. The router finds a new
        prefill pod by its own watch, which can be seconds ahead of the Service's DNS."""
        deadline = time.monotonic() + wait_s
        while ep not in self.endpoints:
            now = time.monotonic()
            if now >= deadline:
                return False
            if now - self._resolved_at < 1.0:
                await asyncio.sleep(min(deadline - now, self._resolved_at + 1.0 - now))
                continue
            self._resolved_at = now
            with contextlib.suppress(ResolveError):  # no answer now: asked again within the wait
                self.found(await asyncio.to_thread(resolver.resolve))
        return True

    def found(self, endpoints: list[Endpoint]) -> None:
        """Discovery's answer: forget shunned pods it no longer names."""
        self.endpoints = endpoints
        self.shunned &= {str(e) for e in endpoints}

    async def run(self, kind: RequestKind, tokens: int, request_id: str, seed: int, timeout_s: float, *,
                  verify: bool = True, endpoint: Endpoint | None = None, own_budget: bool = True,
                  prompt: tuple[int, ...] = (), expect: int = 0) -> SyntheticResult:
        """One request (a client's or a canary) through every rank of this decode pod; tries the next prefill pod
        (up to 3) when one refused it as draining or was unreachable before anything accepted it. ``own_budget``
        False (a caller's shorter ``timeout_s``): its failures are no readiness fact and shun no prefill pod.
        ``prompt`` and ``expect``: a model pod's canary (``check_tokens``), which moves the model's state of
        ``prompt`` and checks its continuation's tokens instead of seeded bytes."""
        self.active += 1
        t0 = time.perf_counter()
        try:
            candidates = [endpoint] if endpoint is not None else self.endpoints_for_requests()
            res = SyntheticResult(request_id, False, FailureReason.NO_PEER, "no prefill pod known", 0, 0.0, 0.0, -1,
                                  None)
            for ep in candidates[:3]:
                res = await self._through(ep, TransferOp(request_id, ep.host, ep.port, len(prompt) or tokens,
                                                         request_seed(request_id, seed), timeout_s, verify, kind=kind,
                                                         prompt=prompt, expect=expect))
                problem = None if res.ok else classify(res.failure, res.cause)
                # Another prefill pod may take it when this one refused it (draining) or never answered
                # (gone: DNS still names a deleted pod for a while) and nothing accepted it.
                if problem is not Problem.PEER_DRAINING and not (problem is Problem.UNREACHABLE and res.released):
                    break
                # Tried last from now on, until a canary passes there again.
                if kind is RequestKind.REQUEST and own_budget:
                    self.shunned.add(str(ep))
                    self._recheck.set()
                if problem is Problem.PEER_DRAINING:
                    res = SyntheticResult(request_id, False, FailureReason.DRAINING, res.reason, 0, 0.0, res.seconds,
                                          -1, str(ep))
            if res.ok and prompt:
                res = await self.check_tokens(res, prompt, expect, timeout_s)
        finally:
            self.active -= 1
        seconds = time.perf_counter() - t0
        res = SyntheticResult(res.request_id, res.ok, res.failure, res.reason, res.bytes, res.write_s, seconds,
                              res.mismatched, res.prefill, cause=res.cause, mismatched_buffers=res.mismatched_buffers)
        self._account(kind, res, tokens, own_budget=own_budget)
        return res

    async def check_tokens(self, res: SyntheticResult, prompt: tuple[int, ...], expect: int,
                           timeout_s: float) -> SyntheticResult:
        """A model canary whose state arrived: decode rank 0 continues it from every rank's share; the tokens must
        equal the aggregate continuation the prefill computed itself, else the canary failed as ``VERIFY`` (a
        state path that corrupts meaning, not only bytes, is not Ready)."""
        assert self.launcher is not None
        firsts, expected = set(res.first_tokens), set(res.expected)

        def failed(reason: str) -> SyntheticResult:
            return dataclasses.replace(res, ok=False, failure=FailureReason.VERIFY, reason=reason,
                                       mismatched_buffers=("tokens",))

        if len(firsts) != 1 or len(expected) != 1 or len(want := expected.pop()) != expect:
            return failed(f"the prefill carried first tokens {sorted(firsts)} and {len(res.expected)} aggregate "
                          f"continuations: one of each ({expect} tokens) is the canary's answer")
        first = firsts.pop()
        try:
            gen = await self.launcher.call(0, GenerateOp(res.request_id, len(prompt), first, expect - 1, res.shares),
                                           timeout_s=timeout_s + 30.0)
        except RankCallError as e:
            return dataclasses.replace(res, ok=False, failure=FailureReason.RANK, reason=str(e))
        got = (first, *gen.tokens) if isinstance(gen, Generated) else ()
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            return failed(f"the canary's continuation differs from the prefill's aggregate generation at token {at}: "
                          f"{list(got)} != {list(want)}")
        return res

    async def pull(self, ep: Endpoint, room: int, tokens: int, request_id: str, seed: int, timeout_s: float, *,
                   retry_refused_s: float = 0.0, prompt: tuple[int, ...] = ()) -> SyntheticResult:
        """One request whose state a prefill pod holds (``room``): from that pod only, ``seed`` as given.

        The prefill may not hold the room yet when a rank claims it: each rank sends its refused claim
        again, under the same id, for ``retry_refused_s`` (``TransferOp.wait_refused_s``), so the ranks
        of this decode (one pod or a group, whose member's ranks claim later) never split between the
        room's id and a retry's. ``prompt``: a model pod's request (the ranks answer their shares of the model's
        state instead of checking seeded bytes)."""
        self.active += 1
        t0 = time.perf_counter()
        try:
            res = await self._through(ep, TransferOp(request_id, ep.host, ep.port, tokens, seed, timeout_s,
                                                     wait_refused_s=retry_refused_s, prompt=prompt,
                                                     kind=RequestKind.ROOM, room=room))
        finally:
            self.active -= 1
        res = dataclasses.replace(res, seconds=time.perf_counter() - t0)
        self._account(RequestKind.ROOM, res, tokens)
        return res

    def _account(self, kind: RequestKind, res: SyntheticResult, tokens: int, *, own_budget: bool = True) -> None:
        """Metrics, and (requests) the readiness fact. ``own_budget`` False: the caller chose a shorter budget
        than the pod's, so a failure may be the caller's deadline, not the path: no readiness fact."""
        seconds, request_id = res.seconds, res.request_id
        said = res.failure not in NOT_THE_PATH and res.failure not in CALLER_FAULT
        if said or res.ok:
            self.metrics.transfer(kind, res.ok, res.bytes, seconds, res.failure, tokens=tokens)
        if res.mismatched > 0:
            self.metrics.mismatched.inc(res.mismatched)
        if kind is not RequestKind.CANARY and said and (res.ok or own_budget):
            self.readiness.record_transfer(res.ok, res.reason)
            if not res.ok:
                self._recheck.set()
        log.info("request %s (%s, %d tokens) via prefill %s: %s%s, %d bytes in %.4fs", request_id,
                 "canary" if kind is RequestKind.CANARY else "request", tokens,
                 res.prefill, "success" if res.ok else "failed", "" if res.ok else f" ({res.failure}: {res.reason})",
                 res.bytes, seconds)

    async def _through(self, ep: Endpoint, op: TransferOp) -> SyntheticResult:
        assert self.launcher is not None
        rid = op.request_id
        try:
            outs = [o for o in await self.launcher.call_all(op, timeout_s=op.timeout_s + 30.0)
                    if isinstance(o, TransferResult)]
        except RankCallError as e:
            return SyntheticResult(rid, False, e.failure, str(e), 0, 0.0, 0.0, -1, str(ep))
        failed = [o for o in outs if not o.ok]
        mismatched = sum(max(0, o.mismatched) for o in outs)
        moved = sum(o.bytes for o in outs)
        write_s = max((o.write_s for o in outs), default=0.0)
        if failed:
            f = failed[0]
            # The prefill pod had no room for it: load, not the path (no canary verdict, not a failing pod).
            failure = FailureReason.BUSY if busy(f.failure, f.cause) else f.failure
            return SyntheticResult(rid, False, failure, f.reason, moved, write_s, 0.0, -1, str(ep),
                                   released=all(o.released for o in outs), cause=f.cause)
        if mismatched:
            names = tuple(sorted({b for o in outs for b in o.mismatched_buffers}))
            return SyntheticResult(rid, False, FailureReason.VERIFY, f"{mismatched} bytes arrived different from the "
                                   f"seeded state in buffer {', '.join(names) or '?'}", moved, write_s, 0.0,
                                   mismatched, str(ep), mismatched_buffers=names)
        shares = tuple(o.share for o in outs if o.share is not None)
        firsts = tuple(r.first_token for o in outs for r in o.reports if r.first_token is not None)
        expected = tuple(r.expected_tokens for o in outs for r in o.reports if r.expected_tokens)
        return SyntheticResult(rid, True, None, "", moved, write_s, 0.0, 0, str(ep), shares=shares,
                               first_tokens=firsts, expected=expected)

    def endpoints_for_requests(self) -> list[Endpoint]:
        """Prefill pods whose canary passed first (round robin), then the others known, then those that
        refused a request as draining or did not answer since their last canary."""
        good = [e for e in self.endpoints if (c := self.readiness.peers.get(str(e))) is not None and c.ok
                and str(e) not in self.shunned]
        shunned = [e for e in self.endpoints if str(e) in self.shunned]
        rest = [e for e in self.endpoints if e not in good and e not in shunned] + shunned
        if good:
            k = next(self._rr) % len(good)
            good = good[k:] + good[:k]
        return good + rest
