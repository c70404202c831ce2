"""Cached builds, done once and never trusted half-built: under a lock, marked complete only at their end.

The project's caches (the shared virtualenv, each checkout's layer, the SGLang check venv, the
toolchain) are directories that take seconds to minutes to build and are shared by every checkout and
every set-up on the machine. ``ensure_built`` makes one of them:

- done already (``<path>/.complete`` exists): returned at once, nothing else read;
- otherwise it takes an exclusive ``flock`` on ``<path>.lock`` (``path`` resolved first, so two caches
  that symlink one directory share its lock) and says on screen whom it waits for: two set-ups never
  build one path at once (pip failing with ``assert os.path.exists(pyc_path)`` while another pip wrote
  the same venv was the likeliest cause of issue 38's flaky first build);
- under the lock it looks again (the other set-up may have finished it), removes what an earlier build
  left incomplete (killed, failed) unless the build salvages it itself, builds, then checks;
- a failed build or check is printed (the error and the log's tail) and tried once more; a second
  failure raises ``BuildError`` naming the log;
- the marker is written last, atomically, with the time the build took.

Stdlib only: ``scripts/venvs.py`` loads this module with the machine's Python before any virtualenv
exists (``pdfleet_operator/__init__.py`` imports nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = ["COMPLETE", "BuildError", "die_with_parent", "ensure_built", "is_complete", "locked", "run_logged", "say"]

COMPLETE = ".complete"
"""The marker inside a built directory: written last, so its presence means the build finished."""
TAIL_LINES = 25


class BuildError(RuntimeError):
    """A cached build failed twice; the message holds the last error and where its log is."""


def say(tag: str, msg: str) -> None:
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def die_with_parent() -> None:
    """preexec_fn: the child (pip, go) gets SIGKILL when the build's process dies, so a killed set-up
    leaves no writer behind in a directory the next set-up removes and builds again."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def locked(lock: Path, what: str, tag: str) -> Iterator[None]:
    """An exclusive flock on ``lock`` (created if missing, never removed: removing a lock file races).
    The kernel releases it when the holder dies, however it dies."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            say(tag, f"waiting for {what}: another set-up (pid {holder}) is building it (lock {lock})")
            start = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            say(tag, f"waited {time.monotonic() - start:.0f}s for the other set-up")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _mark(path: Path, seconds: float) -> None:
    tmp = path / f"{COMPLETE}.tmp-{os.getpid()}"
    tmp.write_text(f"built in {seconds:.0f}s at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    os.replace(tmp, path / COMPLETE)


def _remove(path: Path, tag: str, why: str) -> None:
    say(tag, f"removing {path} ({why})")
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def _size(path: Path) -> str:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return f"{total / 2**30:.1f} GB" if total >= 2**30 else f"{total / 2**20:.0f} MB"


def ensure_built(path: Path, label: str, build: Callable[[Path], None], *, check: Callable[[Path], None] | None = None,
                 salvage: bool = False, tag: str = "setup", attempts: int = 2) -> Path:
    """``path`` built by ``build(path)`` and checked by ``check(path)``, once, under its lock.

    ``salvage``: an incomplete ``path`` (and a failed attempt's) is left for ``build`` to verify and keep
    what it can (the toolchain runs each binary); otherwise it is removed first (a venv: its scripts
    hold absolute paths, so it is built in place and never moved)."""
    if is_complete(path):
        return path
    real = path.resolve()  # through a symlinked cache: the directory itself, and its lock beside it
    with locked(real.with_name(real.name + ".lock"), label, tag):
        if is_complete(real):
            say(tag, f"{label}: finished by the other set-up ({path})")
            return path
        last: BaseException | None = None
        for attempt in range(1, attempts + 1):
            if real.exists() and not salvage:
                _remove(real, tag, "the failed attempt" if attempt > 1
                        else "incomplete: an earlier build was stopped or failed")
            start = time.monotonic()
            if salvage and real.exists() and attempt == 1:
                say(tag, f"{label}: found without its {COMPLETE} marker at {real}: checking what is there, building "
                         "what does not work")
            else:
                say(tag, f"building {label} in {real}" + (f" (attempt {attempt} of {attempts})" if attempt > 1 else ""))
            try:
                real.mkdir(parents=True, exist_ok=True)
                build(real)
                if check is not None:
                    check(real)
            except (BuildError, OSError, subprocess.SubprocessError) as exc:
                last = exc
                say(tag, f"{label}: attempt {attempt} of {attempts} failed after {time.monotonic() - start:.0f}s: {exc}")
                continue
            seconds = time.monotonic() - start
            _mark(real, seconds)
            say(tag, f"built {label} in {seconds:.0f}s ({_size(real)}): {real}")
            return path
        raise BuildError(f"{label}: {attempts} attempts failed; the last: {last}")


def run_logged(cmd: Sequence[str | Path], log: Path, step: str, *, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> str:
    """Run one step of a build, its stderr appended to ``log``; its stdout returned. Raises ``BuildError``
    with the log's tail when it fails, so the retry prints what went wrong."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=out, text=True, env=env,
                              cwd=cwd, preexec_fn=die_with_parent)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-TAIL_LINES:])
        raise BuildError(f"{step} failed (exit {proc.returncode}); log {log}:\n{tail}")
    return proc.stdout
