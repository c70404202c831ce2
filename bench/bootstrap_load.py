"""Load test: a prefill pod's bootstrap process over loopback HTTP, at its caps and with a restarting rank.

    PYTHONPATH=runtime:. python bench/bootstrap_load.py [--max-requests 5000] [--decodes 300] [--out bench/results]

The bootstrap runs in its own process (``BootstrapServer`` as ``serve`` runs it: signed messages,
the rank key, paging, the HTTP bounds); this process plays the pod's prefill rank (signing with
the pod's rank key) and decode ranks (the deployment key), through ``BootstrapClient``.

1. **Queue cap**: one decode rank sends ``--max-requests`` small requests (the configured
   ``maxRequests``), then as many again: the excess must be refused ``busy`` with the cap named.
   The rank then drains its events page by page (reply sizes, latency per poll), reports every
   request Success, and once the finished entries expire a new request is accepted (nothing wedged).
2. **Restarting rank**: ``--decodes`` decode ranks (``qwen3.8-flash-next`` registrations) register;
   the rank takes them, then restarts (registers again) and must take all of them anew, in pages
   under the 4 MiB reply limit (before paging, one reply of ~4.7 MB at 300 ranks wedged it).

Writes JSON (``bootstrap-load-<time>.json``); exits 1 if a check fails (wedged, wrong refusal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.keys import new_rank_key
from pdfleet_runtime.protocol.messages import (
    WIRE,
    Hello,
    PrefillPoll,
    PrefillWork,
    RankKey,
    Role,
    StatusQuery,
    StatusReply,
    StatusReport,
    StatusReports,
)
from pdfleet_runtime.protocol.states import RequestState
from pdfleet_runtime.protocol.virtual import decode_register, prefill_register, transfer_request
from pdfleet_runtime.records import ParallelShape

SECRET = b"bench-bootstrap-load-secret-0123456789"
S1 = ParallelShape(1, 1)
ME = RankKey(tp=0, pp=0)


def _bootstrap(conn: Connection, limits: dict[str, Any], rank_key: bytes) -> None:
    async def main() -> None:
        server = BootstrapServer(BootstrapState(S1, limits=BootstrapLimits(**limits)),
                                 Codec(SECRET, "bench-prefill-0", rank_key=rank_key))
        ep = await server.start()
        conn.send(ep.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send({"refused": {k.value: v for k, v in server.refused.items()}})
        await server.stop()

    asyncio.run(main())


class Pod:
    """A bootstrap process and its rank key."""

    def __init__(self, limits: dict[str, Any]) -> None:
        self.rank_key = new_rank_key()
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_bootstrap, args=(child, limits, self.rank_key), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise SystemExit("the bootstrap process did not start")
        self.ep = Endpoint("127.0.0.1", self.conn.recv())

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def rank(self, name: str = "bench-prefill-0-0-0") -> BootstrapClient:
        return BootstrapClient(self.ep, Codec(SECRET, name, rank_key=self.rank_key))

    def stop(self) -> dict[str, Any]:
        self.conn.send("stop")
        out = self.conn.recv() if self.conn.poll(10) else {}
        self.proc.join(10)
        return out


async def decode_client(ep: Endpoint, instance: str, layout: str = "llama-dense") -> BootstrapClient:
    c = BootstrapClient(ep, Codec(SECRET, f"{instance}-0-0"))
    await c.call(Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance=instance), timeout_s=10)
    await c.call(decode_register(S1, 0, 0, instance=instance, layout=PRESETS[layout]), timeout_s=10)
    return c


async def drain(rank: BootstrapClient, ack: int = 0, tag: str = "") -> tuple[int, list[dict[str, Any]]]:
    """Poll until no page is left; per poll: latency, reply bytes, events, acknowledged so far."""
    polls: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        work = (await rank.call(PrefillPoll(rank=ME, ack=ack, siblings_tag=tag), timeout_s=30)).body
        ms = (time.perf_counter() - t0) * 1e3
        assert isinstance(work, PrefillWork)
        if work.events:
            ack = work.events[-1].seq
        tag = work.siblings_tag
        polls.append({"ms": round(ms, 2), "bytes": len(work.model_dump_json()), "events": len(work.events),
                      "acked": ack, "atS": round(time.perf_counter() - t_start, 3)})
        if not work.more:
            return ack, polls


def summary(polls: list[dict[str, Any]]) -> dict[str, Any]:
    ms = [p["ms"] for p in polls]
    return {"polls": len(polls), "events": sum(p["events"] for p in polls), "maxReplyBytes": max(p["bytes"] for p in polls),
            "msPerPollMedian": round(statistics.median(ms), 2), "msPerPollMax": max(ms),
            "seconds": polls[-1]["atS"]}


async def send_all(dec: BootstrapClient, ids: list[str], concurrency: int = 32) -> tuple[int, dict[str, int], str, list[float]]:
    sem, refused, lat = asyncio.Semaphore(concurrency), {}, []
    accepted, reason = 0, ""

    async def one(rid: str) -> None:
        nonlocal accepted, reason
        async with sem:
            t0 = time.perf_counter()
            try:
                await dec.call(transfer_request(rid).model_copy(update={"timeout_s": 600.0}), timeout_s=30)
                accepted += 1
            except ProtocolError as e:
                refused[e.code.value] = refused.get(e.code.value, 0) + 1
                reason = reason or e.reason
            lat.append((time.perf_counter() - t0) * 1e3)

    await asyncio.gather(*(one(r) for r in ids))
    return accepted, refused, reason, lat


async def queue_cap(n: int) -> dict[str, Any]:
    pod = Pod({"max_requests": n, "max_events": 2 * n + 16, "retain_s": 2.0})
    rank = pod.rank()
    checks: dict[str, bool] = {}
    try:
        await rank.call(prefill_register(S1, 0, 0), timeout_s=10)
        dec = await decode_client(pod.ep, "dec")
        t0 = time.perf_counter()
        ok, refused, _, lat = await send_all(dec, [f"r{i}" for i in range(n)])
        fill_s = time.perf_counter() - t0
        ok2, refused2, reason2, _ = await send_all(dec, [f"x{i}" for i in range(n)])
        checks["maxAccepted"] = ok == n and not refused
        checks["excessRefusedBusyNamingTheCap"] = ok2 == 0 and refused2 == {"busy": n} and "maxRequests" in reason2
        ack, polls = await drain(rank)
        checks["rankTookEveryEvent"] = ack == n + 1  # the decode registration and n requests
        t1 = time.perf_counter()
        for i in range(0, n, 512):
            reports = tuple(StatusReport(request_id=f"r{j}", instance="dec", src=ME, dst=ME,
                                         state=RequestState.SUCCESS) for j in range(i, min(n, i + 512)))
            await rank.call(StatusReports(reports=reports), timeout_s=30)
        report_s = time.perf_counter() - t1
        # The last one reported (earlier ones may already be gone: finished entries stay retain_s, 2 s here).
        q = (await dec.call(StatusQuery(instance="dec", dst=ME, request_ids=(f"r{n - 1}",)), timeout_s=10)).body
        checks["decodeSeesSuccess"] = isinstance(q, StatusReply) and [r.state for r in q.reports] == [
            RequestState.SUCCESS]
        await asyncio.sleep(2.5)  # finished entries expire (retain_s 2): room again
        again, _, _, _ = await send_all(dec, ["after-expiry"])
        checks["acceptsAgainAfterExpiry"] = again == 1
        rss = pod.rss_mib()
        await dec.close()
    finally:
        await rank.close()
        server = pod.stop()
    return {"maxRequests": n, "accepted": ok, "fillSeconds": round(fill_s, 3),
            "msPerRequestMedian": round(statistics.median(lat), 2), "excess": {"sent": n, "refused": refused2,
                                                                              "reason": reason2},
            "drain": summary(polls), "reportSeconds": round(report_s, 3), "bootstrapRssMiB": round(rss, 1),
            "serverRefused": server.get("refused"), "checks": checks}


async def restarting_rank(decodes: int, layout: str) -> dict[str, Any]:
    pod = Pod({})
    rank = pod.rank()
    checks: dict[str, bool] = {}
    try:
        await rank.call(prefill_register(S1, 0, 0), timeout_s=10)
        sem = asyncio.Semaphore(16)

        async def reg(i: int) -> None:
            async with sem:
                c = await decode_client(pod.ep, f"dec{i:03d}", layout)
                await c.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(reg(i) for i in range(decodes)))
        register_s = time.perf_counter() - t0
        size = len(decode_register(S1, 0, 0, instance="dec000", layout=PRESETS[layout]).model_dump_json())
        ack, first = await drain(rank)
        checks["firstIncarnationTookEveryDecode"] = ack == decodes
        await rank.close()
        rank = pod.rank("bench-prefill-0-0-0")  # the rank restarted: a new process, same pod
        await rank.call(prefill_register(S1, 0, 0), timeout_s=10)
        ack2, again = await drain(rank)
        checks["restartedRankTookEveryDecode"] = ack2 - ack == decodes and sum(p["events"] for p in again) == decodes
        checks["everyReplyUnder4MiB"] = max(p["bytes"] for p in first + again) < 4 << 20
        rss = pod.rss_mib()
    finally:
        await rank.close()
        pod.stop()
    return {"decodeRanks": decodes, "layout": layout, "decodeRegisterBytes": size,
            "registerSeconds": round(register_s, 3), "firstIncarnation": summary(first),
            "afterRestart": summary(again), "afterRestartPolls": again, "bootstrapRssMiB": round(rss, 1),
            "checks": checks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-requests", type=int, default=5000)
    ap.add_argument("--decodes", type=int, default=300)
    ap.add_argument("--layout", default="qwen3.8-flash-next")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    a = ap.parse_args()
    cap = asyncio.run(queue_cap(a.max_requests))
    print(f"queue cap {a.max_requests}: accepted {cap['accepted']} in {cap['fillSeconds']}s "
          f"({cap['msPerRequestMedian']} ms median); excess {cap['excess']['refused']}: {cap['excess']['reason'][:90]}")
    print(f"  rank drained {cap['drain']['events']} events in {cap['drain']['polls']} polls, largest reply "
          f"{cap['drain']['maxReplyBytes']} B, {cap['drain']['msPerPollMedian']} ms median per poll; checks "
          f"{cap['checks']}")
    rr = asyncio.run(restarting_rank(a.decodes, a.layout))
    print(f"{a.decodes} decode ranks ({rr['decodeRegisterBytes']} B each): after the rank's restart "
          f"{rr['afterRestart']['events']} events in {rr['afterRestart']['polls']} polls, largest reply "
          f"{rr['afterRestart']['maxReplyBytes']} B, {rr['afterRestart']['msPerPollMedian']} ms median per poll, "
          f"done in {rr['afterRestart']['seconds']}s; checks {rr['checks']}")
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = a.out / f"bootstrap-load-{stamp}.json"
    out.write_text(json.dumps({"bench": "bootstrap-load", "at": stamp, "queueCap": cap, "restartingRank": rr},
                              indent=2, sort_keys=True))
    print(f"wrote {out}")
    if not all([*cap["checks"].values(), *rr["checks"].values()]):
        sys.exit(1)


if __name__ == "__main__":
    main()
