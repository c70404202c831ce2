"""NIXL (UCX) between two spawned processes: its default path, tcp forced on loopback, and shm.

Covers: planned requests arrive byte-exact through descriptor lists prepared at registration
(equal TP: every block by index; heterogeneous TP: whole items by index, slices per request);
blocks outside either registration refused before the engine; the next write succeeds after the
engine itself refused one; idle engines do not spin a core; an empty batch; a dead peer reported at
once with a typed error.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdfleet_runtime.engines import EngineConfig, FailureKind, Side
from pdfleet_runtime.links import LinkProtocol
from tests.engines.conftest import require, results_for, scenario

SCENARIOS = [
    "planned_equal_tp", "planned_hetero_tp", "out_of_range_local", "out_of_range_remote",
    "raw_out_of_range_then_write", "idle_cpu", "empty_batch", "dead_peer",
]
PATHS = {"default": None, "tcp": LinkProtocol.TCP, "shm": LinkProtocol.SHM}
EXPECTED_ENV = {
    "default": {"UCX_TLS": None, "UCX_NET_DEVICES": None},
    "tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
    "shm": {"UCX_TLS": "cma,tcp", "UCX_NET_DEVICES": None},
}


@pytest.fixture(scope="module", params=list(PATHS))
def path(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if _no_cu13():
        require("nixl_cu12")
    return request.param, results_for(EngineConfig("nixl", PATHS[request.param]), SCENARIOS)


def _no_cu13() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl_cu13") is None


def test_settings_are_pinned_from_the_protocol(path: tuple[str, dict[str, Any]]) -> None:
    name, results = path
    setup = results["setup"]
    for key, value in EXPECTED_ENV[name].items():
        assert setup["environ"][key] == value, key
    assert setup["environ"]["NIXL_LOG_LEVEL"] == "WARN"
    assert setup["pinned"] is (name != "default")
    assert setup["effective"] == ("unpinned" if name == "default" else f"ucx:{EXPECTED_ENV[name]['UCX_TLS']}")


def test_equal_tp_request_goes_by_prepared_index(path: tuple[str, dict[str, Any]]) -> None:
    r = scenario(path[1], "planned_equal_tp")
    assert r["fragmented"] and r["match"]
    assert r["adhoc_descriptors"] == 0 and r["prepared_descriptors"] >= r["blocks"] > 100


def test_heterogeneous_tp_request_arrives_byte_exact(path: tuple[str, dict[str, Any]]) -> None:
    r = scenario(path[1], "planned_hetero_tp")
    assert r["match"]
    assert r["prepared_descriptors"] > 0 and r["adhoc_descriptors"] > 0  # whole items by index, slices not


@pytest.mark.parametrize(("name", "side"), [("out_of_range_local", Side.LOCAL), ("out_of_range_remote", Side.REMOTE)])
def test_block_outside_registration_is_refused_before_the_engine(path: tuple[str, dict[str, Any]], name: str,
                                                                 side: Side) -> None:
    r = scenario(path[1], name)
    assert r["error_type"] == "BlockRangeError" and r["side"] == side
    assert r["batches_to_engine_delta"] == 0 and r["untouched"]


def test_next_write_succeeds_after_the_engine_refused_one(path: tuple[str, dict[str, Any]]) -> None:
    r = scenario(path[1], "raw_out_of_range_then_write")
    assert r["injected"] == "nixlNotFoundError"
    assert r["match"]


def test_dead_peer_fails_fast_with_a_typed_error(path: tuple[str, dict[str, Any]]) -> None:
    r = scenario(path[1], "dead_peer")
    assert r["error_type"] == "PeerUnreachable" and r["kind"] == FailureKind.PEER_UNREACHABLE
    assert r["seconds"] < 2.0


def test_idle_engines_do_not_spin_a_core(path: tuple[str, dict[str, Any]]) -> None:
    r = scenario(path[1], "idle_cpu")  # NIXL's own default (progress thread poll timeout 0) spent ~0.85 s
    assert r["initiator_cpu_s"] < 0.25 * r["wall_s"] and r["target_cpu_s"] < 0.25 * r["wall_s"]


def test_empty_batch_completes_without_an_engine_request(path: tuple[str, dict[str, Any]]) -> None:
    r = scenario(path[1], "empty_batch")
    assert r["blocks"] == 0 and r["engine_calls"] == 0 and r["prepared_descriptors"] == r["adhoc_descriptors"] == 0
