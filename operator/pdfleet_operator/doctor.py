"""`pdfleet doctor`'s checks, pure: what the cluster and the pods' metrics say -> a verdict per check, with the fix.

PD's worst failures are silent (a decode recomputing every prompt while healthy, a link on TCP where RDMA was
asked, a prefill whose state is never claimed), so each check reads what the data path itself reports: the
transfer-path gate each pod's canary sets, the ``pdfleet.io/compat`` generation of the pods the routers can
pair, and the runtime's own counters (``/metrics``: failed transfers by reason, bytes that failed
verification, rooms that expired unclaimed, vLLM-contract handshake refusals, the transport each rank runs,
canary throughput against its floor). A check whose input a pod does not export says ``cannot-check`` with
the reason, never ``ok``. Counters are judged over the window the command read them in (two reads), or,
without a window, since each pod started (the detail says which).

The cluster edge (reads only) is ``commands/doctor.py``; docs/doctor.md lists every check.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Collection, Iterable, Mapping, Sequence
from enum import StrEnum
from itertools import product
from typing import Any

from pydantic import BaseModel, ConfigDict

from pdfleet_operator.api.constants import Role
from pdfleet_operator.generations import mixed, paired
from pdfleet_operator.observed import ObservedPod, RouterState
from pdfleet_operator.validation import check_matrix
from pdfleet_runtime.links import link_matches

__all__ = ["CheckResult", "Metrics", "PodMetrics", "Verdict", "diagnose", "failed", "unknown_workers"]


class Verdict(StrEnum):
    OK = "ok"
    FAIL = "fail"
    CANNOT_CHECK = "cannot-check"


class CheckResult(BaseModel):
    """One check's verdict on one subject (a pod, or the fleet), what was seen and, when it failed, the fix."""

    model_config = ConfigDict(frozen=True)

    check: str
    subject: str
    verdict: Verdict
    detail: str
    fix: str = ""


Sample = tuple[Mapping[str, str], float]
"""One series of a metric family: its labels and its value."""


class Metrics(BaseModel):
    """A pod's ``/metrics``, by sample name (``pdfleet_transfer_failures_total``): each series' labels and value."""

    model_config = ConfigDict(frozen=True)

    samples: Mapping[str, tuple[Sample, ...]]

    def has(self, name: str) -> bool:
        return name in self.samples

    def by(self, name: str, label: str | None) -> dict[str, float]:
        """The family summed per value of ``label`` (None: in one sum, keyed '')."""
        out: dict[str, float] = {}
        for labels, value in self.samples.get(name, ()):
            key = labels.get(label, "") if label is not None else ""
            out[key] = out.get(key, 0.0) + value
        return out

    def total(self, name: str, **where: str) -> float:
        """The family's sum over the series whose labels hold ``where``."""
        return sum(v for labels, v in self.samples.get(name, ()) if all(labels.get(k) == w for k, w in where.items()))


class PodMetrics(BaseModel):
    """What the command read from one pod: its metrics at the window's end and start (None: one read, or the
    counters since the pod started), or why they could not be read."""

    model_config = ConfigDict(frozen=True)

    now: Metrics | None = None
    before: Metrics | None = None
    error: str = ""

    def counted(self, name: str, label: str | None) -> dict[str, float]:
        """A counter family's increase per ``label`` value over the window (or its total without one)."""
        assert self.now is not None
        now = self.now.by(name, label)
        if self.before is None:
            return {k: v for k, v in now.items() if v > 0}
        was = self.before.by(name, label)
        return {k: v - was.get(k, 0.0) for k, v in now.items() if v - was.get(k, 0.0) > 0}

    def increase(self, name: str, **where: str) -> float:
        """A counter family's increase over the window (its total without one), over the series matching ``where``."""
        assert self.now is not None
        return self.now.total(name, **where) - (self.before.total(name, **where) if self.before is not None else 0.0)


