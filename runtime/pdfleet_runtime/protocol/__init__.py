"""The prefill/decode protocol: how ranks find each other, agree on buffers and move each request once.

Reading order: ``states`` (the request state machine), ``messages`` (named, versioned wire models),
``keys`` (the deployment keys and their rotation, a pod's rank key), ``auth`` (signing, replay,
recipient and version checks), ``discovery`` (headless
Service DNS; loopback resolvers for tests), ``bootstrap`` (the prefill pod's registry endpoint),
``client``, then the two coordinators ``prefill`` and ``decode``. docs/protocol.md describes the
flow. The pure modules (``states``, ``messages``, ``keys``, ``auth``, ``discovery``) import no engine, no
torch and no aiohttp.
"""

from __future__ import annotations

from .auth import SIGNATURE_HEADER, Codec, ProtocolError, ReplayGuard
from .discovery import DnsResolver, Endpoint, FileResolver, ResolveError, Resolver, StaticResolver
from .keys import Keyring, KeyScope, SecretError, load_secret, new_rank_key
from .messages import MAX_MESSAGE_BYTES, WIRE, Envelope, RefusalCode
from .states import FailureReason, IllegalTransition, RequestState, RequestTracker, StateTimeouts

__all__ = [
    "MAX_MESSAGE_BYTES",
    "SIGNATURE_HEADER",
    "WIRE",
    "Codec",
    "DnsResolver",
    "Endpoint",
    "Envelope",
    "FailureReason",
    "FileResolver",
    "IllegalTransition",
    "KeyScope",
    "Keyring",
    "ProtocolError",
    "RefusalCode",
    "ReplayGuard",
    "RequestState",
    "RequestTracker",
    "ResolveError",
    "Resolver",
    "SecretError",
    "StateTimeouts",
    "StaticResolver",
    "load_secret",
    "new_rank_key",
]
