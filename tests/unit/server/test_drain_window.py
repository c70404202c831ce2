"""A drain with routers (``routerDropSeconds``): ``/health`` answers 503 from the drain's first moment, new
work is still admitted until the routers' window ends, then refused; a cancel inside the window or after
it admits again. The drain of a real ``PodServer`` (decode, nothing in flight) and its worker API's
handlers, called in process: no cluster, no rank processes."""

from __future__ import annotations

import asyncio
import time

from pdfleet_runtime.server.app import PodServer
from pdfleet_runtime.server.drain import Drain, DrainPhase
from pdfleet_runtime.server.options import ServeOptions
from tests.server.harness import config


def _server(leave_s: float) -> PodServer:
    cfg = config("decode").model_copy(update={"router_drop_seconds": leave_s})
    return PodServer(ServeOptions(config=cfg, pod_name="d-0", pod_namespace="ns"))


def test_health_fails_at_once_and_admission_stops_after_the_window() -> None:
    server = _server(0.4)

    async def scenario() -> list[tuple[float, int, bool, DrainPhase]]:
        seen = []
        t0 = time.monotonic()
        server.start_drain()
        while time.monotonic() - t0 < 1.0:
            health = await server.worker._health(None)  # type: ignore[arg-type]
            seen.append((time.monotonic() - t0, health.status, server.drain.admitting, server.drain.phase))
            await asyncio.sleep(0.05)
        server.drain.close()
        return seen

    seen = asyncio.run(scenario())
    assert all(status == 503 for _, status, _, _ in seen), seen  # out of the routers from the start
    admitting = [t for t, _, a, _ in seen if a]
    refusing = [t for t, _, a, _ in seen if not a]
    assert admitting and refusing and max(admitting) < min(refusing), seen
    assert 0.35 <= min(refusing) <= 0.7, seen  # the window, then the refusal
    assert seen[-1][3] is DrainPhase.DRAINED  # nothing in flight: drained once admission stopped


def test_without_routers_admission_stops_at_once() -> None:
    server = _server(0.0)

    async def scenario() -> bool:
        server.start_drain()
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        out = server.drain.admitting
        server.drain.close()
        return out

    assert asyncio.run(scenario()) is False


def test_a_cancel_admits_again_inside_and_after_the_window() -> None:
    calls: list[bool] = []

    async def nothing() -> int:
        return 0

    async def scenario() -> list[bool]:
        d = Drain(10, nothing, on_change=lambda draining: None, on_done=lambda forced: None,
                  on_admit=calls.append, leave_s=0.3)
        d.start()
        await asyncio.sleep(0.1)
        inside = d.admitting
        d.cancel()  # inside the window: admission never stopped, nothing to undo
        after_cancel = (d.admitting, d.serving, list(calls))
        d.start()
        await asyncio.sleep(0.5)
        stopped = d.admitting
        d.cancel()
        d.close()
        return [inside, *after_cancel[:2], after_cancel[2] == [], stopped, d.admitting, calls == [False, True]]

    assert asyncio.run(scenario()) == [True, True, True, True, False, True, True]
