"""Every sample of a Prometheus endpoint, flattened to one dict (tests and benchmarks read pods and routers so)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["scrape"]


def scrape(url: str) -> dict[str, float]:
    """Every sample of a Prometheus endpoint as ``name{label="value",...}`` (labels sorted) -> value."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = out.get(f"{s.name}{{{labels}}}", 0.0) + s.value
    return out
