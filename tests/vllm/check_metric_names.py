"""Run in the vLLM check venv: every ``vllm:`` metric the built-in runtime exports (argv[1], JSON
``{family: {kind, labels}}``) is one vLLM 0.33 registers, with the same labels and kind: its
``PrometheusStatLogger`` (the engine's families) and its NIXL connector's ``NixlPromMetrics`` (the transfers a
NIXL decode records), which takes the logger's label names.

Read from vLLM's own module source (found by importing the modules): building the logger needs a whole
``VllmConfig`` of a real model. A family's labels are the logger's ``labelnames``, plus any list added to them
(``labelnames + ["finished_reason"]``). Prints JSON ``{problems: {family: problem}, vllm_families: N}``.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys

import vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats as nixl_stats
import vllm.v1.metrics.loggers as loggers

KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}


def _labels(node: ast.expr, base: list[str]) -> list[str] | None:
    """``labelnames`` or ``labelnames + [...]`` as a list; None for anything else."""
    if isinstance(node, ast.Name) and node.id == "labelnames":
        return list(base)
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.List)
            and _labels(node.left, base) is not None):
        return [*base, *(ast.literal_eval(e) for e in node.right.elts)]
    return None


def registered() -> tuple[dict[str, tuple[str, list[str]]], list[str] | None]:
    """vLLM's families (``name`` keyword of ``self._gauge_cls(...)`` and friends) with their kind and labels, and
    the logger's own label list."""
    trees = [ast.parse(inspect.getsource(loggers.PrometheusStatLogger)),
             ast.parse(inspect.getsource(nixl_stats.NixlPromMetrics))]
    base: list[str] | None = None
    for node in ast.walk(trees[0]):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
                and any(isinstance(t, ast.Name) and t.id == "labelnames" for t in node.targets)):
            base = [ast.literal_eval(e) for e in node.value.elts]
    found: dict[str, tuple[str, list[str]]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KINDS:
                kw = {k.arg: k.value for k in node.keywords}
                name, ln = kw.get("name"), kw.get("labelnames")
                labels = _labels(ln, base or []) if ln is not None else None
                if isinstance(name, ast.Constant) and labels is not None:
                    found[str(name.value)] = (KINDS[node.func.attr], labels)
    return found, base


def main() -> None:
    ours: dict[str, dict] = json.loads(sys.argv[1])
    theirs, _ = registered()
    problems: dict[str, str] = {}
    for family, want in ours.items():
        if family not in theirs:
            problems[family] = "vLLM registers no such family"
        elif theirs[family][0] != want["kind"]:
            problems[family] = f"vLLM's is a {theirs[family][0]}, ours a {want['kind']}"
        elif sorted(want["labels"]) != sorted(theirs[family][1]):
            problems[family] = f"vLLM's labels are {theirs[family][1]}, ours {want['labels']}"
    print(json.dumps({"problems": problems, "vllm_families": len(theirs)}))


if __name__ == "__main__":
    main()
