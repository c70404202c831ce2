"""The metrics listener: ``GET /metrics`` alone, on its own port (``metricsPort``, 8090).

A scraper then needs no route to the HTTP port, which carries the worker API (prompts): a NetworkPolicy can
admit a monitoring namespace to this port and nothing else (docs/monitoring.md). Unauthenticated, like
``/metrics`` on the HTTP port, which stays for the doctor and the autoscaler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

__all__ = ["start_metrics"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def start_metrics(handler: Handler, host: str, port: int) -> web.AppRunner:
    """Serve ``handler`` at ``GET /metrics`` on ``host:port``; the runner (``cleanup()`` stops it)."""
    app = web.Application(client_max_size=1024)  # a scrape has no body
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner
