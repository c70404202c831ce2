"""Benchmark: the same chat-completion mix through sglang-router and straight to the worker pair, one run.

    PYTHONPATH=runtime:operator python bench/router.py [--requests 200] [--concurrency 4] [--rounds 2]

A prefill and a decode ``pdfleet-runtime serve`` (``llama-dense``, tp 1, Mooncake over TCP on
127.0.0.1, cpu pools) and ``sglang_router.launch_router --pd-disaggregation`` (0.3.2) with the pair
given statically (``--prefill URL BOOTSTRAP_PORT --decode URL``: discovery is the cluster tests'
business) run as local processes. Two modes at the same load (``--concurrency`` requests in flight):

- ``router``: one ``POST /v1/chat/completions`` to the router, which adds ``bootstrap_host``,
  ``bootstrap_port`` and a random ``bootstrap_room`` and sends the body to both workers at once;
- ``direct``: what the router does, done by the client: the same body with those three fields to the
  prefill and the decode at once, the decode's answer kept.

Every answer is verified (``worker_client.verify_chat_answer``: the decode checked every byte and the
completion is the one derived from the room, the prompt and the bytes). The modes alternate for
``--rounds`` rounds so drift on a shared host hits both. Reported: p50/p99 latency and throughput
per mode, the ratios router/direct, and the router process's CPU seconds per request
(``/proc/PID/stat`` utime+stime over its rounds). Acceptance: p99 through the router <= 1.1x direct.
Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests

from pdfleet_runtime.config import RoleShape, RuntimeConfig
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.server.local import LocalPod
from pdfleet_runtime.server.worker_client import chat_body, verify_chat_answer

LAYOUT = "llama-dense"
MODEL = "bench"
SECRET = b"bench-router-secret-0123456789abcdef"
ACCEPT_P99_RATIO = 1.1


def _config(role: str, slots: int) -> RuntimeConfig:
    return RuntimeConfig(deployment=MODEL, namespace="default", role=role, runtime_version="0.1.0",
                         layout=LayoutRef(preset=LAYOUT), shape=RoleShape(tensor=1), peer_shape=RoleShape(tensor=1),
                         backend="mooncake", protocol="tcp", max_concurrent_requests=slots, kv_tokens=2048,
                         prefill_service="bench-prefill", secret_path=Path("/unused"), drain_timeout_seconds=60,
                         device="cpu")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Pair:
    """The two modes' one request each: ``(seconds, problem or None)``."""

    def __init__(self, pre: LocalPod, dec: LocalPod, router_url: str) -> None:
        host, _, port = pre.bootstrap.rpartition(":")
        self.pre, self.dec, self.router, self.boot = pre.url, dec.url, router_url, (host, int(port))
        self._local = threading.local()  # one keep-alive session per client thread, in both modes
        self.side = ThreadPoolExecutor(32)

    def _post(self, url: str, body: dict[str, Any]) -> requests.Response:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s.post(url, json=body, timeout=120)

    def router_once(self, i: int) -> tuple[float, str | None]:
        body = chat_body(MODEL, i)
        t0 = time.perf_counter()
        r = self._post(self.router + "/v1/chat/completions", body)
        dt = time.perf_counter() - t0
        return dt, (f"HTTP {r.status_code}: {r.text[:200]}" if r.status_code != 200 else verify_chat_answer(body, r.json()))

    def direct_once(self, i: int) -> tuple[float, str | None]:
        body = chat_body(MODEL, i)
        full = {**body, "bootstrap_host": self.boot[0], "bootstrap_port": self.boot[1],
                "bootstrap_room": random.getrandbits(63)}
        t0 = time.perf_counter()
        pre = self.side.submit(self._post, self.pre + "/v1/chat/completions", full)
        d = self._post(self.dec + "/v1/chat/completions", full)
        p = pre.result()
        dt = time.perf_counter() - t0
        if d.status_code != 200 or p.status_code != 200:
            return dt, f"HTTP decode {d.status_code} prefill {p.status_code}: {d.text[:200]} {p.text[:200]}"
        return dt, verify_chat_answer(body, d.json())


def _answers(pair: Pair) -> str | None:
    try:
        return pair.router_once(0)[1]
    except requests.ConnectionError as e:
        return str(e)


def _phase(fn: Any, n: int, concurrency: int, first: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(fn, range(first, first + n)))
    wall = time.perf_counter() - t0
    problems = [p for _, p in out if p]
    if problems:
        raise RuntimeError(f"{len(problems)} of {n} answers failed verification, first: {problems[0]}")
    return {"latencies": [x for x, _ in out], "wall_s": wall}


