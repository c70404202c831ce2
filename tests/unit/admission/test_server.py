"""``AdmissionServer`` over real HTTPS on loopback (a dev certificate): routes to the pure review,
answers 200 with an AdmissionReview for unknown paths, oversized bodies and failing delegates; and
the settings and command-line flags that build it."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest

from pdfleet_devcluster.cluster import free_port
from pdfleet_operator.__main__ import build_parser, main
from pdfleet_operator.admission import (
    VALIDATE_WEBHOOK_ID,
    AdmissionServer,
    Verdicts,
    WebhookSetupError,
    build_server,
    response_problems,
    review,
)
from pdfleet_operator.admission import handlers as admission_handlers
from pdfleet_operator.admission.process import AdmissionProcess
from pdfleet_operator.admission.server import server_kwargs
from pdfleet_operator.settings import AdmissionSettings, OperatorSettings, RecheckSettings, WebhookMode
from tests.unit.admission.builders import Review, example


async def _serve(server: AdmissionServer, fn: Any, calls: Callable[[str, aiohttp.ClientSession], Any]) -> Any:
    """Run ``server`` with kopf's fn ``fn`` until ``calls(url, session)`` is done."""
    async with server:
        gen: AsyncIterator[Any] = server(fn)
        config = await gen.__anext__()
        ctx = ssl.create_default_context(cafile=str(server.cafile))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
            try:
                return await calls(config["url"], session)
            finally:
                await gen.aclose()


def _dev_server(tmp_path: Path, **kw: Any) -> AdmissionServer:
    settings = AdmissionSettings(mode=WebhookMode.DEV, host="127.0.0.1", port=free_port(), cert_dir=tmp_path, **kw)
    verdicts = Verdicts()
    return build_server(settings, {VALIDATE_WEBHOOK_ID: lambda b: review(b, verdicts)}, delegate=("kopf-one",))


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, Any]:
    async with session.post(url, data=body) as resp:
        return resp.status, json.loads(await resp.read())


def test_routes_unknown_paths_big_bodies_and_delegates(tmp_path: Path) -> None:
    server = _dev_server(tmp_path, max_body_bytes=2 << 20)

    async def kopf_fn(data: Any, **_: Any) -> Any:
        if data.get("boom"):
            raise kopf.AdmissionError("x", code=500)
        return {"something": "odd"}

    async def calls(url: str, s: aiohttp.ClientSession) -> list[tuple[int, Any]]:
        bad = Review(example("kv-heads-tp", "invalid")).uid("u1").body()
        return [
            await _post(s, f"{url}/{VALIDATE_WEBHOOK_ID}", bad),
            await _post(s, f"{url}/{VALIDATE_WEBHOOK_ID}", b'{"request": {"uid": "u2", "obj'),
            await _post(s, f"{url}/{VALIDATE_WEBHOOK_ID}", Review("x" * (3 << 20)).uid("u3").body()),
            await _post(s, f"{url}/nowhere", Review({}).uid("u4").body()),
            await _post(s, f"{url}/kopf-one", b'{"boom": true, "request": {"uid": "u5"}}'),
            await _post(s, f"{url}/kopf-one", b'{"request": {"uid": "u6"}}'),
        ]

    results = asyncio.run(_serve(server, kopf_fn, calls))
    assert [status for status, _ in results] == [200] * 6
    for (_, resp), uid in zip(results, ["u1", "u2", "u3", "u4", "u5", "u6"], strict=True):
        assert response_problems(resp, uid) == [], resp
        assert resp["response"]["allowed"] is False
    assert "[kv-heads-tp]" in results[0][1]["response"]["status"]["message"]
    assert results[2][1]["response"]["status"]["code"] == 413
    assert "no webhook is served at /nowhere" in results[3][1]["response"]["status"]["message"]
    assert "AdmissionError" in results[4][1]["response"]["status"]["message"]
    assert "malformed answer" in results[5][1]["response"]["status"]["message"]


