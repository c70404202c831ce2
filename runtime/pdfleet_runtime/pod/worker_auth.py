"""Who may start or hold work on a pod's HTTP port: the deployment's worker key, and per-source bounds.

The operator makes one worker key per deployment (Secret ``<deployment>-worker-auth``, item ``key``)
and mounts it into every runtime pod and every router pod. The routers send it as
``Authorization: Bearer <key>`` on every call to a worker (sglang-router's ``--api-key``, set from the
mounted file by the router pod's launcher, never on a command line). A pod answers 401, before it reads
the body, on every route that starts or holds work or tells what the pod is (``PROTECTED``) when the
header does not carry an accepted key; ``/healthz``, ``/readyz`` and ``/metrics`` (the kubelet's
probes, Prometheus) stay open. The key rotates as the transfer key does (``key`` and
``key.previous``, re-read every 10 s: ``protocol.keys.Keyring``).

Bounds on the port (``HTTP_LIMITS``, ``protocol.http_guard``): connections per source address and in
all, and a connection that spends ``idle_s`` outside a handler (headers trickling in, idle keep-alive)
is closed; a body must arrive within ``read_s``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdfleet_runtime.protocol.http_guard import GuardedServer, HttpLimits
from pdfleet_runtime.protocol.keys import Keyring

__all__ = ["HTTP_LIMITS", "PROTECTED", "WorkerAuth", "bearer"]

HTTP_LIMITS = HttpLimits(per_peer=256, total=4096, idle_s=10.0, read_s=10.0, exempt_loopback=True)
"""Port 8080: a router keeps at most a few dozen connections to a worker; the kubelet's probes are short."""

PROTECTED = frozenset({
    "/v1/chat/completions", "/v1/completions", "/generate", "/v1/synthetic",
    "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models", "/version",
})
"""Routes that start or hold work, or tell what the pod serves and holds: the worker key is required.
``/health`` stays open: sglang-router 0.3.2 probes it without its key when it first finds a worker (its
connection-mode check); it says only 200 or 503, and only callers with the key count as routers in a
drain (``openai_api.WorkerApi._health``)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bearer(header: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, as bytes; None when absent or malformed."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    try:
        return token.strip().encode("ascii")
    except UnicodeEncodeError:
        return None


class WorkerAuth:
    """The worker-key check and the port's connection guard, as aiohttp middleware (``keys`` None: no key
    configured, every caller may call: a local run without ``workerKeyPath``)."""

    def __init__(self, keys: Keyring | None, limits: HttpLimits = HTTP_LIMITS) -> None:
        self.keys, self.limits = keys, limits
        self.guard: GuardedServer | None = None
        self.refused = 0
        """Calls answered 401 (a missing or wrong key)."""

    def allows(self, header: str | None) -> bool:
        if self.keys is None:
            return True
        token = bearer(header)
        return token is not None and any(hmac.compare_digest(token, k) for k in self.keys.accepted)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = self.guard
        if guard is None:
            return await self._checked(request, handler)
        with guard.busy(request.transport):
            return await self._checked(request, handler)

    async def _checked(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PROTECTED and not self.allows(request.headers.get("Authorization")):
            self.refused += 1
            resp = web.json_response({"error": {
                "message": "this worker endpoint needs the deployment's worker key (Authorization: Bearer <key>, "
                "Secret <deployment>-worker-auth): only the deployment's routers call it",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}, status=401,
                headers={"WWW-Authenticate": "Bearer"})
            resp.force_close()  # the body is never read: closed after the answer (and ``linger_s`` of dropping it)
            return resp
        return await handler(request)
