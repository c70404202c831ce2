"""Envelopes: sealing and opening, signatures, replays, staleness, versions, size, and fuzzed input.

Every refusal must be a ``ProtocolError`` with the right code, raised before the replay guard
remembers anything (a refused message changes no state).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfleet_runtime.protocol.auth import Codec, ProtocolError, SecretError, load_secret
from pdfleet_runtime.protocol.messages import WIRE, Ack, Hello, RefusalCode, Role, StatusQuery
from tests.unit.protocol.helpers import SECRET, FakeClock, codec, transfer_request

HELLO = Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance="dec")


def reseal(c: Codec, raw: bytes, **changes: object) -> tuple[bytes, str]:
    env = json.loads(raw)
    for k, v in changes.items():
        if k.startswith("body."):
            env["body"][k[5:]] = v
        else:
            env[k] = v
    out = json.dumps(env).encode()
    return out, c.sign(out)


def test_round_trip_names_sender_and_boot() -> None:
    a, b = codec("decode-0"), codec("pod")
    raw, sig, nonce = a.seal(transfer_request("r1"))
    opened = b.open(raw, sig)
    assert opened.body == transfer_request("r1") and opened.envelope.sender == "decode-0"
    assert opened.envelope.boot == a.boot and opened.envelope.nonce == nonce


@pytest.mark.parametrize(("mutate", "code"), [
    (lambda raw, sig: (raw, None), RefusalCode.UNSIGNED),
    (lambda raw, sig: (raw, "0" * 64), RefusalCode.BAD_SIGNATURE),
    (lambda raw, sig: (raw.replace(b'"r1"', b'"r2"'), sig), RefusalCode.BAD_SIGNATURE),
    (lambda raw, sig: (raw, Codec(b"another-secret-of-the-right-size", "x").sign(raw)), RefusalCode.BAD_SIGNATURE),
])
def test_unsigned_or_wrongly_signed_is_refused_and_remembers_nothing(mutate, code) -> None:  # type: ignore[no-untyped-def]
    a, b = codec("a"), codec("b")
    raw, sig, _ = a.seal(transfer_request("r1"))
    raw2, sig2 = mutate(raw, sig)
    with pytest.raises(ProtocolError) as e:
        b.open(raw2, sig2)
    assert e.value.code is code and len(b.replays) == 0


def test_replay_is_refused() -> None:
    a, b = codec("a"), codec("b")
    raw, sig, _ = a.seal(HELLO)
    b.open(raw, sig)
    with pytest.raises(ProtocolError) as e:
        b.open(raw, sig)
    assert e.value.code is RefusalCode.REPLAYED and len(b.replays) == 1


def test_stale_and_future_messages_are_refused() -> None:
    clock = FakeClock()
    a, b = codec("a", clock), codec("b", FakeClock(clock.t + 31))
    raw, sig, _ = a.seal(HELLO)
    with pytest.raises(ProtocolError) as e:
        b.open(raw, sig)
    assert e.value.code is RefusalCode.STALE
    c = codec("c", FakeClock(clock.t - 31))
    with pytest.raises(ProtocolError) as e:
        c.open(raw, sig)
    assert e.value.code is RefusalCode.STALE


def test_nonces_are_forgotten_only_after_the_skew_window() -> None:
    clock = FakeClock()
    a, b = codec("a", clock), codec("b", clock)
    raw, sig, _ = a.seal(HELLO)
    b.open(raw, sig)
    clock.advance(59)
    assert b.replays.seen(json.loads(raw)["nonce"], clock())  # still remembered: window is 2 x skew
    clock.advance(2)
    assert not b.replays.seen(json.loads(raw)["nonce"], clock()) and len(b.replays) == 0


def test_incompatible_major_is_refused_naming_both_versions() -> None:
    a, b = codec("decode-7"), codec("pod")
    raw, _, _ = a.seal(HELLO)
    raw2, sig2 = reseal(a, raw, version=f"{WIRE.major + 1}.0")
    with pytest.raises(ProtocolError) as e:
        b.open(raw2, sig2)
    assert e.value.code is RefusalCode.VERSION
    assert f"{WIRE.major + 1}.0" in e.value.reason and str(WIRE) in e.value.reason


def test_newer_minor_with_unknown_field_is_accepted_same_minor_is_strict() -> None:
    a, b = codec("a"), codec("b")
    raw, _, _ = a.seal(HELLO)
    newer, sig = reseal(a, raw, version=f"{WIRE.major}.{WIRE.minor + 1}", **{"body.future_field": 1})
    assert isinstance(b.open(newer, sig).body, Hello)
    same, sig = reseal(a, raw, nonce="ab" * 16, **{"body.future_field": 1})
    with pytest.raises(ProtocolError) as e:
        b.open(same, sig)
    assert e.value.code is RefusalCode.MALFORMED


def test_oversized_is_refused_before_anything_else() -> None:
    b = Codec(SECRET, "b", max_bytes=1000)
    raw, _, _ = codec("a").seal(StatusQuery(instance="d", dst={"tp": 0, "pp": 0},  # type: ignore[arg-type]
                                               request_ids=tuple(f"r{i}" for i in range(200))))
    with pytest.raises(ProtocolError) as e:
        b.open(raw, None)
    assert e.value.code is RefusalCode.TOO_LARGE


def test_reply_must_answer_the_request_nonce() -> None:
    a, b = codec("a"), codec("b")
    _, _, nonce = a.seal(HELLO)
    raw, sig, _ = b.seal(Ack(), reply_to="cd" * 16)
    with pytest.raises(ProtocolError) as e:
        a.open(raw, sig, reply_to=nonce)
    assert e.value.code is RefusalCode.REPLAYED


def test_secret_file(tmp_path: Path) -> None:
    (tmp_path / "s").write_bytes(SECRET + b"\n")
    assert load_secret(tmp_path / "s") == SECRET
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(SecretError, match="at least"):
        load_secret(tmp_path / "short")
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(tmp_path / "missing")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=2000))
def test_signed_garbage_bytes_never_crash(raw: bytes) -> None:
    b = codec("b")
    with pytest.raises(ProtocolError) as e:
        b.open(raw, b.sign(raw))
    assert e.value.code in (RefusalCode.MALFORMED, RefusalCode.VERSION, RefusalCode.STALE)
    assert len(b.replays) == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(["type", "request_id", "instance", "dst", "indices", "timeout_s",
                                             "role", "wire", "reports", "rank", "engine", "ack", "wait_s"]),
                            json_values, max_size=7),
       kind=st.sampled_from(["hello", "transfer_request", "status_reports", "prefill_register", "decode_register",
                             "prefill_poll", "cancel", "nonsense"]))
def test_signed_well_framed_but_malformed_bodies_are_refused(body: dict, kind: str) -> None:  # type: ignore[type-arg]
    a, b = codec("a"), codec("b")
    raw, _, _ = a.seal(HELLO)
    env = json.loads(raw)
    env["body"] = {**body, "type": kind}
    out = json.dumps(env).encode()
    try:
        opened = b.open(out, b.sign(out))
    except ProtocolError as e:
        assert e.code is RefusalCode.MALFORMED
        assert len(b.replays) == 0
    else:  # hypothesis found a valid message: then it must round-trip
        assert opened.body.type == kind and len(b.replays) == 1


@pytest.mark.parametrize("sig", ["é" * 64, "\udcff" * 64, "\uff10" * 64])
def test_non_ascii_signature_is_a_bad_signature_not_a_crash(sig: str) -> None:
    """Issue 25 item 5: ``compare_digest`` raises on non-ASCII str (HTTP 500 with a traceback before)."""
    c = codec()
    raw, _, _ = c.seal(HELLO)
    with pytest.raises(ProtocolError) as e:
        codec("other").open(raw, sig)
    assert e.value.code is RefusalCode.BAD_SIGNATURE


def test_non_ascii_signature_header_over_http_is_401() -> None:
    """The same through a real ``BootstrapServer``: the header's raw bytes are not ASCII."""
    import asyncio
    import socket

    from pdfleet_runtime.protocol.bootstrap import MESSAGES_PATH, BootstrapServer, BootstrapState
    from pdfleet_runtime.records import ParallelShape

    async def go() -> bytes:
        srv = BootstrapServer(BootstrapState(ParallelShape(1, 1)), codec("boot"))
        ep = await srv.start()
        try:
            raw, _, _ = codec().seal(HELLO)
            head = (f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n"
                    "Connection: close\r\nX-Pdfleet-Signature: ").encode() + "é".encode() * 32 + b"\r\n\r\n"
            reader, writer = await asyncio.open_connection(ep.host, ep.port, family=socket.AF_INET)
            writer.write(head + raw)
            await writer.drain()
            out = await reader.read()
            writer.close()
            return out
        finally:
            await srv.stop()

    status = asyncio.run(go()).split(b"\r\n", 1)[0]
    assert status == b"HTTP/1.1 401 Unauthorized", status