def test_reviews_do_not_wait_for_a_blocked_kopf_loop(tmp_path: Path) -> None:
    """The listener has its own thread and loop: a review is answered while kopf's loop is stuck in
    one long step (a stand-in for a burst of watch events), and a delegated id still runs on kopf's loop."""
    server = _dev_server(tmp_path)
    seen: dict[str, Any] = {}

    async def kopf_fn(data: Any, **_: Any) -> Any:
        seen["loop"] = asyncio.get_running_loop()
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": "d1", "allowed": True}}

    def post(url: str, body: bytes, out: dict[str, Any]) -> None:
        parts = url.removeprefix("https://").split("/", 1)[0]
        host, port = parts.rsplit(":", 1)
        conn = http.client.HTTPSConnection(host, int(port), timeout=10,
                                           context=ssl.create_default_context(cafile=str(server.cafile)))
        start = time.monotonic()
        conn.request("POST", f"/{VALIDATE_WEBHOOK_ID}", body=body, headers={"Content-Type": "application/json"})
        out["resp"] = json.loads(conn.getresponse().read())
        out["s"] = time.monotonic() - start
        conn.close()

    async def calls(url: str, s: aiohttp.ClientSession) -> tuple[dict[str, Any], tuple[int, Any]]:
        out: dict[str, Any] = {}
        seen["kopf"] = asyncio.get_running_loop()
        client = threading.Thread(target=post, args=(url, Review(example("llama-dense")).uid("t1").body(), out))
        client.start()
        time.sleep(2.0)  # kopf's loop blocked: nothing on it runs until this returns
        client.join(10)
        return out, await _post(s, f"{url}/kopf-one", b'{"request": {"uid": "d1"}}')

    out, (status, delegated) = asyncio.run(_serve(server, kopf_fn, calls))
    assert out["resp"]["response"]["uid"] == "t1" and out["resp"]["response"]["allowed"] is True, out
    assert out["s"] < 1.0, f"the review took {out['s']:.2f}s, behind kopf's blocked loop"
    assert status == 200 and delegated["response"]["allowed"] is True
    assert seen["loop"] is seen["kopf"]


def test_a_listener_that_cannot_bind_fails_on_kopfs_loop(tmp_path: Path) -> None:
    server = _dev_server(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.port))
        taken.listen()
        with pytest.raises(OSError, match=r"(?i)address already in use"):
            asyncio.run(_serve(server, None, lambda url, s: asyncio.sleep(0)))


def test_large_bodies_are_judged_off_the_loop(tmp_path: Path) -> None:
    server = _dev_server(tmp_path, inline_body_bytes=1024)
    obj = example("llama-dense")
    # ~1.3 MB: over aiohttp's 1 MiB client_max_size and over inline_body_bytes (a worker thread judges it)
    obj["spec"]["decode"]["env"] = [{"name": f"V{i}", "value": "v" * 230} for i in range(5000)]

    async def calls(url: str, s: aiohttp.ClientSession) -> tuple[int, Any]:
        return await _post(s, f"{url}/{VALIDATE_WEBHOOK_ID}", Review(obj).uid("big").body())

    status, resp = asyncio.run(_serve(server, None, calls))
    assert status == 200 and response_problems(resp, "big") == []
    assert "spec.decode.env" in resp["response"]["status"]["message"]  # maxItems 256


def test_serve_mode_needs_certificate_files(tmp_path: Path) -> None:
    with pytest.raises(WebhookSetupError, match="needs --webhook-cert-dir"):
        build_server(AdmissionSettings(mode=WebhookMode.SERVE), {})
    with pytest.raises(WebhookSetupError, match=r"tls\.crt"):
        build_server(AdmissionSettings(mode=WebhookMode.SERVE, cert_dir=tmp_path), {})
    assert main(["--webhook-listen", "0.0.0.0:9443", "--webhook-cert-dir", str(tmp_path)]) == 2


def _settings(*argv: str) -> OperatorSettings:
    return OperatorSettings.from_args(build_parser().parse_args(list(argv)))


def test_flags_become_settings() -> None:
    s = _settings()
    assert s.admission.mode is WebhookMode.OFF and s.recheck.interval_seconds == 300
    s = _settings("--dev-webhook", "127.0.0.1:0", "--test-deny-cell", "nixl.pipeline", "--recheck-interval", "5")
    assert (s.admission.mode, s.admission.host, s.admission.port) == (WebhookMode.DEV, "127.0.0.1", 0)
    assert s.recheck.deny_cells == ("nixl.pipeline",) and s.recheck.interval_seconds == 5
    s = _settings("--webhook-listen", "[::]:8443", "--webhook-cert-dir", "/tls")
    assert (s.admission.mode, s.admission.host, s.admission.port) == (WebhookMode.SERVE, "::", 8443)
    with pytest.raises(argparse.ArgumentTypeError):
        _settings("--dev-webhook", "nowhere")


def test_register_wires_kopf_by_mode(tmp_path: Path) -> None:
    def wire(*argv: str) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings]:
        registry, settings = kopf.OperatorRegistry(), _settings(*argv)
        ks = settings.kopf_settings()
        admission_handlers.register(registry, settings, ks)
        return registry, ks

    registry, ks = wire()
    assert ks.admission.server is None and ks.admission.managed is None
    assert not registry._webhooks.get_all_handlers()  # no webhook: kopf would refuse to start without a server
    assert ks.persistence.progress_storage.prefix == "pdfleet.io"
    registry, ks = wire("--dev-webhook", "127.0.0.1:0", "--webhook-cert-dir", str(tmp_path))
    (hook,) = registry._webhooks.get_all_handlers()
    assert hook.id == VALIDATE_WEBHOOK_ID and set(hook.operations) == {"CREATE", "UPDATE"}
    assert not hook.ignore_failures  # failurePolicy Fail
    assert isinstance(ks.admission.server, AdmissionProcess) and ks.admission.managed == "pdfleet-admission.pdfleet.io"
    assert (tmp_path / "ca.crt").is_file()


