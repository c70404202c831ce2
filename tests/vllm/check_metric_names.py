"""Run in the vLLM check venv: every ``vllm:`` metric the built-in runtime exports (argv[1], JSON
``{family: [labels]}``) is one vLLM 0.33's ``PrometheusStatLogger`` registers, with the same labels and kind.

Read from vLLM's own module source (``vllm.v1.metrics.loggers``, found by importing it): building the logger
needs a whole ``VllmConfig`` of a real model. Prints JSON ``{family: problem}``, empty when all agree.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys

import vllm.v1.metrics.loggers as loggers

KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}


def registered() -> tuple[dict[str, str], list[str] | None]:
    """vLLM's families (``name`` keyword of ``self._gauge_cls(...)`` and friends, whose ``labelnames`` is the
    logger's own list) and that list."""
    tree = ast.parse(inspect.getsource(loggers.PrometheusStatLogger))
    found: dict[str, str] = {}
    labels: list[str] | None = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
                and any(isinstance(t, ast.Name) and t.id == "labelnames" for t in node.targets)):
            labels = [ast.literal_eval(e) for e in node.value.elts]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KINDS:
            kw = {k.arg: k.value for k in node.keywords}
            name, ln = kw.get("name"), kw.get("labelnames")
            if isinstance(name, ast.Constant) and isinstance(ln, ast.Name) and ln.id == "labelnames":
                found[str(name.value)] = KINDS[node.func.attr]
    return found, labels


def main() -> None:
    ours: dict[str, dict] = json.loads(sys.argv[1])
    theirs, labels = registered()
    problems: dict[str, str] = {}
    for family, want in ours.items():
        if family not in theirs:
            problems[family] = "vLLM registers no such family"
        elif theirs[family] != want["kind"]:
            problems[family] = f"vLLM's is a {theirs[family]}, ours a {want['kind']}"
        elif sorted(want["labels"]) != sorted(labels or []):
            problems[family] = f"vLLM's labels are {labels}, ours {want['labels']}"
    print(json.dumps({"problems": problems, "vllm_families": len(theirs)}))


if __name__ == "__main__":
    main()
