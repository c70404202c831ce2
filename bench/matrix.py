"""Benchmark: capability-matrix evaluation time per spec (target < 50 microseconds).

    PYTHONPATH=runtime:operator python bench/matrix.py [--seconds 1.0] [--out bench/results]

Measures, on a fixed mix of specs (every preset x backend x protocol x a few TP/PP shapes, about
half of them denied):
- ``evaluate``: ``matrix.evaluate`` on prepared ``MatrixInput``s (what the webhook calls per request
  once the spec is parsed);
- ``spec_to_verdict``: pydantic spec model -> ``MatrixInput`` -> ``evaluate`` (the webhook's whole
  matrix step);
- ``validate_object``: the offline ``pdfleet validate`` path (schema walk + CEL twins + matrix);
- ``baseline``: ``PDDeploymentSpec.model_validate`` of the same specs, measured in the same run,
  so the ratios below are comparable across machines.
Prints per-spec times and ratios against the baseline; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.validation import matrix_input, validate_object
from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.matrix import evaluate

TARGET_US = 50.0
SHAPES = ((4, 1, 2, 1), (4, 1, 4, 1), (8, 2, 4, 1), (2, 2, 2, 2), (8, 1, 3, 1))


def specs() -> list[dict[str, Any]]:
    out = []
    for preset, backend, protocol, (ptp, ppp, dtp, dpp) in itertools.product(
        sorted(PRESETS), ("mooncake", "nixl", "mori"), ("rdma", "tcp", "nvlink"), SHAPES
    ):
        out.append(
            {
                "model": {"layout": {"preset": preset}},
                "transfer": {"backend": backend, "protocol": protocol},
                "prefill": {"replicas": 1, "parallelism": {"tensor": ptp, "pipeline": ppp}, "image": "img"},
                "decode": {"replicas": 2, "parallelism": {"tensor": dtp, "pipeline": dpp}, "image": "img"},
            }
        )
    return out


def per_item_us(fn: Callable[[Any], object], items: Sequence[Any], seconds: float) -> dict[str, float]:
    """Median and best of several rounds over all items, in microseconds per item."""
    for item in items:  # warm caches (preset facts, per-shape pool bytes) the way a running webhook has them
        fn(item)
    rounds: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rounds) < 5:
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        rounds.append((time.perf_counter() - t0) / len(items) * 1e6)
    return {"median_us": statistics.median(rounds), "best_us": min(rounds), "rounds": len(rounds)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement (default 1.0)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    raw = specs()
    models = [PDDeploymentSpec.model_validate(s) for s in raw]
    inputs = [matrix_input(m) for m in models]
    objects = [
        {
            "apiVersion": "pdfleet.io/v1alpha1",
            "kind": "PDDeployment",
            "metadata": {"name": f"b{i}"},
            "spec": copy.deepcopy(s),
        }
        for i, s in enumerate(raw)
    ]
    denied = sum(not evaluate(i).admitted for i in inputs)

    results = {
        "baseline": per_item_us(PDDeploymentSpec.model_validate, raw, args.seconds),
        "evaluate": per_item_us(evaluate, inputs, args.seconds),
        "spec_to_verdict": per_item_us(lambda m: evaluate(matrix_input(m)), models, args.seconds),
        "validate_object": per_item_us(validate_object, objects, args.seconds),
    }
    base = results["baseline"]["median_us"]
    print(
        f"{len(raw)} specs ({denied} denied), {args.seconds:.1f}s per measurement, python {platform.python_version()}"
    )
    for name, r in results.items():
        r["ratio_to_baseline"] = r["median_us"] / base
        print(
            f"  {name:16s} {r['median_us']:8.1f} us/spec (best {r['best_us']:.1f})  x{r['ratio_to_baseline']:.2f} "
            f"of pydantic spec parsing"
        )
    ok = results["evaluate"]["median_us"] < TARGET_US
    print(f"target: evaluate < {TARGET_US:.0f} us/spec: {'met' if ok else 'MISSED'}")

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"matrix-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "benchmark": "matrix",
                "timestamp": stamp,
                "specs": len(raw),
                "denied": denied,
                "target_us": TARGET_US,
                "target_met": ok,
                "machine": platform.machine(),
                "python": platform.python_version(),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
