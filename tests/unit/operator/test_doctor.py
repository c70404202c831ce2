"""`pdfleet doctor`'s checks on what the pods really export: the metrics text of the runtime's own registry
(``ServerMetrics``), parsed as the command parses a pod's /metrics, and pods as ``observe`` reads them."""

from __future__ import annotations

from pathlib import Path

import yaml
from prometheus_client import generate_latest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.commands.doctor import format_results, parse_metrics
from pdfleet_operator.doctor import PodMetrics, Verdict, diagnose, failed
from pdfleet_operator.observed import Generation, ObservedPod, RouterState
from pdfleet_runtime.pod.metrics import ServerMetrics
from pdfleet_runtime.pod.seeded_load import LoadMetrics

REPO = Path(__file__).resolve().parents[3]


def _pod(name: str, role: Role, *, compat: str = "k1", gate: str | None = "True", message: str = "",
         draining: bool = False) -> ObservedPod:
    return ObservedPod(name=name, role=role, revision="r1", index=0, ready=gate == "True", gate=gate,
                       gate_message=message, compat=compat, ip="10.0.0.1",
                       drain_started=1.0 if draining else None)


def _healthy(role: str, version: str = "0.1.0", expected: str = "0.1.0", engine: str = "",
             answered: int = 5) -> ServerMetrics:
    return _healthy_with_load(role, version, expected, engine, answered)[0]


def _healthy_with_load(role: str, version: str = "0.1.0", expected: str = "0.1.0", engine: str = "",
                       answered: int = 5) -> tuple[ServerMetrics, LoadMetrics]:
    m = ServerMetrics(role)
    load = LoadMetrics(m.registry, "m", role, 1024)
    for _ in range(answered):  # each answer's state received (a decode), or its prompt computed (a prefill)
        load.requests.inc()
        m.transfers.labels(role, "request", "success").inc()
    m.ready.set(1)
    m.info.labels(version, expected, engine).set(1)
    m.transport.labels("0", "mooncake", "tcp", "tcp", "tcp", "false").set(1)
    if role == "decode":
        m.floor_gbps.set(0.5)
        m.canary_gbps.labels("p-0").set(2.0)
    return m, load


def _read(m: ServerMetrics) -> PodMetrics:
    return PodMetrics(now=parse_metrics(generate_latest(m.registry).decode()))


def _verdicts(results: list, subject: str) -> dict[str, Verdict]:
    return {r.check: r.verdict for r in results if r.subject == subject}


def test_a_healthy_fleet_passes_and_says_what_it_cannot_check() -> None:
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE), _pod("d-1", Role.DECODE)]
    results = diagnose(pods, {"p-0": _read(_healthy("prefill")), "d-0": _read(_healthy("decode")),
                              "d-1": _read(_healthy("decode"))})
    assert failed(results) == [], format_results("x", "ns", results)
    assert _verdicts(results, "d-0") == {"transfer-path": Verdict.OK, "transfer-failures": Verdict.OK,
                                         "state-integrity": Verdict.OK, "link": Verdict.OK, "version": Verdict.OK,
                                         "handshake": Verdict.OK, "canary-throughput": Verdict.OK,
                                         "state-received": Verdict.OK}
    assert _verdicts(results, "fleet")["router-workers"] is Verdict.CANNOT_CHECK
    assert "no check failed" in format_results("x", "ns", results)


def test_each_fault_fails_its_check_with_the_fix() -> None:
    pre, dec = _healthy("prefill"), _healthy("decode")
    dec.failures.labels("decode", "timeout").inc(3)
    dec.mismatched.inc(4096)
    dec.canary_gbps.labels("p-0").set(0.1)  # below the 0.5 floor
    pre.transport.labels("1", "mooncake", "rdma", "tcp", "tcp", "false").set(1)  # RDMA asked, TCP used
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE),
            _pod("d-9", Role.DECODE, compat="k2"),  # another generation, routable
            _pod("d-5", Role.DECODE, gate="False", message="CanaryFailed: bytes differ from p-0")]
    results = diagnose(pods, {"p-0": _read(pre), "d-0": _read(dec), "d-9": _read(_healthy("decode")),
                              "d-5": PodMetrics(error="503 Service Unavailable")})
    bad = {(r.check, r.subject): r for r in failed(results)}
    assert set(bad) == {("generations", "fleet"), ("transfer-failures", "d-0"), ("state-integrity", "d-0"),
                        ("canary-throughput", "d-0"), ("link", "p-0"), ("transfer-path", "d-5")}, sorted(bad)
    assert bad[("transfer-failures", "d-0")].detail == "failed transfers since the pod started: 3 timeout"
    assert "rdma asked, tcp used" in bad[("link", "p-0")].detail
    assert "decode pods of 2 keys (k1: d-0; k2: d-9)" in bad[("generations", "fleet")].detail
    assert "bytes differ from p-0" in bad[("transfer-path", "d-5")].detail
    assert all(r.fix for r in bad.values())
    assert _verdicts(results, "d-5")["metrics"] is Verdict.CANNOT_CHECK  # unread metrics are never "ok"


