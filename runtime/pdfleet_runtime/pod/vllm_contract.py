"""vLLM's PD worker contract on the built-in runtime: ``kv_transfer_params`` in, a room of pdfleet's protocol out.

vllm-router (0.1.17, ``--vllm-pd-disaggregation``) drives vLLM 0.33's PD connectors in one of two ways
(docs/vllm.md, ../shared/vllm.md):

- **NIXL, two steps.** The prefill gets the request with ``max_tokens: 1``, ``stream: false`` and
  ``kv_transfer_params: {do_remote_decode: true, ...}``; vLLM answers once its prefill ran, its blocks pinned
  for the decode, with ``kv_transfer_params`` naming them (``remote_engine_id``, ``remote_request_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``). The router sends those verbatim to the
  decode with the original request; the decode pulls the blocks from ``remote_host:remote_port``.
- **Mooncake, one step.** The router makes a ``transfer_id`` and sends both at once: the prefill
  ``{do_remote_decode: true, transfer_id}``, the decode ``{do_remote_prefill: true, transfer_id,
  remote_bootstrap_addr: "http://<prefill>:<bootstrap port>", remote_engine_id}`` (the engine id read from the
  prefill bootstrap's ``GET /query`` when the router started).

In both, vllm-router sends the decode only once the prefill answered (seen with Mooncake too: a prefill that
waited for the decode's claim timed out), so vLLM's prefill answers when its blocks are computed and pinned,
not when they moved.

Here each becomes a room (``rooms.RoomTable``) moved over pdfleet's own protocol, so the state is verified as
in SGLang's flow: the prefill holds the room and answers at once (the room waits for the claim, as vLLM's
blocks wait ``kv_lease_duration``); NIXL's room is new and travels in ``remote_request_id`` with the prefill's
own bootstrap endpoint as ``remote_host``/``remote_port``; Mooncake's ``transfer_id`` names the room on both
sides. Parameters that name no transfer are a 400 naming the missing keys, never a silent recompute (vLLM logs
"will not utilize KVTransfer" and recomputes).

Each pod start draws a fresh engine id, as vLLM does (``GET /query``, NIXL's ``remote_engine_id``), unless it is
pinned to the pod's name (``--pin-engine-id``). The decode checks the id it was handed against the one the
prefill's bootstrap answers now (``names_engine``), as a vLLM decode does for an id it has not seen, and refuses
a stale one (``unknown_engine_id``, counted in ``pdfleet_vllm_handshake_refusals_total``): vllm-router's Mooncake
hazard (it reads a prefill's id once, so after a restart with a new id every transfer to it fails) shows here as
it would with vLLM.

The decode also compares the prefill's compatibility (``HandshakeKey``, from the prefill bootstrap's ``GET
/handshake``) with its own before it pulls, as vLLM's NIXL handshake compares ``compute_nixl_compatibility_hash``
(vLLM version, model, dtype, KV-cache dtype, attention backend, ...), and refuses a pair that differs
(``incompatible_engine``, counted as ``reason="compatibility"``): the engine a pod stands in for
(``--stand-in-for vllm==X``, the spec's engine version), the model, the layout (dtypes and state), the transfer
backend (NIXL pulls, Mooncake pushes), hybrid caching. pdfleet's own protocol pairs by wire major version and layout, so without this a
rollout of the engine version would pair pods of two generations where vLLM would refuse them.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from pdfleet_runtime.config import Role, RuntimeConfig
from pdfleet_runtime.layouts import layout_digest, resolve_layout

__all__ = ["HandshakeKey", "KvTransferParams", "LegKind", "VllmLeg", "engine_id", "handshake_key", "leg_of",
           "names_engine", "nixl_prefill_params", "query_answer", "room_of_transfer"]


class KvTransferParams(BaseModel):
    """``kv_transfer_params`` as vllm-router sends them and vLLM's connectors read them (unknown keys kept)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = Field(None, max_length=256)
    remote_request_id: str | None = Field(None, max_length=256)
    remote_block_ids: list[Any] | None = None
    remote_host: str | None = Field(None, max_length=253)
    remote_port: int | None = Field(None, ge=1, le=65535)
    transfer_id: str | None = Field(None, min_length=1, max_length=256)
    remote_bootstrap_addr: str | None = Field(None, max_length=512)
    tp_size: int | None = Field(None, ge=1)


