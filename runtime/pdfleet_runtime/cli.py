"""`pdfleet-runtime`: the command the operator runs in each pod, plus offline tools.

Sub-commands:
  parity   build prefill and decode pools, transfer a seeded request set and compare every decode
           byte: in this process (--backend local, mori), or with every rank its own process on
           loopback through the real engine and the prefill/decode protocol (--backend mooncake, nixl). Exit 0 on parity, 1 on a mismatch (naming the first
           differing buffer, layer and offset), 2 when the capability matrix rejects the
           combination (printing the rule and reason) or the arguments are invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pdfleet_runtime import __version__

EXIT_OK, EXIT_MISMATCH, EXIT_REJECTED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdfleet-runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pdfleet-runtime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    par = sub.add_parser("parity", help="check byte-exact prefill -> decode parity in one process")
    par.add_argument("--layout", required=True, help="a preset name (see docs/layouts.md)")
    par.add_argument("--prefill", required=True, help="prefill shape, e.g. tp=4,pp=2")
    par.add_argument("--decode", required=True, help="decode shape, e.g. tp=2,pp=1")
    par.add_argument("--requests", type=int, default=8, help="requests in flight (default 8)")
    par.add_argument("--tokens", type=int, default=4096,
                     help="tokens of all requests together; the pool capacity (default 4096)")
    par.add_argument("--seed", type=int, default=7, help="seed of state, lengths and allocation (default 7)")
    par.add_argument("--backend", default="local", choices=("local", "mooncake", "nixl", "mori"),
                     help="local: in-process copies, Mooncake's matrix column (default); mooncake, nixl: one "
                     "process per rank through the real engine and the protocol; mori: its column, in-process")
    par.add_argument("--device", default="cpu", help="torch device of the pools (default cpu)")
    par.add_argument("--json", action="store_true", help="print one JSON line")
    return parser


def _parity(args: argparse.Namespace) -> int:
    from pdfleet_runtime.layouts import LayoutError, resolve_layout
    from pdfleet_runtime.parity import ENGINE_BACKENDS, ParityConfig, run_parity, run_parity_engine
    from pdfleet_runtime.records import ParallelShape

    try:
        cfg = ParityConfig(
            layout=resolve_layout(args.layout), prefill=ParallelShape.parse(args.prefill),
            decode=ParallelShape.parse(args.decode), requests=args.requests, tokens=args.tokens,
            seed=args.seed, backend=args.backend, layout_name=args.layout, device=args.device,
        )
        if args.requests < 1 or args.tokens < args.requests:
            raise LayoutError(f"need --tokens >= --requests >= 1, got {args.tokens} and {args.requests}")
    except LayoutError as e:
        print(f"pdfleet-runtime parity: {e}", file=sys.stderr)
        return EXIT_REJECTED
    result = run_parity_engine(cfg) if cfg.backend in ENGINE_BACKENDS else run_parity(cfg)
    if args.json:
        print(json.dumps(result.as_json(cfg), sort_keys=True))
    elif result.rejection is not None:
        r = result.rejection
        print(f"rejected by rule {r.rule}: {r.message}\n  reason: {r.reason}")
    else:
        verdict = "parity" if result.ok else "MISMATCH"
        print(f"{verdict}: {cfg.layout_name} prefill {cfg.prefill} -> decode {cfg.decode}, "
              f"{cfg.requests} requests, {cfg.tokens} tokens")
        print(f"  moved {result.bytes_moved} bytes in {result.descriptors} descriptors; "
              f"{result.mismatched_bytes} mismatched bytes")
        for state, n in sorted(result.bytes_by_state.items()):
            print(f"  {state:16s} {n:>14d} bytes  {result.descriptors_by_state.get(state, 0):>8d} descriptors")
        if result.first_mismatch is not None:
            print(f"  first mismatch: {result.first_mismatch.describe()}")
    if result.rejection is not None:
        if args.json:
            print(f"rejected by rule {result.rejection.rule}: {result.rejection.reason}", file=sys.stderr)
        return EXIT_REJECTED
    return EXIT_OK if result.ok else EXIT_MISMATCH


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "parity":
        return _parity(args)
    return 0
