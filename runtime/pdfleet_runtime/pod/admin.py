"""The admin endpoint: drain and cancel, reachable only from inside the pod.

``POST /drain[?wait=true]`` (stop admitting, finish in-flight; the ``exec`` preStop hook runs
``pdfleet-runtime drain --wait``, which calls it) and ``DELETE /drain`` (cancel a drain). Never by
GET (a GET is answered 405). The listener binds 127.0.0.1 only, whatever ``--bind`` says: the HTTP
port is opened by the NetworkPolicy to every source, so drain there would let anyone take the fleet
out of service. Loopback rather than a key: the kubelet runs an ``exec`` hook inside the container,
so the hook needs no secret, and nothing off the pod can reach the port at all (docs/security.md).
The operator never calls it; it drains through the pod's annotation (``PodServer._pod_loop``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

__all__ = ["ADMIN_HOST", "DRAIN_PATH", "admin_app", "call_drain", "start_admin"]

ADMIN_HOST = "127.0.0.1"
DRAIN_PATH = "/drain"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_app(drain: Handler, undrain: Handler) -> web.Application:
    app = web.Application(client_max_size=1024)  # no admin call has a body
    app.router.add_post(DRAIN_PATH, drain)
    app.router.add_delete(DRAIN_PATH, undrain)
    return app


async def start_admin(drain: Handler, undrain: Handler, port: int) -> web.AppRunner:
    """Serve the admin app on ``127.0.0.1:port``; the runner (``cleanup()`` stops it)."""
    runner = web.AppRunner(admin_app(drain, undrain), access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, ADMIN_HOST, port, reuse_address=True).start()
    return runner


def call_drain(port: int, *, wait: bool, cancel: bool = False, timeout_s: float = 3600.0) -> tuple[int, Any]:
    """The preStop hook's side: POST (or, ``cancel``, DELETE) ``/drain`` on this pod's admin port."""
    url = f"http://{ADMIN_HOST}:{port}{DRAIN_PATH}{'?wait=true' if wait and not cancel else ''}"
    req = urllib.request.Request(url, data=b"", method="DELETE" if cancel else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
