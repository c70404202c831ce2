"""Distinct ID types for the runtime, so a slot index is never passed where a row is meant.

Scalars are ``NewType``s over ``int`` (free at run time, checked by type checkers); arrays of
indices travel in :class:`pdfleet_runtime.pools.RequestIndices`, whose fields name the kind.
Layer ids travel as uint32: the two largest values are sentinels for request-wide states and
never collide with a real layer (design.md section 1).
"""

from __future__ import annotations

from typing import NewType

__all__ = [
    "INDEX_POSITIONS_LAYER_ID",
    "PLE_NGRAM_LAYER_ID",
    "QSA_ROPE_LAYER_ID",
    "SENTINEL_LAYER_IDS",
    "LayerId",
    "RankId",
    "RowId",
    "SlotId",
    "is_sentinel",
]

SlotId = NewType("SlotId", int)
"""Index of a per-request slot (linear-attention state, PLE state)."""
RowId = NewType("RowId", int)
"""Index of a request row (QSA pending rings)."""
RankId = NewType("RankId", int)
"""Global rank of one GPU process: ``pp_rank * tp + tp_rank``."""
LayerId = NewType("LayerId", int)
"""Global layer id (uint32), or one of the sentinels below."""

QSA_ROPE_LAYER_ID = LayerId(2**32 - 2)
"""The QSA RoPE position ring is shared by all QSA layers of a stage."""
PLE_NGRAM_LAYER_ID = LayerId(2**32 - 1)
"""The PLE n-gram history is one per request."""
INDEX_POSITIONS_LAYER_ID = LayerId(2**32 - 3)
"""Request-wide per-token index positions (transformers' Qwen4-Exp ``indexer_position_ids``)."""
SENTINEL_LAYER_IDS = frozenset({QSA_ROPE_LAYER_ID, PLE_NGRAM_LAYER_ID, INDEX_POSITIONS_LAYER_ID})


def is_sentinel(layer_id: int) -> bool:
    """True for the request-wide sentinel ids, which one elected PP stage sends."""
    return layer_id in SENTINEL_LAYER_IDS
