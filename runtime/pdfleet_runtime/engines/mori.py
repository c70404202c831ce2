"""MORI-IO adapter (AMD): capabilities declared for the matrix; the engine itself is ROCm-only.

``amd-mori`` ships cp310/cp312 wheels linked to the ROCm runtime (``libamdhip64``,
``libhsa-runtime64``) and installs nowhere without it, so ``start`` fails with
``EngineUnavailable`` naming that library. Its handshake carries no per-buffer layer ids
(``publishes_layer_ids=False``), which is why the matrix refuses QSA with PP > 1 for MORI.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pdfleet_runtime.engines.base import (
    EngineCapabilities,
    PeerId,
    PeerInfo,
    PeerState,
    Transfer,
    TransferEngine,
    import_first,
)
from pdfleet_runtime.engines.errors import EngineUnavailable
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RegionRecord

__all__ = ["LIBRARY", "MODULES", "MoriEngine"]

MODULES = ("mori.io", "mori")
LIBRARY = "MORI-IO (pip amd-mori, cp310/cp312 only; needs the ROCm runtime libamdhip64 and libhsa-runtime64)"


class MoriEngine(TransferEngine):
    """Declares MORI's capabilities; ``start`` raises ``EngineUnavailable`` where ROCm is absent.

    No transfer path is implemented yet: even where the library imports, ``start`` refuses
    rather than pretending, until an adapter is written and tested on an AMD host.
    """

    capabilities = EngineCapabilities(
        backend="mori",
        protocols=frozenset({LinkProtocol.RDMA}),
        memory=frozenset({"cuda"}),
        library=LIBRARY,
        publishes_layer_ids=False,
    )

    def _start(self) -> None:
        import_first(MODULES, LIBRARY)
        raise EngineUnavailable(f"{LIBRARY} imported, but pdfleet has no tested MORI transfer path yet")

    def _unsupported(self) -> NoReturn:
        raise EngineUnavailable(f"{LIBRARY}: the MORI adapter never starts on this host")

    def _register(self, regions: tuple[RegionRecord, ...]) -> None:
        self._unsupported()

    def _name(self) -> str:
        self._unsupported()

    def _connect(self, info: PeerInfo) -> Any:
        self._unsupported()

    def _submit(self, peer_id: PeerId, peer: PeerState, batch: Blocks) -> Transfer:
        self._unsupported()
