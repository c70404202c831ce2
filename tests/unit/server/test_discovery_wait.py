"""A request naming a prefill pod the decode's discovery does not name yet (the router's watch found it first,
as when scaling out adds a prefill pod) waits for discovery a bounded time; one it never names is refused."""

from __future__ import annotations

import asyncio
import time

from pdfleet_runtime.pod.metrics import ServerMetrics
from pdfleet_runtime.pod.readiness import Readiness
from pdfleet_runtime.pod.routing import RequestRouter
from pdfleet_runtime.protocol.discovery import Endpoint, ResolveError

OLD, NEW, STRANGER = Endpoint("127.0.0.11", 8998), Endpoint("127.0.0.12", 8998), Endpoint("127.0.0.19", 8998)


class LaggingDns:
    """Names ``NEW`` only ``lag_s`` after it was made; fails once on the way, as DNS can."""

    def __init__(self, lag_s: float) -> None:
        self.born, self.lag_s, self.calls = time.monotonic(), lag_s, 0

    def resolve(self) -> list[Endpoint]:
        self.calls += 1
        if self.calls == 2:
            raise ResolveError("no answer")
        return [OLD, NEW] if time.monotonic() - self.born >= self.lag_s else [OLD]


def _router() -> RequestRouter:
    readiness = Readiness("decode", floor_gbps=0.0, clock=time.monotonic, ranks_total=1, ranks_up=1)
    return RequestRouter(readiness, ServerMetrics("decode"), asyncio.Event())


def test_a_pod_discovery_names_late_is_waited_for_and_resolves_are_shared() -> None:
    async def main() -> tuple[list[bool], float, int]:
        router, dns = _router(), LaggingDns(2.2)
        t0 = time.monotonic()
        got = await asyncio.gather(*(router.known(NEW, dns, wait_s=6.0) for _ in range(20)))
        return list(got), time.monotonic() - t0, dns.calls

    got, took, calls = asyncio.run(main())
    assert got == [True] * 20
    assert 2.0 <= took < 5.0, took  # found on the first resolve after the lag, not at the wait's end
    assert calls <= 5, calls  # at most one resolve a second, for all 20 callers together


def test_a_pod_discovery_never_names_is_refused_after_the_wait() -> None:
    async def main() -> tuple[bool, bool, float]:
        router, dns = _router(), LaggingDns(0.0)
        t0 = time.monotonic()
        stranger = await router.known(STRANGER, dns, wait_s=1.5)
        took = time.monotonic() - t0
        return stranger, await router.known(OLD, dns, wait_s=0.0), took

    stranger, old, took = asyncio.run(main())
    assert stranger is False and 1.5 <= took < 3.0, took
    assert old is True  # a pod discovery named is known at once
