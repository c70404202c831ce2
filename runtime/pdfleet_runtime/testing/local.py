"""``LocalPod``: one ``pdfleet-runtime serve`` as a local process on loopback, and its HTTP surface.

For tests and benchmarks without a cluster (the cluster's pods each have their own IP): it writes a runtime config (as the operator would)
and the deployment secret, starts ``python -m pdfleet_runtime serve`` in its own process group
with a port offset (many pods share 127.0.0.1), keeps its log, and stops it (SIGTERM, then SIGKILL
of the group after a bound, so no rank process outlives it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdfleet_runtime.config import (
    ADMIN_PORT,
    BOOTSTRAP_PORT,
    ENGINE_PORT,
    GROUP_PORT,
    HTTP_PORT,
    METRICS_PORT,
    RuntimeConfig,
)
from pdfleet_runtime.lifetime import die_with_parent

__all__ = ["REPO", "LocalPod", "free_offset", "http", "metric"]

REPO = Path(__file__).resolve().parents[3]
"""The source tree when run from a checkout (its runtime/ goes on the pod process's PYTHONPATH)."""


def free_offset() -> int:
    """A port offset whose HTTP, admin, group, bootstrap and first engine ports are free now.

    Every port stays below the kernel's ephemeral range: there, any process's outgoing connection (or a
    decode's own retries to a prefill address nobody listens on yet, which can connect to itself) may take
    the port between this check and the pod's bind. Offsets are multiples of ``_STRIDE``, so no port of one
    pod is a port of another pod's offset (a group member's HTTP port was its leader's admin port when their
    random offsets differed by one, before either had bound: CI, 2026-12-07), and this process never hands out
    an offset twice. Random, so concurrent tests rarely pick the same."""
    low = _ephemeral_low()
    top = low - ENGINE_PORT - _RANKS
    if top <= 2_000:
        raise RuntimeError(f"the ephemeral port range starts at {low}: no room below it for a pod's ports "
                           f"(engine ports start at {ENGINE_PORT}); raise net.ipv4.ip_local_port_range")
    rng = random.Random()
    slots = [o for o in range(-(-1_000 // _STRIDE) * _STRIDE, top, _STRIDE) if o not in _HANDED_OUT]
    for offset in rng.sample(slots, min(200, len(slots))):
        if all(_free(p + offset) for p in _PORTS):
            _HANDED_OUT.add(offset)
            return offset
    raise RuntimeError("no free port offset")


_RANKS = 8
"""Engine ports checked free (rank r uses ENGINE_PORT + r; local pods have fewer ranks)."""
_PORTS = (HTTP_PORT, METRICS_PORT, ADMIN_PORT, GROUP_PORT, BOOTSTRAP_PORT, *range(ENGINE_PORT, ENGINE_PORT + _RANKS))
_STRIDE = next(s for s in range(_RANKS + 1, 1_000) if all((a - b) % s for a in _PORTS for b in _PORTS if a != b))
"""The smallest step between offsets for which no two ports of a pod differ by a multiple of it (24 today)."""
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port the kernel hands out for outgoing connections (Linux's default when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LocalPod:
    """One ``serve`` process; ``start`` returns it, ``stop`` ends it and its rank processes."""

    def __init__(self, workdir: Path, name: str, cfg: RuntimeConfig, secret: bytes, *, offset: int | None = None,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None, worker_key: str | None = None) -> None:
        """``worker_key``: the worker API wants it (``workerKeyPath``), as in a cluster; this pod's own calls
        (``get``, ``post``, ``synthetic``) send it."""
        self.name, self.workdir = name, workdir
        self.offset = free_offset() if offset is None else offset
        secret_file = workdir / "secret"
        secret_file.write_bytes(secret)
        update: dict[str, Any] = {"secret_path": secret_file}
        self.worker_key = worker_key
        if worker_key is not None:
            key_file = workdir / f"{name}-worker-key"
            key_file.write_text(worker_key)
            update["worker_key_path"] = key_file
        self.cfg = cfg.model_copy(update=update)
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(self.cfg.to_yaml())
        self.log_path = workdir / f"{name}.log"
        self.args, self.extra_env = args, env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.http_port + self.offset}"

    @property
    def metrics_url(self) -> str:
        """The metrics port's ``/metrics`` (the port that serves nothing else)."""
        return f"http://127.0.0.1:{self.cfg.metrics_port + self.offset}/metrics"

    @property
    def admin_url(self) -> str:
        """The admin port (drain, cancel): loopback only, as inside a pod."""
        return f"http://127.0.0.1:{self.cfg.admin_port + self.offset}"

    def admin(self, method: str, path: str, timeout_s: float = 60.0) -> tuple[int, Any]:
        return http(method, self.admin_url + path, None, timeout_s)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.cfg.bootstrap_port + self.offset}"

    def start(self) -> LocalPod:
        path = os.pathsep.join(filter(None, [str(REPO / "runtime"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path,
               "POD_NAME": self.name, "PDFLEET_PORT_OFFSET": str(self.offset), "MC_LOG_LEVEL": "WARNING",
               **self.extra_env}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "pdfleet_runtime", "serve", "--config",
                                      str(self.config_path), "--bind", "127.0.0.1", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)  # a killed test run leaves no pod behind
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL of the whole process group (the rank processes too)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(timeout_s) is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a rank process left behind by a crash
        self.proc = None

    # ------------------------------------------------------------------ HTTP

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, Any]:
        return http("GET", self.url + path, None, timeout_s, key=self.worker_key)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> tuple[int, Any]:
        return http("POST", self.url + path, body, timeout_s, key=self.worker_key)

    def synthetic(self, tokens: int = 32, timeout_s: float = 30.0, **kw: Any) -> tuple[int, Any]:
        return self.post("/v1/synthetic", {"tokens": tokens, "timeoutS": timeout_s, **kw}, timeout_s + 30)

    def readyz(self) -> dict[str, Any]:
        code, body = self.get("/readyz")
        return body if isinstance(body, dict) else {"ready": False, "reason": f"HTTP {code}: {body}"}

    def metrics(self) -> dict[str, float]:
        """Every sample as ``name{label=value,...}`` -> value, through prometheus_client's text parser."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def wait_ready(self, want: bool = True, timeout_s: float = 60.0,
                   until: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                body = self.readyz()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                body = {}
            if body.get("ready") is want and (until is None or until(body)):
                return body
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: readiness never became {want} (last: {body})\n{self.log()[-3000:]}")


def http(method: str, url: str, body: dict[str, Any] | None, timeout_s: float, *,
         key: str | None = None) -> tuple[int, Any]:
    """One call; ``key``: sent as ``Authorization: Bearer`` (the worker key)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of one sample (0 when absent: a counter that never moved)."""
    key = f"{name}{{{','.join(f'{k}={v}' for k, v in sorted(labels.items()))}}}"
    return samples.get(key, 0.0)