def test_the_admission_process_serves_reviews_and_reports_its_failure(tmp_path: Path) -> None:
    """What kopf runs: the webhook in a child process; a review answered there, and a child that
    cannot listen (port taken) surfacing as WebhookSetupError on kopf's side."""
    settings = AdmissionSettings(mode=WebhookMode.DEV, host="127.0.0.1", port=free_port(), cert_dir=tmp_path)
    proc = AdmissionProcess(server_kwargs(settings), RecheckSettings(), VALIDATE_WEBHOOK_ID)

    async def calls(url: str, s: aiohttp.ClientSession) -> list[tuple[int, Any]]:
        return [await _post(s, f"{url}/{VALIDATE_WEBHOOK_ID}", Review(example("kv-heads-tp", "invalid")).uid("p1").body()),
                await _post(s, f"{url}/{VALIDATE_WEBHOOK_ID}", Review(example("llama-dense")).uid("p2").body())]

    (s1, denied), (s2, allowed) = asyncio.run(_serve(proc, None, calls))  # type: ignore[arg-type]
    assert (s1, s2) == (200, 200)
    assert denied["response"]["allowed"] is False and "[kv-heads-tp]" in denied["response"]["status"]["message"]
    assert allowed["response"] == {"uid": "p2", "allowed": True} or allowed["response"]["allowed"] is True

    taken_port = free_port()
    proc = AdmissionProcess({**server_kwargs(settings), "port": taken_port}, RecheckSettings(), VALIDATE_WEBHOOK_ID)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", taken_port))
        taken.listen()
        with pytest.raises(WebhookSetupError, match="admission process exited with status 1"):
            asyncio.run(_serve(proc, None, lambda url, s: asyncio.sleep(0)))  # type: ignore[arg-type]


def test_a_stopped_admission_process_drains_kept_alive_connections_before_it_closes(tmp_path: Path) -> None:
    """The apiserver keeps webhook connections alive. Stopped (SIGTERM, as kopf's shutdown sends), the child
    answers on for ``drain_seconds``, each answer with Connection: close: a review sent on a kept-alive
    connection after the stop is answered (the child used to die at once, under it), that connection is then
    retired, the next review opens a new one, and the child exits after the drain."""
    drain = 3.0
    settings = AdmissionSettings(mode=WebhookMode.DEV, host="127.0.0.1", port=free_port(), cert_dir=tmp_path,
                                 drain_seconds=drain)
    proc = AdmissionProcess(server_kwargs(settings), RecheckSettings(), VALIDATE_WEBHOOK_ID)
    opened = 0

    async def on_create(*_: Any) -> None:
        nonlocal opened
        opened += 1

    async def run() -> tuple[list[tuple[int, str | None, int]], float]:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(on_create)
        gen: AsyncIterator[Any] = proc(None)
        config = await gen.__anext__()
        url = f"{config['url']}/{VALIDATE_WEBHOOK_ID}"
        ctx = ssl.create_default_context(cafile=str(proc.cafile))
        seen: list[tuple[int, str | None, int]] = []  # (status, Connection header, connections opened so far)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=1),
                                         trace_configs=[trace]) as s:

            async def post(i: int) -> None:
                async with s.post(url, data=Review(example("llama-dense")).uid(f"d{i}").body()) as resp:
                    body = json.loads(await resp.read())
                    assert body["response"]["allowed"] is True, body
                    seen.append((resp.status, resp.headers.get("Connection"), opened))

            await post(0)
            t0 = time.monotonic()
            closing = asyncio.ensure_future(gen.aclose())  # kopf's stop: the child gets SIGTERM
            i = 1
            while time.monotonic() - t0 < drain - 1.0:  # reviews go on, each on the connection the pool holds
                await post(i)
                i += 1
                await asyncio.sleep(0.1)
            await closing
            return seen, time.monotonic() - t0

    seen, took = asyncio.run(run())
    assert seen[0] == (200, None, 1), seen  # before the stop: kept alive
    assert all(status == 200 for status, _, _ in seen), seen
    closed = [i for i, (_, conn, _) in enumerate(seen) if conn == "close"]
    assert closed, f"no answer closed its connection while draining: {seen}"
    first = closed[0]
    assert seen[first][2] == seen[first - 1][2], f"the first drained answer came on a new connection: {seen}"
    assert all(conn == "close" for _, conn, _ in seen[first:]), seen
    assert [n for _, _, n in seen[first:]] == list(range(seen[first][2], seen[first][2] + len(seen) - first)), (
        f"each answer after the first drained one was on a connection of its own: {seen}")
    assert drain <= took < drain + 10, took