def test_counters_are_judged_over_the_window_and_draining_pods_are_not_a_generation() -> None:
    dec = _healthy("decode")
    dec.failures.labels("decode", "timeout").inc(3)
    before = _read(dec)
    later = _read(dec)  # nothing new in the window
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE), _pod("d-old", Role.DECODE, compat="k0",
                                                                       draining=True)]
    results = diagnose(pods, {"p-0": _read(_healthy("prefill")),
                              "d-0": PodMetrics(now=later.now, before=before.now)}, window_s=10)
    assert failed(results) == [], format_results("x", "ns", results)
    dec.failures.labels("decode", "timeout").inc()
    results = diagnose(pods, {"d-0": PodMetrics(now=_read(dec).now, before=before.now)}, window_s=10)
    assert [r.detail for r in failed(results)] == ["failed transfers in the last 10 s: 1 timeout"]


def test_an_engine_pod_without_the_runtimes_counters_cannot_be_checked_never_ok() -> None:
    agent_text = "# TYPE pdfleet_agent_canaries_total counter\npdfleet_agent_canaries_total{result=\"ok\"} 4\n"
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)]
    results = diagnose(pods, {"p-0": PodMetrics(now=parse_metrics(agent_text)),
                              "d-0": PodMetrics(now=parse_metrics(agent_text))})
    assert {c: v for c, v in _verdicts(results, "d-0").items() if c != "transfer-path"} == {
        "transfer-failures": Verdict.CANNOT_CHECK, "state-integrity": Verdict.CANNOT_CHECK,
        "link": Verdict.CANNOT_CHECK, "version": Verdict.CANNOT_CHECK, "handshake": Verdict.CANNOT_CHECK,
        "canary-throughput": Verdict.CANNOT_CHECK, "state-received": Verdict.CANNOT_CHECK}


def test_versions_the_pods_run_against_the_spec_and_each_other() -> None:
    """A pod whose image runs another runtime than the spec names fails ``version``; routable pods standing in for
    two engine versions at once (a rollout through a router that pairs them) fail ``versions``."""
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE), _pod("d-1", Role.DECODE)]
    results = diagnose(pods, {"p-0": _read(_healthy("prefill", engine="vllm==0.33.0")),
                              "d-0": _read(_healthy("decode", version="0.1.1", engine="vllm==0.33.0")),
                              "d-1": _read(_healthy("decode", engine="vllm==0.33.1"))})
    bad = {(r.check, r.subject): r.detail for r in failed(results)}
    assert set(bad) == {("version", "d-0"), ("versions", "fleet")}, bad
    assert bad[("version", "d-0")] == ("its image runs runtime 0.1.1, standing in for vllm==0.33.0; the spec's "
                                       "runtimeVersion is 0.1.0")
    assert "0.1.0 (vllm==0.33.0): p-0; 0.1.0 (vllm==0.33.1): d-1; 0.1.1 (vllm==0.33.0): d-0" in \
        bad[("versions", "fleet")]


def test_a_decode_answering_more_than_it_received_state_for_recomputes() -> None:
    """Answers without state received (the decode recomputed the prompt): PD is not happening while the gates read
    healthy. Judged over the window; a couple of answers whose state arrived before it began are no fault."""
    dec, load = _healthy_with_load("decode", answered=0)
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)]

    def window(answers: int, received: int) -> list:
        before = _read(dec)
        for _ in range(answers):
            load.requests.inc()
        dec.transfers.labels("decode", "request", "success").inc(received)
        return diagnose(pods, {"d-0": PodMetrics(now=_read(dec).now, before=before.now)}, window_s=30)

    [ok] = [r for r in window(12, 10) if r.check == "state-received"]
    assert ok.verdict is Verdict.OK and ok.detail == ("12 requests answered, 10 received prefilled state in the last 30 s "
                                                 "(pdfleet's runtime)")
    [bad] = [r for r in failed(window(40, 10)) if r.check == "state-received"]
    assert "40 requests answered, 10 received prefilled state" in bad.detail and "recomputes" in bad.detail and bad.fix


