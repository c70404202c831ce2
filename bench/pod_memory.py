"""What one runtime pod holds in memory: its pod process and its rank processes, read from /proc.

Three figures per process, from ``/proc/PID/smaps_rollup``: RSS (every resident page it maps, shared
library pages included: torch's and Mooncake's text is counted again in every process), PSS (each
shared page divided among the processes that map it: what N pods add up to on the host) and private
(``Private_Clean + Private_Dirty``: what one more pod adds). A pod is its container's process and
every descendant (``ip netns exec`` -> ``sh`` -> ``pdfleet-runtime serve`` -> its rank processes).

``MemorySampler`` samples every runtime pod of a harness kubelet during bench/rollout.py ``--real``;
run on its own, this starts ONE decode pod on loopback (no cluster; ``PDFLEET_PREFILL_ADDRESSES`` at a
port nobody serves) with the runtime config the operator renders from the bench's manifest
(``rollout_real.manifest``), waits for its rank to come up, and prints its memory; ``--layout-preset``
then measures the same pod with a preset layout instead, one pod at a time (``llama-dense``: the bench's
pods before they had their own small layout)::

    python bench/pod_memory.py [--layout-preset llama-dense] [--out bench/results/pod-memory-<utc>.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["MemorySampler", "descendants", "parse_rollup", "pod_memory", "summarize"]

MIB = 1024  # smaps_rollup counts kB


def parse_rollup(text: str) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` as {field: kB}."""
    out = {}
    for line in text.splitlines()[1:]:  # the first line is the [rollup] mapping
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name.strip()] = int(parts[0])
    return out


def descendants(root: int, parents: Mapping[int, int]) -> list[int]:
    """``root`` and every process below it, from a pid -> parent pid map (root first)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, ())))
    return out


def _parents() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                out[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return out


def _process(pid: int) -> dict[str, Any] | None:
    try:
        rollup = parse_rollup(Path(f"/proc/{pid}/smaps_rollup").read_text())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # gone between the listing and the read
        return None
    return {"pid": pid, "cmd": cmd[:160], "rss_mib": round(rollup.get("Rss", 0) / MIB, 1),
            "pss_mib": round(rollup.get("Pss", 0) / MIB, 1),
            "private_mib": round((rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)) / MIB, 1)}


def summarize(processes: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A pod's totals over its processes (``_process`` rows), and the rows."""
    rows = [p for p in processes if p]
    return {**{k: round(sum(p[k] for p in rows), 1) for k in ("rss_mib", "pss_mib", "private_mib")},
            "processes": rows}


def pod_memory(root: int, parents: Mapping[int, int] | None = None) -> dict[str, Any]:
    """The memory of the process tree under ``root`` (a pod's container process)."""
    tree = descendants(root, parents if parents is not None else _parents())
    return summarize(p for pid in tree if (p := _process(pid)) is not None)


