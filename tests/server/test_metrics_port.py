"""Issue 46: the pod's metrics on a port of their own (``metricsPort``), which serves nothing else, so a scraper
needs no route to the worker API. A real ``serve`` process on loopback."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdfleet_runtime.testing.scrape import scrape
from tests.server.harness import Pod, config, http

pytestmark = pytest.mark.slow


def _code(method: str, url: str) -> int:
    req = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_the_metrics_port_serves_the_pods_metrics_and_nothing_else(tmp_path: Path) -> None:
    pod = Pod(tmp_path, "pre", config("prefill"), args=("--no-gate",)).start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                samples = scrape(pod.metrics_url)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{pod.metrics_url} never answered:\n{pod.log()[-2000:]}") from None
                time.sleep(0.2)
        assert pod.metrics_url.split(":")[-1] != pod.url.split(":")[-1]
        names = {k.split("{")[0] for k in samples}
        assert {"pdfleet_ready", "pdfleet_runtime_info", "pdfleet_transfers_in_flight",
                "sglang:num_running_reqs", "pdfleet_rooms_held"} <= names, sorted(names)
        # The same registry as the HTTP port's /metrics: the same families.
        assert names == {k.split("{")[0] for k in pod.metrics()}
        port = pod.metrics_url.removesuffix("/metrics")
        for method, path in (("GET", "/healthz"), ("GET", "/readyz"), ("POST", "/v1/chat/completions"),
                             ("POST", "/generate"), ("GET", "/v1/models"), ("POST", "/drain")):
            assert _code(method, port + path) == 404, (method, path)
        assert http("GET", pod.url + "/healthz", None, 10)[0] in (200, 503)  # the HTTP port is still there
    finally:
        pod.stop()