def test_the_doctor_reads_the_port_a_pod_declares_as_metrics() -> None:
    """The built-in runtime's pods declare ``metrics`` (8090: /metrics alone); an agent's pod without it is read on
    the HTTP port, where the agent serves its own. The number is what the pod proxy takes."""
    import copy

    from pdfleet_operator.commands.doctor import metrics_port
    from pdfleet_operator.resources.pods import runtime_pod
    from pdfleet_runtime.config import HTTP_PORT, METRICS_PORT
    from tests.unit.operator.test_canary_period import spec

    pod = runtime_pod("d", "ns", spec(None), Role.DECODE, "rev", 0)
    assert metrics_port(pod) == METRICS_PORT
    bare = copy.deepcopy(pod)
    for c in bare["spec"]["containers"]:
        c["ports"] = [p for p in c.get("ports") or () if p["name"] != "metrics"]
    assert metrics_port(bare) == HTTP_PORT


def test_the_link_check_reads_each_engines_own_transport_names() -> None:
    """NIXL reports ``ucx:<UCX_TLS>`` (tcp stays listed beside cma or cuda_ipc for wire-up), Mooncake its own
    protocol names (nvlink_intra): the check compares them with the protocol's accepted transports, not as
    strings; an engine's own setting that forces TCP under another protocol fails it."""
    rows = [("nixl", "tcp", "ucx:tcp", True), ("nixl", "shm", "ucx:cma,tcp", True),
            ("nixl", "nvlink", "ucx:cuda_ipc,cuda_copy,tcp", True), ("nixl", "shm", "ucx:tcp", False),
            ("nixl", "rdma", "ucx:tcp", False), ("mooncake", "nvlink", "nvlink_intra", True),
            ("mooncake", "rdma", "tcp", False), ("nixl", "tcp", "unpinned", None)]
    for backend, asked, used, ok in rows:
        dec = _healthy("decode")
        dec.transport.clear()
        dec.transport.labels("0", backend, asked, "ucx", used, "true").set(1)
        [link] = [r for r in diagnose([_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)],
                                      {"p-0": _read(_healthy("prefill")), "d-0": _read(dec)})
                  if r.check == "link" and r.subject == "d-0"]
        assert link.verdict is (Verdict.FAIL if ok is False else Verdict.OK), (backend, asked, used, link.detail)
        if ok is False:
            assert f"{asked} asked, {used} used" in link.detail


def test_generations_count_the_pods_the_routers_selectors_pair() -> None:
    """A router whose selectors carry a generation pairs only its pods: ready pods of the next generation wait for
    its switch (said, not failed); selectors without one pair every routable pod, so two keys fail."""
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE), _pod("p-1", Role.PREFILL, compat="k2"),
            _pod("d-1", Role.DECODE, compat="k2"), _pod("d-2", Role.DECODE, compat="k2", draining=True)]
    metrics = {p.name: _read(_healthy(p.role.value)) for p in pods}

    def check(router: RouterState | None):
        [r] = [r for r in diagnose(pods, metrics, router=router) if r.check == "generations"]
        return r

    by_generation = check(RouterState(Generation("k1", "k1"), settled=True))
    assert by_generation.verdict is Verdict.OK, by_generation.detail
    assert "2 ready pod(s) of another generation wait for the router's switch: d-1, p-1" in by_generation.detail
    unkeyed = check(RouterState(None, settled=True))
    assert unkeyed.verdict is Verdict.FAIL and "prefill pods of 2 keys (k1: p-0; k2: p-1)" in unkeyed.detail
    assert "decode pods of 2 keys (k1: d-0; k2: d-1)" in unkeyed.detail and "carry no generation" in unkeyed.detail


