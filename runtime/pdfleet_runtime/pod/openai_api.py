"""The worker API: the OpenAI endpoints and SGLang's PD worker contract, on both roles of the built-in runtime.

SGLang's router sends one body to a prefill and a decode worker at once (``POST /generate``,
``/v1/chat/completions``, ``/v1/completions``) with ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room`` added, and returns the decode's answer. Here:

- a prefill pod holds the room (``rooms.RoomTable``: the state's seed and token count, bounded in
  count, bytes and time) until a decode's ``TransferRequest`` of kind ``room`` naming it claims it (the
  bootstrap's ``admit`` hook); its ranks fill that state and write it; the request awaits the room's
  typed outcome (the bootstrap's ``settled`` hook ends it once every leg did) and answers with the bytes
  written, 500 ``transfer_failed`` naming the failure a leg reported, or 504 ``room_expired``;
- a decode pod allocates, pulls the room's state over pdfleet's protocol from the prefill pod at
  ``bootstrap_host:bootstrap_port`` (its own bootstrap port when null), verifies every byte, and
  answers with the completion derived from the verified state (``worker_api.completion``).

With a model (``RuntimeConfig.model``: the reference engine) both roles encode the body into the model's ids
(``model_answer.prompt_of``: its tokenizer and chat template, ``model_text``); the prefill's room holds them and
its ranks compute the prompt's forward and the first token; the decode's ranks answer their shares of the
state, decode rank 0 continues greedily (``GenerateOp``), and the answer is the model's text
(``model_answer.completion_of``). A transfer that failed, a missing or disagreeing first token, or a failed
continuation is an error answer, never text.

Registration and load: ``GET /health``, ``/server_info``, ``/model_info``, ``/v1/models``, ``/version``, and the
gauges SGLang exports (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:num_used_tokens``, ``sglang:token_usage``, label ``model_name``) and vLLM's
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, labels
``model_name`` and ``engine``) on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import ValidationError

from pdfleet_runtime import __version__
from pdfleet_runtime.config import Role, RuntimeConfig
from pdfleet_runtime.layouts import (
    IndexKind,
    pages_for_tokens,
    pool_counts,
    replica_bytes,
    replica_bytes_by_state,
    resolve_layout,
    swa_pages_for_tokens,
)
from pdfleet_runtime.protocol.bootstrap import BootstrapState
from pdfleet_runtime.protocol.discovery import Endpoint as PeerEndpoint
from pdfleet_runtime.protocol.states import FailureReason
from pdfleet_runtime.rank.pipe import Generated, GenerateOp, RankStats

from .compute_cost import cost_from, decode_compute, prefill_compute
from .drain import Drain
from .fallbacks import FallbackReason, SilentFallbacks
from .launcher import RankCallError
from .metrics import ReceivedMetrics, sglang_gauges, vllm_gauges
from .model_answer import completion_of, prompt_of
from .model_stream import ModelStream
from .model_text import ModelText
from .options import KvConnector, ServeOptions
from .rooms import Expired, LegFailed, Room, RoomError, RoomFailure, RoomOutcome, RoomTable
from .routing import SyntheticResult
from .seeded_load import LoadMetrics
from .vllm_contract import (
    HandshakeKey,
    LegError,
    LegKind,
    VllmLeg,
    engine_id,
    handshake_key,
    leg_of,
    names_engine,
    nixl_prefill_params,
    query_answer,
)
from .worker_api import (
    ApiError,
    Completion,
    Endpoint,
    WorkerRequest,
    completion,
    error_body,
    parse_request,
    prefill_answer,
    render,
    sse_chunks,
)

__all__ = ["WorkerApi", "WorkerPod", "request_items", "request_state_bytes", "room_error"]

log = logging.getLogger("pdfleet_runtime.server")
ROOM_WAIT_S = 2.0
"""The router sends both pods the body at once: a decode whose claim came before the prefill held the room
(refused, nothing changed) asks again for this long."""
QUERY_TIMEOUT_S = 5.0  # a decode's GET /query of the prefill bootstrap (vLLM contract: its engine id)

_UNREACHABLE = frozenset({FailureReason.PEER_UNREACHABLE, FailureReason.PEER_LOST, FailureReason.PEER_RESTARTED,
                          FailureReason.NO_PEER})


def _counts(cfg: RuntimeConfig, tokens: int) -> dict[IndexKind, int]:
    layout = resolve_layout(cfg.layout)
    return {IndexKind.PAGE: pages_for_tokens(tokens, layout.page_size),
            IndexKind.SWA_PAGE: swa_pages_for_tokens(tokens, layout.swa.window, layout.page_size)
            if layout.swa else 0, IndexKind.SLOT: 1, IndexKind.ROW: 1}


def request_items(cfg: RuntimeConfig, tokens: int) -> dict[str, int]:
    """Items of each index kind one request of ``tokens`` tokens takes on a rank (``RankStats.free``'s keys)."""
    return {k.value: n for k, n in _counts(cfg, tokens).items() if n}


def request_state_bytes(cfg: RuntimeConfig, tokens: int, *, decode_side: bool) -> int:
    """Bytes a request of ``tokens`` tokens occupies on every rank of the decode pod (what a transfer moves)."""
    shape = cfg.shape if decode_side else cfg.peer_shape
    return replica_bytes(resolve_layout(cfg.layout), shape.tp, shape.pp, _counts(cfg, tokens))


def request_state_bytes_by_state(cfg: RuntimeConfig, tokens: int) -> dict[str, int]:
    """``request_state_bytes`` on the decode side, by state type (the layout's split; the parts sum to it)."""
    parts = replica_bytes_by_state(resolve_layout(cfg.layout), cfg.shape.tp, cfg.shape.pp, _counts(cfg, tokens))
    return {state.value: n for state, n in parts.items() if n}


def _pool_bytes(cfg: RuntimeConfig) -> int:
    layout = resolve_layout(cfg.layout)
    counts = pool_counts(layout, cfg.max_concurrent_requests, cfg.kv_tokens)
    return replica_bytes(layout, cfg.peer_shape.tp, cfg.peer_shape.pp, counts)


def room_error(room: int, failure: RoomFailure, ttl_s: float) -> ApiError:
    """A prefill's answer to a room that ended failed, by the failure's type: expired 504 ``room_expired``, a leg's
    failure 500 ``transfer_failed`` naming its ``FailureReason``."""
    match failure:
        case Expired(claimed=False):
            return ApiError(504, f"no decode claimed bootstrap_room {room} within {ttl_s:g}s: the room expired and its "
                            "reservation was freed", code="room_expired", param="bootstrap_room")
        case Expired(after_s=after):
            return ApiError(504, f"the transfer of bootstrap_room {room} was claimed but did not end within "
                            f"{after:.0f}s: the room expired and its reservation was freed", code="room_expired",
                            param="bootstrap_room")
        case LegFailed(failure=kind, reason=reason):
            return ApiError(500, f"the transfer of bootstrap_room {room} failed: {kind.value}: {reason}",
                            code="transfer_failed")


HandshakeRefusal = Literal["engine_id", "compatibility"]
HANDSHAKE_REFUSALS: tuple[HandshakeRefusal, ...] = ("engine_id", "compatibility")

class WorkerPod(Protocol):
    """What the worker API asks of its pod server, and nothing more (``app.PodServer`` is one; the worker API
    never imports the app). The pod server owns the rooms' wiring: a prefill's bootstrap admits claims
    through ``WorkerApi.rooms`` and tells it of every request that ended (``RoomTable.settle``)."""

    @property
    def opts(self) -> ServeOptions: ...

    @property
    def drain(self) -> Drain: ...

    @property
    def bootstrap_state(self) -> BootstrapState | None:
        """A prefill pod's bootstrap state (its pending requests); None on a decode pod."""

    def ranks_up(self) -> int:
        """Rank processes of the replica up now (0 before they start)."""

    def ranks_died(self) -> bool:
        """Whether a rank process of the replica exited while serving."""

    async def rank_stats(self, timeout_s: float) -> list[RankStats]:
        """Every rank's counters (``RankCallError`` when one does not answer)."""

    def health_checked(self, request: web.Request | None, ok: bool) -> None:
        """Count an answer to a ``/health`` check (a router's, when its caller holds the worker key)."""

    async def read_body(self, request: web.Request) -> bytes:
        """A request's body within the port's read deadline (``ApiError`` 408 when it trickles in)."""

    async def known_prefill(self, ep: PeerEndpoint) -> bool:
        """Whether ``ep`` is a prefill pod this pod's discovery names."""

    async def pull(self, ep: PeerEndpoint, room: int, tokens: int, request_id: str, seed: int, timeout_s: float, *,
                   retry_refused_s: float, prompt: tuple[int, ...] = ()) -> SyntheticResult:
        """A room's state from the prefill pod holding it, verified (``routing.RequestRouter.pull``); with
        ``prompt``, the model's state as every decode rank's share."""

    async def generate(self, op: GenerateOp, timeout_s: float,
                       on_token: Callable[[int, int], None] | None = None) -> Generated:
        """Decode rank 0's continuation of a model request (``RankCallError`` when it fails); ``on_token(index,
        token)`` hears a streaming one's tokens as they are computed."""


class WorkerApi:
    """The worker endpoints of one pod server (``PodServer`` owns one and adds its routes)."""

    def __init__(self, pod: WorkerPod, registry: CollectorRegistry) -> None:
        self.pod = pod
        cfg = pod.opts.config
        self.role = cfg.role
        self.model = cfg.served_model_name or cfg.deployment
        self.text = ModelText(cfg.model.path) if cfg.model is not None else None
        """A model pod's tokenizer and chat template (None: the seeded mode's derived answers)."""
        self.rooms = RoomTable(max_rooms=cfg.max_concurrent_requests * 4, max_bytes=_pool_bytes(cfg),
                               ttl_s=pod.opts.room_ttl_s, legs=cfg.peer_shape.world)
        self.running = 0
        self.queued = 0
        self.used_tokens = 0
        r, m = registry, [self.model]
        sglang_gauges(r, self.model, self.role.value, lambda: self.running, lambda: self.queued,
                      lambda: state.unfinished if (state := pod.bootstrap_state) is not None else 0)
        Gauge("sglang:num_used_tokens", "The number of used tokens.", ["model_name"],
              registry=r).labels(*m).set_function(lambda: self.used_tokens)
        Gauge("sglang:token_usage", "The token usage.", ["model_name"],
              registry=r).labels(*m).set_function(lambda: self.used_tokens / max(1, cfg.kv_tokens))
        vllm_gauges(r, self.model, lambda: self.running, lambda: self.queued,
                    lambda: self.used_tokens / max(1, cfg.kv_tokens))
        self.received = ReceivedMetrics(r, self.model, self.role.value, cfg.backend)
        """A decode's requests whose state arrived, under the engines' names (the doctor's state-received check)."""
        self.fallbacks = SilentFallbacks(r, self.role.value)
        """Answers and rooms that fell back silently (``pod.fallbacks``): the server writes their pod condition."""
        self.expired = Counter("pdfleet_rooms_expired", "Rooms (bootstrap_room) no decode claimed in time: their "
                               "reservation was freed (prefill pods)", registry=r)
        self._expired_seen = 0
        self.held = Gauge("pdfleet_rooms_held", "Rooms held for a decode (prefill pods)", registry=r)
        self.held.set_function(lambda: sum(1 for x in self.rooms.rooms.values() if not x.done))
        self.room_bytes = Counter("pdfleet_room_transfer_bytes", "Bytes of worker requests (rooms) moved, as this "
                                  "pod reports them per request", registry=r)
        self.cost = cost_from(cfg.compute_cost, os.environ)  # the seeded mode's declared compute (compute_cost)
        self.computing = 0  # requests in their declared compute: a drain waits for them
        self.load = LoadMetrics(r, self.model, self.role.value, cfg.kv_tokens, prefill_compute(self.cost),
                                decode_compute(self.cost))
        self.engine_id = engine_id(pod.opts.instance, pinned=pod.opts.pin_engine_id)
        """vLLM's engine id (fresh at every start, as vLLM's, or the pod's name): ``GET /query``, NIXL answers."""
        self.handshake = handshake_key(cfg, pod.opts.stand_in_for, __version__)
        """What a vLLM-contract peer must share to pair (``GET /handshake``; a decode compares it before pulling)."""
        self.refusals = Counter("pdfleet_vllm_handshake_refusals", "vLLM-contract requests a decode refused before "
                                "pulling, by why (engine_id: the id it was handed is not the prefill's engine now; "
                                "compatibility: the prefill's engine, model, layout or backend differs)",
                                ["reason"], registry=r)
        for reason in HANDSHAKE_REFUSALS:  # at 0 from the start: an alert's rate() needs the series before its first
            self.refusals.labels(reason)
        self._background: set[asyncio.Task[None]] = set()
        self._refusals_logged: set[tuple[str, str]] = set()
        self._peers: aiohttp.ClientSession | None = None
        """One session for a decode's ``GET /handshake`` calls (made on first use, closed with the app)."""

    def add_routes(self, app: web.Application) -> None:
        for ep in Endpoint:
            app.router.add_post(ep.value, self._handler(ep))
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.on_cleanup.append(self._close_peers)

    async def _close_peers(self, _: web.Application) -> None:
        if self._peers is not None:
            await self._peers.close()

    # ------------------------------------------------------------------ info

    async def _health(self, request: web.Request | None) -> web.Response:
        """200 while serving with every rank up; 503 from the drain's first moment, so every router's health
        check drops the pod before it refuses new work (``Drain``'s window, which counts these answers per
        caller: ``RouterChecks``)."""
        up = not self.pod.ranks_died() and self.pod.ranks_up() == self.pod.opts.config.shape.world
        serving = self.pod.drain.serving
        self.pod.health_checked(request, serving and up)
        if not serving:
            return web.Response(status=503, text=f"draining ({self.pod.drain.phase.value})")
        return web.Response(status=200 if up else 503)

    async def _server_info(self, _: web.Request) -> web.Response:
        o, cfg = self.pod.opts, self.pod.opts.config
        mode = "prefill" if self.role is Role.PREFILL else "decode"
        engine, _eq, version = (o.stand_in_for or "").partition("==")
        stand_in = {"stand_in": f"pdfleet-runtime serve {__version__} standing in for {engine} {version} "
                    "(which needs GPUs)"} if o.stand_in_for else {}
        return web.json_response({
            "version": version or __version__, "runtime": "pdfleet", "runtime_version": __version__, **stand_in,
            "served_model_name": self.model, "model_path": self.model, "disaggregation_mode": mode,
            "disaggregation_transfer_backend": cfg.backend.value, "disaggregation_bootstrap_port": o.bootstrap_port,
            "tp_size": cfg.shape.tp, "pp_size": cfg.shape.pp, "dp_size": 1,
            "max_running_requests": cfg.max_concurrent_requests, "max_total_num_tokens": cfg.kv_tokens,
            "layout": cfg.layout.model_dump(mode="json", exclude_none=True), "draining": not self.pod.drain.serving,
            "internal_states": [{"num_running_reqs": self.running, "num_queue_reqs": self.queued}],
            "pools": await self._pools()})

    async def _pools(self) -> dict[str, Any]:
        """Items held and free per index kind over every rank (tests check that failed requests free them)."""
        held, free, why = 0, dict[str, int](), dict[str, int]()
        if self.pod.ranks_up():
            with contextlib.suppress(RankCallError):
                for st in await self.pod.rank_stats(timeout_s=5.0):
                    held += st.held
                    for k, v in st.free.items():
                        free[k] = free.get(k, 0) + v
                    for k, v in st.held_by.items():
                        why[k] = why.get(k, 0) + v
        return {"held": held, "free": free, "heldBy": why}

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "tokenizer_path": None, "is_generation": True,
                                  "served_model_name": self.model, "model_type": "pdfleet-synthetic"})

    def vllm_query(self) -> dict[str, Any]:
        """The prefill bootstrap's ``GET /query`` (vLLM's Mooncake contract): this start's engine id."""
        o, cfg = self.pod.opts, self.pod.opts.config
        return query_answer(self.engine_id, cfg.shape.tp, cfg.shape.pp, f"{o.advertise_host}:{o.bootstrap_port}")

    def vllm_handshake(self) -> dict[str, Any]:
        """The prefill bootstrap's ``GET /handshake``: ``/query``'s answer and this pod's ``HandshakeKey``."""
        return {"query": self.vllm_query(), "key": self.handshake.model_dump()}

    async def _version(self, _: web.Request) -> web.Response:
        """vLLM's ``GET /version``: the version of the engine this pod stands in for, else the runtime's."""
        _engine, _eq, version = (self.pod.opts.stand_in_for or "").partition("==")
        return web.json_response({"version": version or __version__})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                              "owned_by": "pdfleet", "root": self.model}]})

    # ------------------------------------------------------------------ requests

    def _handler(self, ep: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                req, leg = self._vllm_leg(parse_request(ep, await self.pod.read_body(request)))
                if self.role is Role.DECODE and self.pod.opts.kv_connector is KvConnector.NONE:
                    self._check(req, transfer=False)  # nothing is pulled: the room only names the request
                    return await self._recompute(request, req)
                self._check(req)
                if self.text is not None:
                    req = prompt_of(req, self.text, self.pod.opts.config.kv_tokens)
                if leg is not None and leg.kind in (LegKind.NIXL_PREFILL, LegKind.MOONCAKE_PREFILL):
                    return await self._prefill_step(req, leg, request.remote or "")
                if leg is not None:
                    await self._check_engine(leg)
                if self.role is Role.PREFILL:
                    return await self._prefill(req, request.remote or "")
                return await self._decode(request, req)
            except ApiError as e:
                headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else {}
                return web.json_response(error_body(e), status=e.status, headers=headers)
        return handle

    def _vllm_leg(self, req: WorkerRequest) -> tuple[WorkerRequest, VllmLeg | None]:
        """vLLM's contract (``kv_transfer_params``, vllm-router): the room and the prefill to pull from."""
        if req.kv is None:
            return req, None
        if req.room is not None:
            raise ApiError(400, "send either SGLang's bootstrap_room (sglang-router) or vLLM's kv_transfer_params "
                           "(vllm-router), not both", param="kv_transfer_params", code="conflicting_pd_fields")
        try:
            leg = leg_of(req.kv, self.role)
        except LegError as e:
            raise ApiError(400, str(e), param="kv_transfer_params", code="invalid_kv_transfer_params") from None
        return req.model_copy(update={"room": leg.room, "host": leg.host, "port": leg.port}), leg

    async def _check_engine(self, leg: VllmLeg) -> None:
        """A decode leg pulls only from the engine it was handed, and only from a compatible one: the prefill
        bootstrap's ``GET /handshake`` names the engine it runs now (as a vLLM decode asks for an id it has not
        seen) and its ``HandshakeKey`` (as vLLM's NIXL handshake compares compatibility hashes). A stale id or
        another key is refused and counted."""
        if leg.engine_id is None or leg.host is None or leg.port is None:
            return
        where = f"{leg.host}:{leg.port}"
        if self._peers is None or self._peers.closed:
            self._peers = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT_S))
        try:
            async with self._peers.get(f"http://{where}/handshake", allow_redirects=False) as resp:
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise ApiError(503, f"the prefill's bootstrap {where} did not answer GET /handshake ({type(e).__name__}): "
                           "its engine cannot be checked", code="prefill_unreachable", retry_after=1) from None
        try:
            theirs = HandshakeKey.model_validate(answer.get("key") if isinstance(answer, dict) else None)
        except ValidationError as e:
            raise ApiError(502, f"the prefill's bootstrap {where} answered GET /handshake without a valid key "
                           f"({e.error_count()} problems): is it a pdfleet runtime of this release?",
                           code="incompatible_engine") from None
        if not names_engine(leg.engine_id, answer.get("query")):
            self._refused("engine_id", where, f"handed engine id {leg.engine_id[:80]!r}")
            raise ApiError(502, f"kv_transfer_params.remote_engine_id {leg.engine_id[:80]!r} is not the engine of the "
                           f"prefill at {where} now: it restarted with a new engine id and the router sent the one it "
                           "had cached (vllm-router reads Mooncake ids once per worker; pin them: --pin-engine-id)",
                           param="kv_transfer_params", code="unknown_engine_id")
        if theirs != self.handshake:
            self._refused("compatibility", where, "; ".join(self.handshake.differences(theirs)))
            raise ApiError(502, f"the prefill at {where} is not compatible with this decode ("
                           f"{'; '.join(self.handshake.differences(theirs))}): vLLM's handshake refuses such a pair; "
                           "roll both roles as one generation and keep the router from pairing two",
                           code="incompatible_engine")

    def _refused(self, reason: HandshakeRefusal, where: str, what: str) -> None:
        """Count a refused pair; log it once per prefill and reason (a router pairing two generations refuses
        every request it sends across them)."""
        self.refusals.labels(reason).inc()
        if (where, reason) not in self._refusals_logged:
            if len(self._refusals_logged) > 1024:
                self._refusals_logged.clear()
            self._refusals_logged.add((where, reason))
            log.warning("refusing vLLM-contract requests from the prefill at %s (%s): %s", where, reason, what)

    def _check(self, req: WorkerRequest, *, transfer: bool = True) -> None:
        if req.model is not None and req.model != self.model:
            raise ApiError(404, f"The model `{req.model}` does not exist: this worker serves `{self.model}`",
                           param="model", code="model_not_found")
        if transfer and req.room is None:
            raise ApiError(400, "bootstrap_room is required: this is a PD worker (send the request through the "
                           "router, or add bootstrap_host, bootstrap_port and bootstrap_room to the body)",
                           param="bootstrap_room", code="missing_bootstrap_room")
        if not self.pod.drain.admitting:
            raise ApiError(503, f"the pod is draining ({self.pod.drain.phase.value}): send the request to another "
                           "worker", code="draining", retry_after=5)
        if self.pod.ranks_up() < self.pod.opts.config.shape.world:
            raise ApiError(503, "rank processes are not up", code="not_ready", retry_after=1)
        if req.prompt_tokens > self.pod.opts.config.kv_tokens:
            raise ApiError(400, f"the prompt has {req.prompt_tokens} tokens, more than this worker's "
                           f"{self.pod.opts.config.kv_tokens} (kvTokens): send a shorter prompt", param="prompt",
                           code="context_length_exceeded")

    async def _hold_room(self, req: WorkerRequest, source: str) -> tuple[Room, int]:
        """The request's compute turn (seeded_load), then its room held: (the room, its bytes on this side)."""
        self.queued += 1  # waits for its turn and its compute (seeded_load; none without a declared cost)
        self.computing += 1
        try:
            await self.load.prefill_prompt(req.prompt_tokens, time.monotonic())
        finally:
            self.queued -= 1
            self.computing -= 1
        nbytes = request_state_bytes(self.pod.opts.config, req.prompt_tokens, decode_side=False)
        assert req.room is not None
        try:
            room = self.rooms.hold(req.room, req.seed, req.prompt_tokens, nbytes, source, prompt=req.ids or ()
                                   if self.text is not None else ())
        except RoomError as e:
            raise ApiError(e.status, str(e), code=e.code, param="bootstrap_room",
                           retry_after=1 if e.status == 503 else None) from e
        return room, nbytes

    async def _prefill_step(self, req: WorkerRequest, leg: VllmLeg, source: str) -> web.Response:
        """vLLM's prefill: the room held and answered at once, as vLLM's prefill answers once its blocks are
        computed and pinned (vllm-router sends the decode only after that answer, with NIXL and with Mooncake).
        The room waits for the decode's claim as vLLM's blocks wait ``kv_lease_duration``; its outcome is
        counted when it ends. NIXL's answer carries the room in ``kv_transfer_params``; Mooncake's carries none
        (the ``transfer_id`` names the room on both sides), as vLLM's."""
        o, cfg = self.pod.opts, self.pod.opts.config
        room, nbytes = await self._hold_room(req, source)
        task = asyncio.create_task(self._settle(req, room, nbytes))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        body = prefill_answer(req, model=self.model, moved=0, layout_bytes=nbytes)
        body["kv_transfer_params"] = nixl_prefill_params(
            leg, engine=self.engine_id, host=o.advertise_host, port=o.bootstrap_port, tp=cfg.shape.tp,
            pp=cfg.shape.pp, tokens=req.prompt_tokens) if leg.kind is LegKind.NIXL_PREFILL else None
        return web.json_response(body)

    async def _settle(self, req: WorkerRequest, room: Room, nbytes: int) -> None:
        outcome = await self._outcome(room)
        if outcome.failure is not None:
            log.warning("room %d (vLLM contract): %s", room.room, room_error(room.room, outcome.failure,
                                                                               self.rooms.ttl_s).message)
            return
        self.room_bytes.inc(outcome.moved)
        log.info("room %d (vLLM contract): %d tokens, %d bytes written (layout %d)", room.room, room.tokens,
                 outcome.moved, nbytes)

    async def _prefill(self, req: WorkerRequest, source: str) -> web.Response:
        assert req.room is not None
        room, nbytes = await self._hold_room(req, source)
        outcome = await self._outcome(room)
        if outcome.failure is not None:
            raise room_error(req.room, outcome.failure, self.rooms.ttl_s)
        self.room_bytes.inc(outcome.moved)
        log.info("room %d: %d tokens, %d bytes written (layout %d)", req.room, room.tokens, outcome.moved, nbytes)
        return web.json_response(prefill_answer(req, model=self.model, moved=outcome.moved, layout_bytes=nbytes))

    async def _outcome(self, room: Room) -> RoomOutcome:
        """The room's outcome, awaited: woken when a decode claims it (from then it runs, no longer queued), when
        it ends, and at its deadline (then the table expires it). The room is forgotten once it is answered."""
        running = False
        self.queued += 1
        try:
            while room.outcome is None:
                if room.claimed is not None and not running:
                    running = True
                    self.queued -= 1
                    self.running += 1
                    self.used_tokens += room.tokens
                room.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room.changed.wait(), self.rooms.remaining(room))
                self._expire()
            return room.outcome
        finally:
            if running:
                self.running -= 1
                self.used_tokens -= room.tokens
            else:
                self.queued -= 1
            self.rooms.drop(room.room)

    def _expire(self) -> None:
        self.rooms.expire()
        if self.rooms.expired > self._expired_seen:
            self.expired.inc(self.rooms.expired - self._expired_seen)
            self.fallbacks.count(FallbackReason.UNCLAIMED_STATE, self.rooms.expired - self._expired_seen)
            self._expired_seen = self.rooms.expired

    async def _decode(self, http: web.Request, req: WorkerRequest) -> web.StreamResponse:
        o = self.pod.opts
        assert req.room is not None
        ep = PeerEndpoint(req.host or "127.0.0.1", req.port or o.bootstrap_port)
        if not await self.pod.known_prefill(ep):
            # Never dialled: a decode sends signed messages only to prefill pods its own discovery names.
            raise ApiError(400, f"bootstrap_host:bootstrap_port {ep} is not a prefill pod of this deployment (the "
                           "prefill Service does not name it): send the request through the router",
                           param="bootstrap_host", code="unknown_prefill")
        # A request runs (and holds KV) from admission; with a declared cost, once its state arrived (SGLang's
        # decode batch: waiting for a prefill's compute is not running).
        counted = self.cost is None
        self._run(+1 if counted else 0, req.prompt_tokens)
        arrived = time.monotonic()
        answer: Completion | None = None
        try:  # with a declared cost the prefill holds the room once computed: wait for it as long as a request
            model = {"prompt": req.ids or ()} if self.text is not None else {}
            res = await self.pod.pull(ep, req.room, req.prompt_tokens, req.request_id, req.seed, o.request_timeout_s,
                                      retry_refused_s=ROOM_WAIT_S if counted else o.request_timeout_s, **model)
            layout = request_state_bytes(o.config, req.prompt_tokens, decode_side=True)
            if res.ok:
                self.received.observe(res.seconds)
            if res.ok and res.bytes < layout:  # verified, yet fewer bytes than the layout gives the request
                self.fallbacks.count(FallbackReason.SHORT_TRANSFER)
            if res.ok and self.text is not None:  # the model continues from the state: a drain waits for it too
                self.computing += 1
                try:
                    if req.stream:
                        return await self._stream(http, req, res, arrived, layout)
                    answer = await self._continue(req, res, arrived)
                finally:
                    self.computing -= 1
            elif res.ok:
                self._run(0 if counted else +1, req.prompt_tokens)
                counted, self.computing = True, self.computing + 1
                try:
                    derived = completion(req.seed, req.prompt_tokens, res.bytes, req.max_tokens)
                    await self.load.generate(len(derived.ids), arrived, lambda: self.running, self._hold,
                                             derived.finish_reason)
                finally:
                    self.computing -= 1
        finally:
            self._run(-1 if counted else 0, req.prompt_tokens)
        if not res.ok:
            raise self._failure(req, res.failure, res.reason, res.mismatched_buffers)
        self.room_bytes.inc(res.bytes)
        c = answer or completion(req.seed, req.prompt_tokens, res.bytes, req.max_tokens)
        return await self._answer(http, req, c, res.bytes,
                                  self._pdfleet(req, res, layout, c if answer is not None else None))

    async def _answer(self, http: web.Request, req: WorkerRequest, c: Completion, state_bytes: int,
                      pdfleet: dict[str, Any]) -> web.StreamResponse:
        """A whole answer: one JSON body, or its events at once for a streaming request."""
        if not req.stream:
            return web.json_response(render(req, c, model=self.model, state_bytes=state_bytes, pdfleet=pdfleet),
                                     headers=self._headers(http, req))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self._headers(http, req)})
        await resp.prepare(http)
        for event in sse_chunks(req, c, model=self.model, pdfleet=pdfleet):
            await resp.write(event.encode())
        await resp.write_eof()
        return resp

    async def _recompute(self, http: web.Request, req: WorkerRequest) -> web.StreamResponse:
        """A decode without its KV connector (``--kv-connector none``): the transfer fields ignored, the prompt
        computed here, the answer the same as PD's (seeded state is a function of the request), so the client
        sees nothing wrong; the prefill's state is never claimed. Counted as a silent fallback."""
        if req.room is None:  # a request no router paired: its own room, for the seeded answer
            req = req.model_copy(update={"room": secrets.randbits(63)})
        nbytes = request_state_bytes(self.pod.opts.config, req.prompt_tokens, decode_side=True)
        c = completion(req.seed, req.prompt_tokens, nbytes, req.max_tokens)
        self._run(+1, req.prompt_tokens)
        self.computing += 1
        try:
            arrived = time.monotonic()
            await self.load.recompute_prompt(req.prompt_tokens, arrived)
            await self.load.generate(len(c.ids), arrived, lambda: self.running, self._hold, c.finish_reason)
        finally:
            self.computing -= 1
            self._run(-1, req.prompt_tokens)
        self.fallbacks.count(FallbackReason.NO_STATE_RECEIVED)
        pdfleet = {"role": "decode", "room": req.room, "seed": req.seed, "transferBytes": 0, "layoutBytes": nbytes,
                   "verified": False, "recomputed": True, "decode": self.pod.opts.instance}
        return await self._answer(http, req, c, 0, pdfleet)

    def _pdfleet(self, req: WorkerRequest, res: SyntheticResult, layout_bytes: int,
                 model_answer: Completion | None) -> dict[str, Any]:
        o = self.pod.opts
        pdfleet: dict[str, Any] = {"role": "decode", "room": req.room, "seed": req.seed, "transferBytes": res.bytes,
                                   "layoutBytes": layout_bytes,
                   "verified": model_answer is None, "prefill": res.prefill, "decode": o.instance,
                   "seconds": res.seconds, "ignored": list(req.ignored)}
        if model_answer is not None:  # what a client needs to check the answer against aggregate generation
            pdfleet.update({"state": "model", "promptIds": list(req.ids or ()), "outputIds": list(model_answer.ids)})
        return pdfleet

    @staticmethod
    def _headers(http: web.Request, req: WorkerRequest) -> dict[str, str]:
        headers = {"X-Pdfleet-Ignored": ",".join(req.ignored)} if req.ignored else {}
        if rid := http.headers.get("X-Request-Id"):
            headers["X-Request-Id"] = rid
        return headers

    async def _stream(self, http: web.Request, req: WorkerRequest, res: SyntheticResult, arrived: float,
                      layout_bytes: int) -> web.StreamResponse:
        """A streaming model request: the events of each token written as decode rank 0 computes it."""
        assert self.text is not None
        first = self._first(req, res)  # a state without its first token is an error answer, before any event
        self.room_bytes.inc(res.bytes)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        task = asyncio.create_task(self._continue(req, res, arrived, lambda _i, tok: queue.put_nowait(tok)))
        task.add_done_callback(lambda _t: queue.put_nowait(None))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self._headers(http, req)})
        try:
            await resp.prepare(http)
            stream = ModelStream(resp, req, self.text, model=self.model, created=int(time.time()))
            ids = [first]
            stopped = await stream.tokens(tuple(ids))
            while not stopped and (tok := await queue.get()) is not None:
                ids.append(tok)
                stopped = await stream.tokens(tuple(ids))
            try:
                c = await task
            except ApiError as e:
                await stream.fail(e)
                return resp
            await stream.finish(c, self._pdfleet(req, res, layout_bytes, c))
            return resp
        finally:
            if not task.done():  # the client went away: the continuation ends on its own (bounded by max_tokens)
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _first(self, req: WorkerRequest, res: SyntheticResult) -> int:
        """The first token every prefill rank carried and every decode rank's share, or 500 ``state_mismatch``."""
        firsts = set(res.first_tokens)
        if len(firsts) != 1:
            raise ApiError(500, f"the state of bootstrap_room {req.room} arrived, but the prefill ranks carried "
                           + (f"different first tokens {sorted(firsts)}" if firsts else "no first token")
                           + ": no answer can be computed", code="state_mismatch")
        world = self.pod.opts.config.shape.world
        if len(res.shares) != world:
            raise ApiError(500, f"{len(res.shares)} of {world} decode ranks answered their share of bootstrap_room "
                           f"{req.room}", code="state_mismatch")
        return firsts.pop()

    async def _continue(self, req: WorkerRequest, res: SyntheticResult, arrived: float,
                        on_token: Callable[[int, int], None] | None = None) -> Completion:
        """A model request whose state arrived: the first token the prefill carried, decode rank 0's greedy
        continuation from every rank's share, and the answer cut at end of sequence or a stop string."""
        assert self.text is not None and req.ids is not None
        first = self._first(req, res)
        steps = 0 if first in self.text.eos_ids else req.max_tokens - 1
        self.load.ttft.observe(max(0.0, time.monotonic() - arrived))
        try:
            op = GenerateOp(req.request_id, len(req.ids), first, steps, res.shares, stop_ids=self.text.eos_ids,
                            stream=on_token is not None)
            gen = await (self.pod.generate(op, self.pod.opts.request_timeout_s, on_token) if on_token is not None
                         else self.pod.generate(op, self.pod.opts.request_timeout_s))
        except RankCallError as e:
            raise ApiError(500, f"the continuation of bootstrap_room {req.room} failed: {e}",
                           code="generation_failed") from e
        c = completion_of((first, *gen.tokens), self.text, req.stop, req.max_tokens)
        for _ in gen.tokens:
            self.load.itl.observe(gen.seconds / max(1, len(gen.tokens)))
        self.load.generation_tokens.inc(len(c.ids))
        self.load.requests.inc(c.finish_reason)
        return c

    def _hold(self, tokens: int) -> None:
        self.used_tokens += tokens

    def _run(self, step: int, prompt_tokens: int) -> None:
        self.running += step
        self.used_tokens += step * prompt_tokens

    def _failure(self, req: WorkerRequest, failure: FailureReason | None, reason: str,
                 buffers: tuple[str, ...]) -> ApiError:
        if failure is FailureReason.VERIFY:
            return ApiError(500, f"the state of bootstrap_room {req.room} arrived different in buffer "
                            f"{', '.join(buffers)}: {reason}", code="state_mismatch")
        if failure in _UNREACHABLE:
            return ApiError(503, f"no prefill reachable for bootstrap_room {req.room}: {reason}",
                            code="prefill_unreachable", retry_after=1)
        if failure is FailureReason.CONFLICT:
            return ApiError(409, f"bootstrap_room {req.room} is in flight on this decode or was used moments ago: "
                            f"send a new room ({reason})", param="bootstrap_room", code="room_conflict")
        if failure in (FailureReason.BUSY, FailureReason.DRAINING):
            return ApiError(503, f"no room for the request: {reason}", code=str(failure), retry_after=1)
        return ApiError(502, f"the transfer of bootstrap_room {req.room} failed ({failure}): {reason}",
                        code="transfer_failed")

