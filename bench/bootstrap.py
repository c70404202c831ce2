"""Benchmark: the bootstrap's cost per prefill heartbeat against the pending requests it holds.

    PYTHONPATH=runtime:. python bench/bootstrap.py [--entries 1000,50000] [--polls 2000] [--out bench/results]

A pure ``BootstrapState`` (fake clock, no HTTP) with N pending requests; one prefill rank's
``PrefillPoll`` (nothing new to send) is applied ``--polls`` times. Issue 25 measured 10.7 ms per
heartbeat at 50k entries when every message walked every entry; with the expiry heap the ratio of
the largest N to the smallest should stay near 1. Prints microseconds per poll and the ratio, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path

from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapState
from pdfleet_runtime.protocol.messages import PrefillPoll, RankKey
from pdfleet_runtime.protocol.virtual import decode_register, prefill_register, transfer_request
from pdfleet_runtime.records import ParallelShape


def per_poll_us(entries: int, polls: int) -> float:
    shape = ParallelShape(1, 1)

    def clock() -> float:  # time stands still: nothing expires, the cost measured is the walk (or not)
        return 1_000_000.0

    st = BootstrapState(shape, clock=clock, limits=BootstrapLimits(max_requests=entries + 1,
                                                                   max_events=entries + 10))
    st.handle(prefill_register(shape, 0, 0))
    st.handle(decode_register(shape, 0, 0))
    for i in range(entries):
        st.handle(transfer_request(f"r{i}"))
    st.handle(PrefillPoll(rank=RankKey(tp=0, pp=0), ack=entries, wait_s=0))  # everything acknowledged
    poll = PrefillPoll(rank=RankKey(tp=0, pp=0), ack=entries, wait_s=0)
    t0 = time.perf_counter()
    for _ in range(polls):
        st.handle(poll)
    return (time.perf_counter() - t0) / polls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", default="1000,50000")
    ap.add_argument("--polls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    a = ap.parse_args()
    sizes = [int(x) for x in a.entries.split(",")]
    res = {str(n): per_poll_us(n, a.polls) for n in sizes}
    ratio = res[str(sizes[-1])] / res[str(sizes[0])]
    for n, us in res.items():
        print(f"{n:>7} pending: {us:8.1f} us per heartbeat")
    print(f"ratio {sizes[-1]} / {sizes[0]}: {ratio:.2f}")
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / "bootstrap.json"
    out.write_text(json.dumps({"bench": "bootstrap-heartbeat", "at": datetime.now(UTC).isoformat(),
                               "usPerPoll": res, "ratio": ratio}, indent=2, sort_keys=True))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
