"""Autoscaling both PD roles, simulated: pdfleet's planner against llm-d's documented KEDA setup and a
fixed prefill:decode ratio, on the same arrival traces, at 10, 100 and 1,000 replicas.

What one machine cannot hold (hundreds of GPUs for a day) is replayed against a queueing model of
the fleet, in one-second steps, with the controllers deciding every 15 s (an HPA's sync period):

* prefill: a pool of replicas, each computing ``prefill_tokens_per_s`` prompt tokens per second. A
  fluid FIFO carries the backlog when arrivals exceed the pool; below that, each request also waits
  the M/G/N queue's random wait (Halfin-Whitt's Erlang-C, Allen-Cunneen's service variability),
  whose tail decides the share of requests past their TTFT target. A request's own prefill takes
  ``prompt / prefill_tokens_per_s`` on one replica; its KV then crosses the link.
* decode: requests are admitted while the ready replicas have KV tokens and batch room (FIFO, else
  they wait: TTFT grows), then each generates its output at the pool's step time,
  ``max(weights_ms, per_request_ms * batch) + kv_ms * KV use`` (weights and KV read from HBM,
  batch compute), so inter-token latency follows batch and KV use as an engine's does.
* replicas take ``startup_s`` to become Ready; a removed replica drains (it holds its GPUs until its
  work is done: prefill its queue share, decode its longest running request at the p95 output)
  under every controller alike, and starting ones are cancelled first.

Requests are tracked in per-second cohorts over 24 prompt-length and 16 output-length bins (numpy),
so a day at 1,000 replicas costs what it costs at 10. Goodput = requests whose TTFT and mean
inter-token latency both meet their targets; reported per GPU-hour, with GPU-hours, scale events,
TTFT/ITL percentiles and the peak GPUs.

Controllers (all see the same metrics, instantaneously, and start from the same right-sized fleet):

* ``pdfleet``: the real ``pdfleet_operator.autoscale.planner``, prefill on backlog seconds (target
  1.5 s, the declared prefill rate), decode on KV-cache use (target 0.8), running requests (the
  batch a replica holds at 90% of the ITL target, as profiled) and the ITL target, llm-d's windows
  (0 s up, 300 s down), a loose ratio band and a GPU budget;
* ``llmd``: llm-d's token-aware KEDA setup for P/D as its guide ships it (LLMD_GUIDE): prefill on
  sum(in-flight prompt tokens) / peakPrefillThroughput, threshold 1.5 s per replica; decode on
  sum(kv_cache_usage_perc), threshold 0.8 per replica; AverageValue (desired = ceil(value /
  threshold), 10% tolerance); scale-up window 0 s at most 1 pod per 180 s, scale-down window 300 s
  at most 1 pod per 300 s; the calibrated rate is the model's exact one (a perfect calibration);
* ``llmd-fast``: the same triggers and windows with Kubernetes' default rate policies (up: 4 pods or
  100% per 15 s; down: 100% per 15 s), since the guide's one-pod policies were written for 1-10
  replicas;
* ``fixed-ratio`` / ``fixed-ratio-fast``: one HPA on decode replicas with both llm-d triggers (the
  prefill one divided by the ratio), the guide's rate policies / Kubernetes' defaults, and prefill =
  ratio x decode, the ratio being the one a right-sized fleet needs for the trace's initial mix
  (what a fixed-skew operator keeps);
* ``pdfleet-kv``: an ablation, pdfleet's planner with llm-d's one decode signal (KV-cache use).

Traces: a 24 h diurnal cycle (trough 30% of peak) with six bursts (x4 within 60 s, held 8 min,
back within 2 min), and a prompt-length shift (median 1k -> 8k tokens over 5 min after 90 min) at a
constant request rate for 4 h. Targets: TTFT <= 1.33 s + 0.814 ms per prompt token (the line
through the llm-d guide's example SLOs, 3 s at 2,048 and 8 s at 8,192 tokens; ~2.2 s at 1k), mean
ITL <= 50 ms. Size N: the replicas (both roles) a right-sized fleet needs at the trace's peak
(pre-burst) load; maxReplicas per role 3x its peak need, pdfleet's GPU budget 2.5x the peak GPUs.

Usage: PYTHONPATH=operator:runtime python bench/autoscale_sim.py [--sizes 10 100 1000]
       [--traces diurnal shift] [--controllers ...] [--set NAME=VALUE ...] [--out PATH]
(default output bench/results/autoscale-sim-<UTC time>.json). Target (issue 48): at 100 replicas, on
both traces, pdfleet's goodput per GPU-hour >= 1.2x that of llm-d's setup and of the fixed ratio,
each counted at the better of its two rate policies (``pdfleetRatioToBest``). Goodput per GPU-hour
rewards serving little with few GPUs: read it with ``goodShareOfOffered``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pdfleet_operator.api.autoscaling import AutoscalingSpec
from pdfleet_operator.autoscale.planner import PlannerState, plan
from pdfleet_operator.autoscale.signals import DecodeMetrics, PrefillMetrics, RoleFleet

LLMD_GUIDE = {
    "guide": "https://github.com/llm-d/llm-d/blob/main/guides/workload-autoscaling/keda-epp-token-aware/README.md",
    "prefill": "https://github.com/llm-d/llm-d/blob/main/guides/workload-autoscaling/keda-epp-token-aware/"
               "pd-disaggregation/base/prefill-scaledobject.yaml",
    "decode": "https://github.com/llm-d/llm-d/blob/main/guides/workload-autoscaling/keda-epp-token-aware/"
              "pd-disaggregation/base/decode-scaledobject.yaml",
    "prefillQuery": "sum(llm_d_epp_inflight_tokens{endpoint_name=~'.*prefill.*'}) / peakPrefillThroughput",
    "prefillThreshold": 1.5,
    "decodeQuery": "sum(vllm:kv_cache_usage_perc{pod=~'.*decode.*'})",
    "decodeThreshold": 0.8,
    "metricType": "AverageValue",
    "behavior": "scaleUp: window 0 s, Pods 1 per 180 s; scaleDown: window 300 s, Pods 1 per 300 s",
}
FAMILIES = {"llmd": ("llmd", "llmd-fast"), "fixed-ratio": ("fixed-ratio", "fixed-ratio-fast")}
HPA_SYNC_S = 15.0
WARMUP_S = 300.0
HPA_TOLERANCE = 0.1


@dataclass(frozen=True)
class Calibration:
    """One replica per role, of the order of a 70B-class dense model in FP8 on H200, TP2 each."""

    prefill_gpus: int = 2
    prefill_tokens_per_s: float = 12000.0  # ~40% MFU of 2 H200 at 140 GFLOP per token
    decode_gpus: int = 2
    kv_tokens: float = 1_000_000.0  # (2 x 141 GB x 0.9 - 70 GB weights - 20 GB) / 160 KiB per token
    max_running: int = 1024
    weights_ms: float = 9.0  # 70 GB of weights read per step at ~80% of 2 x 4.8 TB/s
    per_request_ms: float = 0.058  # 140 GFLOP per token per request at ~60% of 2 x 1,979 TFLOP/s
    kv_ms: float = 28.0  # reading a full KV cache (1M tokens x 160 KiB) per step
    kv_bytes_per_token: float = 163840.0
    link_bytes_per_s: float = 50e9  # 400 Gb/s RDMA per replica
    prefill_startup_s: float = 180.0
    decode_startup_s: float = 180.0
    drain_grace_s: float = 5.0  # the router's drop bound before a draining pod stops admitting
    ttft_base_s: float = 1.33
    ttft_per_token_s: float = 0.000814
    itl_s: float = 0.05
    prompt_sigma: float = 1.0  # lognormal
    output_median: float = 256.0
    output_sigma: float = 0.8
    dt_s: float = 1.0


# -- length distributions ---------------------------------------------------------------------------

P_EDGES = np.geomspace(16, 32768, 25)
O_EDGES = np.geomspace(1, 4096, 17)


def _lognormal_bins(edges: np.ndarray, median: float, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """(weights, mean length) of each bin; the tails beyond the edges fold into the end bins."""
    z = (np.log(edges) - math.log(median)) / sigma
    cdf = 0.5 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in z]))
    cdf[0], cdf[-1] = 0.0, 1.0
    w = np.diff(cdf)
    mids = np.sqrt(edges[:-1] * edges[1:])
    return w / w.sum(), mids


def prompt_bins(median: float, cal: Calibration) -> tuple[np.ndarray, np.ndarray]:
    return _lognormal_bins(P_EDGES, median, cal.prompt_sigma)


def output_bins(cal: Calibration) -> tuple[np.ndarray, np.ndarray]:
    return _lognormal_bins(O_EDGES, cal.output_median, cal.output_sigma)


# -- traces -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate: Callable[[np.ndarray], np.ndarray]  # requests/s at times t
    mix: Callable[[np.ndarray], np.ndarray]  # share of the second prompt distribution at t (0..1)
    medians: tuple[float, float]
    params: dict


def diurnal(peak: float) -> Trace:
    bursts = [3.0, 7.5, 10.5, 13.0, 17.5, 21.0]  # hours
    ramp, hold, back = 60.0, 480.0, 120.0

    def rate(t: np.ndarray) -> np.ndarray:
        base = peak * (0.3 + 0.7 * 0.5 * (1 - np.cos(2 * np.pi * t / 86400.0)))  # trough at 0 h, peak at 12 h
        mult = np.ones_like(t)
        for h in bursts:
            s = h * 3600.0
            up = np.clip((t - s) / ramp, 0, 1)
            down = np.clip((t - s - ramp - hold) / back, 0, 1)
            mult += 3.0 * up * (1 - down)
        return base * mult

    return Trace("diurnal", 86400.0, rate, lambda t: np.zeros_like(t), (1024.0, 1024.0),
                 {"durationS": 86400, "peakRequestsPerS": peak, "troughShareOfPeak": 0.3, "peakHour": 12,
                  "burstHours": bursts, "burstMultiplier": 4, "burstRampS": ramp, "burstHoldS": hold,
                  "burstBackS": back, "promptMedian": 1024})


def shift(rate_rps: float) -> Trace:
    start, ramp = 5400.0, 300.0
    return Trace("shift", 14400.0, lambda t: np.full_like(t, rate_rps),
                 lambda t: np.clip((t - start) / ramp, 0, 1), (1024.0, 8192.0),
                 {"durationS": 14400, "requestsPerS": rate_rps, "promptMedianBefore": 1024,
                  "promptMedianAfter": 8192, "shiftStartS": start, "shiftRampS": ramp})


# -- capacity of one replica (sizing and the fixed ratio) -----------------------------------------


@dataclass(frozen=True)
class Mix:
    w: np.ndarray
    lengths: np.ndarray

    @property
    def mean(self) -> float:
        return float(self.w @ self.lengths)

    @property
    def cs2(self) -> float:
        m = self.mean
        return float(self.w @ self.lengths**2) / (m * m) - 1.0


def step_s(cal: Calibration, batch: float, kv_frac: float) -> float:
    return (max(cal.weights_ms, cal.per_request_ms * batch) + cal.kv_ms * kv_frac) / 1000.0


def decode_capacity(cal: Calibration, prompt: Mix, kv_target: float = 0.8) -> float:
    """Requests/s one decode replica sustains with KV use <= kv_target and the step within the ITL target."""
    ow, ol = output_bins(cal)
    mean_o = float(ow @ ol)
    kv_per = prompt.mean + float(ow @ ol**2) / (2 * mean_o)  # a running request, length-biased
    best = 0.0
    for b in range(1, cal.max_running + 1):
        kv = b * kv_per / cal.kv_tokens
        st = step_s(cal, b, kv)
        if kv > kv_target or st > cal.itl_s:
            break
        best = b / (mean_o * st)
    return best


def batch_at_itl(cal: Calibration, median: float, share: float = 0.9) -> int:
    """The batch at which one decode replica's step reaches ``share`` of the ITL target for a prompt
    mix: the running-requests target a user profiles (pdfleet's second decode signal)."""
    prompt = Mix(*prompt_bins(median, cal))
    ow, ol = output_bins(cal)
    kv_per = prompt.mean + float(ow @ ol**2) / (2 * float(ow @ ol))
    b = 1
    while b < cal.max_running and step_s(cal, b + 1, (b + 1) * kv_per / cal.kv_tokens) <= share * cal.itl_s:
        b += 1
    return b


def needs(cal: Calibration, rate: float, prompt: Mix) -> tuple[float, float]:
    """(prefill, decode) replicas a right-sized fleet runs at this rate and mix."""
    return rate * prompt.mean / cal.prefill_tokens_per_s, rate / decode_capacity(cal, prompt)


# -- the fleet --------------------------------------------------------------------------------------


@dataclass
class Pool:
    ready: int
    gpus: int
    startup: float
    starting: list[float] = field(default_factory=list)  # Ready times
    draining: list[float] = field(default_factory=list)  # free times

    @property
    def replicas(self) -> int:
        return self.ready + len(self.starting)

    def tick(self, now: float) -> None:
        joined = [t for t in self.starting if t <= now]
        if joined:
            self.ready += len(joined)
            self.starting = [t for t in self.starting if t > now]
        self.draining = [t for t in self.draining if t > now]

    def scale(self, desired: int, now: float, drain_s: float) -> int:
        """Grow (new replicas start) or shrink (cancel the newest starting ones, then drain ready ones)."""
        change = desired - self.replicas
        if change > 0:
            self.starting += [now + self.startup] * change
        elif change < 0:
            k = -change
            cancel = min(k, len(self.starting))
            if cancel:
                self.starting = sorted(self.starting)[: len(self.starting) - cancel]
            k -= cancel
            k = min(k, self.ready)
            self.ready -= k
            self.draining += [now + drain_s] * k
        return change

    @property
    def held(self) -> int:
        return self.ready + len(self.starting) + len(self.draining)


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def erlang_c(n: float, a: float) -> float:
    """Probability of waiting in an M/M/n queue at offered load a (Halfin-Whitt)."""
    if a <= 0:
        return 0.0
    beta = (n - a) / math.sqrt(a)
    if beta <= 0:
        return 1.0
    if beta > 8:
        return 0.0  # below 1e-14
    return 1.0 / (1.0 + beta * _Phi(beta) / _phi(beta))


@dataclass
class Observed:
    """What the controllers read at a decision."""

    now: float
    arrivals_tok_s: float  # over the last 30 s
    arrivals_req_s: float
    completions_req_s: float  # decode, over the last 30 s
    queued_tokens: float  # waiting for a prefill to start
    inflight_tokens: float  # dispatched, not yet prefilled (queued + in prefill): llm-d's metric
    kv_used: float
    running: float
    itl_s: float  # the decode pool's step time now (every request sees it in this model)
    queued_requests: float
    prefill: Pool
    decode: Pool


class Sim:
    """One trace under one controller."""

    def __init__(self, cal: Calibration, trace: Trace, controller: Controller, seed: int = 7) -> None:
        self.cal, self.trace, self.ctl = cal, trace, controller
        self.rng = np.random.default_rng(seed)
        self.pw = [prompt_bins(m, cal)[0] for m in trace.medians]
        self.pl = prompt_bins(trace.medians[0], cal)[1]
        self.ow, self.ol = output_bins(cal)
        self.o_p95 = float(self.ol[np.searchsorted(np.cumsum(self.ow), 0.95)])

    def mix_at(self, m: float) -> Mix:
        return Mix((1 - m) * self.pw[0] + m * self.pw[1], self.pl)

    def run(self, p0: int, d0: int) -> dict:
        cal, tr = self.cal, self.trace
        dt = cal.dt_s
        n = int(tr.duration_s / dt)
        ts = np.arange(n) * dt
        rates, mixes = tr.rate(ts + dt / 2), tr.mix(ts + dt / 2)
        counts = self.rng.poisson(rates * dt).astype(float)
        V, K = cal.prefill_tokens_per_s, cal.kv_tokens
        ow, ol = self.ow, self.ol
        w_all = (1 - mixes)[:, None] * self.pw[0] + mixes[:, None] * self.pw[1]
        mean_ls = w_all @ self.pl
        cs2s = (w_all @ self.pl**2) / mean_ls**2 - 1
        # TTFT slack of each prompt bin before any wait: its target less its own prefill and KV transfer.
        slack0 = (cal.ttft_base_s + cal.ttft_per_token_s * self.pl - self.pl / V
                  - self.pl * cal.kv_bytes_per_token / cal.link_bytes_per_s)
        floor0 = self.pl / V + self.pl * cal.kv_bytes_per_token / cal.link_bytes_per_s
        reserve = float(ow @ ol) / 2
        P = Pool(p0, cal.prefill_gpus, cal.prefill_startup_s)
        D = Pool(d0, cal.decode_gpus, cal.decode_startup_s)
        A = Dn = 0.0
        pq: list[list[float]] = []  # prefill FIFO: [arrival t, tokens before it, n, step index]
        dq: list[list[float]] = []  # decode admission FIFO: [ready t, n, mean len, fluid wait, C, theta, step]
        cap = 2 * n + 16  # admitted cohorts (a cohort split by admission counts twice), grown when needed
        e_t, e_g, c_ok = np.zeros(cap), np.zeros(cap), np.zeros(cap)
        c_n, c_nl, c_ng = np.zeros(cap + 1), np.zeros(cap + 1), np.zeros(cap + 1)
        m_ = 0
        ptr = np.zeros(len(ol), dtype=np.int64)
        G = 0.0
        good = done = ttft_ok_sum = itl_ok_sum = 0.0
        gpu_s, peak_gpus = 0.0, 0
        events = {"prefill": 0, "decode": 0}
        moved = {"prefill": 0, "decode": 0}
        win = int(30 / dt)
        arr_tok = np.zeros(n)
        fin = np.zeros(n)  # requests finishing decode per step
        ttft_vals: list[np.ndarray] = []
        ttft_wts: list[np.ndarray] = []
        itl_vals: list[np.ndarray] = []
        itl_wts: list[np.ndarray] = []
        series = []
        next_tick = WARMUP_S  # the fleet starts right-sized and in flow; controllers join once it is
        step = step_s(cal, 0, 0)
        kv_used = running = 0.0
        every = int(60 / dt)
        mark = (0.0, 0.0)

        def kv_running() -> tuple[float, float]:
            nn = c_n[m_] - c_n[ptr]
            kv = (c_nl[m_] - c_nl[ptr]) + G * nn - (c_ng[m_] - c_ng[ptr])
            return float(ow @ kv), float(ow @ nn)

        for i in range(n):
            now = float(ts[i])
            if P.starting or P.draining:
                P.tick(now)
            if D.starting or D.draining:
                D.tick(now)
            mean_l, cs2 = float(mean_ls[i]), float(cs2s[i])
            lam_tok = float(rates[i]) * mean_l
            S = mean_l / V
            a = lam_tok / V
            c_wait = erlang_c(P.ready, a)
            theta = max(P.ready - a, 0.5) / (S * (1 + cs2) / 2)
            # -- decisions
            if now >= next_tick:
                next_tick += HPA_SYNC_S
                lo = max(0, i - win)
                span = max(1, i - lo) * dt
                arrivals = float(arr_tok[lo:i].sum()) / span
                wq = c_wait / theta
                fluid = A - Dn
                obs = Observed(now, arrivals, float(counts[lo:i].sum()) / span, float(fin[lo:i].sum()) / span, fluid + lam_tok * wq, fluid + lam_tok * (wq + S), kv_used, running, step,
                               sum(q[1] for q in dq), P, D)
                want_p, want_d = self.ctl.decide(obs)
                for name, pool, want, drain in (
                        ("prefill", P, want_p, fluid / max(1, P.ready) / V + cal.drain_grace_s),
                        ("decode", D, want_d, self.o_p95 * step + cal.drain_grace_s)):
                    ch = pool.scale(want, now, drain)
                    if ch:
                        events[name] += 1
                        moved[name] += abs(ch)
            gpus = P.held * P.gpus + D.held * D.gpus
            gpu_s += gpus * dt
            peak_gpus = max(peak_gpus, gpus)
            # -- arrivals into the prefill queue
            cnt = float(counts[i])
            if cnt > 0:
                arr_tok[i] = cnt * mean_l
                pq.append([now + dt / 2, A, cnt, i])
                A += cnt * mean_l
            # -- prefill service (a fluid FIFO): cohorts whose turn came start their prefill
            d_prev = Dn
            Dn = min(A, Dn + P.ready * V * dt)
            k = 0
            while k < len(pq) and pq[k][1] <= Dn:
                t_arr, before, cn, ci = pq[k]
                frac = (before - d_prev) / (Dn - d_prev) if Dn > d_prev else 0.0
                t_start = now + max(0.0, frac) * dt
                dq.append([now, cn, float(mean_ls[int(ci)]), max(0.0, t_start - t_arr), c_wait, theta, ci])
                k += 1
            if k:
                del pq[:k]
            # -- decode admission: KV tokens and batch room on the ready replicas, FIFO
            serving = D.ready + len(D.draining)
            if dq and D.ready:
                share = D.ready / serving
                free_kv = K * D.ready - kv_used * share
                free_slots = cal.max_running * D.ready - running * share
                while dq and free_kv > 0 and free_slots > 0:
                    q = dq[0]
                    per = q[2] + reserve
                    take = min(q[1], free_kv / per, free_slots)
                    if take <= 0:
                        break
                    if m_ + 1 >= len(e_t):
                        e_t, e_g, c_ok = (np.concatenate([x, np.zeros_like(x)]) for x in (e_t, e_g, c_ok))
                        c_n, c_nl, c_ng = (np.concatenate([x, np.zeros_like(x)]) for x in (c_n, c_nl, c_ng))
                    w = w_all[int(q[6])]
                    wait = q[3] + (now - q[0]) + step  # fluid prefill wait, decode admission wait, first step
                    slack = slack0 - wait
                    p_ok = np.where(slack > 0, 1 - q[4] * np.exp(-q[5] * np.maximum(slack, 0)), 0.0)
                    ok = float(w @ p_ok)
                    ttft_vals.append(floor0 + wait + q[4] / q[5])
                    ttft_wts.append(w * take)
                    e_t[m_], e_g[m_], c_ok[m_] = now, G, ok
                    c_n[m_ + 1] = c_n[m_] + take
                    c_nl[m_ + 1] = c_nl[m_] + take * q[2]
                    c_ng[m_ + 1] = c_ng[m_] + take * G
                    m_ += 1
                    free_kv -= take * per
                    free_slots -= take
                    q[1] -= take
                    if q[1] <= 1e-9:
                        dq.pop(0)
            # -- decode progress at the pool's step time; finished requests are counted
            kv_used, running = kv_running()
            if serving > 0 and running > 0:
                step = step_s(cal, running / serving, kv_used / (K * serving))
                g_prev = G
                G += dt / step
                his = np.searchsorted(e_g[:m_], G - ol, side="right")
                for o in np.nonzero(his > ptr)[0]:
                    lo, hi = int(ptr[o]), int(his[o])
                    t_fin = now + (e_g[lo:hi] + ol[o] - g_prev) / (G - g_prev) * dt
                    itl = (t_fin - e_t[lo:hi]) / ol[o]
                    nn = (c_n[lo + 1:hi + 1] - c_n[lo:hi]) * ow[o]
                    okk = c_ok[lo:hi]
                    hit = itl <= cal.itl_s
                    good += float(nn @ (okk * hit))
                    done += float(nn.sum())
                    fin[i] += float(nn.sum())
                    ttft_ok_sum += float(nn @ okk)
                    itl_ok_sum += float(nn @ hit)
                    itl_vals.append(itl)
                    itl_wts.append(nn)
                    ptr[o] = hi
                kv_used, running = kv_running()
            if i % every == every - 1:
                series.append([round(now), P.ready, len(P.starting), len(P.draining), D.ready, len(D.starting),
                               len(D.draining), round(A - Dn), round(kv_used / K, 2), round(step * 1000, 1),
                               round(good - mark[0]), round(done - mark[1]), round(float(counts[i + 1 - every:i + 1].sum()))])
                mark = (good, done)
        gpu_h = gpu_s / 3600.0
        offered = float(counts.sum())
        tv, tw = np.concatenate(ttft_vals or [np.zeros(0)]), np.concatenate(ttft_wts or [np.zeros(0)])
        iv, iw = np.concatenate(itl_vals or [np.zeros(0)]), np.concatenate(itl_wts or [np.zeros(0)])
        return {
            "goodRequests": round(good), "completedRequests": round(done), "offeredRequests": round(offered),
            "gpuHours": round(gpu_h, 2), "goodputPerGpuHour": round(good / gpu_h, 1),
            "goodShareOfOffered": round(good / offered, 4),
            "ttftMetShare": round(ttft_ok_sum / done, 4) if done else None,
            "itlMetShare": round(itl_ok_sum / done, 4) if done else None,
            "ttftP50S": _pct(tv, tw, 0.5), "ttftP90S": _pct(tv, tw, 0.9),
            "itlP50S": _pct(iv, iw, 0.5), "itlP90S": _pct(iv, iw, 0.9),
            "scaleEvents": events, "replicasMoved": moved, "peakGpus": peak_gpus,
            "series": {"columns": ["t", "prefillReady", "prefillStarting", "prefillDraining", "decodeReady",
                                   "decodeStarting", "decodeDraining", "prefillBacklogTokens", "decodeKvPods",
                                   "stepMs", "good", "completed", "arrived"], "everyS": 60, "rows": series},
        }


def _pct(values: np.ndarray, weights: np.ndarray, p: float) -> float | None:
    """The weighted p-quantile (TTFT: the mean random wait, not its spread; ITL: per request)."""
    if not len(values) or weights.sum() <= 0:
        return None
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return round(float(values[order][min(len(order) - 1, int(np.searchsorted(cum, p * cum[-1])))]), 4)


# -- controllers --------------------------------------------------------------------------------------


class Controller:
    name = "?"

    def decide(self, o: Observed) -> tuple[int, int]:
        raise NotImplementedError


@dataclass
class HpaBehavior:
    up_window: float
    down_window: float
    up_policies: list[tuple[str, float, float]]  # (Pods|Percent, value, period); the largest change wins
    down_policies: list[tuple[str, float, float]]


DOCUMENTED = HpaBehavior(0, 300, [("Pods", 1, 180)], [("Pods", 1, 300)])
K8S_DEFAULT = HpaBehavior(0, 300, [("Pods", 4, 15), ("Percent", 100, 15)], [("Percent", 100, 15)])


class Hpa:
    """A HorizontalPodAutoscaler on AverageValue external metrics (as KEDA creates), per the
    Kubernetes algorithm: tolerance, stabilization windows, rate policies over scale events."""

    def __init__(self, lo: int, hi: int, behavior: HpaBehavior) -> None:
        self.lo, self.hi, self.b = lo, hi, behavior
        self.recs: list[tuple[float, int]] = []
        self.events: list[tuple[float, int]] = []  # (t, change)

    def desired(self, now: float, current: int, metrics: list[tuple[float, float]]) -> int:
        raw = 0
        for value, threshold in metrics:
            ratio = value / (threshold * max(1, current))
            raw = max(raw, current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(value / threshold - 1e-9))
        self.recs = [(t, r) for t, r in self.recs if now - t < max(self.b.up_window, self.b.down_window)]
        self.recs.append((now, raw))
        up = min(r for t, r in self.recs if now - t <= self.b.up_window)
        down = max(r for t, r in self.recs if now - t <= self.b.down_window)
        rec = current
        if rec < up:
            rec = up
        if rec > down:
            rec = down
        if rec > current:
            rec = min(rec, self._limit(now, current, self.b.up_policies, up=True))
        elif rec < current:
            rec = max(rec, self._limit(now, current, self.b.down_policies, up=False))
        rec = min(max(rec, self.lo), self.hi)
        if rec != current:
            self.events.append((now, rec - current))
        self.events = [(t, c) for t, c in self.events if now - t < 3600]
        return rec

    def _limit(self, now: float, current: int, policies, up: bool) -> int:
        best = None
        for kind, value, period in policies:
            if up:
                start = current - sum(c for t, c in self.events if now - t < period and c > 0)
                prop = start + value if kind == "Pods" else math.ceil(start * (1 + value / 100))
                best = prop if best is None else max(best, prop)
            else:
                start = current - sum(c for t, c in self.events if now - t < period and c < 0)
                prop = start - value if kind == "Pods" else math.ceil(start * (1 - value / 100))
                best = prop if best is None else min(best, prop)
        return int(best if best is not None else current)


class Llmd(Controller):
    def __init__(self, cal: Calibration, bounds, behavior: HpaBehavior, name: str) -> None:
        self.cal, self.name = cal, name
        self.p = Hpa(*bounds[0], behavior)
        self.d = Hpa(*bounds[1], behavior)

    def decide(self, o: Observed) -> tuple[int, int]:
        prefill = o.inflight_tokens / self.cal.prefill_tokens_per_s
        kv_sum = o.kv_used / self.cal.kv_tokens  # sum over decode pods of their usage fraction
        return (self.p.desired(o.now, o.prefill.replicas, [(prefill, 1.5)]),
                self.d.desired(o.now, o.decode.replicas, [(kv_sum, 0.8)]))


class FixedRatio(Controller):
    def __init__(self, cal: Calibration, bounds, ratio: float, behavior: HpaBehavior, name: str) -> None:
        self.cal, self.ratio, self.bounds, self.name = cal, ratio, bounds, name
        self.d = Hpa(bounds[1][0], min(bounds[1][1], int(bounds[0][1] / ratio)), behavior)

    def decide(self, o: Observed) -> tuple[int, int]:
        prefill = o.inflight_tokens / self.cal.prefill_tokens_per_s / self.ratio
        kv_sum = o.kv_used / self.cal.kv_tokens
        d = self.d.desired(o.now, o.decode.replicas, [(kv_sum, 0.8), (prefill, 1.5)])
        p = min(max(self.bounds[0][0], round(self.ratio * d)), self.bounds[0][1])
        return p, d


class Pdfleet(Controller):
    def __init__(self, cal: Calibration, spec: AutoscalingSpec, name: str = "pdfleet") -> None:
        self.cal, self.spec, self.name = cal, spec, name
        self.state = PlannerState()

    def decide(self, o: Observed) -> tuple[int, int]:
        cal = self.cal
        pm = PrefillMetrics(queued_prompt_tokens=o.queued_tokens, prompt_tokens_per_second=o.arrivals_tok_s,
                            requests_per_second=o.arrivals_req_s)
        dm = DecodeMetrics(kv_used_tokens=o.kv_used, kv_tokens_per_replica=cal.kv_tokens,
                           running_requests=o.running, queued_requests=o.queued_requests,
                           requests_per_second=o.completions_req_s, itl_seconds=o.itl_s)

        def fleet(pool: Pool, gpus: int) -> RoleFleet:
            return RoleFleet(pool.replicas, pool.ready, tuple(pool.startup - (t - o.now) for t in pool.starting),
                             len(pool.draining), pool.startup, gpus)

        d = plan(self.spec, o.now, (pm, fleet(o.prefill, cal.prefill_gpus)), (dm, fleet(o.decode, cal.decode_gpus)),
                 self.state)
        self.state = d.state
        return d.prefill.desired, d.decode.desired


# -- runs -------------------------------------------------------------------------------------------


def setup(cal: Calibration, trace_name: str, size: int) -> tuple[Trace, dict]:
    """The trace scaled so a right-sized fleet needs ``size`` replicas at its peak, and the bounds."""
    first = Mix(*prompt_bins(1024.0, cal))
    if trace_name == "diurnal":
        p1, d1 = needs(cal, 1.0, first)
        peak = size / (p1 + d1)
        tr = diurnal(peak)
        peak_need = (p1 * peak, d1 * peak)
        start_need = needs(cal, float(tr.rate(np.array([0.0]))[0]), first)
        init_ratio = p1 / d1
    else:
        last = Mix(*prompt_bins(8192.0, cal))
        p8, d8 = needs(cal, 1.0, last)
        rate = size / (p8 + d8)
        tr = shift(rate)
        p1, d1 = needs(cal, rate, first)
        peak_need = (max(p8 * rate, p1), max(d8 * rate, d1))
        start_need = (p1, d1)
        init_ratio = p1 / d1
    hi = (max(2, math.ceil(3 * peak_need[0])), max(2, math.ceil(3 * peak_need[1])))
    start = (max(1, math.ceil(start_need[0])), max(1, math.ceil(start_need[1])))
    budget = math.ceil(2.5 * (peak_need[0] * cal.prefill_gpus + peak_need[1] * cal.decode_gpus))
    budget = max(budget, cal.prefill_gpus + cal.decode_gpus)
    return tr, {"peakNeed": [round(x, 2) for x in peak_need], "startReplicas": list(start),
                "maxReplicas": list(hi), "initialRatio": round(init_ratio, 3), "gpuBudget": budget}


def pdfleet_spec(cal: Calibration, bounds: dict, band: tuple[float, float], kv_only: bool = False) -> AutoscalingSpec:
    """pdfleet's spec for the run: llm-d's targets (1.5 s of prefill backlog at the declared rate, 0.8 of
    the KV cache) and windows; decode also on running requests (the batch a replica holds at 90% of
    the ITL target for the initial mix, as a user profiles it) and the ITL target (``kv_only``: the
    KV cache alone, llm-d's one signal, for the ablation)."""
    hi = bounds["maxReplicas"]
    decode_signals: dict = {"kvCache": {"target": 0.8}}
    if not kv_only:
        decode_signals |= {"runningRequests": {"targetPerReplica": batch_at_itl(cal, 1024.0)},
                           "itl": {"percentile": "p90", "targetSeconds": cal.itl_s}}
    return AutoscalingSpec.model_validate({
        "prefill": {"minReplicas": 1, "maxReplicas": hi[0], "scaleDownStabilizationSeconds": 300,
                    "signals": {"backlog": {"targetSeconds": 1.5, "prefillTokensPerSecond": cal.prefill_tokens_per_s}}},
        "decode": {"minReplicas": 1, "maxReplicas": hi[1], "scaleDownStabilizationSeconds": 300,
                   "signals": decode_signals},
        "prefillDecodeRatio": {"min": band[0], "max": band[1]},
        "gpuBudget": bounds["gpuBudget"],
    })


def controllers(cal: Calibration, bounds: dict, names: list[str]) -> list[Controller]:
    b = ((1, bounds["maxReplicas"][0]), (1, bounds["maxReplicas"][1]))
    r1 = needs(cal, 1.0, Mix(*prompt_bins(1024.0, cal)))
    r8 = needs(cal, 1.0, Mix(*prompt_bins(8192.0, cal)))
    ratios = (r1[0] / r1[1], r8[0] / r8[1])
    band = (round(0.5 * min(ratios), 2), round(2.0 * max(ratios), 2))
    out: list[Controller] = []
    for name in names:
        if name == "pdfleet":
            out.append(Pdfleet(cal, pdfleet_spec(cal, bounds, band)))
        elif name == "pdfleet-kv":
            out.append(Pdfleet(cal, pdfleet_spec(cal, bounds, band, kv_only=True), "pdfleet-kv"))
        elif name == "llmd":
            out.append(Llmd(cal, b, DOCUMENTED, "llmd"))
        elif name == "llmd-fast":
            out.append(Llmd(cal, b, K8S_DEFAULT, "llmd-fast"))
        elif name == "fixed-ratio":
            out.append(FixedRatio(cal, b, bounds["initialRatio"], DOCUMENTED, "fixed-ratio"))
        elif name == "fixed-ratio-fast":
            out.append(FixedRatio(cal, b, bounds["initialRatio"], K8S_DEFAULT, "fixed-ratio-fast"))
    bounds["pdfleetRatioBand"] = list(band)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--traces", nargs="+", default=["diurnal", "shift"], choices=["diurnal", "shift"])
    ap.add_argument("--controllers", nargs="+",
                    default=["pdfleet", "pdfleet-kv", "llmd", "llmd-fast", "fixed-ratio", "fixed-ratio-fast"])
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a calibration default, e.g. prefill_startup_s=300")
    ap.add_argument("--series", action="store_true", help="keep the per-minute series in the JSON")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    types = {f.name: f.type for f in fields(Calibration)}
    over = {}
    for item in args.set:
        k, v = item.split("=", 1)
        if k not in types:
            ap.error(f"--set {k}: no such calibration value; known: {', '.join(types)}")
        over[k] = int(v) if types[k] in (int, "int") else float(v)
    cal = replace(Calibration(), **over)
    results = []
    t_all = time.perf_counter()
    for trace_name in args.traces:
        for size in args.sizes:
            tr, bounds = setup(cal, trace_name, size)
            row = {"trace": trace_name, "size": size, "bounds": bounds, "traceParams": tr.params, "runs": {}}
            for ctl in controllers(cal, bounds, args.controllers):
                t0 = time.perf_counter()
                res = Sim(cal, tr, ctl).run(*bounds["startReplicas"])
                res["wallS"] = round(time.perf_counter() - t0, 1)
                if not args.series:
                    res.pop("series")
                row["runs"][ctl.name] = res
                print(f"{trace_name:8s} {size:5d} {ctl.name:12s} goodput/GPU-h {res['goodputPerGpuHour']:9.1f} "
                      f"GPU-h {res['gpuHours']:9.1f} good {res['goodShareOfOffered']:.3f} ttft-met "
                      f"{res['ttftMetShare']} itl-met {res['itlMetShare']} events {res['scaleEvents']} "
                      f"peak GPUs {res['peakGpus']} ({res['wallS']}s)", flush=True)
            runs = row["runs"]
            if "pdfleet" in runs:
                base = runs["pdfleet"]["goodputPerGpuHour"]
                ratios = {k: round(base / v["goodputPerGpuHour"], 3) for k, v in runs.items()
                          if k != "pdfleet" and v["goodputPerGpuHour"] > 0}
                row["pdfleetRatio"] = ratios
                # Each baseline family at its better rate policy (the stricter comparison).
                row["pdfleetRatioToBest"] = {
                    fam: round(base / max(runs[k]["goodputPerGpuHour"] for k in names), 3)
                    for fam, names in FAMILIES.items() if all(k in runs for k in names)}
                print(f"{trace_name:8s} {size:5d} pdfleet ratio: {ratios}; to each family's best: "
                      f"{row['pdfleetRatioToBest']}", flush=True)
            results.append(row)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parent / "results" / f"autoscale-sim-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "autoscale_sim", "when": stamp, "host": platform.node(), "python": platform.python_version(),
        "wallS": round(time.perf_counter() - t_all, 1),
        "calibration": asdict(cal), "llmdGuide": LLMD_GUIDE,
        "decodeCapacityReqPerS": {"prompt1k": round(decode_capacity(cal, Mix(*prompt_bins(1024.0, cal))), 2),
                                  "prompt8k": round(decode_capacity(cal, Mix(*prompt_bins(8192.0, cal))), 2)},
        "prefillCapacityReqPerS": {"prompt1k": round(cal.prefill_tokens_per_s / Mix(*prompt_bins(1024.0, cal)).mean, 2),
                                   "prompt8k": round(cal.prefill_tokens_per_s / Mix(*prompt_bins(8192.0, cal)).mean, 2)},
        "results": results,
    }, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