@dataclass(eq=False)
class MemorySampler(threading.Thread):
    """Every ``period_s``, the memory of every started runtime pod of a harness kubelet (``runner.pods``):
    per pod its largest sample, and the largest sum over all pods at one sample."""

    runner: Any
    period_s: float = 10.0
    per_pod: dict[str, dict[str, Any]] = field(default_factory=dict)
    peak_total: dict[str, float] = field(default_factory=dict)
    samples: int = 0

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self.stop_event = threading.Event()

    def sample(self) -> None:
        parents, total = _parents(), {"rss_mib": 0.0, "pss_mib": 0.0, "private_mib": 0.0, "pods": 0}
        for pod in list(self.runner.pods.values()):
            role = (pod.pod["metadata"].get("labels") or {}).get("pdfleet.io/role")
            if role not in ("prefill", "decode") or not pod.started or pod.proc is None:
                continue
            m = pod_memory(pod.proc.pid, parents)
            for k in ("rss_mib", "pss_mib", "private_mib"):
                total[k] += m[k]
            total["pods"] += 1
            best = self.per_pod.get(pod.name)
            if best is None or m["pss_mib"] > best["pss_mib"]:
                self.per_pod[pod.name] = {"role": role, **m}
        self.samples += 1
        if total["pss_mib"] > self.peak_total.get("pss_mib", -1):
            self.peak_total = {k: round(v, 1) for k, v in total.items()}

    def run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            with contextlib.suppress(OSError):
                self.sample()

    def stop(self) -> dict[str, Any]:
        """The medians and maxima per role (MiB), the peak over all pods at once, and every pod's largest sample."""
        self.stop_event.set()
        if self.is_alive():
            self.join(timeout=30)
        roles: dict[str, Any] = {}
        for role in ("prefill", "decode"):
            pods = [m for m in self.per_pod.values() if m["role"] == role]
            if pods:
                roles[role] = {k: {"median": sorted(m[k] for m in pods)[len(pods) // 2], "max": max(m[k] for m in pods)}
                               for k in ("rss_mib", "pss_mib", "private_mib")} | {"pods": len(pods)}
        return {"samples": self.samples, "period_s": self.period_s, "per_role": roles,
                "peak_all_pods_at_once": self.peak_total,
                "per_pod": {n: {k: v for k, v in m.items() if k != "role"} | {"role": m["role"]}
                            for n, m in sorted(self.per_pod.items())}}


def _measure_one(layout_preset: str | None, timeout_s: float) -> dict[str, Any]:
    """One decode pod with the bench's rendered config (the layout swapped for ``layout_preset`` if given)."""
    from rollout_real import LOCAL_ARGS, RUNTIME_ARGS, manifest

    from pdfleet_operator.api.constants import Role
    from pdfleet_operator.api.models import PDDeploymentSpec
    from pdfleet_operator.resources.runtime_config import runtime_config
    from pdfleet_runtime.testing.local import LocalPod

    m = manifest("bench", 1, "v1", 2, 0, 60)
    if layout_preset:
        m["spec"]["model"]["layout"] = {"preset": layout_preset}
    cfg = runtime_config("roll", "bench", PDDeploymentSpec.model_validate(m["spec"]), Role.DECODE)
    with tempfile.TemporaryDirectory(prefix="pdfleet-pod-memory-") as tmp:
        pod = LocalPod(Path(tmp), "decode-0", cfg, os.urandom(32), args=(*LOCAL_ARGS, *RUNTIME_ARGS["decode"]),
                       env={"PDFLEET_PREFILL_ADDRESSES": "127.0.0.1:1"}, worker_key=os.urandom(16).hex())
        pod.start()
        try:
            start, body = time.monotonic(), {}
            while time.monotonic() - start < timeout_s:
                with contextlib.suppress(OSError, ValueError):
                    body = pod.readyz()
                if body.get("ranks") and body.get("ranksUp") == body.get("ranks"):
                    break
                time.sleep(0.3)
            else:
                raise TimeoutError(f"the decode pod's rank did not come up in {timeout_s}s: {pod.log()[-2000:]}")
            up_s = time.monotonic() - start
            time.sleep(2)  # the rank's pools allocated and registered, the canary loop running
            assert pod.proc is not None
            mem = pod_memory(pod.proc.pid)
        finally:
            pod.stop()
    return {"layout": m["spec"]["model"]["layout"], "pool": m["spec"]["decode"]["pool"],
            "rank_up_s": round(up_s, 1), **mem}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout-preset", nargs="*", default=[],
                    help="after the bench's pod, the same pod with each of these presets instead (one pod at a time)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for preset in [None, *args.layout_preset]:
        rows.append(_measure_one(preset, args.timeout))
        r = rows[-1]
        print(f"decode pod, layout {json.dumps(r['layout'])}: RSS {r['rss_mib']} MiB, PSS {r['pss_mib']} MiB, "
              f"private {r['private_mib']} MiB", flush=True)
        for p in r["processes"]:
            print(f"    pid {p['pid']}: RSS {p['rss_mib']}  PSS {p['pss_mib']}  private {p['private_mib']}  {p['cmd'][:90]}")
    out = args.out or Path("bench/results") / f"pod-memory-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "pod-memory", "date": datetime.now(UTC).isoformat(),
                               "load_average": os.getloadavg(), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