RUNTIME_MARK = "pdfleet_ready"  # the built-in runtime's gauge: its counters below are exported
FAILURES = "pdfleet_transfer_failures_total"
MISMATCHED = "pdfleet_verify_mismatched_bytes_total"
EXPIRED = "pdfleet_rooms_expired_total"
REFUSALS = "pdfleet_vllm_handshake_refusals_total"
TRANSPORT = "pdfleet_transport_info"
INFO = "pdfleet_runtime_info"
TRANSFERS = "pdfleet_transfers_total"
ANSWERED = "sglang:num_requests_total"  # the built-in runtime exports SGLang's name (a decode: last token out)
ANSWER_SLACK = 2.0
"""Answers a window may hold beyond the state received in it: requests whose state arrived just before it began."""
CANARY_GBPS = "pdfleet_canary_throughput_gbps"
FLOOR_GBPS = "pdfleet_canary_floor_gbps"


SGLANG_WORKERS = "smg_worker_health"
"""sglang-router 0.3.2's gauge per worker it lists (1 healthy, 0 not); a removed worker's series stays at -1 (seen
here: ``DELETE /workers/{id}`` turned 1 into -1)."""
VLLM_WORKERS = "vllm_router_worker_health"
"""vllm-router 0.1.17's: a removed worker's series stays at its last value (seen here: 1 after ``/remove_worker``)."""
ROUTER_RECHECK_S = 3.0
"""A worker no pod stands behind is said only when a second read this much later still lists it: the router pod's
sweeper removes such workers every second, and a pod deleted just before the read is not yet swept."""


def unknown_workers(m: Metrics, known_ips: Collection[str]) -> list[str]:
    """The workers sglang-router lists (its gauge >= 0) whose address is no pod's of ``known_ips``."""
    return sorted(labels.get("worker", "") for labels, health in m.samples.get(SGLANG_WORKERS, ())
                  if health >= 0 and (urllib.parse.urlsplit(labels.get("worker", "")).hostname or "") not in known_ips)


def _router_workers(routers: Mapping[str, Sequence[Metrics | str]], known_ips: Collection[str]) -> CheckResult:
    """Each router pod's listed workers against the deployment's pods: a worker left for a deleted pod is one the
    router may still send to, and whose address the next pod may get (docs/router.md)."""
    def said(verdict: Verdict, detail: str, fix: str = "") -> CheckResult:
        return CheckResult(check="router-workers", subject="fleet", verdict=verdict, detail=detail, fix=fix)

    if not routers:
        return said(Verdict.CANNOT_CHECK, "no router pod running (the deployment has no spec.router, or its pods "
                                          "are not up)")
    stale: dict[str, list[str]] = {}
    unread: list[str] = []
    for router, reads in sorted(routers.items()):
        if not reads or isinstance(reads[-1], str):
            unread.append(f"{router}: {reads[-1] if reads else 'not read'}")
            continue
        last = reads[-1]
        if VLLM_WORKERS in last.samples and SGLANG_WORKERS not in last.samples:
            return said(Verdict.CANNOT_CHECK, "vllm-router 0.1.17 keeps a removed worker's health series at its "
                                              "last value, so its metrics cannot say which workers it still lists "
                                              "(its list is on its pod's loopback only)")
        if SGLANG_WORKERS not in last.samples:
            unread.append(f"{router}: its metrics hold no {SGLANG_WORKERS}")
            continue
        left = set(unknown_workers(last, known_ips))
        for earlier in reads[:-1]:  # listed in every read
            left &= set(unknown_workers(earlier, known_ips)) if not isinstance(earlier, str) else left
        if left:
            stale[router] = sorted(left)
    if stale:
        listed = "; ".join(f"{r} lists {', '.join(w)}" for r, w in stale.items())
        return said(Verdict.FAIL, f"router workers no pod of the deployment stands behind, {ROUTER_RECHECK_S:g} s "
                                  f"apart: {listed}",
                    "the router pod's sweeper removes them within a second and logs each removal: read the router "
                    "pod's log (a sweeper that stopped); deleting the router pod starts one with a fresh list")
    if unread:
        return said(Verdict.CANNOT_CHECK, "router pods not read: " + "; ".join(unread))
    return said(Verdict.OK, f"{len(routers)} router pod(s): every worker listed is a pod of the deployment")


