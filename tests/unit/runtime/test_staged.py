"""The staged path's protocol logic on CPU: layout, path choice, flow control through a real engine, failure mid-way.

Both sides run in one process over the in-process engine (``engines/local.py``: the contract's checks
with ``memmove``); every signal is an engine write or read of an 8-byte word, as between nodes. The
copy kernels run their CPU loop here (the Triton kernel is tests/unit/runtime/test_staging.py and tests/gpu).
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch

from pdfleet_runtime import staging
from pdfleet_runtime.engines import EngineConfig, create_engine
from pdfleet_runtime.engines.chunks import chunk_link
from pdfleet_runtime.protocol.staged import (
    READY_DIRECT,
    DecodeStaging,
    Layout,
    Path,
    PrefillStaging,
    StagingError,
    StagingRegion,
    choose_path,
)
from pdfleet_runtime.protocol.staged_timeline import parse

SLOT = 4096


class _Announce:
    def __init__(self, d: dict[str, int]) -> None:
        self.__dict__.update(d)


def _pair(slots: int = 2, lanes: int = 2, table_bytes: int = 64 << 10, arena_bytes: int = 1 << 20):
    rng = np.random.default_rng(7)
    src_arena = torch.from_numpy(rng.integers(0, 256, arena_bytes, dtype=np.uint8))
    dst_arena = torch.zeros(arena_bytes, dtype=torch.uint8)
    pre_region = StagingRegion(Layout(slots, SLOT, 1, table_bytes), "cpu", extra=PrefillStaging.extra_bytes())
    dec_region = StagingRegion(Layout(slots, SLOT, lanes, table_bytes), "cpu")
    pre = PrefillStaging(pre_region, src_arena)
    dec = DecodeStaging(dec_region, dst_arena, threshold_bytes=1, min_chunks=4, cpu=True)
    e_pre = create_engine(EngineConfig("local"))
    e_dec = create_engine(EngineConfig("local"))
    for e in (e_pre, e_dec):
        e.start()
    from pdfleet_runtime.records import RegionRecord

    e_pre.register([RegionRecord(src_arena.data_ptr(), arena_bytes, "cpu"), pre_region.record()])
    info_dec = e_dec.register([RegionRecord(dst_arena.data_ptr(), arena_bytes, "cpu"), dec_region.record()])
    peer = e_pre.connect(info_dec)
    return pre, dec, chunk_link(e_pre, peer), src_arena, dst_arena


def _blocks(n: int = 300, seed: int = 1, arena_bytes: int = 1 << 20):
    """Scattered, non-overlapping blocks of 256-byte multiples (source and destination shuffled apart)."""
    rng = np.random.default_rng(seed)
    pages = arena_bytes // 1024
    src = rng.choice(pages, n, replace=False).astype(np.int64) * 1024
    dst = rng.choice(pages, n, replace=False).astype(np.int64) * 1024
    length = rng.integers(1, 5, n).astype(np.int64) * 256
    return src, dst, length


def _expected(src_arena, src, dst, length, size: int):
    exp = np.zeros(size, dtype=np.uint8)
    s = src_arena.numpy()
    for a, b, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        exp[b : b + n] = s[a : a + n]
    return exp


def test_path_choice_by_size_and_device():
    assert choose_path(64 << 20, "cuda:0", 32 << 20) is Path.STAGED
    assert choose_path(16 << 20, "cuda:0", 32 << 20) is Path.DIRECT  # below the threshold
    assert choose_path(64 << 20, "cpu", 32 << 20) is Path.DIRECT  # host pools keep the direct write
    assert choose_path(64 << 20, "cpu", 32 << 20, cpu=True) is Path.STAGED
    assert choose_path(64 << 20, "cuda:0", 32 << 20, enabled=False) is Path.DIRECT
    assert choose_path(0, "cuda:0", 0) is Path.DIRECT


def test_layout_keeps_lanes_apart():
    lay = Layout(3, 1 << 20, 2, 1 << 16)
    spans = sorted([(lay.ring(i), lay.ring_bytes) for i in range(2)] + [(lay.table(i), lay.table_bytes) for i in range(2)]
                   + [(lay.word(i, w), 8) for i in range(2) for w in range(3)])
    for (a, n), (b, _) in itertools.pairwise(spans):
        assert a + n <= b
    assert spans[-1][0] + 8 <= lay.total
    assert lay.max_blocks == ((1 << 16) - 32) // 16
    with pytest.raises(ValueError, match="slot bytes"):
        Layout(3, 1000, 1, 1 << 16)


def test_grant_needs_a_lane_per_source_and_release_gives_them_back():
    _, dec, *_ = _pair(lanes=2)
    assert dec.grant("a", 1 << 20, 2) == (0, 1)
    assert dec.grant("b", 1 << 20, 1) is None  # no lane left: the direct write
    dec.release("a")
    assert dec.grant("b", 1 << 20, 1) == (0,)
    assert dec.lanes_free == 1


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_staged_request_lands_every_byte_with_bounded_slots(slots):
    pre, dec, link, src_arena, dst_arena = _pair(slots=slots)
    src, dst, length = _blocks()
    (lane,) = dec.grant("r", int(length.sum()), 1)
    addr = pre.lane(_Announce(dec.announce()), lane)
    lay = dec.layout
    freed_word = dec.region.words(lay.word(lane, 1))
    ahead: list[int] = []  # per chunk post: chunks posted minus chunks the decode had freed by then
    posts = itertools.count()
    real_post = link.post

    def post(local: int, remote: int, nbytes: int):
        if addr.ring <= remote < addr.ring + lay.ring_bytes:
            ahead.append(next(posts) - int(freed_word.item()))
        return real_post(local, remote, nbytes)

    link.post = post  # type: ignore[method-assign]
    got: dict[str, object] = {}
    t = threading.Thread(target=lambda: got.update(n=dec.receive(lane, abort=lambda: False, timeout_s=20)))
    t.start()
    chunks = pre.send(link, addr, src, dst, length, slot_bytes=SLOT, min_chunks=4, abort=lambda: False, timeout_s=20)
    t.join(20)
    assert got["n"] == int(length.sum())
    assert chunks == -(-int(length.sum()) // SLOT) > slots  # more chunks than slots: the freed reads gated reuse
    assert np.array_equal(dst_arena.numpy(), _expected(src_arena, src, dst, length, dst_arena.numel()))
    m = pre.metrics
    assert m.requests["staged"] == 1 and m.bytes["staged"] == int(length.sum())
    assert m.landed_write_s.n == chunks and m.chunk_s.n == chunks
    # Flow control: a chunk is posted only into a slot the decode freed, so never more than ``slots`` are
    # ahead of its scatter; the freed count was read (through the engine) when the ring filled.
    assert len(ahead) == chunks and max(ahead) < slots and max(ahead) >= 0, ahead
    assert m.freed_read_s.n >= 1  # polled (repeatedly while the decode scatters) only when the ring was full
    assert dec.metrics.bytes["staged"] == int(length.sum())


def test_direct_marker_ends_the_receiver_without_chunks():
    pre, dec, link, _, dst_arena = _pair()
    (lane,) = dec.grant("r", 1 << 20, 1)
    pre.direct(link, pre.lane(_Announce(dec.announce()), lane))
    assert int(dec.region.words(dec.layout.word(lane, 2)).item()) == READY_DIRECT
    assert dec.receive(lane, abort=lambda: False, timeout_s=5) == 0
    assert not dst_arena.any()


def test_failure_mid_way_leaves_only_whole_chunks():
    """The sender stops after 3 of its chunks landed (its request failed): the decode scattered exactly
    those chunks' bytes, every one whole, and wrote nothing else."""
    pre, dec, link, src_arena, dst_arena = _pair(slots=2)
    src, dst, length = _blocks(n=400, seed=3)
    (lane,) = dec.grant("r", int(length.sum()), 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def receive():
        try:
            dec.receive(lane, abort=stop.is_set, timeout_s=20)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=receive)
    t.start()
    landed_box = [0]
    orig = link.write_word

    def counting(local, remote):
        orig(local, remote)
        if remote == pre.lane(_Announce(dec.announce()), lane).landed:
            landed_box[0] += 1

    link.write_word = counting  # type: ignore[method-assign]
    with pytest.raises(staging.Aborted):
        pre.send(link, pre.lane(_Announce(dec.announce()), lane), src, dst, length, slot_bytes=SLOT, min_chunks=4,
                 abort=lambda: landed_box[0] >= 3, timeout_s=20)
    # the decode scatters what landed, then the request's failure stops it
    deadline = time.monotonic() + 10
    while int(dec.region.words(dec.layout.word(lane, 1)).item()) < 3 and time.monotonic() < deadline:
        pass
    stop.set()
    t.join(20)
    assert errors and isinstance(errors[0], staging.Aborted)
    # the expected arena: only the bytes of the first 3 chunks (stream bytes [0, 3 * SLOT))
    stream_end = np.cumsum(length)
    exp = np.zeros(dst_arena.numel(), dtype=np.uint8)
    s = src_arena.numpy()
    for a, b, n, e in zip(src.tolist(), dst.tolist(), length.tolist(), stream_end.tolist(), strict=True):
        start = e - n
        keep = max(0, min(n, 3 * SLOT - start))
        exp[b : b + keep] = s[a : a + keep]
    assert np.array_equal(dst_arena.numpy(), exp)


