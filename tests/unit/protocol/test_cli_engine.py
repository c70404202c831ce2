"""``pdfleet-runtime parity --backend mooncake|nixl``: a combination the matrix rejects exits 2 with the
matrix's rule and reason before any process starts (checked by making process creation fail)."""

from __future__ import annotations

import json

import pytest

from pdfleet_runtime.cli import main
from pdfleet_runtime.pod.launcher import RankLauncher


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a process was started for a rejected combination")

    monkeypatch.setattr(RankLauncher, "__init__", refuse)  # every rank process starts through one


@pytest.mark.usefixtures("no_processes")
def test_rejected_combination_exits_two_with_the_matrix_reason(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["parity", "--layout", "qwen3.8-flash-next", "--prefill", "tp=4", "--decode", "tp=2",
               "--requests", "1", "--tokens", "16", "--backend", "nixl", "--json"])
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert rc == 2 and doc["ok"] is False and doc["backend"] == "nixl"
    assert doc["rejected"]["rule"] == "nixl.replicated-hetero-tp" and doc["rejected"]["reason"]
    assert "rejected by rule nixl.replicated-hetero-tp" in out.err


@pytest.mark.usefixtures("no_processes")
def test_indivisible_tp_is_rejected_for_mooncake_before_processes(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["parity", "--layout", "llama-dense", "--prefill", "tp=3", "--decode", "tp=2", "--requests", "1",
               "--tokens", "16", "--backend", "mooncake"])
    out = capsys.readouterr().out
    assert rc == 2 and "rejected by rule" in out and "reason:" in out
