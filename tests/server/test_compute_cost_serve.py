"""The declared compute cost against real ``serve`` processes: a prefill pod reports not Ready for its
declared start-up, prompts queue behind one another on it (TTFT grows with the backlog, the queued
prompt tokens show), decode generates at a step time that follows its batch, every request succeeds,
and the pods' metrics under SGLang's names read back through the operator's table."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pdfleet_operator.autoscale.sources import Key, parse_sample
from pdfleet_runtime.config import ComputeCost
from tests.server.harness import Pod, config, free_offset, http

pytestmark = pytest.mark.slow

FAST = ("--retry-period", "0.3", "--canary-timeout", "3", "--canary-tokens", "64")
PREFILL_COST = ComputeCost(prefill_seconds_per_prompt_token=0.002, startup_seconds=20)  # 400 tokens: 0.8 s; start-up
# long enough that a pod slow to listen on a loaded host (10 s seen) still answers /readyz inside it
DECODE_COST = ComputeCost(decode_seconds_per_token=0.02, decode_seconds_per_running_request=0.002)


def scrape(pod: Pod) -> Any:
    import urllib.request

    with urllib.request.urlopen(pod.url + "/metrics", timeout=10) as r:
        return parse_sample(r.read().decode())


def test_prompts_queue_on_prefill_and_decode_paces_tokens(tmp_path: Path) -> None:
    off = free_offset()
    prefill = Pod(tmp_path, "pre", config("prefill", requests=16, tokens=16384).model_copy(
        update={"compute_cost": PREFILL_COST}), offset=off, args=("--room-ttl", "30"))
    decode = Pod(tmp_path, "dec", config("decode", requests=16, tokens=16384).model_copy(
        update={"compute_cost": DECODE_COST}), args=FAST, env={"PDFLEET_PREFILL_ADDRESSES": prefill.bootstrap})
    started = time.monotonic()
    prefill.start()
    decode.start()
    try:
        reasons: list[str] = []
        while time.monotonic() - started < 90:
            try:
                code, body = prefill.get("/readyz")
            except OSError:  # not listening yet
                time.sleep(0.2)
                continue
            if code == 200:
                break
            if body.get("ranksUp") == body.get("ranks"):
                reasons.append(body["reason"])
            time.sleep(0.2)
        # Never Ready before its declared start-up (counted from the pod's start); once its ranks were up and
        # until then, the gate said why.
        assert time.monotonic() - started >= PREFILL_COST.startup_seconds
        assert reasons and any("declared start-up" in r for r in reasons), reasons
        decode.wait_ready(True, 90)
        host, port = prefill.bootstrap.split(":")
        n, prompt = 6, "x" * (4 * 400 - 6)  # "user: " + text = 1600 bytes -> 400 tokens

        def one(i: int) -> tuple[int, int, float]:
            body = {"model": "srv", "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                    "bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": random.getrandbits(63)}
            out: dict[str, Any] = {}
            t = threading.Thread(target=lambda: out.update(p=http("POST", prefill.url + "/v1/chat/completions",
                                                                  body, 60)))
            t0 = time.monotonic()
            t.start()
            d = http("POST", decode.url + "/v1/chat/completions", body, 60)
            took = time.monotonic() - t0
            t.join(70)
            return out["p"][0], d[0], took

        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            time.sleep(1.0)
            mid = scrape(prefill)
            results = [f.result() for f in futures]
        assert [(p, d) for p, d, _ in results] == [(200, 200)] * n, results
        took = sorted(t for _, _, t in results)
        # One prefill computes 400 tokens in 0.8 s at a time: the last request waited for the others.
        assert took[-1] >= (n - 1) * 0.8, took
        assert mid.values[Key.QUEUED_PROMPT_TOKENS] > 0  # the backlog showed while it was there
        p, d = scrape(prefill), scrape(decode)
        assert p.values[Key.PROMPT_TOKENS] == n * 400 and p.values[Key.REQUESTS_FINISHED] == n
        assert p.values[Key.PREFILL_BUSY_SECONDS] == pytest.approx(n * 0.8, rel=0.05)
        assert p.values[Key.QUEUED_PROMPT_TOKENS] == 0
        assert d.values[Key.REQUESTS_FINISHED] == n and d.values[Key.RUNNING] == 0
        assert d.values[Key.KV_USED_TOKENS] == 0  # every request's KV given back
        itl = d.histograms[Key.ITL]
        assert itl[-1][1] > 0 and dict(itl)[0.015] == 0  # every step took at least 0.02 s
    finally:
        decode.stop()
        prefill.stop()
