"""A model directory's content digest (``spec.model.source.digest``): the same weights on every pod.

``sha256:`` over one line per regular file, in sorted relative-path order: ``PATH\\0SHA256(file)\\n``
(symlinks followed, as a Hugging Face cache snapshot links its blobs). Any added, removed, renamed or changed
file changes it; nothing else does. Pure stdlib: the CLI (``pdfleet digest DIR``) and the pod both compute it.
Cost: one read of every byte (about 1 GB/s per core), paid at start only where the spec sets a digest.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pdfleet_runtime.model.config_values import ModelConfigError

__all__ = ["DIGEST_PATTERN", "check_digest", "directory_digest", "hash_file"]

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
_CHUNK = 1 << 20


def hash_file(h: hashlib._Hash, path: Path) -> hashlib._Hash:
    """``h`` updated with ``path``'s bytes, read a MiB at a time (the weights cache hashes files this way too)."""
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h


def directory_digest(root: Path) -> str:
    """The digest of every regular file under ``root``. Raises ``ModelConfigError`` if it is not a directory."""
    if not root.is_dir():
        raise ModelConfigError(f"{root} is not a directory", "path")
    files = sorted(p for p in root.rglob("*") if p.is_file())  # is_file follows symlinks
    h = hashlib.sha256()
    for p in files:
        rel = p.relative_to(root).as_posix()
        h.update(f"{rel}\0{hash_file(hashlib.sha256(), p).hexdigest()}\n".encode())
    return f"sha256:{h.hexdigest()}"


def check_digest(root: Path, expected: str | None) -> None:
    """Refuse a directory whose content is not the one the spec names (``expected`` None: nothing to check)."""
    if expected is None:
        return
    got = directory_digest(root)
    if got != expected:
        raise ModelConfigError(
            f"the model directory {root} has digest {got}, the spec's model.source.digest is {expected}: this "
            f"pod would serve other weights than its peers (fix the volume's content, or set the digest "
            f"`pdfleet digest {os.fspath(root)}` prints)", "digest")
