"""The staged path through ``pdfleet-runtime serve``: a prefill pod and a decode pod as real processes on
loopback, Mooncake over TCP, host pools with ``staging.onCpu`` (the device machine runs the same on a GPU:
bench/gpu_serve.py). Requests at or above the threshold go staged (plans cut when the decode's indices
arrive, chunks signalled through the engine), smaller ones direct; every byte is checked by the decode.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_runtime.config import StagingConfig
from pdfleet_runtime.protocol.staged_timeline import parse
from tests.server.harness import Pod, config, metric

pytestmark = pytest.mark.slow

FAST = ("--retry-period", "0.3", "--canary-timeout", "3", "--canary-tokens", "64", "--floor-gbps", "0.001")
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # llama-dense, tp 1


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for p in started:
        p.stop()


def test_large_requests_go_staged_small_ones_direct_every_byte_checked(tmp_path: Path, pods: list[Pod]) -> None:
    staging = StagingConfig(on_cpu=True, slot_mib=1, slots=2, lanes=2, table_mib=1,
                            threshold_bytes=200 * BYTES_PER_TOKEN)
    pre_cfg = config("prefill", requests=4, tokens=2048).model_copy(update={"staging": staging})
    dec_cfg = config("decode", requests=4, tokens=2048).model_copy(update={"staging": staging})
    pre = Pod(tmp_path, "pre", pre_cfg)
    pods.append(pre)
    pre.start()
    dec = Pod(tmp_path, "dec", dec_cfg, args=FAST, env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
    pods.append(dec)
    dec.start()
    dec.wait_ready(True, 90)
    before = {"dec": dec.metrics(), "pre": pre.metrics()}
    moved_bytes = []
    for i, tokens in enumerate((1024, 64, 1500)):  # 1024 x 128 KiB = 128 MiB: 128+ chunks of 1 MiB through 2 slots
        code, body = dec.synthetic(tokens, 60, requestId=f"s{i}")
        assert code == 200 and body["ok"] and body["mismatchedBytes"] == 0, body
        moved_bytes.append(body["bytes"])
    log = dec.log()
    assert re.search(r"request s0 <- \S+: success.*; staged, landed at", log), log[-3000:]
    assert re.search(r"request s1 <- \S+: success.*; direct, landed at", log), log[-3000:]
    assert re.search(r"request s2 <- \S+: success.*; staged, landed at", log), log[-3000:]
    assert re.search(r"request s0: filled 1024 tokens of seeded state; state ready at", pre.log())
    # Each staged leg's per-chunk timeline, one line per side (bench/gpu_serve.py summarises them).
    timelines = {(t.side, t.request): t for t in parse(pre.log() + dec.log())}
    assert {("send", "s0"), ("receive", "s0"), ("send", "s2"), ("receive", "s2")} <= set(timelines), timelines.keys()
    assert ("send", "s1") not in timelines  # the direct request has none
    assert timelines["send", "s0"].n_chunks == timelines["receive", "s0"].n_chunks >= 128

    # The pod's /metrics: the ranks' staged counters, summed, moved by exactly the two staged requests (the
    # canary loop's small transfers may add direct ones meanwhile).
    after = {"dec": dec.metrics(), "pre": pre.metrics()}

    def moved(pod: str, name: str, **labels: str) -> float:
        return metric(after[pod], name, **labels) - metric(before[pod], name, **labels)

    staged_bytes = moved_bytes[0] + moved_bytes[2]  # whole pages: a little over tokens x bytes per token
    for pod, role in (("dec", "decode"), ("pre", "prefill")):
        assert moved(pod, "pdfleet_staged_path_requests_total", role=role, path="staged") == 2, after[pod]
        assert moved(pod, "pdfleet_staged_path_bytes_total", role=role, path="staged") == staged_bytes
        assert moved(pod, "pdfleet_staged_path_requests_total", role=role, path="direct") >= 1
        assert moved(pod, "pdfleet_staged_path_bytes_total", role=role, path="direct") >= moved_bytes[1]
    chunks = moved("pre", "pdfleet_staged_chunk_seconds_count", role="prefill")
    assert chunks >= 128 + 187, chunks  # 1 MiB chunks: 128 MiB and ~188 MiB
    assert moved("pre", "pdfleet_staged_landed_write_seconds_count", role="prefill") == chunks
    assert moved("pre", "pdfleet_staged_chunk_seconds_bucket", role="prefill", le="+Inf") == chunks
    assert moved("pre", "pdfleet_staged_freed_read_seconds_count", role="prefill") > 0  # 2 slots: the ring fills
