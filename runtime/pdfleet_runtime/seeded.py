"""Seeded state: the bytes a request must hold, derived from a seed on both sides without talking.

Pure (numpy, hashlib and layouts only; no torch), so the pod process, the rank processes and the
verification harness share one definition:

- ``logical_items``: a request's unsharded bytes of one logical buffer (state type, field, layer),
  independent of the shape that holds it;
- ``shard_logical``: what one tensor-parallel rank holds of them (written independently of the
  planner's byte offsets, so agreement between the two is evidence, not a tautology);
- ``background``: the bytes an arena is filled with before a run (so writes outside a request show);
- ``request_seed``: a request's seed from its id; ``request_lengths``: a run's request lengths.
"""

from __future__ import annotations

import hashlib

import numpy as np

from pdfleet_runtime.layouts import BufferSpec, EntryField, Sharding, StateType, group_range

__all__ = ["background", "logical_items", "request_lengths", "request_seed", "shard_logical"]

_STATE_CODE = {s: i for i, s in enumerate(StateType)}
_FIELD_CODE = {f: i for i, f in enumerate(EntryField)}


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()


def request_seed(request_id: str, seed: int = 0) -> int:
    """A 63-bit seed for one request (both sides compute it from the id and the caller's seed)."""
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def background(seed: int, side: int, rank: int, n: int) -> np.ndarray:
    """``n`` seeded bytes for the arena of global rank ``rank`` of ``side`` (1 prefill, 2 decode)."""
    return _random_bytes(_rng(seed, side, rank), n)


def logical_items(seed: int, spec: BufferSpec, tp: int, request: int, n_items: int) -> np.ndarray:
    """The request's unsharded bytes of one logical buffer, shaped for ``shard_logical``.

    ``[n, outer, global_dim, unit]`` (dim), ``[n, heads, unit]`` (heads) or ``[n, item]`` (replicated);
    independent of the rank and shape that holds it (``tp`` only recovers the global dim).
    """
    rng = _rng(seed, 11, _STATE_CODE[spec.state_type], _FIELD_CODE[spec.field], spec.layer_id, request)
    if spec.sharding is Sharding.DIM:
        width = sum(spec.shard_groups) if spec.shard_groups else spec.dim * tp
        shape: tuple[int, ...] = (n_items, spec.outer_count, width, spec.unit_bytes)
    elif spec.sharding is Sharding.HEADS:
        shape = (n_items, spec.total_heads, spec.unit_bytes)
    else:
        shape = (n_items, spec.item_bytes)
    return _random_bytes(rng, int(np.prod(shape))).reshape(shape)


def shard_logical(logical: np.ndarray, spec: BufferSpec, tp: int, tp_rank: int) -> np.ndarray:
    """What rank ``tp_rank`` of ``tp`` holds of ``logical``: ``[n, item_bytes]``."""
    n = logical.shape[0]
    if spec.sharding is Sharding.REPLICATED:
        return logical.reshape(n, -1)
    if spec.sharding is Sharding.HEADS:
        h = spec.total_heads
        per = max(1, h // tp)
        first = (tp_rank // max(1, tp // h)) * per
        return np.ascontiguousarray(logical[:, first : first + per]).reshape(n, -1)
    groups = spec.shard_groups or (logical.shape[2],)
    heads = spec.group_heads or tuple(tp for _ in groups)  # undeclared groups: sharded by TP
    parts, start = [], 0
    for g, h in zip(groups, heads, strict=True):
        first, width = group_range(g, h, tp, tp_rank)
        parts.append(logical[:, :, start + first : start + first + width])
        start += g
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(n, -1)


def request_lengths(tokens: int, requests: int, seed: int) -> list[int]:
    """Split ``tokens`` into ``requests`` lengths of at least 1 (random cut points), all summing to ``tokens``."""
    if requests < 1 or tokens < requests:
        raise ValueError(f"need tokens >= requests >= 1, got tokens={tokens}, requests={requests}")
    cuts = np.sort(_rng(seed, 3).choice(np.arange(1, tokens), size=requests - 1, replace=False))
    return [int(x) for x in np.diff(np.concatenate(([0], cuts, [tokens])))]
