"""The validating webhook in a process of its own, so admission never shares an interpreter with
the reconcile work.

A thread with its own event loop was not enough: during a thousand pods' rollout a review's p99
stayed at 1.8x the allow-all webhook's (likely causes: kopf's thread holding the GIL through long C
calls and garbage collections, or while descheduled on a loaded host). ``AdmissionProcess`` is
what kopf gets as its webhook server: it starts a Python child running ``main`` below
with the server's arguments (``server.server_kwargs``: limits, listener, certificate files) and the
re-check settings on stdin, and yields the client configs the child prints, one JSON line each
(kopf's managed mode publishes them). The child judges with its own ``Verdicts`` (the same verdict
function; the cache is per process).

Stopping: the operator sends the child SIGTERM (the child ignores SIGINT, which is the operator's to
handle); the child then drains for ``drain_s`` (it answers every review and closes each connection
after its answer; see ``AdmissionServer.draining``) and exits. It drains the same way when its stdin
closes (the operator died). Without the drain the child died at SIGTERM, closing the apiserver's
kept-alive connections under reviews it was sending on them: one apply in 71 was refused with "use of
closed network connection" during a rolling ``helm upgrade`` (CI, test_helm_upgrade_runtimes).

Failure behaviour: a child that exits (a port in use, bad certificates, OOM) raises
``WebhookSetupError`` in kopf's webhook task, as the in-process listener's failure did.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from pdfleet_operator.admission.review import review
from pdfleet_operator.admission.server import AdmissionServer, WebhookSetupError
from pdfleet_operator.admission.verdicts import Verdicts
from pdfleet_operator.settings import RecheckSettings

__all__ = ["AdmissionProcess"]

_STOP_S = 10.0
# Not ``-m``: the package imports this module first, and runpy warns about running it again.
_CHILD = f"from {__name__} import main; raise SystemExit(main())"


class AdmissionProcess:
    """kopf's webhook server protocol (``__call__(fn)`` yields client configs), served by a child
    process with the pure ``review`` route ``route``; kopf's own ``fn`` is never called."""

    def __init__(self, server_kwargs: dict[str, Any], recheck: RecheckSettings, route: str) -> None:
        self.server_kwargs = dict(server_kwargs)
        self.cafile = server_kwargs.get("cafile")
        self.drain_s = float(server_kwargs.get("drain_s", 0.0))
        self._config = json.dumps({"server": self.server_kwargs, "recheck": recheck.model_dump(mode="json"),
                                   "route": route}).encode() + b"\n"

    async def __aenter__(self) -> AdmissionProcess:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    async def __call__(self, fn: Any) -> AsyncIterator[dict[str, Any]]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(self._config)
            await proc.stdin.drain()
            while line := await proc.stdout.readline():
                yield json.loads(line)
            rc = await proc.wait()
            raise WebhookSetupError(f"the admission process exited with status {rc} (its log is above, on stderr)")
        finally:
            if proc.returncode is None:
                proc.terminate()  # the child drains for drain_s, then exits
                try:
                    await asyncio.wait_for(proc.wait(), self.drain_s + _STOP_S)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def _serve(config: dict[str, Any]) -> int:
    verdicts = Verdicts.from_settings(RecheckSettings.model_validate(config["recheck"]))
    server = AdmissionServer(routes={config["route"]: lambda body: review(body, verdicts)}, **config["server"])
    loop = asyncio.get_running_loop()
    parent_gone, stop = asyncio.Event(), asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def watch_stdin() -> None:  # EOF: the operator closed its end or died (a raw read: a daemon
        while os.read(0, 1 << 12):  # thread in sys.stdin's buffer would abort the interpreter's exit)
            pass
        loop.call_soon_threadsafe(parent_gone.set)

    threading.Thread(target=watch_stdin, name="parent-watch", daemon=True).start()

    async def publish() -> None:
        async for client_config in server(None):
            sys.stdout.write(json.dumps(client_config) + "\n")
            sys.stdout.flush()

    serving = asyncio.ensure_future(publish())
    ends = [asyncio.ensure_future(parent_gone.wait()), asyncio.ensure_future(stop.wait())]
    await asyncio.wait([serving, *ends], return_when=asyncio.FIRST_COMPLETED)
    if not serving.done():  # stopped: answer on, each connection closed after its answer, then close
        server.draining = True
        await asyncio.wait([serving], timeout=server.drain_s)
    for task in (serving, *ends):
        task.cancel()
    await asyncio.gather(serving, *ends, return_exceptions=True)
    if serving.done() and not serving.cancelled() and serving.exception() is not None:
        raise serving.exception()  # type: ignore[misc]
    return 0


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = json.loads(sys.stdin.buffer.readline())
    return asyncio.run(_serve(config))
