"""Runtime versions (matrix and wire protocol per release) and the protocol -> engine settings table."""

from __future__ import annotations

import pytest

from pdfleet_runtime.links import (
    ENGINE_SETTINGS,
    UNSUPPORTED_PROTOCOLS,
    Backend,
    LinkProtocol,
    engine_settings,
)
from pdfleet_runtime.matrix import LATEST_MATRIX_VERSION, MATRICES, Feature
from pdfleet_runtime.versions import (
    CURRENT_RUNTIME_VERSION,
    RUNTIME_RELEASES,
    RuntimeRelease,
    WireProtocol,
    compatibility,
    release_of,
)


def test_current_runtime_is_a_known_release() -> None:
    rel = release_of(CURRENT_RUNTIME_VERSION)
    assert rel is not None and rel.matrix_version in MATRICES
    assert all(r.matrix_version in MATRICES for r in RUNTIME_RELEASES.values())


@pytest.mark.parametrize("version", ["0.1.0+cu13", "0.1.0"])
def test_build_metadata_is_ignored(version: str) -> None:
    assert release_of(version) == RUNTIME_RELEASES["0.1.0"]


@pytest.mark.parametrize("version", ["9.9.9", "0.1", "v0.1.0", "", None, 1, "0.1.0 "])
def test_unknown_or_malformed_versions(version: object) -> None:
    assert release_of(version) is None
    assert not compatibility(version, "0.1.0").ok


def test_wire_protocol_majors_decide() -> None:
    releases = {
        "1.0.0": RuntimeRelease("1.0.0", "1", WireProtocol(1, 0)),
        "1.1.0": RuntimeRelease("1.1.0", "1", WireProtocol(1, 2)),
        "2.0.0": RuntimeRelease("2.0.0", "1", WireProtocol(2, 0)),
    }
    assert compatibility("1.0.0", "1.1.0", releases).ok
    bad = compatibility("1.1.0", "2.0.0", releases)
    assert not bad.ok and "1.2" in bad.reason and "2.0" in bad.reason


def test_every_pair_is_either_served_or_refused_with_a_reason() -> None:
    for b in Backend:
        for p in LinkProtocol:
            served, refused = (b, p) in ENGINE_SETTINGS, (b, p) in UNSUPPORTED_PROTOCOLS
            assert served != refused, (b, p)
            cell = MATRICES[LATEST_MATRIX_VERSION].supports(b, Feature(f"protocol-{p}"))
            assert cell.supported == served


def test_design_table_entries() -> None:
    nv = engine_settings("mooncake", "nvlink")
    assert nv is not None and nv.engine_protocol == "nvlink_intra" and nv.env["MC_INTRANODE_NVLINK"] == "1"
    assert nv.needs_host_ipc and nv.same_host_only
    assert engine_settings("nixl", "tcp").env["UCX_TLS"] == "tcp"  # type: ignore[union-attr]
    assert engine_settings("nixl", "nvlink").env["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"  # type: ignore[union-attr]
    assert engine_settings("mooncake", "shm") is None
    assert engine_settings("bogus", "tcp") is None
    rdma = engine_settings("mooncake", "rdma")
    assert rdma is not None and not rdma.needs_host_ipc
