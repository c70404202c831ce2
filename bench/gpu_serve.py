"""Benchmark: requests through ``pdfleet-runtime serve`` on the staged path, against the direct path and a torch copy.

    PYTHONPATH=runtime:operator:. python bench/gpu_serve.py --engine mooncake|nixl \\
        [--tokens 4096 32768 131072] [--reps 5] [--prefill-gpu 0 --decode-gpu 1] [--hetero] [--out bench/results]

Three ``serve`` processes on one host: one prefill pod (``--prefill-gpu``, the runtime config's
``placement``) and two decode pods (``--decode-gpu``), ``qwen3.8-flash-next`` tp 1 -> 1. The first decode
pod takes the staged path (``staging`` defaults: every request at or above the threshold), the second
has staging disabled (the direct write of the planner's scattered blocks). ``--hetero`` (Mooncake) then
runs prefill tp 2 -> decode tp 1 staged, with prefill rank 0 on the prefill GPU and rank 1 on the
decode's (so one source shares the decode's GPU): reported apart. Requests are synthetic
(``POST /v1/synthetic``): the decode sends its indices at admission, the prefill allocates its items
(when both sides cut their staged plans and the decode receives its block table), fills seeded state
(the "compute"), then transfers. Every pod draws its pages at random (``--fault-scatter-pages``), as a
long-running pod's pools are: fresh pools hand out contiguous pages, which the planner would coalesce
into a few large blocks (both paths then move near the copy's speed, and the comparison says nothing).
Chunk signals go through the engine (an 8-byte landed write per chunk, a freed read when the ring is
full), as between nodes; no shared memory.

GB/s = request bytes / (the prefill's state ready (its last rank's, with tp 2) -> the decode knowing every byte is
in place: the last staged chunk scattered, or the direct write's status), both ``time.monotonic()`` of
one host, read from the pods' logs. Every byte is checked by the decode after that window
(``mismatchedBytes``). Beside them: a torch copy of the same number of bytes as one block from the
prefill's GPU to the decode's (the peer copy; on one GPU the same-device copy, named so). The first
request of each size and path is a warm-up. The staged legs' timelines (``staged_timeline``: one log
line per leg and side) are summarised per size: per chunk gather / post / link write / landed signal /
the decode's notice / scatter, and where the window goes (fill before the first post, the link, the
drain after the last write). Writes JSON (and the pods' logs, one tar.gz) to ``--out``.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import re
import statistics
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LAYOUT = "qwen3.8-flash-next"
SECRET = b"gpu-serve-benchmark-secret-0123456789"
FAST = ("--fault-scatter-pages", "6", "--retry-period", "0.5", "--canary-timeout", "60", "--canary-tokens", "64",
        "--floor-gbps", "0.001", "--canary-period", "3600")


def _config(role: str, args: argparse.Namespace, staging: dict[str, Any], tp: int = 1, peer_tp: int = 1,
            gpus: tuple[int, ...] = (0,)) -> Any:
    from pdfleet_runtime.config import RuntimeConfig, StagingConfig
    from pdfleet_runtime.layouts import LayoutRef
    from pdfleet_runtime.records import ParallelShape

    tokens = max(args.tokens + (args.hetero_tokens or [] if args.hetero else []))
    return RuntimeConfig(
        deployment="bench", namespace="default", role=role, runtime_version="0.1.0", layout=LayoutRef(preset=LAYOUT),
        shape=ParallelShape(tp), peer_shape=ParallelShape(peer_tp), backend=args.engine, protocol=args.protocol,
        max_concurrent_requests=2, kv_tokens=int(tokens * 2.2), prefill_service="bench-prefill",
        secret_path=Path("/nonexistent"), device=args.device,
        placement=None if args.device == "cpu" else gpus, staging=StagingConfig(**staging))


def _times(log: str, pattern: str, pick: Any = max) -> dict[str, float]:
    """Per request, the time lines of ``pattern`` give (``pick`` of them: a tp 2 prefill logs one per rank,
    and a request's state is ready when its last rank's is)."""
    seen: dict[str, list[float]] = {}
    for m in re.finditer(pattern, log):
        seen.setdefault(m.group(1), []).append(float(m.group(2)))
    return {k: pick(v) for k, v in seen.items()}


def _copy_name(args: argparse.Namespace) -> str:
    return "same-device copy" if args.device == "cpu" or args.prefill_gpu == args.decode_gpu else "peer copy"


def _peer_copy(nbytes: int, args: argparse.Namespace, reps: int) -> dict[str, Any]:
    """A torch copy of ``nbytes`` as one block, prefill GPU -> decode GPU (the same device on one GPU)."""
    import torch

    src_dev, dst_dev = (("cpu", "cpu") if args.device == "cpu"
                        else (f"cuda:{args.prefill_gpu}", f"cuda:{args.decode_gpu}"))
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)

    devices = {d for d in (src.device, dst.device) if d.type == "cuda"}

    def sync() -> None:
        for d in devices:
            torch.cuda.synchronize(d)

    times = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    ok = bool(torch.equal(src, dst.to(src.device)))
    del src, dst
    med = statistics.median(times[1:])
    return {"kind": _copy_name(args), "from": src_dev, "to": dst_dev, "seconds": times[1:], "median_s": med,
            "gbps": nbytes / med / 1e9, "byte_exact": ok}


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _timeline_summary(ids: list[str], ready: dict[str, float], landed: dict[str, float], pre_log: str,
                      dec_log: str) -> dict[str, Any]:
    """Where each timed staged request's window went, from the pods' timeline lines (medians, ms): per chunk
    over every leg; fill / link / drain of the leg that ended last (one leg with tp 1 -> 1)."""
    from pdfleet_runtime.protocol.staged_timeline import parse

    sends: dict[str, list[Any]] = {}
    recvs: dict[str, list[Any]] = {}
    for t in parse(pre_log):
        if t.side == "send":
            sends.setdefault(t.request, []).append(t)
    for t in parse(dec_log):
        if t.side == "receive":
            recvs.setdefault(t.request, []).append(t)
    per_chunk: dict[str, list[float]] = {k: [] for k in ("gather", "post", "queue", "write", "land", "signal",
                                                         "notice", "scatter")}
    parts: dict[str, list[float]] = {k: [] for k in ("to_send", "fill", "link", "drain", "serial", "window")}
    chunks = []
    example: dict[str, Any] | None = None
    for rid in ids:
        ss, rs = sends.get(rid, []), recvs.get(rid, [])
        if not ss or not rs or rid not in ready or rid not in landed:
            continue
        t_ready, t_end = ready[rid], landed[rid]
        chunks.append(sum(s.n_chunks for s in ss))
        for s in ss:
            for k in range(s.n_chunks):
                for name, a, b in (("gather", "gather", "post"), ("post", "post", "posted"),
                                   ("queue", "posted", "write"), ("write", "write", "written"),
                                   ("land", "posted", "done"), ("signal", "done", "landed")):
                    x, y = s.at(a, k), s.at(b, k)
                    if x is not None and y is not None:
                        per_chunk[name].append(y - x)
        for r in rs:
            for k in range(r.n_chunks):
                if (x := r.at("scatter", k)) is not None and (y := r.at("freed", k)) is not None:
                    per_chunk["scatter"].append(y - x)
        if len(ss) == 1 and len(rs) == 1:  # one source, one lane: chunk k is the same chunk on both sides
            for k in range(ss[0].n_chunks):
                if (x := ss[0].at("done", k)) is not None and (y := rs[0].at("scatter", k)) is not None:
                    per_chunk["notice"].append(y - x)
        last = max(ss, key=lambda s: s.at("done", s.n_chunks - 1))  # tp 2: the leg that ended last
        first_post, last_done = last.at("post", 0), last.at("done", last.n_chunks - 1)
        fill, link, drain = first_post - t_ready, last_done - first_post, t_end - last_done
        for k, v in (("to_send", last.start - t_ready), ("fill", fill), ("link", link),
                     ("drain", drain), ("serial", fill + drain), ("window", t_end - t_ready)):
            parts[k].append(v)
        if example is None:  # the first timed request's chunk times, relative to its state ready (ms)
            s = ss[0]

            def rel(t: float | None, t_ready: float = t_ready) -> float | None:
                return None if t is None else round((t - t_ready) * 1e3, 4)
            example = {"request": rid, "send_start_ms": rel(s.start),
                       "chunks": [{step: rel(s.at(step, k)) for step in ("gather", "post", "posted", "write",
                                                                         "written", "done", "landed")}
                                  | ({"scatter": rel(rs[0].at("scatter", k)), "freed": rel(rs[0].at("freed", k))}
                                     if len(rs) == 1 else {}) for k in range(s.n_chunks)],
                       "end_ms": rel(t_end)}
    ms = {k: (None if (m := _med(v)) is None else m * 1e3) for k, v in per_chunk.items()}
    return {"requests": len(parts["window"]), "chunks_per_request": _med(chunks),
            "per_chunk_median_ms": ms, "window_median_ms": {k: (None if (m := _med(v)) is None else m * 1e3)
                                                            for k, v in parts.items()},
            "serial_share": (_med(parts["serial"]) or 0) / (_med(parts["window"]) or 1), "example": example}


def _print_timeline(tokens: int, label: str, tl: dict[str, Any]) -> None:
    if not tl["requests"]:
        print(f"  {tokens:>7} tokens {label} timeline: none parsed", flush=True)
        return
    w, c = tl["window_median_ms"], tl["per_chunk_median_ms"]

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"
    print(f"  {tokens:>7} tokens {label} timeline (medians, ms): window {f(w['window'])} = fill {f(w['fill'])} "
          f"(ready -> send {f(w['to_send'])}) + link {f(w['link'])} ({tl['chunks_per_request']:.0f} chunks) + drain "
          f"{f(w['drain'])}; serial {tl['serial_share']:.0%}. Per chunk: gather {f(c['gather'])}, post {f(c['post'])}, "
          f"land {f(c['land'])} (poster queue {f(c['queue'])}, write {f(c['write'])}), landed signal "
          f"{f(c['signal'])}, decode notice {f(c['notice'])}, scatter {f(c['scatter'])}", flush=True)


def _measure(label: str, pre: Any, pod: Any, path: str, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """``reps`` timed requests (after one warm-up) of ``tokens`` through ``pod``; each byte-checked after."""
    ids, bodies = [], []
    for rep in range(args.reps + 1):
        rid = f"{label}-{tokens}-{rep}"
        code, body = pod.synthetic(tokens, args.timeout, requestId=rid)
        if code != 200 or not body.get("ok"):
            raise RuntimeError(f"{rid}: HTTP {code}: {body}\n{pod.log()[-4000:]}")
        if rep:
            ids.append(rid)
            bodies.append(body)
    pre_log, dec_log = pre.log(), pod.log()
    ready_re = r"request (\S+): filled \d+ tokens of seeded state; state ready at ([\d.]+)"
    ready, first_ready = _times(pre_log, ready_re), _times(pre_log, ready_re, min)
    landed = _times(dec_log, r"request (\S+) <- \S+: success.*; (?:staged|direct), landed at ([\d.]+)")
    took = [landed[i] - ready[i] for i in ids]
    nbytes = int(bodies[0]["bytes"])
    med = statistics.median(took)
    kinds = {k for i, k in re.findall(r"request (\S+) <- \S+: success.*; (staged|direct), landed at", dec_log)
             if i in ids}
    if kinds != {path}:
        raise RuntimeError(f"{label}: the decode pod moved {ids} by {sorted(kinds)}, not {path}")
    res = {"bytes": nbytes, "seconds": took, "median_s": med, "gbps": nbytes / med / 1e9,
           "engine_write_s": [float(b["writeSeconds"]) for b in bodies],
           "request_s": [float(b["seconds"]) for b in bodies],
           "mismatched_bytes": sum(int(b["mismatchedBytes"]) for b in bodies), "paths_seen": sorted(kinds),
           "ready_spread_s": [ready[i] - first_ready[i] for i in ids]}  # tp 2: the first rank's lead
    print(f"  {tokens:>7} tokens {label:7s} {res['gbps']:8.1f} GB/s  median {med * 1e3:8.3f} ms  "
          f"mismatched {res['mismatched_bytes']}  (request s {[round(x, 2) for x in res['request_s']]})", flush=True)
    if path == "staged":
        res["timeline"] = _timeline_summary(ids, ready, landed, pre_log, dec_log)
        _print_timeline(tokens, label, res["timeline"])
    return res


def _start(pods: list[Any]) -> None:
    for p in pods:
        p.start()
    for p in pods:
        if p.cfg.role == "decode":
            p.wait_ready(True, 300)


def _stop(pods: list[Any], logs: dict[str, str]) -> None:
    for p in pods:
        p.stop()
        logs[p.name] = p.log()[-(4 << 20):]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdfleet_runtime.testing.local import LocalPod

    work = Path(tempfile.mkdtemp(prefix="gpu-serve-"))
    staged_cfg: dict[str, Any] = {"thresholdBytes": 0, "minChunks": args.min_chunks}
    if args.device == "cpu":
        staged_cfg |= {"onCpu": True, "slotMib": 16}
    pg, dg = (args.prefill_gpu,), (args.decode_gpu,)
    pre = LocalPod(work, "pre", _config("prefill", args, staged_cfg, gpus=pg), SECRET,
                   args=("--fault-scatter-pages", "5"))
    env = {"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap}
    dec = {"staged": LocalPod(work, "dec-staged", _config("decode", args, staged_cfg, gpus=dg), SECRET, args=FAST,
                              env=env),
           "direct": LocalPod(work, "dec-direct", _config("decode", args, {"enabled": False}, gpus=dg), SECRET,
                              args=FAST, env=env)}
    out: dict[str, Any] = {"sizes": [], "logs": str(work), "copy": _copy_name(args)}
    logs: dict[str, str] = {}
    try:
        _start([pre, *dec.values()])
        for tokens in args.tokens:
            size: dict[str, Any] = {"tokens": tokens, "paths": {}}
            for path, pod in dec.items():
                size["paths"][path] = _measure(path, pre, pod, path, tokens, args)
                size["bytes"] = size["paths"][path]["bytes"]
            size["peer_copy"] = _peer_copy(size["bytes"], args, args.reps)
            p = size["paths"]
            size["staged_over_direct"] = p["staged"]["gbps"] / p["direct"]["gbps"]
            size["staged_over_copy"] = p["staged"]["gbps"] / size["peer_copy"]["gbps"]
            print(f"  {tokens:>7} tokens {_copy_name(args)} {size['peer_copy']['gbps']:8.1f} GB/s median "
                  f"{size['peer_copy']['median_s'] * 1e3:.3f} ms; staged/direct {size['staged_over_direct']:.1f}x, "
                  f"staged/copy {size['staged_over_copy']:.3f}", flush=True)
            out["sizes"].append(size)
        out["staged_metrics"] = _staged_stats(pre.log())
        if args.hetero:
            _stop([pre, *dec.values()], logs)
            out["hetero"] = _hetero(args, work, staged_cfg, logs)
    finally:
        _stop([pre, *dec.values()], logs)
        _write_logs(args, logs)
    return out


def _hetero(args: argparse.Namespace, work: Path, staged_cfg: dict[str, Any], logs: dict[str, str]) -> dict[str, Any]:
    """Prefill tp 2 -> decode tp 1, staged: prefill rank 0 on the prefill GPU, rank 1 on the decode's."""
    from pdfleet_runtime.testing.local import LocalPod

    gpus = (args.prefill_gpu, args.decode_gpu)
    pre = LocalPod(work, "pre-tp2", _config("prefill", args, staged_cfg, 2, 1, gpus), SECRET,
                   args=("--fault-scatter-pages", "5"))
    dec = LocalPod(work, "dec-tp1", _config("decode", args, staged_cfg, 1, 2, (args.decode_gpu,)), SECRET, args=FAST,
                   env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
    out: dict[str, Any] = {"prefill_tp": 2, "decode_tp": 1, "prefill_gpus": list(gpus), "decode_gpu": args.decode_gpu,
                           "sizes": []}
    print(f"{LAYOUT} tp2 -> tp1 (staged; prefill ranks on cuda:{gpus[0]} and cuda:{gpus[1]}, decode on "
          f"cuda:{args.decode_gpu}): reported apart", flush=True)
    try:
        _start([pre, dec])
        for tokens in args.hetero_tokens or args.tokens:
            out["sizes"].append({"tokens": tokens} | _measure("tp2to1", pre, dec, "staged", tokens, args))
    finally:
        _stop([pre, dec], logs)
    return out


def _write_logs(args: argparse.Namespace, logs: dict[str, str]) -> None:
    """The pods' logs, one tar.gz (the timelines are in them)."""
    with tarfile.open(args.out / f"serve-{args.engine}-logs.tar.gz", "w:gz") as tar:
        for name, text in logs.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}.log")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _staged_stats(log: str) -> list[str]:
    """The prefill's per-request staged lines (chunk and signal costs), as logged."""
    return re.findall(r"staged leg .*", log)[-12:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, choices=("mooncake", "nixl"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--reps", type=int, default=5, help="timed requests per size and path (after one warm-up)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--prefill-gpu", type=int, default=0, help="the prefill pod's GPU (its placement)")
    parser.add_argument("--decode-gpu", type=int, default=0, help="the decode pods' GPU (two GPUs: 1)")
    parser.add_argument("--hetero", action="store_true", help="also prefill tp 2 -> decode tp 1, staged (Mooncake)")
    parser.add_argument("--hetero-tokens", type=int, nargs="+", default=None, help="sizes for --hetero (--tokens)")
    parser.add_argument("--min-chunks", type=int, default=4,
                        help="staging.minChunks: a small request still splits into about this many chunks")
    parser.add_argument("--protocol", default=None, help="default nvlink on cuda, tcp on cpu")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.hetero and args.engine != "mooncake":
        parser.error(f"--hetero: the matrix denies {args.engine} moving {LAYOUT}'s PLE state across TP sizes; "
                     "use --engine mooncake")
    args.protocol = args.protocol or ("nvlink" if args.device == "cuda" else "tcp")
    where = ("cpu" if args.device == "cpu" else
             f"all ranks on cuda:{args.prefill_gpu}" if args.prefill_gpu == args.decode_gpu else
             f"prefill on cuda:{args.prefill_gpu}, decode on cuda:{args.decode_gpu}")
    print(f"{LAYOUT} tp1 -> tp1 through serve, {args.engine} {args.protocol}, {where}, median of {args.reps} "
          f"(+1 warm-up)", flush=True)
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    checked = [p for s in res["sizes"] for p in s["paths"].values()] + res.get("hetero", {}).get("sizes", [])
    ok = all(p["mismatched_bytes"] == 0 for p in checked) and all(s["peer_copy"]["byte_exact"] for s in res["sizes"])
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report = {"benchmark": "gpu_serve", "engine": args.engine, "protocol": args.protocol, "layout": LAYOUT,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "date": stamp, "seconds": time.time() - t0, "byte_exact": ok, "placement": where,
              "min_chunks": args.min_chunks,
              "prefill_gpu": args.prefill_gpu, "decode_gpu": args.decode_gpu,
              "machine": {"host": platform.node(), "python": platform.python_version(), "device": args.device},
              "reps": args.reps, "results": res}
    path = args.out / f"gpu-serve-{args.engine}-{stamp}.json"
    path.write_text(json.dumps(report, indent=1))
    copy = "copy" if res["copy"] == "peer copy" else "same-dev"
    print(f"\n{where}\n{'engine':9} {'tokens':>7} {'MB':>7} {'staged':>8} {'direct':>8} {copy:>8} {'st/dir':>7} "
          f"{'st/copy':>7} {'staged ms':>9} {'copy ms':>8}")
    for s in res["sizes"]:
        p = s["paths"]
        print(f"{args.engine:9} {s['tokens']:>7} {s['bytes'] / 1e6:>7.0f} {p['staged']['gbps']:>8.1f} "
              f"{p['direct']['gbps']:>8.1f} {s['peer_copy']['gbps']:>8.1f} {s['staged_over_direct']:>7.1f} "
              f"{s['staged_over_copy']:>7.3f} {p['staged']['median_s'] * 1e3:>9.3f} "
              f"{s['peer_copy']['median_s'] * 1e3:>8.3f}")
    for s in res.get("hetero", {}).get("sizes", []):
        print(f"{args.engine:9} {s['tokens']:>7} {s['bytes'] / 1e6:>7.0f} {s['gbps']:>8.1f}  tp2 -> tp1 staged "
              f"(apart), median {s['median_s'] * 1e3:.3f} ms")
    print(f"byte-exact: {ok}; wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