def _live(pods: Iterable[ObservedPod]) -> list[ObservedPod]:
    return [p for p in pods if not p.deleting and not p.failed]


def _transfer_path(p: ObservedPod) -> CheckResult:
    if p.gate == "True":
        return CheckResult(check="transfer-path", subject=p.name, verdict=Verdict.OK,
                           detail="its canary moved state through a peer and it was verified")
    if p.gate is None:
        return CheckResult(check="transfer-path", subject=p.name, verdict=Verdict.FAIL,
                           detail="no canary result yet (the pod's runtime has not reported its transfer path)",
                           fix=f"wait for the pod to start, then read its log: kubectl logs {p.name}")
    return CheckResult(check="transfer-path", subject=p.name, verdict=Verdict.FAIL,
                       detail=f"its canary failed: {p.gate_message or 'no reason given'}",
                       fix=f"the reason names the peer and the step; kubectl logs {p.name}")


def _generations(pods: Sequence[ObservedPod], router: RouterState | None) -> CheckResult:
    """The pods a router pairs (ready, routable, and of the generation its selectors carry, when they carry one)
    must share one compatibility key per role."""
    live = _live(pods)
    bad = mixed(live, router)
    if bad:
        return CheckResult(check="generations", subject="fleet", verdict=Verdict.FAIL,
                           detail=f"the router pairs {bad}: it moves state between generations the engines may "
                                  "not share" + ("" if router is not None and router.serving is not None else
                                                 " (its selectors carry no generation)"),
                           fix="let the rollout finish (kubectl get pdd shows its progress); an operator run with "
                               "--no-router-generations lets the router pair two generations during every rollout")
    pairs = paired(live, router)
    keys = sorted({k for by_key in pairs.values() for k in by_key})
    waiting = sorted(p.name for p in live if p.ready and p.drain_started is None
                     and all(p.name not in v for v in pairs[p.role].values()))
    return CheckResult(check="generations", subject="fleet", verdict=Verdict.OK,
                       detail=f"{sum(len(v) for b in pairs.values() for v in b.values())} pod(s) the router pairs, "
                              f"one key per role: {', '.join(keys) or 'none'}"
                              + (f"; {len(waiting)} ready pod(s) of another generation wait for the router's switch: "
                                 f"{', '.join(waiting)}" if waiting else ""))


def _counter_check(check: str, p: ObservedPod, m: PodMetrics, name: str, label: str | None, *, what: str, fix: str,
                   window: str) -> CheckResult:
    assert m.now is not None
    if not m.now.has(RUNTIME_MARK):
        return CheckResult(check=check, subject=p.name, verdict=Verdict.CANNOT_CHECK,
                           detail=f"the pod is not pdfleet's runtime (no {RUNTIME_MARK}): its engine does not export "
                                  f"{name}")
    counted = m.counted(name, label)  # a labelled counter never incremented has no series: none happened
    if not counted:
        return CheckResult(check=check, subject=p.name, verdict=Verdict.OK, detail=f"no {what} {window}")
    parts = ", ".join(f"{v:g}" + (f" {k}" if k else "") for k, v in sorted(counted.items()))
    return CheckResult(check=check, subject=p.name, verdict=Verdict.FAIL, detail=f"{what} {window}: {parts}",
                       fix=fix)