SGLANG_DECODE = """# TYPE sglang:num_requests counter
sglang:num_requests_total{model_name="m"} ANSWERED
# TYPE sglang:per_stage_req_latency_seconds histogram
sglang:per_stage_req_latency_seconds_bucket{stage="decode_transferred",le="+Inf"} RECEIVED
sglang:per_stage_req_latency_seconds_count{stage="decode_transferred"} RECEIVED
sglang:per_stage_req_latency_seconds_sum{stage="decode_transferred"} 1.5
sglang:per_stage_req_latency_seconds_count{stage="decode_waiting"} ANSWERED
"""
VLLM_DECODE = """# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} ANSWERED
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} RECEIVED
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.7
"""


def test_state_received_reads_sglangs_and_vllms_own_counts_on_engine_pods() -> None:
    """An engine pod's merged /metrics (the agent's and the engine's): SGLang 0.5.23 counts a PD decode's received
    requests as its ``decode_transferred`` stage, vLLM 0.33's NIXL decode its transfers (the names as in the pinned
    packages' metrics code). A decode that recomputes fails the check; vLLM with Mooncake cannot be checked."""
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)]

    def check(text: str, answered: int, received: int, backend: str) -> object:
        m = parse_metrics(text.replace("ANSWERED", str(answered)).replace("RECEIVED", str(received)))
        [r] = [r for r in diagnose(pods, {"d-0": PodMetrics(now=m)}, backend=backend)
               if r.check == "state-received" and r.subject == "d-0"]
        return r

    ok = check(SGLANG_DECODE, 20, 20, "mooncake")
    assert ok.verdict is Verdict.OK and ok.detail.endswith("(SGLang)"), ok.detail
    bad = check(SGLANG_DECODE, 20, 0, "mooncake")
    assert bad.verdict is Verdict.FAIL and "20 requests answered, 0 received" in bad.detail
    assert check(VLLM_DECODE, 9, 9, "nixl").verdict is Verdict.OK
    assert check(VLLM_DECODE, 30, 3, "nixl").verdict is Verdict.FAIL
    mooncake = check(VLLM_DECODE, 30, 3, "mooncake")
    assert mooncake.verdict is Verdict.CANNOT_CHECK and "does not count the state it received" in mooncake.detail
    bare = check("# TYPE up gauge\nup 1\n", 0, 0, "nixl")
    assert bare.verdict is Verdict.CANNOT_CHECK and "neither" in bare.detail


def test_an_engine_pod_is_read_by_its_engines_own_counts_even_beside_the_runtimes() -> None:
    """A stand-in's pod exports pdfleet's counts and the engine's names; the deployment's engine kind decides which
    the doctor reads, as a real engine exports only its own (so the doctor's SGLang and vLLM paths run on stand-ins).
    The built-in runtime's pods keep pdfleet's."""
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)]
    dec, load = _healthy_with_load("decode", answered=0)
    for _ in range(10):
        load.requests.inc()
    dec.transfers.labels("decode", "request", "success").inc(10)  # pdfleet's count: all received
    engine_text = "\n".join(line for text in (VLLM_DECODE, SGLANG_DECODE) for line in text.splitlines()
                            if "_seconds" in line).replace("RECEIVED", "0").replace("ANSWERED", "10") + "\n"
    merged = parse_metrics(generate_latest(dec.registry).decode() + engine_text)

    def verdict(engine: str | None, backend: str = "nixl") -> object:
        [r] = [r for r in diagnose(pods, {"d-0": PodMetrics(now=merged)}, backend=backend, engine=engine)
               if r.check == "state-received"]
        return r

    assert verdict(None).verdict is Verdict.OK and verdict(None).detail.endswith("(pdfleet's runtime)")
    assert verdict("pdfleet").verdict is Verdict.OK
    assert verdict("vllm").verdict is Verdict.FAIL and "(vLLM (NIXL)): the decode recomputes" in verdict("vllm").detail
    assert verdict("sglang").verdict is Verdict.FAIL and "(SGLang): the decode recomputes" in verdict("sglang").detail
    assert verdict("vllm", "mooncake").verdict is Verdict.CANNOT_CHECK
    bare = parse_metrics("# TYPE up gauge\nup 1\n")
    [r] = [r for r in diagnose(pods, {"d-0": PodMetrics(now=bare)}, engine="sglang") if r.check == "state-received"]
    assert r.verdict is Verdict.CANNOT_CHECK and "--enable-metrics" in r.detail