class LegKind(StrEnum):
    NIXL_PREFILL = "nixl-prefill"
    """Hold a new room, answer at once with it in ``kv_transfer_params``."""
    NIXL_DECODE = "nixl-decode"
    MOONCAKE_PREFILL = "mooncake-prefill"
    MOONCAKE_DECODE = "mooncake-decode"


class VllmLeg(BaseModel):
    """What one vLLM-contract request means for this pod: the room, and where the decode pulls it from."""

    model_config = ConfigDict(frozen=True)

    kind: LegKind
    room: int = Field(ge=0, lt=2**63)
    host: str | None = None
    port: int | None = None
    engine_id: str | None = None
    """The prefill's engine id the decode was handed (checked against the prefill's current one)."""


class LegError(ValueError):
    """Parameters that name no transfer for this pod's role; the message names the keys and the fix."""


def engine_id(instance: str, pinned: bool = False) -> str:
    """A fresh engine id per pod start (vLLM draws a new one at every start), or the pod's name when pinned."""
    return instance if pinned else f"{instance}-{uuid.uuid4().hex[:12]}"


def names_engine(handed: str, query: Any) -> bool:
    """Whether ``handed`` (a request's ``remote_engine_id``) names an engine a bootstrap's ``GET /query`` answer
    lists (vllm-router suffixes Mooncake's ids with ``_dp<rank>``)."""
    ids = {str(v.get("engine_id")) for v in query.values() if isinstance(v, dict)} if isinstance(query, dict) else set()
    return handed in ids or any(handed.startswith(f"{i}_dp") and handed[len(i) + 3:].isdigit() for i in ids)


def room_of_transfer(transfer_id: str) -> int:
    """The room both pods derive from a router-made ``transfer_id`` (63 bits of its sha256)."""
    return int.from_bytes(hashlib.sha256(transfer_id.encode()).digest()[:8], "big") >> 1


def leg_of(params: KvTransferParams, role: Role) -> VllmLeg:
    """The leg this pod runs, or ``LegError``."""
    if role is Role.PREFILL:
        if not params.do_remote_decode:
            raise LegError("kv_transfer_params.do_remote_decode must be true on a prefill worker (vllm-router sets "
                           "it): without it the prefill would answer the whole request and nothing would move")
        if params.transfer_id is not None:
            return VllmLeg(kind=LegKind.MOONCAKE_PREFILL, room=room_of_transfer(params.transfer_id))
        return VllmLeg(kind=LegKind.NIXL_PREFILL, room=secrets.randbits(63))
    if not params.do_remote_prefill:
        raise LegError("kv_transfer_params.do_remote_prefill must be true on a decode worker: without it the decode "
                       "would recompute the prompt and nothing would move (send the request through vllm-router)")
    if params.transfer_id is not None:
        missing = [k for k in ("remote_bootstrap_addr", "remote_engine_id") if getattr(params, k) is None]
        if missing:
            raise LegError(f"kv_transfer_params with transfer_id (Mooncake) also needs {', '.join(missing)}")
        assert params.remote_bootstrap_addr is not None
        url = urlsplit(params.remote_bootstrap_addr)
        if url.scheme not in ("http", "https") or not url.hostname or url.port is None:
            raise LegError(f"kv_transfer_params.remote_bootstrap_addr {params.remote_bootstrap_addr!r} is not "
                           "http://HOST:PORT")
        return VllmLeg(kind=LegKind.MOONCAKE_DECODE, room=room_of_transfer(params.transfer_id), host=url.hostname,
                       port=url.port, engine_id=params.remote_engine_id)
    missing = [k for k in ("remote_request_id", "remote_host", "remote_port", "remote_engine_id")
               if getattr(params, k) is None]
    if missing:
        raise LegError(f"kv_transfer_params (NIXL) needs {', '.join(missing)}: pass the prefill's answer's "
                       "kv_transfer_params to the decode verbatim")
    assert params.remote_request_id is not None
    if not params.remote_request_id.isdigit() or int(params.remote_request_id) >= 2**63:
        raise LegError(f"kv_transfer_params.remote_request_id {params.remote_request_id!r} is not a room this "
                       "runtime's prefill handed out")
    return VllmLeg(kind=LegKind.NIXL_DECODE, room=int(params.remote_request_id), host=params.remote_host,
                   port=params.remote_port, engine_id=params.remote_engine_id)