def _transport(p: ObservedPod, m: PodMetrics) -> CheckResult:
    assert m.now is not None
    ranks = m.now.samples.get(TRANSPORT, ())
    if not ranks:
        return CheckResult(check="link", subject=p.name, verdict=Verdict.CANNOT_CHECK,
                           detail=f"the pod exports no {TRANSPORT} (its engine's transport is not reported)")
    off = sorted({(lab.get("requested", ""), lab.get("effective", "")) for lab, _ in ranks
                  if link_matches(lab.get("backend", ""), lab.get("requested", ""), lab.get("effective", "")) is False})
    if off:
        said = ", ".join(f"{r} asked, {e} used" for r, e in off)
        return CheckResult(check="link", subject=p.name, verdict=Verdict.FAIL,
                           detail=f"the transfer engine runs another link than the spec asked for: {said}",
                           fix="check spec.transfer.protocol and rdmaDevices against the node's devices; the "
                               "pod's log names what the engine found")
    used = sorted({lab.get("effective", "") for lab, _ in ranks})
    unsaid = any(link_matches(lab.get("backend", ""), lab.get("requested", ""), lab.get("effective", "")) is None
                 for lab, _ in ranks)
    return CheckResult(check="link", subject=p.name, verdict=Verdict.OK,
                       detail=f"{len(ranks)} rank(s) on {', '.join(used)}, "
                              + ("not pinned to a protocol: the engine picks (not checked)" if unsaid else "as asked"))


def _version(p: ObservedPod, m: PodMetrics) -> CheckResult:
    assert m.now is not None
    info = m.now.samples.get(INFO, ())
    if not info:
        return CheckResult(check="version", subject=p.name, verdict=Verdict.CANNOT_CHECK,
                           detail=f"the pod exports no {INFO} (not pdfleet's runtime, or an older one)")
    labels = info[0][0]
    running, expected = labels.get("version", ""), labels.get("expected", "")
    engine = labels.get("stand_in_for", "")
    said = f"runtime {running}" + (f", standing in for {engine}" if engine else "")
    if running != expected:
        return CheckResult(check="version", subject=p.name, verdict=Verdict.FAIL,
                           detail=f"its image runs {said}; the spec's runtimeVersion is {expected}",
                           fix="set the role's image to the runtime version the spec names (or the spec's "
                               "runtimeVersion to the image's), which rolls the role")
    return CheckResult(check="version", subject=p.name, verdict=Verdict.OK, detail=f"{said}, as the spec asks")


def _versions(pods: Sequence[ObservedPod], metrics: Mapping[str, PodMetrics]) -> CheckResult | None:
    """Routable pods running more than one runtime or engine version at once (a rollout in progress, or one
    stuck): said with the pods; vLLM refuses pairs across versions."""
    seen: dict[str, list[str]] = {}
    for p in _live(pods):
        m = metrics.get(p.name)
        info = m.now.samples.get(INFO, ()) if m is not None and m.now is not None else ()
        if info and p.ready and p.drain_started is None:
            labels = info[0][0]
            key = labels.get("version", "") + (f" ({labels['stand_in_for']})" if labels.get("stand_in_for") else "")
            seen.setdefault(key, []).append(p.name)
    if len(seen) <= 1:
        return None
    said = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(seen.items()))
    return CheckResult(check="versions", subject="fleet", verdict=Verdict.FAIL,
                       detail=f"routable pods run {len(seen)} versions at once ({said})",
                       fix="let the rollout finish; vLLM refuses to pair two versions (docs/vllm.md)")


