"""A staged leg's timeline: its log line read back, and the benchmark's summary of where a window went."""

from __future__ import annotations

import pytest

from bench.gpu_serve import _timeline_summary
from pdfleet_runtime.protocol.staged_timeline import Timeline, parse


def _leg(side: str, request: str, start: float, chunks: dict[str, list[float]], **marks: float) -> Timeline:
    return Timeline(side, request, start, "x", {"start": 0.0, **marks}, {k: list(v) for k, v in chunks.items()})


def test_a_line_reads_back_and_missing_steps_stay_missing():
    t = _leg("send", "r-1", 100.0, {"gather": [0.001, 0.002], "write": [None, None]}, end=0.01)
    (back,) = parse("noise\n2026-12-01 INFO prefill[0,0] pdfleet_runtime.protocol.staged: " + t.line() + "\nmore")
    assert (back.side, back.request, back.n_chunks) == ("send", "r-1", 2)
    assert back.at("gather", 1) == pytest.approx(100.002) and back.at("write", 0) is None and back.at("post", 5) is None
    assert back.marks["end"] == pytest.approx(0.01)


def test_the_summary_splits_the_window_into_fill_link_and_drain():
    # State ready at 10.000; the leg starts 0.5 ms later; two chunks; the decode reports in place at 10.006.
    ms = 1e-3
    send = _leg("send", "q", 10.0 + 0.5 * ms, {
        "gather": [0.3 * ms, 0.6 * ms], "post": [0.7 * ms, 1.5 * ms], "posted": [0.8 * ms, 1.6 * ms],
        "done": [1.2 * ms, 3.5 * ms], "landed": [1.4 * ms, 3.7 * ms]})
    recv = _leg("receive", "q", 10.0, {"scatter": [1.9 * ms, 4.3 * ms], "freed": [2.4 * ms, 5.0 * ms]})
    lines = "\n".join([send.line(), recv.line()])
    tl = _timeline_summary(["q"], {"q": 10.0}, {"q": 10.006}, lines, lines)
    w, c = tl["window_median_ms"], tl["per_chunk_median_ms"]
    assert tl["requests"] == 1 and tl["chunks_per_request"] == 2
    assert w["to_send"] == pytest.approx(0.5) and w["fill"] == pytest.approx(1.2)  # the first post at 1.2 ms
    assert w["link"] == pytest.approx(2.8) and w["drain"] == pytest.approx(2.0) and w["window"] == pytest.approx(6.0)
    assert tl["serial_share"] == pytest.approx(3.2 / 6.0)
    assert c["gather"] == pytest.approx((0.4 + 0.9) / 2) and c["land"] == pytest.approx((0.4 + 1.9) / 2)
    assert c["notice"] == pytest.approx((0.2 + 0.3) / 2)  # the decode saw chunk k landed after its write ended
    assert c["queue"] is None  # no poster stamps (not Mooncake)
    assert [ch["done"] for ch in tl["example"]["chunks"]] == pytest.approx([1.7, 4.0])
