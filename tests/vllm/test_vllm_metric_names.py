"""The built-in runtime's metrics under vLLM's names are vLLM 0.33's own (issue 45): each ``vllm:`` family a pod
exports is one vLLM's ``PrometheusStatLogger`` registers, of the same kind, with its labels (``model_name``,
``engine``, and ``finished_reason`` where vLLM adds it), read from vLLM's source (its stat logger and its NIXL
connector's metrics) in the check venv (``check_metric_names.py``); and a name vLLM does not
register is caught (the check can fail)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdfleet_runtime.pod.metrics import ReceivedMetrics, vllm_gauges
from pdfleet_runtime.pod.seeded_load import LoadMetrics
from tests.vllm.harness import vllm_python

CHECKER = Path(__file__).resolve().parent / "check_metric_names.py"


def _exported() -> dict[str, dict]:
    """Every ``vllm:`` family a pod's registry holds (both roles register the same), with its kind and labels."""
    reg = CollectorRegistry()
    LoadMetrics(reg, "m", "decode", 1000).requests.inc("stop")
    vllm_gauges(reg, "m", lambda: 1, lambda: 2, lambda: 0.5)
    ReceivedMetrics(reg, "m", "decode", "nixl").observe(0.01)  # a NIXL decode's: vLLM's NIXL connector names it
    out: dict[str, dict] = {}
    for fam in reg.collect():
        if fam.name.startswith("vllm:"):
            labels = sorted({k for s in fam.samples for k in s.labels if k != "le"})
            out[fam.name] = {"kind": fam.type, "labels": labels}
    return out


def _check(families: dict[str, dict]) -> dict:
    done = subprocess.run([vllm_python(), str(CHECKER), json.dumps(families)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_vllm_metric_a_pod_exports_is_vllms_own() -> None:
    ours = _exported()
    assert set(ours) == {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                         "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                         "vllm:inter_token_latency_seconds", "vllm:request_success", "vllm:nixl_xfer_time_seconds"}, ours
    said = _check({**ours, "vllm:made_up_total_tokens": {"kind": "counter", "labels": ["model_name", "engine"]},
                   "vllm:generation_tokens": {**ours["vllm:generation_tokens"], "kind": "gauge"},
                   "vllm:prompt_tokens": {**ours["vllm:prompt_tokens"], "labels": ["model_name"]}})
    assert said["vllm_families"] > 20, said  # the source was read
    problems = said["problems"]  # ours as exported pass; a made-up name, a wrong kind, a missing label fail
    assert problems.keys() == {"vllm:made_up_total_tokens", "vllm:generation_tokens", "vllm:prompt_tokens"}, said
    assert "no such family" in problems["vllm:made_up_total_tokens"]
    assert "counter, ours a gauge" in problems["vllm:generation_tokens"]
    assert "labels" in problems["vllm:prompt_tokens"]
