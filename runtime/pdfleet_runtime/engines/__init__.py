"""Transfer engines behind one small contract (issue 6; docs/engines.md).

Reading order: ``errors`` (Enums and typed errors), ``blocks`` (block arrays and the vectorized
range checks), ``settings`` (protocol -> engine settings, the one writer of engine environment
variables), ``base`` (the contract), ``registry`` (lazy backend lookup), then the adapters
``local``, ``mooncake``, ``nixl``, ``mori``. Importing this package imports no engine library.
"""

from __future__ import annotations

from pdfleet_runtime.engines.base import (
    PEER_INFO_VERSION,
    EngineCapabilities,
    PeerId,
    PeerInfo,
    Transfer,
    TransferEngine,
    TransferReport,
    TransportReport,
)
from pdfleet_runtime.engines.blocks import Granule, GranuleTable, RegionTable, checked, granules_of
from pdfleet_runtime.engines.errors import (
    BlockError,
    BlockRangeError,
    EngineError,
    EngineStartError,
    EngineState,
    EngineStateError,
    EngineUnavailable,
    FailureKind,
    HandshakeError,
    PeerUnreachable,
    SettingsError,
    Side,
    TransferFailed,
    TransferStatus,
    TransferTimeout,
    TransportMismatch,
    UnknownPeer,
)
from pdfleet_runtime.engines.registry import ADAPTERS, adapter_class, create_engine
from pdfleet_runtime.engines.settings import LOCAL_BACKEND, EngineConfig, ResolvedSettings, resolve

__all__ = [
    "ADAPTERS",
    "LOCAL_BACKEND",
    "PEER_INFO_VERSION",
    "BlockError",
    "BlockRangeError",
    "EngineCapabilities",
    "EngineConfig",
    "EngineError",
    "EngineStartError",
    "EngineState",
    "EngineStateError",
    "EngineUnavailable",
    "FailureKind",
    "Granule",
    "GranuleTable",
    "HandshakeError",
    "PeerId",
    "PeerInfo",
    "PeerUnreachable",
    "RegionTable",
    "ResolvedSettings",
    "SettingsError",
    "Side",
    "Transfer",
    "TransferEngine",
    "TransferFailed",
    "TransferReport",
    "TransferStatus",
    "TransferTimeout",
    "TransportMismatch",
    "TransportReport",
    "UnknownPeer",
    "adapter_class",
    "checked",
    "create_engine",
    "granules_of",
    "resolve",
]
