"""Multi-process parity: every rank its own spawned process on loopback, through a real engine and the protocol.

A *group* is one (backend, prefill shape, decode shape); its processes are one bootstrap host
(no torch: it runs one ``BootstrapServer`` per case, each a fresh "prefill pod" on its own port),
one process per prefill rank and one per decode rank. Each rank process builds the pools of every
case of the group at start and registers all of them with one engine, once; then, per case, the
prefill ranks register with that case's bootstrap and the decode ranks handshake, send their
indices, wait for every source's status and verify their own bytes (the receiving side checks:
background plus the logical state sharded for the decode shape, so bytes outside the request's
items must be untouched). So the process start cost (~1-2 s with torch) is paid once per group,
not per case.

Reading order: ``cases`` (``CaseSpec``/``GroupSpec``), ``run_group`` (the parity flow), ``ProcessGroup``
(start/stop), then the process mains ``bootstrap_host.bootstrap_main`` and ``rank_workers``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from pdfleet_runtime.layouts import resolve_layout
from pdfleet_runtime.protocol.discovery import Endpoint, FileResolver
from pdfleet_runtime.seeded import request_lengths

from .arena import Mismatch
from .bootstrap_host import bootstrap_main
from .cases import GroupSpec
from .precheck import check_matrix
from .procs import RankProcess
from .rank_workers import decode_main, prefill_main
from .results import ParityConfig, ParityResult, RunDetails

__all__ = ["ProcessGroup", "run_case", "run_group"]

READY_TIMEOUT_S = 180.0
"""Waiting for a rank process to build pools and start its engine (2 cores, torch import, several cases)."""
CASE_TIMEOUT_S = 240.0


class ProcessGroup:
    """The bootstrap host plus one process per prefill and decode rank of a group."""

    def __init__(self, spec: GroupSpec, workdir: Path) -> None:
        self.spec, self.workdir = spec, Path(workdir)
        self.resolver_file = self.workdir / "prefill-endpoints.json"
        self.bootstrap: RankProcess | None = None
        self.prefill: list[RankProcess] = []
        self.decode: list[RankProcess] = []
        self.ready_seconds = 0.0
        self.devices: dict[str, str] = {}
        """Each rank process's torch device, by process name (what ``ready`` reported)."""

    def __enter__(self) -> ProcessGroup:
        t0 = time.monotonic()
        try:
            self.start_bootstrap()
            self.start_prefill()
            self.decode = [RankProcess(f"decode-{t}-{p}", decode_main, self.spec, t, p, str(self.resolver_file))
                           for t, p in self.spec.decode.coords()]
            for w in [*self.prefill, *self.decode]:
                info = w.recv(READY_TIMEOUT_S, expect="ready")[1]
                self.devices[w.name] = info.get("device", "cpu")
        except BaseException:
            self.close()
            raise
        self.ready_seconds = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_bootstrap(self) -> None:
        self.bootstrap = RankProcess("bootstrap", bootstrap_main, self.spec)
        self.bootstrap.recv(READY_TIMEOUT_S, expect="ready")

    def start_prefill(self, *, wait: bool = False) -> None:
        self.prefill = [RankProcess(f"prefill-{t}-{p}", prefill_main, self.spec, t, p)
                        for t, p in self.spec.prefill.coords()]
        if wait:
            for w in self.prefill:
                w.recv(READY_TIMEOUT_S, expect="ready")

    def open_pod(self) -> tuple[str, int]:
        """A fresh bootstrap server (a new prefill pod incarnation); the resolver file names it."""
        assert self.bootstrap is not None
        self.bootstrap.send("start", self.spec.prefill)
        _, host, port = self.bootstrap.recv(30, expect="started")
        FileResolver.write(self.resolver_file, [Endpoint(host, port)])
        return host, port

    def close_pod(self, port: int) -> None:
        assert self.bootstrap is not None
        self.bootstrap.send("stop", port)
        self.bootstrap.recv(30, expect="stopped")

    def close(self) -> None:
        for w in [*self.decode, *self.prefill, *([self.bootstrap] if self.bootstrap else [])]:
            w.stop()


def run_group(spec: GroupSpec, workdir: Path) -> list[ParityResult]:
    """Run every case of a group; one ``ParityResult`` per case, in order.

    A case the capability matrix rejects is reported with the matrix's rule and reason and never
    reaches a process; if every case is rejected no process starts.
    """
    results: list[ParityResult | None] = [None] * len(spec.cases)
    admitted = []
    for i, case in enumerate(spec.cases):
        cfg = ParityConfig(resolve_layout(case.layout_name), spec.prefill, spec.decode, case.requests, case.tokens,
                           case.seed, spec.backend, case.layout_name, spec.device)
        rejection = check_matrix(cfg)
        if rejection is not None:
            results[i] = ParityResult(ok=False, rejection=rejection)
        else:
            admitted.append(i)
    if not admitted:
        return [r for r in results if r is not None]
    sub = dataclasses.replace(spec, cases=tuple(spec.cases[i] for i in admitted))
    with ProcessGroup(sub, workdir) as group:
        for j, i in enumerate(admitted):
            results[i] = run_case(group, j)
    return [r for r in results if r is not None]


def run_case(group: ProcessGroup, case: int) -> ParityResult:
    """One case through a fresh pod: serve on every prefill rank, transfer and verify on every decode rank."""
    spec = group.spec
    host, port = group.open_pod()
    try:
        for w in group.prefill:
            w.send("serve", case, host, port, {})
        for w in group.prefill:
            w.recv(60, expect="serving")
        for w in group.decode:
            w.send("transfer", case, None, spec.request_timeout_s, "a")
        decoded = [w.recv(CASE_TIMEOUT_S, expect="transferred")[1] for w in group.decode]
        served = [w.recv(CASE_TIMEOUT_S, expect="served")[1] for w in group.prefill]
    finally:
        group.close_pod(port)
    c = spec.cases[case]
    bytes_by: dict[str, int] = {}
    desc_by: dict[str, int] = {}
    moved = desc = mismatched = 0
    first = None
    all_ok = True
    plan_s = 0.0
    for d in decoded:
        mismatched += d["mismatched_bytes"]
        first = first or d["first_mismatch"]
        all_ok = all_ok and d["all_success"] and d["mismatched_bytes"] == 0 and d["reports_complete"]
        for r in d["reports"]:
            moved += r["bytes"]
            desc += r["descriptors"]
            plan_s += r["plan_seconds"]
            for k, v in r["bytes_by_state"].items():
                bytes_by[k] = bytes_by.get(k, 0) + v
            for k, v in r["descriptors_by_state"].items():
                desc_by[k] = desc_by.get(k, 0) + v
    all_ok = all_ok and all(s["released"] == s["requests"] for s in served)
    return ParityResult(ok=all_ok, bytes_moved=moved, descriptors=desc, mismatched_bytes=mismatched,
                        bytes_by_state=bytes_by, descriptors_by_state=desc_by,
                        request_tokens=request_lengths(c.tokens, c.requests, c.seed), plan_seconds=plan_s,
                        copy_seconds=max(d["seconds"] for d in decoded),
                        first_mismatch=Mismatch(**first) if first is not None else None,
                        details=RunDetails(decoded, served, dict(group.devices)))
