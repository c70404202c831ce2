"""Benchmark: the staged path's per-chunk signal over the engine against over the bootstrap's HTTP channel.

    PYTHONPATH=runtime:operator python bench/chunk_signal.py [--chunks 1000] [--configs mooncake-tcp nixl-tcp]
        [--out bench/results]

Why: chunk flow control must work between pods on different nodes (issue 27), so each chunk's
``landed`` signal and the ring's ``freed`` signal go either through the transfer engine (what
``protocol/staged.py`` does: an 8-byte write of a constant word into the decode's landed word, an
8-byte read of the decode's freed word) or through the bootstrap's HTTP channel (a signed message per
signal to the prefill pod's bootstrap server, and a long-poll from the peer). This measures one
chunk's signalling both ways, in separate processes on loopback, in the same run:

- ``engine`` (per config): a target process (the decode) registers its signal words; an initiator
  process (the prefill) connects, then per chunk ``k`` writes ``landed = k`` through the runtime's
  own ``ChunkLink.write_word``; the target sees it in its memory and sets its local ``freed = k``;
  the initiator reads ``freed`` (``ChunkLink.read_word``) until it is ``k``. The round trip is one
  chunk's full signalling (landed out, freed back); ``write_word`` alone is what the sender's loop pays
  per chunk when the ring is not full.
- ``http``: a server process with the bootstrap's stack (aiohttp on 127.0.0.1, each message a JSON
  envelope with sender, nonce and timestamp, HMAC-SHA256 signed with the deployment secret as
  ``protocol/auth.py`` signs, checked and its nonce remembered) keeps the counts; the sender POSTs
  ``landed = k`` and long-polls ``freed >= k``; the receiver long-polls ``landed >= k`` and POSTs
  ``freed = k``. Same round trip; the POST alone is the sender's per-chunk cost.

Reported: median and p90 of the round trip and of the sender's per-chunk cost, and the ratio
``http / engine`` per config. Loopback is HTTP's best case (no network hop; across nodes both gain
the link's latency, the engine's without a TCP handshake per call since its connection is kept).
Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import multiprocessing as mp
import platform
import secrets
import socket
import statistics
import time
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from pdfleet_runtime.engines import EngineConfig, PeerInfo, create_engine
from pdfleet_runtime.links import LinkProtocol

CONFIGS: dict[str, EngineConfig] = {
    "mooncake-tcp": EngineConfig("mooncake", LinkProtocol.TCP),
    "nixl-tcp": EngineConfig("nixl", LinkProtocol.TCP),
}
SECRET = b"bench-chunk-signal-secret-0123456789"
WARMUP = 50
_LANDED, _FREED = 0, 8  # word offsets (bytes) in the target's signal buffer


def _stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"median_us": statistics.median(v) * 1e6, "p90_us": v[int(0.9 * (len(v) - 1))] * 1e6,
            "mean_us": statistics.fmean(v) * 1e6, "n": len(v)}


# --------------------------------------------------------------------------- engine


def _engine_target(config: EngineConfig, conn: Connection) -> None:
    from pdfleet_runtime.records import RegionRecord

    engine = create_engine(config)
    engine.start()
    words = np.zeros(512, dtype=np.int64)  # 4 KiB: landed at 0, freed at 8
    info = engine.register([RegionRecord(words.ctypes.data, words.nbytes, "cpu")])
    conn.send({"info": info.to_wire(), "address": words.ctypes.data})
    n = conn.recv()
    for k in range(1, n + 1):
        while words[0] < k:
            time.sleep(0)
        words[1] = k  # freed: the decode's own word, read by the sender through the engine
    conn.recv()
    engine.close()


def _engine_initiator(config: EngineConfig, target: Connection, out: Connection, n: int) -> None:
    from pdfleet_runtime.engines.chunks import chunk_link
    from pdfleet_runtime.records import RegionRecord

    hello = target.recv()
    engine = create_engine(config)
    engine.start()
    counts = np.arange(n + 2, dtype=np.int64)  # constant words 0..n, as PrefillStaging's
    readback = np.zeros(32, dtype=np.int64)
    engine.register([RegionRecord(counts.ctypes.data, counts.nbytes, "cpu"),
                     RegionRecord(readback.ctypes.data, readback.nbytes, "cpu")])
    peer = engine.connect(PeerInfo.from_wire(hello["info"]))
    link = chunk_link(engine, peer)
    landed, freed = hello["address"] + _LANDED, hello["address"] + _FREED
    target.send(n)
    rtt, write, reads = [], [], 0
    for k in range(1, n + 1):
        t0 = time.perf_counter()
        link.write_word(counts.ctypes.data + 8 * k, landed)
        t1 = time.perf_counter()
        while True:
            link.read_word(readback.ctypes.data, freed)
            reads += 1
            if readback[0] >= k:
                break
        t2 = time.perf_counter()
        if k > WARMUP:
            rtt.append(t2 - t0)
            write.append(t1 - t0)
    target.send("done")
    link.close()
    engine.close()
    out.send({"round_trip": _stats(rtt), "sender_per_chunk": _stats(write), "freed_reads_per_chunk": reads / n})


def run_engine(config: EngineConfig, n: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    r_parent, r_child = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_engine_target, args=(config, b), daemon=True),
             ctx.Process(target=_engine_initiator, args=(config, a, r_child, n), daemon=True)]
    for p in procs:
        p.start()
    try:
        if not r_parent.poll(300):
            raise TimeoutError("engine initiator gave no result in 300 s")
        return r_parent.recv()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# --------------------------------------------------------------------------- HTTP (the bootstrap's channel)


def _sign(raw: bytes) -> str:
    return hmac.new(SECRET, raw, hashlib.sha256).hexdigest()


def _seal(sender: str, which: str, value: int) -> tuple[bytes, dict[str, str]]:
    raw = json.dumps({"sender": sender, "nonce": secrets.token_hex(16), "timestamp": time.time(),
                      "body": {"which": which, "value": value}}, separators=(",", ":")).encode()
    return raw, {"X-Pdfleet-Signature": _sign(raw), "Content-Type": "application/json"}


def _server(port_conn: Connection) -> None:
    from aiohttp import web

    counts = {"landed": 0, "freed": 0}
    changed: asyncio.Condition | None = None
    nonces: set[str] = set()

    async def signal(request: web.Request) -> web.Response:
        raw = await request.read()
        if not hmac.compare_digest(_sign(raw).encode(), request.headers.get("X-Pdfleet-Signature", "").encode()):
            return web.json_response({"error": "bad signature"}, status=401)
        env = json.loads(raw)
        if env["nonce"] in nonces or abs(time.time() - env["timestamp"]) > 30:
            return web.json_response({"error": "replayed or stale"}, status=409)
        nonces.add(env["nonce"])
        body = env["body"]
        assert changed is not None
        async with changed:
            counts[body["which"]] = max(counts[body["which"]], int(body["value"]))
            changed.notify_all()
        return web.json_response({"ok": True})

    async def wait(request: web.Request) -> web.Response:  # long-poll: answers once the count reaches ``at``
        which, at = request.query["which"], int(request.query["at"])
        assert changed is not None
        async with changed:
            await asyncio.wait_for(changed.wait_for(lambda: counts[which] >= at), 30)
            value = counts[which]
        raw = json.dumps({"which": which, "value": value}).encode()
        return web.Response(body=raw, headers={"X-Pdfleet-Signature": _sign(raw)})

    async def main() -> None:
        nonlocal changed
        changed = asyncio.Condition()
        app = web.Application()
        app.router.add_post("/signal", signal)
        app.router.add_get("/wait", wait)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock)
        await site.start()
        port_conn.send(sock.getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, port_conn.recv)
        await runner.cleanup()

    asyncio.run(main())


async def _wait_for(session: Any, url: str, which: str, at: int) -> int:
    async with session.get(f"{url}/wait", params={"which": which, "at": str(at)}) as resp:
        raw = await resp.read()
        if not hmac.compare_digest(_sign(raw).encode(), resp.headers.get("X-Pdfleet-Signature", "").encode()):
            raise RuntimeError("unsigned answer")
        return int(json.loads(raw)["value"])


async def _post(session: Any, url: str, sender: str, which: str, value: int) -> None:
    raw, headers = _seal(sender, which, value)
    async with session.post(f"{url}/signal", data=raw, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"signal refused: {resp.status} {await resp.text()}")


def _http_peer(role: str, port: int, n: int, out: Connection) -> None:
    import aiohttp

    async def main() -> dict[str, Any]:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as s:
            rtt, post = [], []
            for k in range(1, n + 1):
                if role == "receiver":
                    await _wait_for(s, url, "landed", k)
                    await _post(s, url, "decode", "freed", k)
                    continue
                t0 = time.perf_counter()
                await _post(s, url, "prefill", "landed", k)
                t1 = time.perf_counter()
                await _wait_for(s, url, "freed", k)
                t2 = time.perf_counter()
                if k > WARMUP:
                    rtt.append(t2 - t0)
                    post.append(t1 - t0)
            return {"round_trip": _stats(rtt), "sender_per_chunk": _stats(post)} if role == "sender" else {}

    out.send(asyncio.run(main()))


def run_http(n: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    srv_parent, srv_child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(srv_child,), daemon=True)
    server.start()
    port = srv_parent.recv()
    s_parent, s_child = ctx.Pipe(duplex=False)
    r_parent, r_child = ctx.Pipe(duplex=False)
    peers = [ctx.Process(target=_http_peer, args=("receiver", port, n, r_child), daemon=True),
             ctx.Process(target=_http_peer, args=("sender", port, n, s_child), daemon=True)]
    for p in peers:
        p.start()
    try:
        if not s_parent.poll(300):
            raise TimeoutError("HTTP sender gave no result in 300 s")
        result = s_parent.recv()
        if not r_parent.poll(30):
            raise TimeoutError("HTTP receiver did not finish")
        r_parent.recv()
        return result
    finally:
        srv_parent.send("stop")
        for p in [*peers, server]:
            p.join(10)
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=1000)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    n = args.chunks + WARMUP
    http = run_http(n)
    print(f"http (bootstrap channel, loopback): round trip {http['round_trip']['median_us']:.0f} us median "
          f"(p90 {http['round_trip']['p90_us']:.0f}), sender per chunk {http['sender_per_chunk']['median_us']:.0f} us")
    engines: dict[str, Any] = {}
    for name in args.configs:
        r = engines[name] = run_engine(CONFIGS[name], n)
        r["http_over_engine"] = {"round_trip": http["round_trip"]["median_us"] / r["round_trip"]["median_us"],
                                 "sender_per_chunk": http["sender_per_chunk"]["median_us"]
                                 / r["sender_per_chunk"]["median_us"]}
        print(f"{name}: round trip {r['round_trip']['median_us']:.0f} us median (p90 {r['round_trip']['p90_us']:.0f}), "
              f"sender per chunk {r['sender_per_chunk']['median_us']:.0f} us; http/engine: round trip "
              f"{r['http_over_engine']['round_trip']:.1f}x, sender {r['http_over_engine']['sender_per_chunk']:.1f}x")
    result = {"benchmark": "chunk_signal", "time": datetime.now(UTC).isoformat(), "host": platform.node(),
              "cpus": mp.cpu_count(), "chunks": args.chunks, "warmup": WARMUP, "http": http, "engines": engines}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"chunk_signal-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
