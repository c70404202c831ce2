"""Benchmark: the validating webhook over HTTPS on loopback, side by side with an allow-all webhook.

    PYTHONPATH=runtime:operator python bench/admission.py [--requests 3000] [--concurrency 16] [--out bench/results]

One child process serves three real kopf WebhookServers with one certificate (EC P-256, TLS on
loopback, keep-alive connections as the apiserver uses):
- ``allow-all``: a stock ``kopf.WebhookServer`` whose WebhookFn allows everything (kopf's own request
  path: read, ``json.loads``, the fn, ``json_response``) -- the baseline;
- ``pdfleet``: ``AdmissionServer`` with ``review`` as deployed (verdicts cached by content);
- ``pdfleet-nocache``: the same with the cache off, so every request runs the whole
  ``validate_object`` (schema walk, CEL twins, pydantic, matrix): the worst case.

The client (this process, aiohttp) sends AdmissionReview CREATE and UPDATE requests built from the
examples (valid ones, matrix denials, warnings, an inline layout), each with its own uid, from
``--concurrency`` workers, in alternating rounds so drift hits every server alike. Targets (issue 4):
``pdfleet`` p99 at most 1.3x the allow-all's, and at least 200 admissions/s on 2 cores. Prints the
ratios, writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
P99_RATIO_TARGET = 1.3
THROUGHPUT_TARGET = 200.0
SERVERS = ("allow-all", "pdfleet", "pdfleet-nocache")
MIX = [
    ("valid", "llama-dense"), ("valid", "deepseek-mla"), ("valid", "qwen3.8-flash-next"),
    ("valid", "qwen3-next-hybrid"), ("valid", "all-fields"), ("valid", "inline-layout"),
    ("invalid", "nixl.replicated-hetero-tp"), ("invalid", "kv-heads-tp"), ("invalid", "pool-fits-gpu"),
    ("invalid", "mori.qsa-pipeline"),
]


# -- the servers (child process) ---------------------------------------------------------------------


async def _serve(cert_dir: Path) -> None:
    import kopf

    from pdfleet_operator.admission import VALIDATE_WEBHOOK_ID, AdmissionServer, Verdicts, review
    from pdfleet_operator.certs import CertificateAuthority

    ca = CertificateAuthority(cert_dir, name="bench-ca")
    pair = ca.issue("webhook", common_name="127.0.0.1")
    tls = {"certfile": pair.cert_path, "pkeyfile": pair.key_path, "cafile": ca.cert_path, "addr": "127.0.0.1"}

    async def allow_all(request: Any, **_: Any) -> dict[str, Any]:
        uid = request.get("request", {}).get("uid", "")
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": uid, "allowed": True}}

    cached, uncached = Verdicts(), Verdicts(cache_size=0)
    servers: dict[str, kopf.WebhookServer] = {
        "allow-all": kopf.WebhookServer(**tls),
        "pdfleet": AdmissionServer(routes={VALIDATE_WEBHOOK_ID: lambda b: review(b, cached)}, **tls),
        "pdfleet-nocache": AdmissionServer(routes={VALIDATE_WEBHOOK_ID: lambda b: review(b, uncached)}, **tls),
    }
    urls, gens = {}, []
    for name, server in servers.items():
        gen = server(allow_all)
        gens.append(gen)
        urls[name] = (await gen.__anext__())["url"]
    print(json.dumps({"urls": urls, "ca": str(ca.cert_path)}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    print(json.dumps({"cache": {"hits": cached.hits, "misses": cached.misses}}), flush=True)


# -- the client --------------------------------------------------------------------------------------


def _bodies() -> list[bytes]:
    """One request per example CREATE, plus UPDATEs (a scale of the valid ones); fresh uids later."""
    docs = []
    for kind, name in MIX:
        obj = yaml.safe_load((EXAMPLES / kind / f"{name}.yaml").read_text())
        obj["metadata"].update({"namespace": "bench", "uid": str(uuid.uuid4()), "generation": 1})
        docs.append({"operation": "CREATE", "object": obj})
        if kind == "valid":
            new = json.loads(json.dumps(obj))
            new["spec"]["decode"]["replicas"] += 1
            docs.append({"operation": "UPDATE", "object": new, "oldObject": obj})
    return [
        json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                    "request": {"uid": "UID-PLACEHOLDER-0000-0000-000000000000",
                                "resource": {"group": "pdfleet.io", "version": "v1alpha1",
                                             "resource": "pddeployments"},
                                "userInfo": {"username": "bench"}, **d}}).encode()
        for d in docs
    ]


async def _round(url: str, ca: str, bodies: list[bytes], n: int, concurrency: int) -> tuple[list[float], float]:
    ctx = ssl.create_default_context(cafile=ca)
    latencies: list[float] = []
    counter = iter(range(n))
    connector = aiohttp.TCPConnector(ssl=ctx, limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for i in counter:
                body = bodies[i % len(bodies)].replace(b"UID-PLACEHOLDER-0000-0000-000000000000",
                                                       str(uuid.uuid4()).encode())
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    data = await resp.read()
                latencies.append(time.perf_counter() - t0)
                if resp.status != 200 or b'"allowed"' not in data:
                    raise RuntimeError(f"{url}: HTTP {resp.status}: {data[:200]!r}")

        # warm up the connections (TLS handshakes are not what is measured)
        await asyncio.gather(*(session.post(url, data=bodies[0]) for _ in range(concurrency)))
        latencies.clear()
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return latencies, wall


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _client(urls: dict[str, str], ca: str, args: argparse.Namespace) -> dict[str, Any]:
    bodies = _bodies()
    from pdfleet_operator.admission import VALIDATE_WEBHOOK_ID

    lat: dict[str, list[float]] = {s: [] for s in SERVERS}
    walls: dict[str, float] = dict.fromkeys(SERVERS, 0.0)
    per_round = max(1, args.requests // args.rounds)
    for name in SERVERS:  # warm-up round, discarded (imports, caches, connection set-up)
        await _round(f"{urls[name]}/{VALIDATE_WEBHOOK_ID}", ca, bodies, 200, args.concurrency)
    for r in range(args.rounds):
        order = SERVERS if r % 2 == 0 else tuple(reversed(SERVERS))
        for name in order:
            xs, wall = await _round(f"{urls[name]}/{VALIDATE_WEBHOOK_ID}", ca, bodies, per_round, args.concurrency)
            lat[name] += xs
            walls[name] += wall
    out = {}
    for name in SERVERS:
        xs = lat[name]
        out[name] = {
            "requests": len(xs),
            "p50_ms": statistics.median(xs) * 1e3,
            "p99_ms": _pct(xs, 0.99) * 1e3,
            "mean_ms": statistics.fmean(xs) * 1e3,
            "throughput_per_s": len(xs) / walls[name],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="measured requests per server (default 3000)")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    with tempfile.TemporaryDirectory(prefix="pdfleet-bench-") as tmp:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", tmp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(REPO / "runtime"), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])},
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            ready = json.loads(child.stdout.readline())
            results = asyncio.run(_client(ready["urls"], ready["ca"], args))
            child.stdin.close()
            cache = json.loads(child.stdout.readline())["cache"]
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=30)
    base = results["allow-all"]
    for r in results.values():
        r["p99_ratio_to_allow_all"] = r["p99_ms"] / base["p99_ms"]
        r["p50_ratio_to_allow_all"] = r["p50_ms"] / base["p50_ms"]
    ours = results["pdfleet"]
    met = {"p99_ratio": ours["p99_ratio_to_allow_all"] <= P99_RATIO_TARGET,
           "throughput": ours["throughput_per_s"] >= THROUGHPUT_TARGET}
    print(f"admission webhook over HTTPS, concurrency {args.concurrency}, {os.cpu_count()} CPUs, "
          f"{len(_bodies())} request shapes")
    print(f"{'server':<16} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'p50 x':>7} {'p99 x':>7}")
    for name, r in results.items():
        print(f"{name:<16} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['throughput_per_s']:8.0f} "
              f"{r['p50_ratio_to_allow_all']:7.2f} {r['p99_ratio_to_allow_all']:7.2f}")
    print(f"pdfleet cache: {cache['hits']} hits, {cache['misses']} misses")
    print(f"targets: p99 <= {P99_RATIO_TARGET}x allow-all: {'met' if met['p99_ratio'] else 'MISSED'}; "
          f">= {THROUGHPUT_TARGET:.0f}/s: {'met' if met['throughput'] else 'MISSED'}")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"admission-{stamp}.json"
    path.write_text(json.dumps({
        "benchmark": "admission", "timestamp": stamp, "concurrency": args.concurrency, "cpus": os.cpu_count(),
        "machine": platform.machine(), "python": platform.python_version(), "cache": cache,
        "targets": {"p99_ratio": P99_RATIO_TARGET, "throughput_per_s": THROUGHPUT_TARGET}, "targets_met": met,
        "results": results,
    }, indent=2))
    print(f"wrote {path}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
