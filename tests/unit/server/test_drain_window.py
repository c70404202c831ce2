"""A drain with routers (``routerDropSeconds``): ``/health`` answers 503 from the drain's first moment, new
work is still admitted until the routers' window ends, then refused; a cancel inside the window or after
it admits again. The drain of a real ``PodServer`` (decode, nothing in flight) and its worker API's
handlers, called in process: no cluster, no rank processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from pdfleet_runtime.pod.app import PodServer
from pdfleet_runtime.pod.drain import Drain, DrainPhase, WindowEnd
from pdfleet_runtime.pod.options import ServeOptions
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


class _Caller:
    """What ``_health`` reads of a request: the caller's address and its headers (the worker key)."""

    def __init__(self, remote: str, key: str | None = None) -> None:
        self.remote = remote
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}


def _counted_server(leave_s: float, grace_s: float, key_file: Path | None = None) -> PodServer:
    cfg = config("decode").model_copy(update={"router_drop_seconds": leave_s, "router_health_failures": 2,
                                              "worker_key_path": key_file})
    server = PodServer(ServeOptions(config=cfg, pod_name="d-0", pod_namespace="ns"))
    server.drain.grace_s = grace_s
    return server


def test_admission_stops_once_every_router_failed_its_checks_then_the_grace() -> None:
    server = _counted_server(leave_s=5.0, grace_s=0.2)
    r1, r2 = _Caller("10.64.0.7"), _Caller("10.64.0.8")

    async def scenario() -> dict[str, object]:
        for r in (r1, r2):  # both routers check the serving pod
            await server.worker._health(r)  # type: ignore[arg-type]
        t0 = time.monotonic()
        server.start_drain()
        out: dict[str, object] = {}
        assert (await server.worker._health(r1)).status == 503  # type: ignore[arg-type]
        assert (await server.worker._health(r1)).status == 503  # type: ignore[arg-type]
        assert (await server.worker._health(r2)).status == 503  # type: ignore[arg-type]
        await asyncio.sleep(0.4)
        out["r2 has failed once"] = server.drain.admitting  # r2 has not dropped the pod yet
        await server.worker._health(r2)  # type: ignore[arg-type]
        t_dropped = time.monotonic()
        while server.drain.admitting and time.monotonic() - t0 < 6:
            await asyncio.sleep(0.01)
        out["grace"] = time.monotonic() - t_dropped
        out["stopped at"] = time.monotonic() - t0
        out["window"] = server.drain.window
        await asyncio.sleep(0.1)
        out["phase"] = server.drain.phase
        out["metric"] = server.metrics.render().decode()
        server.drain.close()
        return out

    out = asyncio.run(scenario())
    assert out["r2 has failed once"] is True, out
    assert 0.15 <= out["grace"] <= 0.5, out  # type: ignore[operator]
    assert out["stopped at"] < 1.5, out  # type: ignore[operator]  # long before the 5 s bound
    window = out["window"]
    assert isinstance(window, tuple) and window[1] is WindowEnd.ROUTERS and window[0] < 1.5, out
    assert out["phase"] is DrainPhase.DRAINED
    assert 'pdfleet_drain_window_seconds_count{ended="routers"} 1.0' in out["metric"], out  # type: ignore[operator]


def test_with_a_worker_key_only_callers_holding_it_count_as_routers(tmp_path: Path) -> None:
    """Issue 39: ``/health`` stays open (sglang-router's first probe carries no key), so anyone may ask it; a
    caller without the key must not be waited for as a router (it would hold the window to the bound)."""
    key = "router-key-" + "r" * 30
    (tmp_path / "key").write_text(key)
    server = _counted_server(leave_s=5.0, grace_s=0.1, key_file=tmp_path / "key")
    router, stranger = _Caller("10.64.0.7", key), _Caller("10.64.0.99")

    async def scenario() -> tuple[list[str], float]:
        for r in (router, stranger):
            await server.worker._health(r)  # type: ignore[arg-type]
        t0 = time.monotonic()
        server.start_drain()
        waited = sorted(server.router_checks.pending())
        for _ in range(2):
            await server.worker._health(router)  # type: ignore[arg-type]
        while server.drain.admitting and time.monotonic() - t0 < 6:
            await asyncio.sleep(0.01)
        server.drain.close()
        return waited, time.monotonic() - t0

    waited, stopped = asyncio.run(scenario())
    assert waited == ["10.64.0.7"] and stopped < 1.5, (waited, stopped)


def test_a_router_that_stops_checking_leaves_the_bound_to_end_the_window() -> None:
    server = _counted_server(leave_s=0.8, grace_s=0.1)
    r1, r2 = _Caller("10.64.0.7"), _Caller("10.64.0.8")

    async def scenario() -> tuple[float, object, bool]:
        for r in (r1, r2):
            await server.worker._health(r)  # type: ignore[arg-type]
        t0 = time.monotonic()
        server.start_drain()
        for _ in range(3):
            await server.worker._health(r1)  # type: ignore[arg-type]  # r2 never checks again
        while server.drain.admitting and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.01)
        stopped = time.monotonic() - t0
        window = server.drain.window
        server.drain.close()
        return stopped, window, server.drain.admitting

    stopped, window, admitting = asyncio.run(scenario())
    assert not admitting and 0.75 <= stopped <= 1.3, stopped
    assert isinstance(window, tuple) and window[1] is WindowEnd.BOUND, window


def test_no_router_known_keeps_the_whole_bound() -> None:
    server = _counted_server(leave_s=0.6, grace_s=0.1)

    async def scenario() -> float:
        t0 = time.monotonic()
        server.start_drain()  # nobody checked /health before: nothing to count
        while server.drain.admitting and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.01)
        server.drain.close()
        return time.monotonic() - t0

    assert 0.55 <= asyncio.run(scenario()) <= 1.2
