"""Signing and opening envelopes with the per-deployment secret; replays and stale messages refused.

``Codec.seal(body)`` makes the exact bytes sent and an HMAC-SHA256 over them (sent in the
``X-Pdfleet-Signature`` header). ``Codec.open(raw, signature)`` checks, in this order and before any
state changes: size, presence and value of the signature (constant-time compare, before parsing
so unsigned input is never parsed), JSON and envelope schema, wire-version major, timestamp
within ``max_skew_s``, the nonce not seen before, the body's schema. Only a message that passes
every check has its nonce remembered. Every refusal is a ``ProtocolError`` with a ``RefusalCode``.

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
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from .messages import MAX_MESSAGE_BYTES, WIRE, Body, Envelope, Refusal, RefusalCode, parse_wire

__all__ = [
    "MIN_SECRET_BYTES",
    "SIGNATURE_HEADER",
    "Codec",
    "Opened",
    "ProtocolError",
    "ReplayGuard",
    "SecretError",
    "load_secret",
    "new_boot_id",
]

SIGNATURE_HEADER = "X-Pdfleet-Signature"
MIN_SECRET_BYTES = 16
_BODY: TypeAdapter[Body] = TypeAdapter(Body)


class SecretError(ValueError):
    """The secret file is missing, unreadable or too short."""


class ProtocolError(Exception):
    """A message was refused; ``code`` says why (and whether a retry can help)."""

    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(f"{code.value}: {reason}")
        self.code, self.reason = code, reason

    def refusal(self) -> Refusal:
        return Refusal(code=self.code, reason=self.reason[:4000])


def load_secret(path: Path) -> bytes:
    """The deployment secret from a mounted file (trailing newline stripped); at least 16 bytes."""
    try:
        data = Path(path).read_bytes().rstrip(b"\r\n")
    except OSError as e:
        raise SecretError(f"cannot read the deployment secret {path}: {e.strerror}") from e
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"the deployment secret {path} holds {len(data)} bytes; at least {MIN_SECRET_BYTES} needed")
    return data


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
    """An authenticated message: its envelope and typed body."""

    __slots__ = ("body", "envelope")

    def __init__(self, envelope: Envelope, body: Body) -> None:
        self.envelope, self.body = envelope, body


class Codec:
    """Seals and opens envelopes for one process (one sender name, one boot id, one replay guard)."""

    def __init__(self, secret: bytes, sender: str, *, boot: str | None = None, max_skew_s: float = 30.0,
                 max_bytes: int = MAX_MESSAGE_BYTES, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"a secret of at least {MIN_SECRET_BYTES} bytes is needed")
        self._secret = secret
        self.sender, self.boot = sender, boot or new_boot_id()
        self.max_skew_s, self.max_bytes, self._clock = max_skew_s, max_bytes, clock
        self.replays = ReplayGuard(2 * max_skew_s)

    def sign(self, raw: bytes) -> str:
        return hmac.new(self._secret, raw, hashlib.sha256).hexdigest()

    def seal(self, body: Body, *, reply_to: str | None = None) -> tuple[bytes, str, str]:
        """The bytes to send, their signature, and the envelope's nonce (to match the reply)."""
        nonce = secrets.token_hex(16)
        env = {"version": str(WIRE), "sender": self.sender, "boot": self.boot, "nonce": nonce,
               "timestamp": self._clock(), "reply_to": reply_to, "body": body.model_dump(mode="json")}
        raw = json.dumps(env, separators=(",", ":"), allow_nan=False).encode()
        return raw, self.sign(raw), nonce

    def open(self, raw: bytes, signature: str | None, *, reply_to: str | None = None) -> Opened:
        """Check and parse one message (see the module docstring for the order); raises ``ProtocolError``."""
        if len(raw) > self.max_bytes:
            raise ProtocolError(RefusalCode.TOO_LARGE, f"message of {len(raw)} bytes, limit {self.max_bytes}")
        if not signature:
            raise ProtocolError(RefusalCode.UNSIGNED, f"no {SIGNATURE_HEADER} header")
        # Bytes, not str: ``compare_digest`` raises on a non-ASCII str (a header of any bytes reaches here).
        given = signature.strip().lower().encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(self.sign(raw).encode(), given):
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
        if reply_to is not None and env.reply_to != reply_to:
            raise ProtocolError(RefusalCode.REPLAYED, "reply does not answer this request's nonce")
        if self.replays.seen(env.nonce, now):
            raise ProtocolError(RefusalCode.REPLAYED, f"nonce {env.nonce[:8]}... was already used")
        try:
            body = _BODY.validate_python(env.body, context={"lenient": theirs.minor > WIRE.minor})
        except (ValidationError, ValueError, RecursionError) as e:
            raise ProtocolError(RefusalCode.MALFORMED, f"body: {_short(e)}") from None
        self.replays.remember(env.nonce, now)
        return Opened(env, body)


def _short(e: BaseException) -> str:
    text = str(e).replace("\n", "; ")
    return text if len(text) < 600 else text[:600] + "..."