def test_table_that_leaves_the_arena_is_refused():
    pre, dec, link, _, _ = _pair()
    src, dst, length = _blocks(n=10)
    dst = dst.copy()
    dst[3] = dec.arena.numel()  # past the decode's arena
    (lane,) = dec.grant("r", int(length.sum()), 1)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(errors, lambda: dec.receive(lane, abort=lambda: False, timeout_s=5)))
    t.start()
    try:  # fits the ring: lands, and is never scattered (or stops between chunks once the decode refused)
        pre.send(link, pre.lane(_Announce(dec.announce()), lane), src, dst, length, slot_bytes=SLOT, min_chunks=4,
                 abort=lambda: bool(errors), timeout_s=5)
    except staging.Aborted:
        assert errors  # aborted only because the decode refused the table
    t.join(10)
    assert not dec.arena.any()
    assert errors and isinstance(errors[0], StagingError) and "leaves this rank's arena" in str(errors[0])


def test_too_many_blocks_for_the_table_is_a_clear_error():
    pre, dec, link, _, _ = _pair(table_bytes=1024)
    src, dst, length = _blocks(n=100)
    with pytest.raises(StagingError, match="tableMib"):
        pre.send(link, pre.lane(_Announce(dec.announce()), 0), src, dst, length, slot_bytes=SLOT, min_chunks=4,
                 abort=lambda: False)


