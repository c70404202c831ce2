"""What a pod of the local cluster runs from: the harness's own Python environment and checkout.

The harness pulls no images: the host's filesystem is every image. Two things make that image the
checkout that started the kubelet, and no other (docs/local-cluster.md, "Whose code runs"):

- its ``PATH`` starts with the bin directory of the kubelet's own interpreter (the checkout's layer,
  ``scripts/venvs.py``), so ``pdfleet-runtime`` in a pod's command is this checkout's, whatever ``PATH``
  the caller had;
- its directories (the interpreter's prefix, every ``sys.path`` entry, every ``PATH`` entry, the
  checkout and its git files) stay visible inside the pod: a pod's volume can hide them (every runtime
  pod mounts an emptyDir at ``/tmp``, and a clone under ``/tmp`` vanished behind it: issue 38), so the
  kubelet binds each one that a mount hides back at its own path, read-only, after the pod's own mounts
  (``PodSandbox``). A path that holds a mount point (``/tmp`` itself) is never bound: it would hide
  the volume.

The image is offline, as every process of a run must be (local traffic only): ``HF_HUB_OFFLINE=1``, and
``HF_ENDPOINT`` at a closed loopback port for what reads only that (sglang-router's Rust ``hf-hub``
fetches a tokenizer for each worker's ``model_path`` it cannot find on disk, and asked huggingface.co).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pdfleet_runtime.source import checkout, git_dirs

__all__ = ["ENV", "OFFLINE", "Image", "local_image"]

ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "VIRTUAL_ENV", "PDFLEET_CACHE")
"""What every container inherits from the harness."""

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
"""Every container's hub settings: nothing is fetched, and a client that ignores ``HF_HUB_OFFLINE`` is
refused on the loopback (port 9, discard, has no listener in a pod's network namespace)."""


@dataclass(frozen=True)
class Image:
    """The environment every container starts with, and the directories it runs from."""

    env: dict[str, str]
    paths: tuple[Path, ...]

    def hidden_by(self, mount_paths: Iterable[str]) -> tuple[Path, ...]:
        """The image's directories under one of ``mount_paths`` (hidden once mounted) that hold none of
        them (binding those back would hide the volume itself), in order."""
        mounts = [Path(m) for m in mount_paths]
        return _outermost(p for p in self.paths
                          if any(m in p.parents for m in mounts) and not any(p == m or p in m.parents for m in mounts))


def _outermost(paths: Iterable[Path]) -> tuple[Path, ...]:
    out: list[Path] = []
    for p in sorted(set(paths), key=lambda q: len(q.parts)):
        if not any(o == p or o in p.parents for o in out):
            out.append(p)
    return tuple(out)


def local_image(environ: Mapping[str, str] = os.environ) -> Image:
    """This process's interpreter, checkout and environment as the image of the pods its kubelet runs."""
    env = {**OFFLINE, **{k: environ[k] for k in ENV if k in environ}}
    bindir = str(Path(sys.executable).parent)  # not resolved: a venv's bin holds a link to its base interpreter
    env["PATH"] = os.pathsep.join([bindir, *(p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir)])
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    else:
        env.pop("VIRTUAL_ENV", None)
    root = checkout()
    candidates = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent,
                  *(Path(p) for p in sys.path if p), *(Path(p) for p in env["PATH"].split(os.pathsep) if p)]
    if root is not None:
        candidates += [root, *git_dirs(root)]
    dirs = {p for p in candidates if p.is_absolute() and p != Path("/") and p.is_dir()}
    return Image(env, tuple(sorted(dirs)))