def _running_matrix(spec: Mapping[str, Any], pods: Sequence[ObservedPod],
                    metrics: Mapping[str, PodMetrics]) -> CheckResult:
    """The spec through the capability matrix with the runtime versions the live pods report in place of the ones
    it names, for every prefill and decode version running at once: admission checked the spec's versions, but
    what pairs is what runs (an image tag that moved, a rollout half done)."""
    running: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
    for p in _live(pods):
        m = metrics.get(p.name)
        info = m.now.samples.get(INFO, ()) if m is not None and m.now is not None else ()
        if info and info[0][0].get("version"):
            running[p.role].add(info[0][0]["version"])
    if not running[Role.PREFILL] or not running[Role.DECODE]:
        return CheckResult(check="matrix", subject="fleet", verdict=Verdict.CANNOT_CHECK,
                           detail=f"no {' or '.join(r.value for r in running if not running[r])} pod exports "
                                  f"{INFO} (an engine beside the agent, or an older runtime): the running versions "
                                  "are unknown")
    spec_verdict = check_matrix(spec)
    if spec_verdict is None:
        return CheckResult(check="matrix", subject="fleet", verdict=Verdict.CANNOT_CHECK,
                           detail="the deployment's spec does not parse as this operator's PDDeployment spec")
    admitted = {(v.rule, v.message) for v in spec_verdict.violations}
    broken: list[str] = []
    fixes: list[str] = []
    pairs = sorted(product(running[Role.PREFILL], running[Role.DECODE]))
    for pv, dv in pairs:
        verdict = check_matrix({**spec, "prefill": {**(spec.get("prefill") or {}), "runtimeVersion": pv},
                                "decode": {**(spec.get("decode") or {}), "runtimeVersion": dv}})
        for v in verdict.violations if verdict is not None else ():
            if (v.rule, v.message) not in admitted:
                broken.append(f"prefill {pv} with decode {dv}: {v.rule}: {v.message}")
                if v.fix not in fixes:
                    fixes.append(v.fix)
    said = ", ".join(f"prefill {pv} with decode {dv}" for pv, dv in pairs)
    if broken:
        return CheckResult(check="matrix", subject="fleet", verdict=Verdict.FAIL,
                           detail="the running runtime versions break the capability matrix: " + "; ".join(broken),
                           fix=" ".join(fixes) + " Run the versions the spec names (pdfleet explain-rule RULE).")
    return CheckResult(check="matrix", subject="fleet", verdict=Verdict.OK,
                       detail=f"the running runtime versions pass the capability matrix ({said})")


def _canary_speed(p: ObservedPod, m: PodMetrics) -> CheckResult:
    assert m.now is not None
    speeds = m.now.by(CANARY_GBPS, "peer")
    floor = m.now.total(FLOOR_GBPS)
    if not speeds:
        return CheckResult(check="canary-throughput", subject=p.name, verdict=Verdict.CANNOT_CHECK,
                           detail=f"the pod exports no {CANARY_GBPS} (no canary measured yet)")
    slow = {peer: v for peer, v in speeds.items() if floor > 0 and v < floor}
    if slow:
        said = ", ".join(f"{peer} {v:.3g} GB/s" for peer, v in sorted(slow.items()))
        return CheckResult(check="canary-throughput", subject=p.name, verdict=Verdict.FAIL,
                           detail=f"last canaries below the {floor:.3g} GB/s floor: {said}",
                           fix="a slow link (TCP where RDMA was meant, a far NUMA or PCI root): see the link check "
                               "and the pods' placement")
    best = ", ".join(f"{peer} {v:.3g} GB/s" for peer, v in sorted(speeds.items()))
    return CheckResult(check="canary-throughput", subject=p.name, verdict=Verdict.OK,
                       detail=f"last canaries: {best}" + (f" (floor {floor:.3g} GB/s)" if floor > 0 else " (no floor)"))


class Received(BaseModel):
    """Where an engine counts its answers and the prefilled state it received (a decode's), as it exports them."""

    model_config = ConfigDict(frozen=True)

    engine: str
    answered: str
    received: str
    where: Mapping[str, str] = {}


RECEIVED_PDFLEET = Received(engine="pdfleet's runtime", answered=ANSWERED, received=TRANSFERS,
                            where={"role": "decode", "kind": "request", "outcome": "success"})
RECEIVED_SGLANG = Received(engine="SGLang", answered="sglang:num_requests_total",
                           received="sglang:per_stage_req_latency_seconds_count", where={"stage": "decode_transferred"})
