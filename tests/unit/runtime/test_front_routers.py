"""The router front per router kind (``front.routers``): the routes it passes and whether it adds the worker key.

A ``Front`` on 127.0.0.1 before a stub router that records what reaches it: vllm-router's worker API is
refused at the front and its serving routes arrive without an ``Authorization`` header; sglang-router's
arrive with the worker key. A key given for a kind that takes none, or missing for one that wants it, is
refused when the settings are made.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from pdfleet_runtime.front.proxy import Front, FrontSettings, serve_front
from pdfleet_runtime.front.routers import FrontedRouter

KEY = "k" * 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("router", "key"), [(FrontedRouter.VLLM, KEY), (FrontedRouter.SGLANG, None)])
def test_a_key_must_match_the_router_kind(router: FrontedRouter, key: str | None) -> None:
    with pytest.raises(ValueError, match=str(router)):
        FrontSettings(router=router, served_model="m", upstream="http://127.0.0.1:1", api_key=key)


async def _through_front(router: FrontedRouter, key: str | None,
                         calls: list[tuple[str, str]]) -> tuple[list[tuple[str, str, int]], list[dict]]:
    seen: list[dict] = []

    async def stub(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "authorization": request.headers.get("Authorization")})
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", stub)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    upstream_port = runner.addresses[0][1]
    front = Front(FrontSettings(router=router, served_model="m", upstream=f"http://127.0.0.1:{upstream_port}",
                                api_key=key))
    port = await front.start("127.0.0.1", 0)
    answers = []
    try:
        async with aiohttp.ClientSession() as client:
            for method, path in calls:
                body = {"model": "m", "prompt": "hi"} if method == "POST" else None
                async with client.request(method, f"http://127.0.0.1:{port}{path}", json=body,
                                          headers={"Authorization": "Bearer client"}) as r:
                    answers.append((method, path, r.status))
    finally:
        await front.stop()
        await runner.cleanup()
    return answers, seen


def test_vllm_routers_worker_api_stops_at_the_front_and_no_key_is_added() -> None:
    worker_api = [("POST", "/remove_worker?url=http://d:30000"), ("POST", "/workers"), ("GET", "/workers"),
                  ("DELETE", "/workers/http%3A%2F%2Fd%3A30000"), ("POST", "/add_worker"), ("GET", "/list_workers"),
                  ("POST", "/flush_cache"), ("GET", "/get_loads"), ("POST", "/generate"), ("GET", "/health_generate")]
    serving = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
               ("GET", "/readiness"), ("GET", "/liveness"), ("GET", "/health")]
    answers, seen = asyncio.run(_through_front(FrontedRouter.VLLM, None, worker_api + serving))
    assert [s for _, _, s in answers] == [404] * len(worker_api) + [200] * len(serving), answers
    assert [s["path"] for s in seen] == [p for _, p in serving]
    assert all(s["authorization"] is None for s in seen)  # neither the client's header nor a key


def test_sglang_router_gets_the_worker_key_in_place_of_the_clients() -> None:
    answers, seen = asyncio.run(_through_front(FrontedRouter.SGLANG, KEY, [("POST", "/generate"),
                                                                           ("GET", "/workers")]))
    assert [s for _, _, s in answers] == [200, 404]
    assert seen == [{"path": "/generate", "authorization": f"Bearer {KEY}"}]


async def _answering_upstream() -> tuple[web.AppRunner, str]:
    """A router stand-in on loopback answering 200 to anything: its runner (clean it up) and base URL."""

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

def test_a_stopping_front_keeps_serving_for_its_drain_and_closes_each_connection_after_its_answer() -> None:
    """SIGTERM (``stop``) starts the drain: answers still come, each with ``Connection: close`` (a kept-alive
    client moves to another router pod through the Service); after ``drain_s``, with no new connection for
    ``quiet_s``, nothing listens."""

    async def run() -> tuple[list[tuple[int, str | None]], bool]:
        runner, upstream = await _answering_upstream()
        settings = FrontSettings(router=FrontedRouter.VLLM, served_model="m", upstream=upstream, api_key=None,
                                 drain_s=1.5, quiet_s=0.5)
        stop = asyncio.Event()
        port = free_port()
        task = asyncio.create_task(serve_front(settings, "127.0.0.1", port, stop))
        url = f"http://127.0.0.1:{port}/v1/models"
        out: list[tuple[int, str | None]] = []
        try:
            async with aiohttp.ClientSession() as client:
                for _ in range(50):  # listening
                    with contextlib.suppress(aiohttp.ClientConnectorError):
                        async with client.get(url) as r:
                            out.append((r.status, r.headers.get("Connection")))
                            break
                    await asyncio.sleep(0.05)
                stop.set()
                await asyncio.sleep(0.3)
                for _ in range(2):  # draining: served, and closed after the answer
                    async with client.get(url) as r:
                        out.append((r.status, r.headers.get("Connection")))
                await asyncio.sleep(1.8)
                try:
                    async with client.get(url) as r:
                        listening = True
                except aiohttp.ClientConnectorError:
                    listening = False
        finally:
            stop.set()
            await task
            await runner.cleanup()
        return out, listening

    out, listening = asyncio.run(run())
    assert out[0][0] == 200 and (out[0][1] or "").lower() != "close", out
    assert out[1:] == [(200, "close"), (200, "close")], out
    assert not listening


def test_a_draining_front_listens_while_new_connections_still_come_and_stops_once_they_cease() -> None:
    """kube-proxy sends new connections to a terminating router pod until it next syncs: the front serves them
    past ``drain_s`` (each closed after its answer) and stops listening ``quiet_s`` after the last one."""

    async def run() -> tuple[list[int], float, float]:
        runner, upstream = await _answering_upstream()
        settings = FrontSettings(router=FrontedRouter.VLLM, served_model="m", upstream=upstream, api_key=None,
                                 drain_s=0.5, quiet_s=0.8, drain_max_s=20)
        stop, port = asyncio.Event(), free_port()
        task = asyncio.create_task(serve_front(settings, "127.0.0.1", port, stop))
        url = f"http://127.0.0.1:{port}/v1/models"
        statuses: list[int] = []
        last = 0.0
        try:
            async with aiohttp.ClientSession() as client:
                for _ in range(50):  # listening
                    with contextlib.suppress(aiohttp.ClientConnectorError):
                        async with client.get(url) as r:
                            break
                    await asyncio.sleep(0.05)
                stop.set()
                began = time.monotonic()
                while time.monotonic() - began < 2.0:  # a new connection every 0.3 s, well past drain_s
                    async with client.get(url) as r:
                        statuses.append(r.status)
                    last = time.monotonic()
                    await asyncio.sleep(0.3)
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
                stopped = time.monotonic()
        finally:
            stop.set()
            await task
            await runner.cleanup()
        return statuses, last - began, stopped - last

    statuses, served_for, stopped_after = asyncio.run(run())
    assert statuses and set(statuses) == {200} and served_for >= 1.5, statuses  # past drain_s + quiet_s
    assert 0.7 <= stopped_after < 3.0, stopped_after  # quiet_s after the last connection (and the 2 s cleanup bound)


def test_the_router_prestop_hook_waits_until_nothing_listens_on_the_front_port() -> None:
    """``router-front-wait`` reads the namespace's listening sockets (no connection: it would prolong the drain)."""
    from pdfleet_runtime.front.stopped import listening, wait_stopped

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    assert not listening(port)  # bound, not listening
    sock.listen()
    try:
        assert listening(port)
        t0 = time.monotonic()
        assert not wait_stopped(port, within_s=0.5, poll_s=0.05) and time.monotonic() - t0 >= 0.5
    finally:
        sock.close()
    assert not listening(port) and wait_stopped(port, within_s=0.5)
