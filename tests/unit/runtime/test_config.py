"""The runtime config file: what the operator writes is what the runtime reads, and bad files say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfleet_runtime.config import ConfigError, RuntimeConfig, load_config
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.records import ParallelShape


def config(**over: object) -> RuntimeConfig:
    base = dict(
        deployment="demo", namespace="ns", role="decode", runtime_version="0.1.0",
        layout=LayoutRef(preset="llama-dense"), shape=ParallelShape(2), peer_shape=ParallelShape(4),
        backend="nixl", protocol="tcp", max_concurrent_requests=8, kv_tokens=4096,
        prefill_service="demo-prefill", secret_path="/var/run/pdfleet/auth/key",
    )
    base.update(over)
    return RuntimeConfig(**base)


def test_round_trip(tmp_path: Path) -> None:
    cfg = config()
    path = tmp_path / "runtime.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg
    assert "prefillService: demo-prefill" in cfg.to_yaml()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("role: [", "not valid YAML"),
        ("- a\n- b\n", "must be a mapping"),
        ("deployment: demo\n", "namespace"),
        (config().to_yaml().replace("role: decode", "role: router"), "role"),
        (config().to_yaml() + "surprise: 1\n", "surprise"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "runtime.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_engine_ports_may_not_overlap_http() -> None:
    with pytest.raises(ValueError, match="overlaps the engine ports"):
        config(shape=ParallelShape(8), engine_port=8075)


def test_placement_names_one_gpu_per_rank_and_staging_has_defaults() -> None:
    from pdfleet_runtime.config import RuntimeConfig, StagingConfig

    base = {"deployment": "d", "namespace": "n", "role": "decode", "runtimeVersion": "0.1.0",
            "layout": {"preset": "llama-dense"}, "shape": {"tensor": 2}, "peerShape": {"tensor": 1},
            "backend": "mooncake", "protocol": "nvlink", "maxConcurrentRequests": 2, "kvTokens": 64,
            "prefillService": "p", "secretPath": "/s"}
    cfg = RuntimeConfig.model_validate(base)
    assert [cfg.device_of(r) for r in range(2)] == ["cuda:0", "cuda:1"]  # rank i on cuda:i
    shared = RuntimeConfig.model_validate({**base, "placement": [0, 0]})
    assert [shared.device_of(r) for r in range(2)] == ["cuda:0", "cuda:0"]  # both ranks on one GPU
    assert cfg.staging == StagingConfig() and cfg.staging.threshold_bytes == 32 << 20 and cfg.staging.slots == 4
    with pytest.raises(ValueError, match="placement lists 1 GPUs for 2 local ranks"):
        RuntimeConfig.model_validate({**base, "placement": [0]})
    with pytest.raises(ValueError, match="slotMib"):
        RuntimeConfig.model_validate({**base, "staging": {"slotMib": 0}})
    cpu = RuntimeConfig.model_validate({**base, "device": "cpu", "placement": [0, 1]})
    assert cpu.device_of(1) == "cpu"
    assert "placement" not in cfg.to_yaml() and "thresholdBytes" in cfg.to_yaml()
