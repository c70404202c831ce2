"""The protocol table as each engine sees it, and the one writer of engine environment variables."""

from __future__ import annotations

import pytest

from pdfleet_runtime.engines import EngineConfig, SettingsError, resolve
from pdfleet_runtime.engines.settings import MOONCAKE_QUEUE_VAR, EnvLedger
from pdfleet_runtime.links import LinkProtocol


@pytest.mark.parametrize(
    ("backend", "protocol", "engine_protocol", "env"),
    [
        ("mooncake", LinkProtocol.TCP, "tcp", {MOONCAKE_QUEUE_VAR: "8192", "MC_LOG_LEVEL": "WARNING"}),
        ("mooncake", LinkProtocol.NVLINK, "nvlink_intra", {"MC_INTRANODE_NVLINK": "1"}),
        ("mooncake", LinkProtocol.RDMA, "rdma", {"MC_LOG_LEVEL": "WARNING"}),
        ("nixl", LinkProtocol.TCP, "ucx", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}),
        ("nixl", LinkProtocol.NVLINK, "ucx", {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}),
        ("nixl", LinkProtocol.SHM, "ucx", {"UCX_TLS": "cma,tcp"}),
        ("nixl", LinkProtocol.RDMA, "ucx", {"UCX_TLS": "rc,ud,cuda_copy"}),
    ],
)
def test_protocol_table(backend: str, protocol: LinkProtocol, engine_protocol: str, env: dict[str, str]) -> None:
    s = resolve(EngineConfig(backend, protocol))
    assert s.engine_protocol == engine_protocol and s.pinned
    for key, value in env.items():
        assert s.env[key] == value, key


@pytest.mark.parametrize(("backend", "protocol"), [("mooncake", LinkProtocol.SHM), ("mori", LinkProtocol.TCP)])
def test_unsupported_pairs_are_errors_with_the_reason(backend: str, protocol: LinkProtocol) -> None:
    with pytest.raises(SettingsError, match=f"cannot serve protocol {protocol.value}"):
        resolve(EngineConfig(backend, protocol))


def test_nixl_default_path_is_unpinned_and_clears_inherited_ucx_tls() -> None:
    s = resolve(EngineConfig("nixl", None))
    assert not s.pinned and s.env["UCX_TLS"] is None and s.env["UCX_NET_DEVICES"] is None


def test_mooncake_needs_a_protocol() -> None:
    with pytest.raises(SettingsError, match="explicit protocol"):
        resolve(EngineConfig("mooncake", None))


def test_nixl_tcp_off_loopback_does_not_pin_lo() -> None:
    assert "UCX_NET_DEVICES" not in resolve(EngineConfig("nixl", LinkProtocol.TCP, host="10.0.0.5")).env
    s = resolve(EngineConfig("nixl", LinkProtocol.TCP, host="10.0.0.5", net_devices="eth0"))
    assert s.env["UCX_NET_DEVICES"] == "eth0"


@pytest.mark.parametrize(("queue", "batch"), [(None, 1024), ("8192", 4096), ("100", 50)])
def test_mooncake_batches_are_half_the_per_peer_queue(queue: str | None, batch: int) -> None:
    s = resolve(EngineConfig("mooncake", LinkProtocol.TCP, env={MOONCAKE_QUEUE_VAR: queue}))
    assert s.env[MOONCAKE_QUEUE_VAR] == queue
    assert s.max_batch_entries == batch


def test_mooncake_queue_values_the_engine_ignores_are_refused() -> None:
    with pytest.raises(SettingsError, match="outside"):
        resolve(EngineConfig("mooncake", LinkProtocol.TCP, env={MOONCAKE_QUEUE_VAR: "65536"}))


def test_mooncake_nvlink_without_its_variable_is_refused() -> None:
    with pytest.raises(SettingsError, match="silently uses TCP"):
        resolve(EngineConfig("mooncake", LinkProtocol.NVLINK, env={"MC_INTRANODE_NVLINK": None}))


def test_rdma_device_names_reach_the_engine() -> None:
    s = resolve(EngineConfig("mooncake", LinkProtocol.RDMA, rdma_devices=("mlx5_0", "mlx5_1")))
    assert s.device_names == "mlx5_0,mlx5_1"


def test_unknown_backend_and_log_level() -> None:
    with pytest.raises(SettingsError, match="unknown backend"):
        resolve(EngineConfig("gloo"))
    with pytest.raises(SettingsError, match="log_level"):
        EngineConfig("nixl", log_level="LOUD")


def test_ledger_sets_removes_and_refuses_conflicts() -> None:
    ledger, environ = EnvLedger(), {"UCX_TLS": "sm", "KEEP": "1"}
    ledger.apply({"UCX_TLS": None, "NIXL_LOG_LEVEL": "WARN"}, environ)
    assert environ == {"KEEP": "1", "NIXL_LOG_LEVEL": "WARN"}
    ledger.apply({"NIXL_LOG_LEVEL": "WARN"}, environ)  # the same value again is fine
    with pytest.raises(SettingsError, match="UCX_TLS is None, wanted 'tcp'"):
        ledger.apply({"UCX_TLS": "tcp"}, environ)
    assert "UCX_TLS" not in environ