def _catch(errors: list[BaseException], fn) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def test_each_leg_keeps_and_logs_one_ordered_timeline_per_side(caplog):
    pre, dec, link, _, _ = _pair(slots=2)
    src, dst, length = _blocks()
    (lane,) = dec.grant("r-1", int(length.sum()), 1)
    addr = pre.lane(_Announce(dec.announce()), lane)
    t = threading.Thread(target=lambda: dec.receive(lane, abort=lambda: False, timeout_s=20))
    with caplog.at_level("INFO", logger="pdfleet_runtime.protocol.staged"):
        t.start()
        prepared = pre.prepare(link, addr, src, dst, length, slot_bytes=SLOT, min_chunks=4)
        chunks = pre.send_prepared(link, prepared, abort=lambda: False, timeout_s=20, request="r-1", where="to dec")
        t.join(20)
    sent, got = pre.timelines[-1], dec.timelines[-1]
    assert (sent.side, sent.request, sent.where, got.side, got.request) == ("send", "r-1", "to dec", "receive", "r-1")
    assert sent.n_chunks == got.n_chunks == chunks > 2
    for k in range(chunks):
        stamps = [sent.at(s, k) for s in ("gather", "post", "posted", "done", "landed")]
        assert None not in stamps and stamps == sorted(stamps), (k, stamps)
        assert got.at("scatter", k) <= got.at("freed", k)
        assert got.at("scatter", k) >= sent.at("done", k)  # the decode scatters a chunk only after its write ended
        if k:
            assert sent.at("landed", k) >= sent.at("landed", k - 1) and got.at("freed", k) >= got.at("freed", k - 1)
    assert sent.at("write", 0) is None  # the in-process engine has no poster thread (Mooncake's stamps)
    assert got.marks["table"] <= got.marks["plan"] <= got.at("scatter", 0) - got.start <= got.marks["end"]
    assert sent.marks["end"] >= sent.at("landed", chunks - 1) - sent.start
    # One log line per leg and side (never one per chunk), read back whole.
    lines = [r.getMessage() for r in caplog.records if "staged timeline" in r.getMessage()]
    assert len(lines) == 2, lines
    back = {tl.side: tl for tl in parse("\n".join(lines))}
    assert back["send"].request == "r-1" and back["send"].n_chunks == chunks
    assert back["receive"].at("freed", chunks - 1) == pytest.approx(got.at("freed", chunks - 1), abs=1e-6)
