"""Issue 46: a decode's transfers by state type (``pdfleet_transfer_state_bytes_total{state}``), for a hybrid model's
layout (KV, Mamba, sliding window, sparse-attention index, PLE state): each state type of the layout is counted, and
the parts sum to the bytes the transfers moved. Real ``serve`` processes on loopback, the real Mooncake engine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdfleet_runtime.layouts import PRESETS
from tests.server.harness import Pod, config, free_offset

pytestmark = pytest.mark.slow

PRESET = "qwen3.8-flash-next"
FAST = ("--retry-period", "0.3", "--canary-timeout", "10", "--canary-tokens", "64", "--canary-period", "1")


def _labels(key: str) -> dict[str, str]:
    """``name{a=x,b=y}`` (the harness's form of a sample) -> its labels."""
    inner = key.partition("{")[2].rstrip("}")
    return dict(kv.split("=", 1) for kv in inner.split(",") if "=" in kv)


def _canary(samples: dict[str, float], name: str, **where: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for k, v in samples.items() if k.startswith(name + "{")
            and (lab := _labels(k)).get("kind") == "canary" and all(lab.get(a) == b for a, b in where.items())]


def test_a_decodes_bytes_by_state_type_cover_the_layout_and_sum_to_what_moved(tmp_path: Path) -> None:
    prefill = Pod(tmp_path, "pre", config("prefill", layout=PRESET), offset=free_offset(), args=("--no-gate",)).start()
    decode = Pod(tmp_path, "dec", config("decode", layout=PRESET), args=("--no-gate", *FAST),
                 env={"PDFLEET_PREFILL_ADDRESSES": prefill.bootstrap}).start()
    try:
        decode.wait_ready(True, 120)
        deadline = time.monotonic() + 30
        while True:  # a few canaries
            m = decode.metrics()
            moved = sum(v for _, v in _canary(m, "pdfleet_transfer_bytes_total"))
            if sum(v for _, v in _canary(m, "pdfleet_transfers_total", outcome="success")) >= 3:
                m = decode.metrics()  # the counters of one moment
                moved = sum(v for _, v in _canary(m, "pdfleet_transfer_bytes_total"))
                break
            assert time.monotonic() < deadline, decode.log()[-3000:]
            time.sleep(0.5)
        parts = {lab["state"]: v for lab, v in _canary(m, "pdfleet_transfer_state_bytes_total")}
        print("canary bytes by state type:", parts, "of", moved)
        assert set(parts) == {s.value for s in PRESETS[PRESET].state_types()}, parts
        assert sum(parts.values()) == moved and all(v > 0 for v in parts.values())
    finally:
        decode.stop()
        prefill.stop()