def _summary(lat: list[float], wall: float, n: int) -> dict[str, float]:
    lat = sorted(lat)
    return {"p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "mean_s": statistics.fmean(lat), "requests_per_s": n / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per mode per round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    slots = 2 * args.concurrency + 2
    with tempfile.TemporaryDirectory(prefix="pdfleet-bench-router-") as tmp:
        work = Path(tmp)
        pre = LocalPod(work, "bench-prefill", _config("prefill", slots), SECRET).start()
        dec = LocalPod(work, "bench-decode", _config("decode", slots), SECRET,
                       args=("--canary-period", "600", "--retry-period", "0.5"),
                       env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap}).start()
        port, mport = _port(), _port()
        boot_port = pre.bootstrap.rpartition(":")[2]
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
               "--prefill", pre.url, boot_port, "--decode", dec.url,
               "--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--log-level", "warn"]
        router = None
        try:
            dec.wait_ready(True, 300)
            # The router fetches a tokenizer for the served model from HF_ENDPOINT (huggingface.co by default):
            # pointed at a closed loopback port, nothing here connects beyond 127.0.0.1 (it routes without one).
            env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}
            router = subprocess.Popen(cmd, stdout=(work / "router.log").open("wb"), stderr=subprocess.STDOUT, env=env)
            url = f"http://127.0.0.1:{port}"
            pair = Pair(pre, dec, url)
            deadline = time.monotonic() + 60
            while _answers(pair) is not None:  # listening, its workers registered and answering
                if time.monotonic() > deadline or router.poll() is not None:
                    raise RuntimeError(f"the router never answered:\n{(work / 'router.log').read_text()[-3000:]}")
                time.sleep(0.5)
            for fn in (pair.direct_once, pair.router_once):  # warm: connections, first-touch pages
                _phase(fn, 2 * args.concurrency, args.concurrency, 1)
            lat: dict[str, list[float]] = {"direct": [], "router": []}
            wall = {"direct": 0.0, "router": 0.0}
            cpu = 0.0
            for rnd in range(args.rounds):
                for mode in ("direct", "router"):
                    c0 = _cpu_s(router.pid)
                    r = _phase(pair.direct_once if mode == "direct" else pair.router_once, args.requests,
                               args.concurrency, 1000 * (rnd + 1))
                    if mode == "router":
                        cpu += _cpu_s(router.pid) - c0
                    lat[mode] += r["latencies"]
                    wall[mode] += r["wall_s"]
                    s = _summary(r["latencies"], r["wall_s"], args.requests)
                    print(f"round {rnd} {mode:6}: p50 {s['p50_s'] * 1e3:7.1f} ms  p99 {s['p99_s'] * 1e3:7.1f} ms  "
                          f"{s['requests_per_s']:6.1f} req/s", flush=True)
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as resp:
                retries = sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                              if line.startswith("smg_worker_retries_total"))
        finally:
            if router is not None:
                router.terminate()
                router.wait(10)
            dec.stop()
            pre.stop()
    n = args.requests * args.rounds
    res = {m: _summary(lat[m], wall[m], n) for m in lat}
    ratios = {"p50": res["router"]["p50_s"] / res["direct"]["p50_s"],
              "p99": res["router"]["p99_s"] / res["direct"]["p99_s"],
              "throughput": res["router"]["requests_per_s"] / res["direct"]["requests_per_s"]}
    ok = ratios["p99"] <= ACCEPT_P99_RATIO
    report = {"benchmark": "router", "router": "sglang-router==0.3.2", "layout": LAYOUT, "backend": "mooncake",
              "protocol": "tcp", "requests_per_mode": n, "concurrency": args.concurrency, "rounds": args.rounds,
              "host": {"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count()},
              "results": res, "ratios_router_over_direct": ratios,
              "router_cpu_s_per_request": cpu / n, "router_retries": retries, "every_answer_verified": True,
              "acceptance": {"p99_ratio_max": ACCEPT_P99_RATIO, "passed": ok}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"router-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(report, indent=1, sort_keys=True))
    print(f"router/direct: p50 {ratios['p50']:.3f}x, p99 {ratios['p99']:.3f}x, throughput {ratios['throughput']:.3f}x;"
          f" router CPU {cpu / n * 1e3:.2f} ms per request; retries {retries:g}; "
          f"acceptance p99 <= {ACCEPT_P99_RATIO}x: {'PASS' if ok else 'FAIL'}; wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
