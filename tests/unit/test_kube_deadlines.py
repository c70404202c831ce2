"""Every Kubernetes API call has a deadline (issue 26, item 3).

An endpoint on 127.0.0.1 that accepts connections and never answers stands in for a hung
apiserver (or a half-open connection). The runtime's gate writer and the operator's reconcile pass
(observe, apply, status), both with the clients they build in production, must fail within the
deadline rather than block, and the PDDeployment's lock must be free again afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from pdfleet_operator import handlers
from pdfleet_operator.reconcile import Reconciler
from pdfleet_runtime.config import READINESS_GATE
from pdfleet_runtime.pod.gate import KubeGate

# The calls must give up well before this; the unfixed code was still blocked after 30 s.
BOUND_S = 30.0


class Silent:
    """A TCP listener that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.accepted.append(conn)

    def close(self) -> None:
        """Closing the accepted sockets ends any call still blocked on them (the unfixed code)."""
        for conn in self.accepted:
            with contextlib.suppress(OSError):
                conn.close()
        self.sock.close()


@pytest.fixture(params=["http", "https"])
def silent_kubeconfig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """http: the request is sent and no response comes; https: the TLS handshake never completes."""
    server = Silent()
    cluster: dict[str, object] = {"server": f"{request.param}://127.0.0.1:{server.port}"}
    if request.param == "https":
        cluster["insecure-skip-tls-verify"] = True
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "silent",
           "clusters": [{"name": "silent", "cluster": cluster}],
           "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
           "contexts": [{"name": "silent", "context": {"cluster": "silent", "user": "u"}}]}
    path = tmp_path / "kubeconfig.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        yield path
    finally:
        server.close()


def _in_thread(fn, bound: float) -> tuple[bool, BaseException | None, float]:
    """Run ``fn`` in a daemon thread; (finished within ``bound``, what it raised, seconds taken)."""
    out: dict[str, BaseException | None] = {"exc": None}

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            out["exc"] = exc

    t0 = time.monotonic()
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(bound)
    return not t.is_alive(), out["exc"], time.monotonic() - t0


def test_gate_writer_and_reconcile_fail_within_the_deadline(
    silent_kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both at once (each waits out its own deadline; together they take one)."""
    gate = KubeGate.from_kubeconfig(silent_kubeconfig, "default", "pod-0", READINESS_GATE)
    # The operator's own client factory reads KUBECONFIG (the kubernetes package reads it at import).
    monkeypatch.setenv("KUBECONFIG", str(silent_kubeconfig))
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(silent_kubeconfig))
    lock_free: dict[str, bool] = {}

    async def one_pass() -> None:
        reconciler = Reconciler(handlers._api_client(), lambda obj: ([], {}))  # as the startup handler does
        try:
            await reconciler.reconcile("default", "demo", logging.getLogger("test"))
        finally:
            lock_free["after"] = not reconciler._locks[("default", "demo")].locked()

    with ThreadPoolExecutor(2) as pool:
        gate_run = pool.submit(_in_thread, lambda: asyncio.run(gate.set(True, "TransferPathVerified", "ok")), BOUND_S)
        pass_run = pool.submit(_in_thread, lambda: asyncio.run(one_pass()), BOUND_S)
        (done, exc, took), (p_done, p_exc, p_took) = gate_run.result(), pass_run.result()
    assert done, f"the gate write was still blocked after {BOUND_S:.0f}s"
    assert exc is not None and took < BOUND_S, (exc, took)
    assert p_done, f"the reconcile pass was still blocked after {BOUND_S:.0f}s (holding its PDDeployment's lock)"
    assert p_exc is not None and not isinstance(p_exc, TimeoutError | asyncio.CancelledError), (p_exc, p_took)
    assert lock_free.get("after"), "the PDDeployment's lock is still held after the failed pass"


def test_kopf_own_calls_get_the_same_deadlines() -> None:
    from pdfleet_operator.settings import OperatorSettings
    from pdfleet_runtime.kubeapi import DEFAULT_DEADLINES

    s = OperatorSettings().kopf_settings()
    assert s.networking.request_timeout == DEFAULT_DEADLINES.total_s
    assert s.networking.connect_timeout == s.watching.connect_timeout == DEFAULT_DEADLINES.connect_s
    assert s.watching.server_timeout is not None and s.watching.client_timeout > s.watching.server_timeout


def test_a_watch_gets_only_the_connect_deadline(silent_kubeconfig: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch is silent while nothing changes: a read deadline would cut it (tests watch pods)."""
    from kubernetes.client import ApiClient

    from pdfleet_runtime.kubeapi import DEFAULT_DEADLINES, api_client

    seen: list[object] = []
    monkeypatch.setattr(ApiClient, "call_api", lambda self, *a, _request_timeout=None, **k: seen.append(_request_timeout))
    client = api_client(silent_kubeconfig)
    client.call_api("GET", "https://x/api/v1/namespaces/n/pods?watch=True&timeoutSeconds=900")
    client.call_api("GET", "https://x/api/v1/namespaces/n/pods")
    client.call_api("GET", "https://x/api/v1/namespaces/n/pods", _request_timeout=3)
    assert seen == [(DEFAULT_DEADLINES.connect_s, None), DEFAULT_DEADLINES.request_timeout, 3]
