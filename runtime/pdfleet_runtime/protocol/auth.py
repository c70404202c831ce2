"""Signing and opening envelopes with the deployment's keys (``keys``); replays, stale and misdirected messages refused.

``Codec.seal(body, to=...)`` makes the exact bytes sent and an HMAC-SHA256 over them (sent in the
``X-Pdfleet-Signature`` header); ``Codec.headers`` adds ``X-Pdfleet-Auth``, an HMAC over the
timestamp, the body's length and its signature, which the bootstrap checks before it reads a
byte of the body (``check_headers``). ``Codec.open(raw, signature)`` checks, in this order and
before any state changes: size, presence and value of the signature (constant-time compare against
each accepted key, before parsing so unsigned input is never parsed), JSON and envelope schema,
wire-version major, timestamp within ``max_skew_s``, the recipient (an envelope that names another
pod or another incarnation of this one is refused), the nonce not seen before, the body's schema.
Only a message that passes every check has its nonce remembered. Every refusal is a
``ProtocolError`` with a ``RefusalCode``. ``Opened.scope`` says which key signed it.

Nonces need remembering only for the skew window: an older timestamp is refused as stale.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from .keys import MIN_SECRET_BYTES, Keyring, KeyScope, SecretError, load_secret
from .messages import (
    MAX_MESSAGE_BYTES,
    WIRE,
    Body,
    Envelope,
    PrefillPoll,
    PrefillRegister,
    Recipient,
    Refusal,
    RefusalCode,
    StatusReports,
    parse_wire,
)

__all__ = [
    "AUTH_HEADER",
    "MIN_SECRET_BYTES",
    "RANK_ONLY",
    "SIGNATURE_HEADER",
    "Codec",
    "KeyScope",
    "Keyring",
    "Opened",
    "ProtocolError",
    "ReplayGuard",
    "SecretError",
    "load_secret",
    "new_boot_id",
]

SIGNATURE_HEADER = "X-Pdfleet-Signature"
AUTH_HEADER = "X-Pdfleet-Auth"
RANK_ONLY = (PrefillRegister, PrefillPoll, StatusReports)
"""What only a prefill pod's own ranks may say to its bootstrap: signed with the pod's rank key."""
_BODY: TypeAdapter[Body] = TypeAdapter(Body)


class ProtocolError(Exception):
    """A message was refused; ``code`` says why (and whether a retry can help)."""

    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(f"{code.value}: {reason}")
        self.code, self.reason = code, reason

    def refusal(self) -> Refusal:
        return Refusal(code=self.code, reason=self.reason[:4000])


def new_boot_id() -> str:
    return secrets.token_hex(8)


class ReplayGuard:
    """Nonces seen within the skew window, bounded; a full guard refuses rather than forgets (fail closed)."""

    def __init__(self, window_s: float, limit: int = 200_000) -> None:
        self.window_s, self.limit = window_s, limit
        self._seen: OrderedDict[str, float] = OrderedDict()

    def _evict(self, now: float) -> None:
        while self._seen:
            nonce, at = next(iter(self._seen.items()))
            if now - at <= self.window_s:
                break
            del self._seen[nonce]

    def seen(self, nonce: str, now: float) -> bool:
        self._evict(now)
        return nonce in self._seen

    def remember(self, nonce: str, now: float) -> None:
        self._evict(now)
        if len(self._seen) >= self.limit:
            raise ProtocolError(RefusalCode.BUSY, f"{self.limit} nonces in the replay window; try again later")
        self._seen[nonce] = now

    def __len__(self) -> int:
        return len(self._seen)


class Opened:
    """An authenticated message: its envelope, typed body and the scope of the key that signed it."""

    __slots__ = ("body", "envelope", "scope")

    def __init__(self, envelope: Envelope, body: Any, scope: KeyScope = KeyScope.DEPLOYMENT) -> None:
        self.envelope, self.body, self.scope = envelope, body, scope


class Codec:
    """Seals and opens envelopes for one process (one sender name, one boot id, one replay guard).

    ``secret`` is the deployment key (or a ``Keyring`` that reloads and rotates it); ``rank_key`` is
    the pod's rank key: a prefill pod's bootstrap and its own ranks hold it, and a rank signs
    ``RANK_ONLY`` messages with it.
    """

    def __init__(self, secret: bytes | Keyring, sender: str, *, boot: str | None = None, max_skew_s: float = 30.0,
                 max_bytes: int = MAX_MESSAGE_BYTES, clock: Callable[[], float] = time.time,
                 rank_key: bytes | None = None, bodies: TypeAdapter[Any] | None = None) -> None:
        self.keys = secret if isinstance(secret, Keyring) else Keyring(secret)
        if rank_key is not None and len(rank_key) < MIN_SECRET_BYTES:
            raise SecretError(f"a rank key of at least {MIN_SECRET_BYTES} bytes is needed")
        self.rank_key = rank_key
        self.sender, self.boot = sender, boot or new_boot_id()
        self.max_skew_s, self.max_bytes, self._clock = max_skew_s, max_bytes, clock
        self.replays = ReplayGuard(2 * max_skew_s)
        self._bodies = bodies or _BODY
        """The message union this codec opens: the bootstrap's (``Body``), or the group channel's."""

    @property
    def me(self) -> Recipient:
        """This process as a recipient: envelopes for it name it."""
        return Recipient(name=self.sender, boot=self.boot)

    def sign(self, raw: bytes, key: bytes | None = None) -> str:
        return hmac.new(key or self.keys.signing, raw, hashlib.sha256).hexdigest()

    def seal(self, body: BaseModel, *, reply_to: str | None = None, to: Recipient | None = None) -> tuple[bytes, str, str]:
        """The bytes to send, their signature, and the envelope's nonce (to match the reply)."""
        raw, sig, nonce, _ = self._seal(body, reply_to, to)
        return raw, sig, nonce

    def seal_http(self, body: Body, *, reply_to: str | None = None, to: Recipient | None = None
                  ) -> tuple[bytes, dict[str, str], str]:
        """``seal`` plus the HTTP headers: the signature and the header MAC (``check_headers``)."""
        raw, sig, nonce, key = self._seal(body, reply_to, to)
        return raw, {SIGNATURE_HEADER: sig, AUTH_HEADER: self.auth_header(len(raw), sig, key),
                     "Content-Type": "application/json"}, nonce

    def auth_header(self, length: int, signature: str, key: bytes | None = None) -> str:
        """``X-Pdfleet-Auth``: now, and an HMAC over now, the body's length and its signature."""
        ts = f"{self._clock():.3f}"
        return f"{ts}.{_header_mac(key or self.keys.signing, ts, length, signature)}"

    def _seal(self, body: BaseModel, reply_to: str | None, to: Recipient | None) -> tuple[bytes, str, str, bytes]:
        nonce = secrets.token_hex(16)
        env = {"version": str(WIRE), "sender": self.sender, "boot": self.boot, "nonce": nonce,
               "timestamp": self._clock(), "reply_to": reply_to, "body": body.model_dump(mode="json")}
        if to is not None:
            env["to"] = to.model_dump(mode="json")
        raw = json.dumps(env, separators=(",", ":"), allow_nan=False).encode()
        key = self.rank_key if self.rank_key is not None and isinstance(body, RANK_ONLY) else self.keys.signing
        return raw, self.sign(raw, key), nonce, key

    def _keys(self) -> list[tuple[bytes, KeyScope]]:
        out = [(k, KeyScope.DEPLOYMENT) for k in self.keys.accepted]
        if self.rank_key is not None:
            out.append((self.rank_key, KeyScope.RANK))
        return out

    def check_headers(self, signature: str | None, auth: str | None, length: int | None) -> KeyScope:
        """Before the body is read: a declared length within the limit, a signature, and a header MAC made with
        an accepted key within the skew window. Costs a few HMACs over ~100 bytes; raises ``ProtocolError``."""
        if length is None:
            raise ProtocolError(RefusalCode.MALFORMED, "a Content-Length header is required (no chunked bodies)")
        if length > self.max_bytes:
            raise ProtocolError(RefusalCode.TOO_LARGE, f"message of {length} bytes, limit {self.max_bytes}")
        if not signature:
            raise ProtocolError(RefusalCode.UNSIGNED, f"no {SIGNATURE_HEADER} header")
        ts, _, mac = (auth or "").rpartition(".")
        try:
            when = float(ts)
        except ValueError:
            raise ProtocolError(RefusalCode.UNSIGNED, f"no valid {AUTH_HEADER} header") from None
        if not abs(self._clock() - when) <= self.max_skew_s:
            raise ProtocolError(RefusalCode.STALE, f"{AUTH_HEADER} timestamp is off this clock by more than "
                                f"{self.max_skew_s:.0f}s")
        given = mac.strip().lower().encode("utf-8", "surrogateescape")
        for key, scope in self._keys():
            if hmac.compare_digest(_header_mac(key, ts, length, signature).encode(), given):
                return scope
        raise ProtocolError(RefusalCode.BAD_SIGNATURE, f"{AUTH_HEADER} does not match the deployment secret")

    def open(self, raw: bytes, signature: str | None, *, reply_to: str | None = None) -> Opened:
        """Check and parse one message (see the module docstring for the order); raises ``ProtocolError``."""
        if len(raw) > self.max_bytes:
            raise ProtocolError(RefusalCode.TOO_LARGE, f"message of {len(raw)} bytes, limit {self.max_bytes}")
        if not signature:
            raise ProtocolError(RefusalCode.UNSIGNED, f"no {SIGNATURE_HEADER} header")
        # Bytes, not str: ``compare_digest`` raises on a non-ASCII str (a header of any bytes reaches here).
        given = signature.strip().lower().encode("utf-8", "surrogateescape")
        scope = next((sc for key, sc in self._keys() if hmac.compare_digest(self.sign(raw, key).encode(), given)),
                     None)
        if scope is None:
            raise ProtocolError(RefusalCode.BAD_SIGNATURE, "signature does not match the deployment secret")
        try:
            data = json.loads(raw)
            env = Envelope.model_validate(data, context={"lenient": True})
        except (ValueError, ValidationError, RecursionError) as e:
            raise ProtocolError(RefusalCode.MALFORMED, f"not an envelope: {_short(e)}") from None
        try:
            theirs = parse_wire(env.version)
        except ValueError as e:
            raise ProtocolError(RefusalCode.MALFORMED, str(e)) from None
        if not WIRE.talks_to(theirs):
            raise ProtocolError(RefusalCode.VERSION, f"peer {env.sender} speaks wire protocol {theirs}, this "
                                f"{self.sender} speaks {WIRE}: majors differ, refusing")
        now = self._clock()
        if abs(now - env.timestamp) > self.max_skew_s:
            raise ProtocolError(RefusalCode.STALE, f"timestamp {env.timestamp:.3f} is {now - env.timestamp:+.1f}s "
                                f"off this clock (limit {self.max_skew_s:.0f}s)")
        if env.to is not None and env.to != self.me:
            raise ProtocolError(RefusalCode.WRONG_RECIPIENT, f"message for {env.to.name} (boot {env.to.boot}) "
                                f"reached {self.sender} (boot {self.boot}): another pod, or an earlier incarnation")
        if reply_to is not None and env.reply_to != reply_to:
            raise ProtocolError(RefusalCode.REPLAYED, "reply does not answer this request's nonce")
        if self.replays.seen(env.nonce, now):
            raise ProtocolError(RefusalCode.REPLAYED, f"nonce {env.nonce[:8]}... was already used")
        try:
            body = self._bodies.validate_python(env.body, context={"lenient": theirs.minor > WIRE.minor})
        except (ValidationError, ValueError, RecursionError) as e:
            raise ProtocolError(RefusalCode.MALFORMED, f"body: {_short(e)}") from None
        self.replays.remember(env.nonce, now)
        return Opened(env, body, scope)


def _header_mac(key: bytes, ts: str, length: int, signature: str) -> str:
    return hmac.new(key, f"pdfleet-header:{ts}:{length}:{signature}".encode(), hashlib.sha256).hexdigest()


def _short(e: BaseException) -> str:
    text = str(e).replace("\n", "; ")
    return text if len(text) < 600 else text[:600] + "..."