"""SGLang 0.5.23 (``--enable-metrics``): a PD decode observes the ``decode_transferred`` stage for each request whose
KV arrived (``observability/req_time_stats.py``); one without its decode mode observes ``request_process`` instead."""
RECEIVED_VLLM_NIXL = Received(engine="vLLM (NIXL)", answered="vllm:request_success_total",
                              received="vllm:nixl_xfer_time_seconds_count")
"""vLLM 0.33's NIXL connector: the decode reads the blocks and records each transfer (``nixl/stats.py``)."""


def received_counts(m: Metrics, backend: str | None, engine: str | None = None) -> Received | str:
    """Which engine's counts the pod exports, or why the check cannot run (said per engine). ``engine``: the
    deployment's ``spec.engine.kind``; an engine pod is read by its engine's own names (its engine container's
    /metrics), whatever else the pod exports, as a real SGLang or vLLM exports only those."""
    vllm_push = (f"vLLM with {backend or 'this connector'}: its decode does not count the state it received (the "
                 "prefill pushes; vllm:mooncake_* counts sends and failed receives only)")
    if engine == "sglang":
        return RECEIVED_SGLANG if m.has(RECEIVED_SGLANG.answered) else (
            f"the SGLang engine exports no {RECEIVED_SGLANG.answered} (started without --enable-metrics, or its "
            "/metrics could not be read)")
    if engine == "vllm":
        if not m.has(RECEIVED_VLLM_NIXL.answered):
            return f"the vLLM engine exports no {RECEIVED_VLLM_NIXL.answered} (its /metrics could not be read)"
        return RECEIVED_VLLM_NIXL if backend == "nixl" else vllm_push
    # the built-in runtime's pods (or an engine pod the spec does not name): whichever counts it exports
    if m.has(RUNTIME_MARK) and m.has(ANSWERED):
        return RECEIVED_PDFLEET
    if m.has(RECEIVED_SGLANG.answered):
        return RECEIVED_SGLANG
    if m.has(RECEIVED_VLLM_NIXL.answered):
        return RECEIVED_VLLM_NIXL if backend == "nixl" else vllm_push
    return (f"the pod exports neither pdfleet's {TRANSFERS}, SGLang's {RECEIVED_SGLANG.answered} nor vLLM's "
            f"{RECEIVED_VLLM_NIXL.answered} (its engine's /metrics could not be read, or metrics are off)")


def _state_received(p: ObservedPod, m: PodMetrics, window: str, backend: str | None,
                    engine: str | None) -> CheckResult:
    """A decode that answers more requests than it received prefilled state for recomputes prompts: PD is not
    happening while every gate reads healthy (a decode engine started without its PD mode, a router not in PD mode)."""
    assert m.now is not None
    counts = received_counts(m.now, backend, engine)
    if isinstance(counts, str):
        return CheckResult(check="state-received", subject=p.name, verdict=Verdict.CANNOT_CHECK, detail=counts)
    answered = m.increase(counts.answered)
    received = m.increase(counts.received, **counts.where)
    said = f"{answered:g} requests answered, {received:g} received prefilled state {window} ({counts.engine})"
    if answered - received > max(ANSWER_SLACK, 0.1 * answered):
        return CheckResult(check="state-received", subject=p.name, verdict=Verdict.FAIL,
                           detail=f"{said}: the decode recomputes prompts (PD is not happening)",
                           fix="check the decode's PD settings (SGLang --disaggregation-mode decode; vLLM "
                               "kv_transfer_config kv_role kv_consumer) and that the router runs in PD mode")
    return CheckResult(check="state-received", subject=p.name, verdict=Verdict.OK, detail=said)