def test_the_doctor_also_reads_an_engine_containers_port() -> None:
    from pdfleet_operator.commands.doctor import engine_port

    pod = {"spec": {"containers": [{"name": "agent", "ports": [{"name": "http", "containerPort": 8080}]},
                                   {"name": "engine", "ports": [{"name": "engine-http", "containerPort": 30000}]}]}}
    assert engine_port(pod) == 30000
    assert engine_port({"spec": {"containers": [{"name": "runtime", "ports": []}]}}) is None


def test_the_versions_the_pods_run_go_through_the_capability_matrix() -> None:
    """Admission checked the spec's runtime versions; ``matrix`` checks the ones running (a moved image tag): a
    decode on a runtime this operator's matrix does not know fails with the rule and its fix, and a fleet whose
    pods export no version cannot be checked, never ok."""
    raw = yaml.safe_load((REPO / "examples" / "valid" / "llama-dense.yaml").read_text())["spec"]
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)]
    ok = diagnose(pods, {"p-0": _read(_healthy("prefill")), "d-0": _read(_healthy("decode"))}, spec=raw)
    [matrix] = [r for r in ok if r.check == "matrix"]
    assert matrix.verdict is Verdict.OK and "prefill 0.1.0 with decode 0.1.0" in matrix.detail, matrix

    moved = diagnose(pods, {"p-0": _read(_healthy("prefill")), "d-0": _read(_healthy("decode", version="0.9.0"))},
                     spec=raw)
    [matrix] = [r for r in moved if r.check == "matrix"]
    assert matrix.verdict is Verdict.FAIL, matrix
    assert "prefill 0.1.0 with decode 0.9.0: runtime-version-unknown: decode runtime version '0.9.0' is unknown" \
        in matrix.detail and matrix.fix, matrix

    engine_pods = diagnose(pods, {"p-0": _read(ServerMetrics("prefill")), "d-0": _read(_healthy("decode"))},
                           spec=raw)
    [matrix] = [r for r in engine_pods if r.check == "matrix"]
    assert matrix.verdict is Verdict.CANNOT_CHECK and "no prefill pod exports" in matrix.detail, matrix


SGLANG_ROUTER = """# TYPE smg_worker_health gauge
smg_worker_health{{worker="http://10.0.0.1:8080"}} 1
smg_worker_health{{worker="http://10.0.0.2:8080"}} 1
smg_worker_health{{worker="http://10.0.0.3:8080"}} -1
{extra}"""
"""sglang-router 0.3.2's worker gauges as it exported them here: 10.0.0.3's worker was removed (-1)."""


def _router_check(reads: list[str], ips: set[str] | None = None) -> object:
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)]
    metrics = {"p-0": _read(_healthy("prefill")), "d-0": _read(_healthy("decode"))}
    results = diagnose(pods, metrics, routers={"r-0": [parse_metrics(text) for text in reads]},
                       worker_ips=ips if ips is not None else {"10.0.0.1", "10.0.0.2"})
    [check] = [r for r in results if r.check == "router-workers"]
    return check


def test_router_workers_no_pod_stands_behind_fail_when_both_reads_list_them() -> None:
    """A worker left for a deleted pod (listed by sglang-router, its address no pod's) fails in two reads; a
    removed worker's series (-1) and a worker swept between the reads do not; vllm-router's gauges cannot say."""
    clean = SGLANG_ROUTER.format(extra="")
    left = SGLANG_ROUTER.format(extra='smg_worker_health{worker="http://10.0.0.9:8080"} 0\n')
    assert _router_check([clean]).verdict is Verdict.OK  # -1: removed, not listed
    stale = _router_check([left, left])
    assert stale.verdict is Verdict.FAIL and "r-0 lists http://10.0.0.9:8080" in stale.detail and stale.fix, stale
    assert _router_check([left, clean]).verdict is Verdict.OK  # swept by the second read
    vllm = '# TYPE vllm_router_worker_health gauge\nvllm_router_worker_health{worker="http://10.0.0.9:8080"} 1\n'
    assert _router_check([vllm]).verdict is Verdict.CANNOT_CHECK
    pods = [_pod("p-0", Role.PREFILL), _pod("d-0", Role.DECODE)]
    for routers in (None, {}):
        [check] = [r for r in diagnose(pods, {}, routers=routers) if r.check == "router-workers"]
        assert check.verdict is Verdict.CANNOT_CHECK, check
