"""The staged path's Prometheus export (``pod.metrics.StagedCollector``): the ranks' ``StagedMetrics``
reports summed, histogram buckets made cumulative, nothing rendered before a rank reported."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdfleet_runtime.pod.metrics import ServerMetrics
from pdfleet_runtime.protocol.staged import Path, StagedMetrics


def _samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"] = s.value
    return out


def test_ranks_reports_are_summed_and_buckets_cumulative() -> None:
    m = ServerMetrics("prefill")
    assert not any(k.startswith("pdfleet_staged") for k in _samples(m))  # no rank reported yet
    a, b = StagedMetrics(), StagedMetrics()
    a.count(Path.STAGED, 1000)
    b.count(Path.STAGED, 24)
    b.count(Path.DIRECT, 7)
    for s in (3e-6, 4e-4, 2.0):  # first bucket, a middle one, past the last bound
        a.chunk_s.observe(s)
    b.chunk_s.observe(4e-4)
    m.staged.update([a.to_dict(), b.to_dict(), {}])  # a rank without staging reports nothing
    got = _samples(m)
    assert got["pdfleet_staged_path_bytes_total{path=staged,role=prefill}"] == 1024
    assert got["pdfleet_staged_path_bytes_total{path=direct,role=prefill}"] == 7
    assert got["pdfleet_staged_path_requests_total{path=staged,role=prefill}"] == 2
    assert got["pdfleet_staged_chunk_seconds_bucket{le=1e-05,role=prefill}"] == 1
    assert got["pdfleet_staged_chunk_seconds_bucket{le=0.0005,role=prefill}"] == 3
    assert got["pdfleet_staged_chunk_seconds_bucket{le=1.0,role=prefill}"] == 3
    assert got["pdfleet_staged_chunk_seconds_bucket{le=+Inf,role=prefill}"] == 4
    assert got["pdfleet_staged_chunk_seconds_count{role=prefill}"] == 4
    assert abs(got["pdfleet_staged_chunk_seconds_sum{role=prefill}"] - (3e-6 + 8e-4 + 2.0)) < 1e-9
    assert got["pdfleet_staged_landed_write_seconds_count{role=prefill}"] == 0
