"""Typed errors and status Enums of the engine contract.

Engines report failure as ``-1`` (Mooncake), as exceptions with their own names (NIXL), or not at
all (a Mooncake write from an unregistered address once returned 0). Adapters translate every
one of these into the errors below at the edge, so callers branch on a type and a ``FailureKind``,
never on an engine's integers or strings.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import ClassVar

__all__ = [
    "BlockError",
    "BlockRangeError",
    "EngineError",
    "EngineStartError",
    "EngineState",
    "EngineStateError",
    "EngineUnavailable",
    "FailureKind",
    "HandshakeError",
    "PeerUnreachable",
    "SettingsError",
    "Side",
    "TransferFailed",
    "TransferStatus",
    "TransferTimeout",
    "TransportMismatch",
    "UnknownPeer",
]


class EngineState(StrEnum):
    """Lifecycle of one adapter: NEW -> STARTED -> REGISTERED -> CLOSED (peers only when REGISTERED)."""

    NEW = "new"
    STARTED = "started"
    REGISTERED = "registered"
    CLOSED = "closed"


class TransferStatus(StrEnum):
    """Poll state of one submitted batch."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Side(StrEnum):
    """Which end of a block a check is about."""

    LOCAL = "local"
    REMOTE = "remote"


class FailureKind(StrEnum):
    """Why an engine operation failed; drives retry and readiness decisions."""

    UNAVAILABLE = "unavailable"
    START = "start"
    SETTINGS = "settings"
    HANDSHAKE = "handshake"
    TRANSPORT = "transport"
    STATE = "state"
    BAD_BLOCKS = "bad_blocks"
    OUT_OF_RANGE = "out_of_range"
    UNKNOWN_PEER = "unknown_peer"
    PEER_UNREACHABLE = "peer_unreachable"
    ENGINE = "engine"
    TIMEOUT = "timeout"


class EngineError(RuntimeError):
    """Base of every engine failure. ``retryable``: the same call may succeed later without a config change."""

    kind: ClassVar[FailureKind] = FailureKind.ENGINE
    retryable: ClassVar[bool] = False


class EngineUnavailable(EngineError):
    """The engine's library cannot be imported on this host (names the missing library)."""

    kind = FailureKind.UNAVAILABLE


class EngineStartError(EngineError):
    """The engine imported but refused to initialize or register memory."""

    kind = FailureKind.START


class SettingsError(EngineError, ValueError):
    """A backend cannot serve the protocol asked for, or settings conflict with an engine already started."""

    kind = FailureKind.SETTINGS


class HandshakeError(EngineError, ValueError):
    """A peer's published info is malformed, of another version, backend or protocol."""

    kind = FailureKind.HANDSHAKE


class TransportMismatch(EngineError):
    """The engine would use (or did use) another transport than the protocol asked for; never a fallback."""

    kind = FailureKind.TRANSPORT


class EngineStateError(EngineError):
    """An operation was called in the wrong lifecycle state (for example a write before ``register``)."""

    kind = FailureKind.STATE


class BlockError(EngineError, ValueError):
    """Malformed block arrays: unequal lengths, non-positive lengths, negative addresses."""

    kind = FailureKind.BAD_BLOCKS


class BlockRangeError(BlockError):
    """Blocks outside the registered memory of one side, refused before they reach the engine."""

    kind = FailureKind.OUT_OF_RANGE

    def __init__(self, side: Side, count: int, first: Iterable[int], detail: str) -> None:
        self.side = side
        self.count = count
        self.first = tuple(int(i) for i in first)
        super().__init__(f"{count} block(s) outside the {side.value} registration, first indices "
                         f"{list(self.first)}: {detail}")


class UnknownPeer(EngineError, KeyError):
    """A write named a peer that was never connected (or was forgotten)."""

    kind = FailureKind.UNKNOWN_PEER

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PeerUnreachable(EngineError):
    """The peer does not answer (process gone, port closed): reported at once, not after a timeout."""

    kind = FailureKind.PEER_UNREACHABLE


class TransferFailed(EngineError):
    """The engine failed a batch to a reachable peer even after the adapter's one recovery."""

    kind = FailureKind.ENGINE
    retryable = True


class TransferTimeout(EngineError):
    """A batch did not complete within its deadline; the adapter cancelled what it could."""

    kind = FailureKind.TIMEOUT
    retryable = True
