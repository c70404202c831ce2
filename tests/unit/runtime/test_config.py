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
