"""Benchmark: the same chat-completion mix through sglang-router and straight to the worker pair, one run.

    PYTHONPATH=runtime:operator python bench/router.py [--requests 200] [--concurrency 4] [--rounds 2]
                                                        [--schedule interleaved|alternating]

A prefill and a decode ``pdfleet-runtime serve`` (``llama-dense``, tp 1, Mooncake over TCP on
127.0.0.1, cpu pools) and ``sglang_router.launch_router --pd-disaggregation`` (0.3.2) with the pair
given statically (``--prefill URL BOOTSTRAP_PORT --decode URL``: discovery is the cluster tests'
business) run as local processes. Two modes at the same load (``--concurrency`` requests in flight):

- ``router``: one ``POST /v1/chat/completions`` to the router, which adds ``bootstrap_host``,
  ``bootstrap_port`` and a random ``bootstrap_room`` and sends the body to both workers at once;
- ``direct``: what the router does, done by the client: the same body with those three fields to the
  prefill and the decode at once, the decode's answer kept.

Every answer is verified (``worker_client.verify_chat_answer``: the decode checked every byte and the
completion is the one derived from the room, the prompt and the bytes). ``--schedule interleaved``
(the default) sends odd requests through the router and even ones direct from the same client
threads at the same time, so both modes see the same host (on a shared 2-core host the load swings
by tens of percent between seconds); throughput per mode is then Little's law's
``concurrency / mean latency``. ``alternating`` runs whole phases of one mode, then the other, for
``--rounds`` rounds, throughput from the wall clock. Reported: p50/p99 latency and throughput per
mode, the ratios router/direct, and the router process's CPU seconds per routed request
(``/proc/PID/stat`` utime+stime over the phases with routed requests, its idle work included: an
upper bound; its idle rate over 3 s before is reported beside it). Acceptance: p99
through the router <= 1.1x direct. Writes JSON to ``--out``.
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

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.testing.local import LocalPod
from pdfleet_runtime.testing.worker_client import chat_body, verify_chat_answer

LAYOUT = "llama-dense"
MODEL = "bench"
SECRET = b"bench-router-secret-0123456789abcdef"
ACCEPT_P99_RATIO = 1.1


def _config(role: str, slots: int) -> RuntimeConfig:
    return RuntimeConfig(deployment=MODEL, namespace="default", role=role, runtime_version="0.1.0",
                         layout=LayoutRef(preset=LAYOUT), shape=ParallelShape(1), peer_shape=ParallelShape(1),
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


def _phase(pair: Pair, modes: tuple[str, ...], n: int, concurrency: int, first: int) -> dict[str, Any]:
    """``n`` requests, request ``i`` through ``modes[i % len(modes)]``: latencies per mode and the wall time."""
    def one(i: int) -> tuple[str, float, str | None]:
        mode = modes[i % len(modes)]
        return (mode, *(pair.router_once(i) if mode == "router" else pair.direct_once(i)))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, range(first, first + n)))
    wall = time.perf_counter() - t0
    problems = [p for _, _, p in out if p]
    if problems:
        raise RuntimeError(f"{len(problems)} of {n} answers failed verification, first: {problems[0]}")
    return {"latencies": {m: [x for mode, x, _ in out if mode == m] for m in modes}, "wall_s": wall}


def _summary(lat: list[float], wall: float | None, concurrency: int) -> dict[str, float]:
    """p50/p99/mean latency; throughput from the wall clock, or (interleaved: None) concurrency / mean."""
    lat = sorted(lat)
    mean = statistics.fmean(lat)
    return {"p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "mean_s": mean, "requests_per_s": len(lat) / wall if wall else concurrency / mean}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per mode per round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--schedule", choices=("interleaved", "alternating"), default="interleaved")
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
            _phase(pair, ("direct", "router"), 4 * args.concurrency, args.concurrency, 1)  # warm: connections, pages
            t0, c0 = time.perf_counter(), _cpu_s(router.pid)
            time.sleep(3.0)
            idle_rate = (_cpu_s(router.pid) - c0) / (time.perf_counter() - t0)  # health checks, timers: reported
            lat: dict[str, list[float]] = {"direct": [], "router": []}
            wall = {"direct": 0.0, "router": 0.0}
            cpu = 0.0
            phases = ([("direct", "router")] if args.schedule == "interleaved" else [("direct",), ("router",)])
            for rnd in range(args.rounds):
                for modes in phases:
                    c0 = _cpu_s(router.pid)
                    r = _phase(pair, modes, args.requests * len(modes), args.concurrency, 100_000 * (rnd + 1))
                    if "router" in modes:
                        cpu += _cpu_s(router.pid) - c0  # all of it: an upper bound (its idle work too)
                    for m in modes:
                        lat[m] += r["latencies"][m]
                        wall[m] += r["wall_s"]
                        s = _summary(r["latencies"][m], r["wall_s"] if len(modes) == 1 else None, args.concurrency)
                        print(f"round {rnd} {m:6}: p50 {s['p50_s'] * 1e3:7.1f} ms  p99 {s['p99_s'] * 1e3:7.1f} ms  "
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
    interleaved = args.schedule == "interleaved"
    res = {m: _summary(lat[m], None if interleaved else wall[m], args.concurrency) for m in lat}
    ratios = {"p50": res["router"]["p50_s"] / res["direct"]["p50_s"],
              "p99": res["router"]["p99_s"] / res["direct"]["p99_s"],
              "throughput": res["router"]["requests_per_s"] / res["direct"]["requests_per_s"]}
    ok = ratios["p99"] <= ACCEPT_P99_RATIO
    report = {"benchmark": "router", "router": "sglang-router==0.3.2", "layout": LAYOUT, "backend": "mooncake",
              "protocol": "tcp", "requests_per_mode": n, "concurrency": args.concurrency, "rounds": args.rounds,
              "schedule": args.schedule, "throughput_from": "concurrency / mean latency" if interleaved else "wall clock",
              "router_idle_cpu_s_per_s": idle_rate,
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