def nixl_prefill_params(leg: VllmLeg, *, engine: str, host: str, port: int, tp: int, pp: int,
                        tokens: int) -> dict[str, Any]:
    """The prefill's answer's ``kv_transfer_params`` (NIXL): vLLM's keys, this runtime's meaning. The room is
    ``remote_request_id``; ``remote_host:remote_port`` is the prefill's bootstrap (where the decode claims it);
    ``remote_block_ids`` stays empty (pdfleet's protocol plans the items)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [], "remote_engine_id": engine,
            "remote_request_id": str(leg.room), "remote_host": host, "remote_port": port, "tp_size": tp,
            "pp_size": pp, "remote_num_tokens": tokens}


def query_answer(engine: str, tp: int, pp: int, addr: str) -> dict[str, Any]:
    """The bootstrap's ``GET /query`` as vLLM's Mooncake bootstrap answers it (``{dp: {engine_id, worker_addr:
    {tp: {pp: addr}}}}``; one DP rank here)."""
    return {"0": {"engine_id": engine,
                  "worker_addr": {str(t): {str(p): addr for p in range(pp)} for t in range(tp)}}}


class HandshakeKey(BaseModel):
    """What a vLLM-contract decode and prefill must share to pair (vLLM's NIXL compatibility hash, as this runtime
    has its fields); ``GET /handshake`` on the prefill's bootstrap answers it beside the engine id."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str = Field(max_length=200, description="The engine and version the pod stands in for (vllm==0.33.0), "
                        "else pdfleet-runtime and its version: vLLM hashes its exact version.")
    model: str = Field(max_length=300, description="The model identity (Hub commit or directory digest), else the "
                       "served name: vLLM hashes the model path.")
    kv_dtype: str = Field(max_length=32, description="The KV cache's element type.")
    layout: str = Field(max_length=64, description="A digest of the whole layout (dtypes, page size, every state).")
    transfer: str = Field(max_length=32, description="The transfer backend (vLLM: NIXL pulls, Mooncake pushes).")
    hybrid: bool = Field(description="Hybrid caching: linear-attention or sliding-window state beside the KV.")

    def differences(self, theirs: HandshakeKey) -> list[str]:
        """Each field that differs, both values: ``engine: 'vllm==0.33.1' here, 'vllm==0.33.0' at the prefill``."""
        mine, other = self.model_dump(), theirs.model_dump()
        return [f"{k}: {mine[k]!r} here, {other[k]!r} at the prefill" for k in mine if mine[k] != other[k]]


def handshake_key(config: RuntimeConfig, stand_in_for: str | None, version: str) -> HandshakeKey:
    """This pod's ``HandshakeKey`` (``version``: this runtime's, when it stands in for no engine)."""
    layout = resolve_layout(config.layout)
    digest = layout_digest(layout)
    return HandshakeKey(engine=stand_in_for or f"pdfleet-runtime=={version}",
                        model=config.model_identity or config.served_model_name or config.deployment,
                        kv_dtype=layout.dtype.value, layout=digest,
                        transfer=config.backend.value,
                        hybrid=layout.linear_attention is not None or layout.swa is not None)
