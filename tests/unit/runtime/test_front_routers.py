"""The router front per router kind (``front.routers``): the routes it passes and whether it adds the worker key.

A ``Front`` on 127.0.0.1 before a stub router that records what reaches it: vllm-router's worker API is
refused at the front and its serving routes arrive without an ``Authorization`` header; sglang-router's
arrive with the worker key. A key given for a kind that takes none, or missing for one that wants it, is
refused when the settings are made.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from pdfleet_runtime.front.proxy import Front, FrontSettings
from pdfleet_runtime.front.routers import FrontedRouter

KEY = "k" * 32


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
