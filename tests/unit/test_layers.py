"""The architecture's import layers hold (import-linter contracts in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 18 kept, 0 broken" in proc.stdout


# No circle is left (issue 40 removed the last ones); any circle fails.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


def test_no_import_circles() -> None:
    """No module of the operator or the runtime reaches itself through imports, type-only
    (``TYPE_CHECKING``) and function-local ones included (grimp reads every import statement)."""
    import grimp

    graph = grimp.build_graph("pdfleet_operator", "pdfleet_devcluster", "pdfleet_runtime", cache_dir=None)
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.startswith("pdfleet_")}
             for m in graph.modules}
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [frozenset({"a", "b"})]  # the finder finds one
    assert set(_circles(edges)) <= KNOWN_CIRCLES, set(_circles(edges)) - KNOWN_CIRCLES


def test_no_top_level_operator_package() -> None:
    # `operator/` is a folder, not a package: it must never shadow the stdlib module.
    assert not (REPO / "operator" / "__init__.py").exists()
    import operator

    assert operator.__file__ is not None and "pdfleet" not in operator.__file__
    assert hasattr(operator, "itemgetter")


@pytest.mark.parametrize("module", ["pdfleet_operator.cli", "pdfleet_runtime"])
def test_console_modules_print_help(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
