"""Issue 25 item 5 (key rotation, runtime side): the deployment key is rotated in the mounted Secret while pods run.

Before, every pod held one key read once at start: replacing the Secret's key made pods started after
the change and pods started before refuse each other. Now a pod reloads ``key`` and ``key.previous``
(``Keyring``), accepts both at once and keeps signing with the previous key for ``settle_s`` (so a pod
that has not reloaded yet still understands it); pods on either side of the change keep talking.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.keys import Keyring, SecretError, previous_path
from pdfleet_runtime.protocol.messages import WIRE, Hello, RefusalCode, Role
from tests.unit.protocol.helpers import FakeClock

OLD, NEW = b"old-deployment-key-0123456789", b"new-deployment-key-0123456789"
HELLO = Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance="dec")


def talks(a: Codec, b: Codec) -> bool:
    raw, sig, _ = a.seal(HELLO)
    try:
        b.open(raw, sig)
    except ProtocolError as e:
        assert e.code is RefusalCode.BAD_SIGNATURE
        return False
    return True


def mount(tmp_path: Path, key: bytes, previous: bytes | None = None) -> Path:
    path = tmp_path / "key"
    path.write_bytes(key + b"\n")
    prev = previous_path(path)
    if previous is None:
        prev.unlink(missing_ok=True)
    else:
        prev.write_bytes(previous)
    return path


def test_pods_on_both_sides_of_a_rotation_keep_talking(tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    path = mount(tmp_path, OLD)
    early = Codec(Keyring.from_file(path, clock=clock, settle_s=120.0, reload_s=10.0), "early-pod")
    mount(tmp_path, NEW, previous=OLD)  # the user rotates: new key, the old one as key.previous
    late = Codec(Keyring.from_file(path, clock=clock, settle_s=120.0, reload_s=10.0), "late-pod")  # started after
    assert early.keys.current == OLD and late.keys.accepted == (NEW, OLD)
    assert talks(early, late) and talks(late, early)  # late signs with the previous key until settled
    clock.advance(11)  # the early pod reloads the mounted Secret
    assert early.keys.accepted == (NEW, OLD) and early.keys.rotations == 1
    assert talks(early, late) and talks(late, early)
    clock.advance(130)  # settled: both sign with the new key, still accept the old
    assert early.keys.signing == NEW and late.keys.signing == NEW
    assert talks(early, late) and talks(late, early)
    mount(tmp_path, NEW)  # key.previous removed: the old key is refused from the next reload on
    clock.advance(11)
    assert early.keys.accepted == (NEW,) and not talks(Codec(OLD, "straggler"), early)


def test_a_rotation_without_key_previous_keeps_the_held_key_as_previous(tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    path = mount(tmp_path, OLD)
    pod = Codec(Keyring.from_file(path, clock=clock, settle_s=60.0, reload_s=1.0), "pod")
    mount(tmp_path, NEW)
    clock.advance(2)
    assert pod.keys.accepted == (NEW, OLD) and pod.keys.signing == OLD
    assert talks(Codec(OLD, "not-reloaded-yet"), pod) and talks(pod, Codec(OLD, "not-reloaded-yet"))


def test_an_unreadable_or_short_secret_keeps_the_keys_held(tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    path = mount(tmp_path, OLD)
    ring = Keyring.from_file(path, clock=clock, reload_s=1.0)
    path.unlink()  # the kubelet swaps the mount's symlink: briefly absent
    clock.advance(2)
    assert ring.accepted == (OLD,) and not ring.maybe_reload()
    path.write_bytes(b"short")
    clock.advance(2)
    assert ring.accepted == (OLD,)
    with pytest.raises(SecretError, match="holds 5 bytes; at least 16 needed"):
        Keyring.from_file(path)
