"""Probe the nvlink path before the long runs: one contiguous write GPU0 -> GPU1 through the adapter.

    python3 scripts/gpu/probe.py --engine mooncake|nixl [--mib 1024] [--ucx-tls A B ...]

Two processes (prefill on GPU0, decode on GPU1), ``protocol: nvlink``; the decode compares the
bytes it received. For NIXL each ``--ucx-tls`` candidate is tried in order (``table`` = the protocol
table's value) until one moves the bytes at link speed (> 50 GB/s: a slow path means UCX fell back
to a host transport); the last stdout line is ``CHOSEN <value>`` for the scripts to reuse, or
``CHOSEN none``. Why: neither engine reports the transport it picked (docs/engines.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

LINK_GBPS = 50.0


def _config(engine: str, tls: str) -> Any:
    from pdfleet_runtime.engines import EngineConfig
    from pdfleet_runtime.links import LinkProtocol

    return EngineConfig(engine, LinkProtocol.NVLINK, env={} if tls == "table" else {"UCX_TLS": tls})


def _side(conn: Connection, engine: str, tls: str, gpu: int, nbytes: int, initiator: bool) -> None:
    try:
        import torch

        from pdfleet_runtime.engines import PeerInfo, create_engine
        from pdfleet_runtime.records import RegionRecord

        torch.cuda.set_device(gpu)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
        buf.view(torch.int64).random_(generator=torch.Generator(device=buf.device).manual_seed(7 + initiator))
        torch.cuda.synchronize()
        eng = create_engine(_config(engine, tls))
        eng.start()
        info = eng.register([RegionRecord(buf.data_ptr(), nbytes, str(buf.device))])
        if not initiator:
            conn.send({"info": info.to_wire()})
            conn.recv()  # written
            want = torch.empty_like(buf)
            want.view(torch.int64).random_(generator=torch.Generator(device=buf.device).manual_seed(8))
            conn.send({"equal": bool(torch.equal(buf, want))})
            conn.recv()
            return
        remote = PeerInfo.from_wire(conn.recv()["info"])
        peer = eng.connect(remote)
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            eng.write(peer, ([buf.data_ptr()], [remote.regions[0].address], [nbytes]), timeout_s=60)
            times.append(time.perf_counter() - t0)
        conn.send({"gbps": nbytes / min(times[1:]) / 1e9, "transport": eng.transport().effective})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def probe(engine: str, tls: str, nbytes: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    a, a_child = ctx.Pipe()
    b, b_child = ctx.Pipe()
    procs = [ctx.Process(target=_side, args=(b_child, engine, tls, 1, nbytes, False), daemon=True),
             ctx.Process(target=_side, args=(a_child, engine, tls, 0, nbytes, True), daemon=True)]
    for p in procs:
        p.start()
    try:
        if not b.poll(60):
            return {"error": "decode side did not start in 60 s"}
        hello = b.recv()
        if "error" in hello:
            return hello
        a.send(hello)
        if not a.poll(60):
            return {"error": "write did not finish in 60 s"}
        res = a.recv()
        if "error" in res:
            return res
        b.send("written")
        res.update(b.recv())
        b.send("bye")
        return res
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, choices=("mooncake", "nixl"))
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--ucx-tls", nargs="+", default=["table"])
    args = ap.parse_args()
    chosen = "none"
    for tls in args.ucx_tls:
        res = probe(args.engine, tls, args.mib << 20)
        print(json.dumps({"engine": args.engine, "ucx_tls": tls, "mib": args.mib, **res}), flush=True)
        if res.get("equal") and res.get("gbps", 0) > LINK_GBPS:
            chosen = tls
            break
    print(f"CHOSEN {chosen}")
    return 0 if chosen != "none" else 1


if __name__ == "__main__":
    sys.exit(main())