def _pod_metrics_checks(p: ObservedPod, m: PodMetrics | None, window: str, backend: str | None,
                        engine: str | None) -> list[CheckResult]:
    if m is None or m.now is None:
        why = m.error if m is not None and m.error else "not read"
        return [CheckResult(check="metrics", subject=p.name, verdict=Verdict.CANNOT_CHECK,
                            detail=f"its /metrics could not be read ({why}): the counter checks cannot run",
                            fix="the doctor reads /metrics through the apiserver's pod proxy: it needs "
                                "pods/proxy get, and the pod's NetworkPolicy must admit the apiserver")]
    out = [
        _counter_check("transfer-failures", p, m, FAILURES, "reason", what="failed transfers", window=window,
                       fix=f"the reasons name the step; kubectl logs {p.name} says which peer"),
        _counter_check("state-integrity", p, m, MISMATCHED, None, what="bytes that failed verification",
                       window=window, fix="state arrived different from what the prefill wrote: a layout or "
                       "engine mismatch between the roles, or a faulty link; roll both roles to one revision"),
        _transport(p, m),
        _version(p, m),
    ]
    if p.role is Role.PREFILL:
        out.append(_counter_check("unclaimed-state", p, m, EXPIRED, None, what="rooms that expired unclaimed "
                                  "(state prefilled that no decode took)", window=window,
                                  fix="decodes that never claim: their handshake or router pairing fails; see the "
                                      "decodes' transfer-failures"))
    else:
        out.append(_counter_check("handshake", p, m, REFUSALS, "reason", what="vLLM-contract pairs refused",
                                  window=window, fix="engine_id: pin prefill engine ids (--pin-engine-id); "
                                  "compatibility: the roles run two generations, let the rollout finish"))
        out.append(_canary_speed(p, m))
        out.append(_state_received(p, m, window, backend, engine))
    return out


def diagnose(pods: Sequence[ObservedPod], metrics: Mapping[str, PodMetrics], *,
             window_s: float | None = None, router: RouterState | None = None,
             backend: str | None = None, engine: str | None = None,
             spec: Mapping[str, Any] | None = None, routers: Mapping[str, Sequence[Metrics | str]] | None = None,
             worker_ips: Collection[str] | None = None) -> list[CheckResult]:
    """Every check over ``pods`` (the deployment's, as ``observe`` reads them), their ``metrics``, the ``router``
    Deployment's state (None: none read, so every routable pod counts as paired), the spec's transfer
    ``backend`` and ``engine`` kind (which engine's counters say what a decode received), and the stored
    ``spec`` (run through the matrix with the versions the pods run; None: that check is left out), and each
    router pod's metrics (one read, or two ``ROUTER_RECHECK_S`` apart) against ``worker_ips`` (default: the pods'
    addresses; None for ``routers``: not read, ``cannot-check``)."""
    window = f"in the last {window_s:g} s" if window_s else "since the pod started"
    live = sorted(_live(pods), key=lambda p: (p.role.value, p.name))
    out = [_generations(pods, router)]
    if not any(p.role is Role.PREFILL for p in live) or not any(p.role is Role.DECODE for p in live):
        out.append(CheckResult(check="fleet", subject="fleet", verdict=Verdict.FAIL,
                               detail="no running " + ("prefill" if not any(p.role is Role.PREFILL for p in live)
                                                       else "decode") + " pod: nothing can be served",
                               fix="kubectl get pdd and its Progressing condition say why"))
    for p in live:
        out.append(_transfer_path(p))
        out += _pod_metrics_checks(p, metrics.get(p.name), window, backend, engine)
    versions = _versions(pods, metrics)
    if versions is not None:
        out.append(versions)
    if spec is not None:
        out.append(_running_matrix(spec, pods, metrics))
    if routers is None:
        out.append(CheckResult(check="router-workers", subject="fleet", verdict=Verdict.CANNOT_CHECK,
                               detail="the router pods' metrics were not read"))
    else:
        ips = worker_ips if worker_ips is not None else {p.ip for p in pods if p.ip}
        out.append(_router_workers(routers, ips))
    return out


def failed(results: Iterable[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.verdict is Verdict.FAIL]
