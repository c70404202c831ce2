"""The pod's Prometheus metrics (``GET /metrics``); names and labels are documented in docs/runtime-server.md.

One registry per pod server (no global default registry: two servers in one test process must not
share counters). The rank processes report to the pod process over their pipes; only the pod
process touches these objects, so no multiprocess mode is needed.

Roles count differently, as each sees a transfer: a decode pod counts a *request* (every rank of
the pod, end to end, bytes verified); a prefill pod counts a *leg* (one source rank writing to one
decode rank, as reported in its status).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from pdfleet_runtime.protocol.messages import RequestKind

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "SGLANG_INFLIGHT", "SGLANG_QUEUED", "SGLANG_RUNNING", "VLLM_ENGINE",
           "VLLM_LABELS", "VLLM_RUNNING", "VLLM_WAITING", "ReceivedMetrics", "ServerMetrics", "StagedCollector", "Twin", "sglang_gauges",
           "vllm_gauges"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# SGLang 0.5.23's names (python/sglang/srt/observability/metrics_collector.py): the agent's drain reads
# them from the engine, so the built-in runtime exports them too and one test suite covers both.
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_QUEUED = "sglang:num_queue_reqs"
SGLANG_INFLIGHT = "sglang:num_prefill_inflight_queue_reqs"
# vLLM 0.33's names and labels (vllm/v1/metrics/loggers.py, PrometheusStatLogger): the built-in runtime speaks
# vLLM's PD contract too (pod.vllm_contract), so a dashboard or autoscaler written for vLLM reads its pods.
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_LABELS = ("model_name", "engine")
SGLANG_STAGE_BUCKETS = tuple(0.001 * 1.62 ** i for i in range(30))  # SGLang's exponential_buckets(0.001, 1.62, 30)
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)  # vLLM's nixl/stats.py
VLLM_ENGINE = "0"
"""The ``engine`` label's value: a pod is one engine (vLLM numbers its data-parallel engines)."""
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Every metric of one pod. ``kind`` is ``request`` or ``canary`` (the readiness check's own transfers): the
    request's ``RequestKind``, a room's claim counted as a request."""

    def __init__(self, role: str) -> None:
        self.role = role
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.transfers = Counter("pdfleet_transfers", "Transfers finished, by outcome (decode: requests; "
                                 "prefill: legs written to one decode rank)", ["role", "kind", "outcome"], registry=r)
        self.bytes = Counter("pdfleet_transfer_bytes", "Bytes moved by transfers that succeeded",
                             ["role", "kind"], registry=r)
        self.seconds = Histogram("pdfleet_transfer_seconds", "Transfer latency (decode: whole request; prefill: "
                                 "engine write of one leg)", ["role", "kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.failures = Counter("pdfleet_transfer_failures", "Failed transfers by reason (the request state "
                                "machine's FailureReason, or verify, busy, conflict, rank)", ["role", "reason"],
                                registry=r)
        self.state_bytes = Counter("pdfleet_transfer_state_bytes", "Bytes of request state moved by transfers that "
                                   "succeeded, by state type (kv, mamba, swa, ...): the layout's split of a transfer whose "
                                   "total it matched (decode pods)", ["role", "kind", "state"], registry=r)
        self._split: Callable[[int], Mapping[str, int]] | None = None
        self.in_flight = Gauge("pdfleet_transfers_in_flight", "Transfers accepted and not finished", ["role"],
                               registry=r)
        self.transport = Gauge("pdfleet_transport_info", "The transport each rank's engine runs (value 1)",
                               ["rank", "backend", "requested", "engine_protocol", "effective", "pinned"], registry=r)
        self.canary_gbps = Gauge("pdfleet_canary_throughput_gbps", "Engine write throughput of the last canary "
                                 "per prefill pod (decode pods)", ["peer"], registry=r)
        self.canary_ok = Gauge("pdfleet_canary_peer_ok", "1 when the last canary through this prefill pod passed, 0 "
                               "when it failed (decode pods; a failed pair is reported here, acted on only when most "
                               "prefill pods fail)", ["peer"], registry=r)
        self.floor_gbps = Gauge("pdfleet_canary_floor_gbps", "Readiness floor of canary throughput for the "
                                "configured protocol", registry=r)
        self.ready = Gauge("pdfleet_ready", "1 when /readyz answers ready (the transfer-path gate)", registry=r)
        self.info = Gauge("pdfleet_runtime_info", "What this pod runs (value 1): the runtime's version, the one its "
                          "config (the operator) expects, and the engine it stands in for ('' when none)",
                          ["version", "expected", "stand_in_for"], registry=r)
        self.draining = Gauge("pdfleet_draining", "1 while the pod drains", registry=r)
        self.drains = Counter("pdfleet_drains", "Drains finished, by result (drained | forced: budget ran out)",
                              ["result"], registry=r)
        self.drain_window = Histogram("pdfleet_drain_window_seconds", "How long a drain kept admitting while the "
                                      "routers dropped the pod, by what ended it (routers: every router failed its "
                                      "health checks, then the grace; bound: routerDropSeconds)", ["ended"],
                                      buckets=(0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 15, 30, 60), registry=r)
        self.mismatched = Counter("pdfleet_verify_mismatched_bytes", "Bytes of synthetic requests that arrived "
                                  "different from the seeded state (decode pods)", registry=r)
        self.ranks_up = Gauge("pdfleet_rank_processes_up", "Rank processes running", registry=r)
        self.pool_held = Gauge("pdfleet_pool_requests_held", "Requests holding pool items, summed over the ranks, "
                               "by why: running (a transfer has them), fencing (failed, kept until no write can "
                               "land), orphaned (neither: the rank gives them back after a grace)", ["reason"],
                               registry=r)
        for reason in ("running", "fencing", "orphaned"):
            self.pool_held.labels(reason).set(0)
        self.pool_free = Gauge("pdfleet_pool_items_free", "Free pool items of the rank with the fewest, per index "
                               "kind (page, swa_page, slot, row)", ["kind"], registry=r)
        self.pool_reclaimed = Counter("pdfleet_pool_requests_reclaimed", "Orphaned requests whose items a rank "
                                      "gave back (held with nothing running or fencing past the grace: a bug)",
                                      registry=r)
        self._reclaimed_seen: dict[int, int] = {}
        self._peers: set[str] = set()
        self.staged = StagedCollector(role)
        r.register(self.staged)

    def pools(self, held_by: Mapping[str, int], free: Mapping[str, int], reclaimed: Mapping[int, int]) -> None:
        """The ranks' latest accounting (``RankStats``): held by reason, the lowest free count, reclaims per rank."""
        for reason in ("running", "fencing", "orphaned"):
            self.pool_held.labels(reason).set(held_by.get(reason, 0))
        for kind, n in free.items():
            self.pool_free.labels(kind).set(n)
        for rank, n in reclaimed.items():
            if n > self._reclaimed_seen.get(rank, 0):
                self.pool_reclaimed.inc(n - self._reclaimed_seen.get(rank, 0))
            self._reclaimed_seen[rank] = n

    def canary(self, peer: str, gbps: float, ok: bool) -> None:
        self.canary_gbps.labels(peer).set(gbps)
        self.canary_ok.labels(peer).set(1 if ok else 0)
        self._peers.add(peer)

    def forget_peers(self, keep: set[str]) -> None:
        """Prefill pods discovery no longer names: their canary gauge goes (a series per pod ever seen
        would grow with every rollout)."""
        for peer in self._peers - keep:
            for gauge in (self.canary_gbps, self.canary_ok):
                with contextlib.suppress(KeyError):
                    gauge.remove(peer)
        self._peers &= keep

    def in_flight_from(self, fn: Callable[[], float]) -> None:
        self.in_flight.labels(self.role).set_function(fn)

    def split_states_with(self, split: Callable[[int], Mapping[str, int]]) -> None:
        """How a request of N tokens splits by state type (``openai_api.request_state_bytes_by_state``)."""
        self._split = split

    def transfer(self, kind: RequestKind, ok: bool, nbytes: int, seconds: float, reason: str | None = None,
                 tokens: int | None = None) -> None:
        kind_label = "canary" if kind is RequestKind.CANARY else "request"
        self.transfers.labels(self.role, kind_label, "success" if ok else "failed").inc()
        if ok:
            self.bytes.labels(self.role, kind_label).inc(nbytes)
            self.seconds.labels(self.role, kind_label).observe(seconds)
            parts = self._split(tokens) if self._split is not None and tokens is not None else {}
            if parts and sum(parts.values()) == nbytes:  # a total the layout does not give is not split by guess
                for state, n in parts.items():
                    self.state_bytes.labels(self.role, kind_label, state).inc(n)
        else:
            self.failures.labels(self.role, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


_STAGED_HISTOGRAMS = (
    ("chunk_seconds", "pdfleet_staged_chunk_seconds", "Staged path (prefill): one chunk from its post to its landed "
     "count written"),
    ("landed_write_seconds", "pdfleet_staged_landed_write_seconds", "Staged path (prefill): one landed-count write "
     "(8 bytes through the engine)"),
    ("freed_read_seconds", "pdfleet_staged_freed_read_seconds", "Staged path (prefill): one freed-count read (8 "
     "bytes through the engine, only when the ring is full)"),
)


class StagedCollector:
    """The staged path's counters (``protocol.staged.StagedMetrics``), summed over the pod's ranks.

    Each rank keeps its own cumulative ``StagedMetrics`` and reports it in ``RankStats.staged``; the pod
    server hands the latest reports to ``update`` when it is scraped, and this collector renders them (as
    counters and histograms: the ranks' values only grow while they live). Prefill ranks count a leg per
    (source rank, decode rank) as written; decode ranks count a staged lane received and a direct request.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self._ranks: list[Mapping[str, Any]] = []

    def update(self, reports: Iterable[Mapping[str, Any]]) -> None:
        self._ranks = [r for r in reports if r]

    def describe(self) -> list[Metric]:
        return []  # rendered only when ranks reported: no empty families before the first scrape

    def collect(self) -> Iterator[Metric]:
        if not self._ranks:
            return
        role = self.role
        for key, name, doc in (("bytes", "pdfleet_staged_path_bytes", "Bytes written (prefill) or received "
                                "(decode) per path: staged (gathered, chunked, scattered) or direct"),
                               ("requests", "pdfleet_staged_path_requests", "Legs (prefill), or staged lanes and "
                                "direct requests (decode), per path")):
            fam = CounterMetricFamily(name, doc, labels=["role", "path"])
            paths = sorted({p for r in self._ranks for p in r.get(key, {})})
            for path in paths:
                fam.add_metric([role, path], float(sum(r.get(key, {}).get(path, 0) for r in self._ranks)))
            yield fam
        for key, name, doc in _STAGED_HISTOGRAMS:
            hists = [r[key] for r in self._ranks if key in r]
            if not hists:
                continue
            bounds = hists[0]["bounds"]
            counts = [sum(h["counts"][i] for h in hists) for i in range(len(bounds) + 1)]
            cumulative, total = [], 0
            for b, c in zip([*map(repr, map(float, bounds)), "+Inf"], counts, strict=True):
                total += c
                cumulative.append((b, float(total)))
            hist = HistogramMetricFamily(name, doc, labels=["role"])
            hist.add_metric([role], cumulative, sum_value=sum(h["sum"] for h in hists))
            yield hist


def sglang_gauges(registry: CollectorRegistry, model: str, role: str, running: Callable[[], float],
                  queued: Callable[[], float], inflight: Callable[[], float]) -> None:
    """The load gauges under SGLang's names and labels (``model_name``, ``engine_type``), read at scrape time.

    ``inflight``: prefill pods, requests whose state is still being written (SGLang's inflight queue)."""
    labels = {"model_name": model, "engine_type": role}
    for name, doc, fn in ((SGLANG_RUNNING, "The number of running requests.", running),
                          (SGLANG_QUEUED, "The number of requests in the waiting queue (held rooms on a prefill "
                           "pod).", queued)):
        Gauge(name, doc, list(labels), registry=registry).labels(**labels).set_function(fn)
    if role == "prefill":
        Gauge(SGLANG_INFLIGHT, "The number of requests in the prefill inflight queue (transfers in flight).",
              list(labels), registry=registry).labels(**labels).set_function(inflight)


def vllm_gauges(registry: CollectorRegistry, model: str, running: Callable[[], float], waiting: Callable[[], float],
                kv_usage: Callable[[], float]) -> None:
    """The load gauges under vLLM's names and labels, read at scrape time (the same values as SGLang's)."""
    for name, doc, fn in ((VLLM_RUNNING, "Number of requests in model execution batches.", running),
                          (VLLM_WAITING, "Number of requests waiting to be processed (held rooms on a prefill "
                           "pod).", waiting),
                          (VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", kv_usage)):
        Gauge(name, doc, list(VLLM_LABELS), registry=registry).labels(model, VLLM_ENGINE).set_function(fn)


class ReceivedMetrics:
    """A decode's requests whose prefilled state arrived, as each engine counts them (what the doctor's
    ``state-received`` check compares with the answers): SGLang 0.5.23 observes the ``decode_transferred`` stage
    of ``sglang:per_stage_req_latency_seconds`` (``observability/req_time_stats.py``), vLLM 0.33's NIXL connector
    observes ``vllm:nixl_xfer_time_seconds`` per transfer (``nixl/stats.py``; NIXL fleets only: its Mooncake
    connector counts no receive). A decode that recomputes observes neither."""

    def __init__(self, registry: CollectorRegistry, model: str, role: str, backend: str) -> None:
        self.sglang: Any = None
        self.vllm: Any = None
        if role != "decode":
            return
        self.sglang = Histogram("sglang:per_stage_req_latency_seconds", "The latency of each stage of requests.",
                                ["model_name", "engine_type", "stage"], buckets=SGLANG_STAGE_BUCKETS,
                                registry=registry).labels(model, role, "decode_transferred")
        if backend == "nixl":
            self.vllm = Histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache "
                                  "transfers.", list(VLLM_LABELS), buckets=NIXL_XFER_BUCKETS,
                                  registry=registry).labels(model, VLLM_ENGINE)

    def observe(self, seconds: float) -> None:
        for h in (self.sglang, self.vllm):
            if h is not None:
                h.observe(seconds)


class Twin:
    """One counter or histogram kept under two engines' names (SGLang's, vLLM's): every call goes to both, so
    the two can never disagree."""

    def __init__(self, *children: Any) -> None:
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)
