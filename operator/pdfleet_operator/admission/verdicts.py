"""The verdict the webhook and the re-check use: ``validation.validate_object``, cached, plus the
running matrix when it is pinned or made stricter.

Why a cache: the webhook is on the apiserver's request path, and the same spec is judged again and
again (``kubectl apply`` of unchanged manifests, GitOps resyncs, kopf's own annotation patches,
every re-check). The key is the object's content without ``metadata`` and ``status`` (which change
on every request), plus the name fields the verdict reads; a verdict depends on nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.settings import RecheckSettings
from pdfleet_operator.validation import ObjectVerdict, matrix_input, validate_object
from pdfleet_runtime.links import Backend
from pdfleet_runtime.matrix import LATEST_MATRIX_VERSION, MATRICES, Cell, Feature, Matrix, Violation, evaluate

__all__ = ["Verdicts", "running_matrix", "violation_key"]

_MAX_KEY_CHARS = 64 << 10  # huge objects are judged every time rather than pinned in memory
_ENTRY_OVERHEAD = 1024  # bytes charged per entry beyond its key (the verdict's own objects)


def violation_key(v: Violation) -> tuple[str, tuple[str, ...]]:
    """What makes two violations "the same" across two evaluations (old and new object)."""
    return v.rule, v.paths


def running_matrix(settings: RecheckSettings) -> Matrix | None:
    """The matrix that overrides each role's own, or None when the operator runs unpinned.

    ``deny_cells`` (a test hook) layers extra "no" cells on the pinned or latest matrix; the version
    string says so, so a Degraded message shows that a modified matrix judged it.
    """
    if settings.matrix_version is None and not settings.deny_cells:
        return None
    base = MATRICES[settings.matrix_version or LATEST_MATRIX_VERSION]
    if not settings.deny_cells:
        return base
    cells = dict(base.cells)
    for text in settings.deny_cells:
        backend, _, feature = text.partition(".")
        b, f = Backend(backend), Feature(feature)
        cells[(b, f)] = Cell(b, f, False, f"denied by the operator's --test-deny-cell {text}", f"{b}.{f}")
    version = f"{base.version}+deny.{'.'.join(sorted(settings.deny_cells))}"
    return Matrix(version, MappingProxyType(cells), base.gpu_memory_fraction)


class Verdicts:
    """``of(obj)``: the verdict on one object, as ``pdfleet validate`` gives it (plus the override).

    Never raises (``validate_object`` is total; the override is guarded). Thread-safe: large
    reviews are judged in worker threads while the loop judges small ones, so every cache access
    holds one lock (never held while computing a verdict). The cache is bounded by entries and by
    bytes: an entry is charged twice its key (the key, and the parsed spec the verdict keeps) plus
    a fixed overhead, so many large distinct objects cannot grow it past ``max_bytes``.
    """

    def __init__(self, matrix: Matrix | None = None, cache_size: int = 1024, max_bytes: int = 8 << 20) -> None:
        self.matrix = matrix
        self.cache_size = cache_size
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, ObjectVerdict] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_settings(cls, settings: RecheckSettings) -> Verdicts:
        return cls(running_matrix(settings), settings.cache_size, settings.cache_bytes)

    @property
    def cached_bytes(self) -> int:
        """What the cache is charged now (at most ``max_bytes``)."""
        return self._bytes

    def of(self, obj: object) -> ObjectVerdict:
        key = _key(obj) if self.cache_size and self.max_bytes else None
        if key is not None:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    self.hits += 1
                    return hit
        verdict = self.compute(obj)
        with self._lock:
            self.misses += 1
            if key is not None:
                self._store(key, verdict)
        return verdict

    def _store(self, key: str, verdict: ObjectVerdict) -> None:
        """Insert and evict the least recently used until both bounds hold (the lock is held)."""
        cost = _cost(key)
        if cost > self.max_bytes:
            return
        if key in self._cache:  # another thread judged it meanwhile
            self._cache.move_to_end(key)
            return
        self._cache[key] = verdict
        self._bytes += cost
        while len(self._cache) > self.cache_size or self._bytes > self.max_bytes:
            old, _ = self._cache.popitem(last=False)
            self._bytes -= _cost(old)

    def compute(self, obj: object) -> ObjectVerdict:
        """The uncached verdict; safe to call from a worker thread."""
        verdict = validate_object(obj, "<admission>")
        if self.matrix is None or verdict.spec is None:
            return verdict
        try:
            extra = evaluate(matrix_input(PDDeploymentSpec.model_validate(verdict.spec)), matrix=self.matrix)
        except (ValidationError, ValueError, TypeError):
            return verdict  # the spec does not parse: validate_object already said why
        seen = {violation_key(v) for v in (*verdict.violations, *verdict.warnings)}
        errors = tuple(v for v in extra.violations if violation_key(v) not in seen)
        warnings = tuple(v for v in extra.warnings if violation_key(v) not in seen)
        return dataclasses.replace(
            verdict,
            violations=verdict.violations + errors,
            warnings=verdict.warnings + warnings,
            matrix_versions=(self.matrix.version,),
        )


def _cost(key: str) -> int:
    return 2 * len(key) + _ENTRY_OVERHEAD


def _key(obj: object) -> str | None:
    """The cache key of an object, or None when it is not worth (or not possible) to cache."""
    if not isinstance(obj, Mapping):
        return None
    meta = obj.get("metadata")
    names = (meta.get("name"), meta.get("generateName")) if isinstance(meta, Mapping) else (meta, None)
    content: dict[str, Any] = {k: v for k, v in obj.items() if k not in ("metadata", "status")}
    try:
        key = json.dumps([names, content], sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None
    return key if len(key) <= _MAX_KEY_CHARS else None
