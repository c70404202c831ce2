"""The keys that sign protocol messages: the deployment's (current and previous, reloaded) and a pod's rank key.

- **Deployment keys** (the mounted Secret, ``secretPath``): every pod of the deployment holds them;
  they sign what decode ranks and prefill pods say to each other. Rotation: the Secret gets a new
  ``key`` and the old one as ``key.previous`` (``<secretPath>.previous``). A process accepts both
  as soon as it sees them, and keeps signing with the previous key for ``settle_s`` (default 120 s:
  longer than the kubelet takes to refresh a mounted Secret on every node), so no pod signs with a
  key that another pod has not loaded yet. Files are read again at most every ``reload_s``.
- **The rank key** (``new_rank_key``): random per prefill pod incarnation, made by the pod process
  and handed to its own rank processes over the launcher's pipe; never on disk, never sent. Only it
  signs what a rank says to its pod's bootstrap (``PrefillRegister``, ``PrefillPoll``,
  ``StatusReports``), so another pod holding the deployment secret cannot speak for a rank.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

__all__ = [
    "MIN_SECRET_BYTES",
    "KeyScope",
    "Keyring",
    "SecretError",
    "load_secret",
    "mounted_keys",
    "new_rank_key",
    "previous_path",
]

MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """The secret file is missing, unreadable or too short."""


class KeyScope(StrEnum):
    """Which key a message was signed with: what its sender may say."""

    DEPLOYMENT = "deployment"
    RANK = "rank"


def load_secret(path: Path) -> bytes:
    """The deployment secret from a mounted file (trailing newline stripped); at least 16 bytes."""
    try:
        data = Path(path).read_bytes().rstrip(b"\r\n")
    except OSError as e:
        raise SecretError(f"cannot read the deployment secret {path}: {e.strerror}") from e
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"the deployment secret {path} holds {len(data)} bytes; at least {MIN_SECRET_BYTES} needed")
    return data


def previous_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".previous")


def new_rank_key() -> bytes:
    return secrets.token_bytes(32)


class Keyring:
    """Current and previous deployment keys; ``signing`` is the one to sign with now, ``accepted`` opens."""

    def __init__(self, current: bytes, previous: bytes | None = None, *, path: Path | None = None,
                 settle_s: float = 120.0, reload_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        for k in (current, previous):
            if k is not None and len(k) < MIN_SECRET_BYTES:
                raise SecretError(f"a secret of at least {MIN_SECRET_BYTES} bytes is needed")
        self.current, self.previous, self.path = current, previous, path
        self.settle_s, self.reload_s, self._clock = settle_s, reload_s, clock
        self._since = clock()
        self._checked = self._since
        self.rotations = 0

    @classmethod
    def from_file(cls, path: Path, *, settle_s: float = 120.0, reload_s: float = 10.0,
                  clock: Callable[[], float] = time.monotonic) -> Keyring:
        """``path`` and, when present, ``<path>.previous``; raises ``SecretError``."""
        prev = previous_path(path)
        return cls(load_secret(path), load_secret(prev) if prev.exists() else None, path=Path(path),
                   settle_s=settle_s, reload_s=reload_s, clock=clock)

    @property
    def signing(self) -> bytes:
        self.maybe_reload()
        if self.previous is not None and self._clock() - self._since < self.settle_s:
            return self.previous
        return self.current

    @property
    def accepted(self) -> tuple[bytes, ...]:
        self.maybe_reload()
        return (self.current,) if self.previous is None else (self.current, self.previous)

    def maybe_reload(self) -> bool:
        """Read the files again if ``reload_s`` passed; True when the keys changed. A file that cannot be
        read keeps the keys held (a Secret being rewritten is briefly absent): never fewer keys than before."""
        now = self._clock()
        if self.path is None or now - self._checked < self.reload_s:
            return False
        self._checked = now
        try:
            current = load_secret(self.path)
            prev = previous_path(self.path)
            previous = load_secret(prev) if prev.exists() else None
        except SecretError:
            return False
        return self.update(current, previous)

    def update(self, current: bytes, previous: bytes | None) -> bool:
        if (current, previous) == (self.current, self.previous):
            return False
        if current != self.current:
            # A rotation: keep the key held so far as previous while the Secret does not name one, so
            # peers that have not reloaded yet are still understood; sign with it until settled.
            previous = previous if previous is not None else self.current
            self._since = self._clock()
            self.rotations += 1
        self.current, self.previous = current, previous
        return True


def mounted_keys(path: Path, loaded: bytes) -> Keyring:
    """The keyring of a mounted Secret (reloaded as it changes); ``loaded`` (read by the pod process at start)
    while the file cannot be read."""
    try:
        return Keyring.from_file(path)
    except SecretError:
        return Keyring(loaded, path=Path(path))
