"""Mooncake over TCP loopback between two spawned processes, with its per-peer queue variable unset.

Covers: planned requests (equal and heterogeneous TP) arrive byte-exact; 10,000 blocks to one peer;
recovery after a real queue-full, an engine-refused address and an injected wedge; blocks outside
either registration refused before the engine; a dead peer reported at once with a typed error.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdfleet_runtime.engines import EngineConfig, FailureKind, Side
from pdfleet_runtime.links import LinkProtocol
from tests.engines.conftest import require, results_for, scenario

SCENARIOS = [
    "planned_equal_tp", "planned_hetero_tp", "out_of_range_local", "out_of_range_remote", "batch_10000",
    "raw_queue_full_then_write", "raw_out_of_range_then_write", "poisoned_then_write", "dead_peer",
]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    require("mooncake.engine")
    # None removes the variable the protocol table would set: the adapter alone must keep batches safe.
    config = EngineConfig("mooncake", LinkProtocol.TCP, env={"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": None})
    return results_for(config, SCENARIOS)


def test_settings_reach_the_process(results: dict[str, Any]) -> None:
    setup = results["setup"]
    assert setup["environ"]["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] is None
    assert setup["environ"]["MC_LOG_LEVEL"] == "WARNING"
    assert setup["effective"] == "tcp" and setup["pinned"]


@pytest.mark.parametrize("name", ["planned_equal_tp", "planned_hetero_tp"])
def test_planned_request_arrives_byte_exact(results: dict[str, Any], name: str) -> None:
    r = scenario(results, name)
    assert r["fragmented"], "the request's pages should be fragmented"
    assert r["blocks"] > 100 and r["bytes"] > 1 << 20
    assert r["match"], "target arena differs from background + planned blocks"


def test_ten_thousand_blocks_to_one_peer_with_the_queue_unset(results: dict[str, Any]) -> None:
    r = scenario(results, "batch_10000")
    assert r["queue_var"] is None
    assert r["blocks"] == 10_000 and r["match"]
    assert r["engine_calls"] == 10  # chunks of 1,024: half the default per-peer queue of 2,048
    assert r["recoveries"] == 0


def test_recovers_after_a_real_queue_full(results: dict[str, Any]) -> None:
    r = scenario(results, "raw_queue_full_then_write")
    assert r["raw_rc"] != 0, "the raw engine should have refused 5,000 entries to one peer"
    assert r["match"], "the adapter's write after the queue-full did not land byte-exact"


def test_next_write_succeeds_after_an_engine_refused_address(results: dict[str, Any]) -> None:
    r = scenario(results, "raw_out_of_range_then_write")
    assert r["injected"] == "rc=-1"
    assert r["match"]


def test_recovers_from_a_wedged_engine_by_rebuilding_it(results: dict[str, Any]) -> None:
    r = scenario(results, "poisoned_then_write")
    assert r["recoveries"] == 1 and r["generation_delta"] == 1
    assert r["match"]


@pytest.mark.parametrize(("name", "side"), [("out_of_range_local", Side.LOCAL), ("out_of_range_remote", Side.REMOTE)])
def test_block_outside_registration_is_refused_before_the_engine(results: dict[str, Any], name: str,
                                                                 side: Side) -> None:
    r = scenario(results, name)
    assert r["error_type"] == "BlockRangeError" and r["side"] == side and r["count"] == 1
    assert r["batches_to_engine_delta"] == 0
    assert r["untouched"], "a refused batch must not change the target"


def test_dead_peer_fails_fast_with_a_typed_error(results: dict[str, Any]) -> None:
    r = scenario(results, "dead_peer")
    assert r["error_type"] == "PeerUnreachable" and r["kind"] == FailureKind.PEER_UNREACHABLE
    assert r["seconds"] < 2.0
