"""Which code this is: the checkout pdfleet was imported from, and its commit.

Two checkouts on one machine (a second clone, a git worktree) each run their own code, in their own pods
too (docs/local-cluster.md, "Whose code runs"); ``--version`` of both commands and the first line a
runtime pod logs name the checkout and its commit, so a process running another checkout's code shows it.
The commit is read from the checkout's git files (a pod has no git binary); an installed copy (an image's
site-packages) has no checkout and says only its version. Stdlib only, no imports of the project.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["checkout", "commit", "describe", "git_dirs"]

_HERE = Path(__file__).resolve()


def checkout(module_file: Path = _HERE) -> Path | None:
    """The checkout holding this package (``<root>/runtime/pdfleet_runtime``), None for an installed copy."""
    root = module_file.parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "runtime").is_dir() else None


def git_dirs(root: Path) -> tuple[Path, ...]:
    """The git directory of ``root`` and, for a worktree, the common one its refs live in (often outside
    the checkout); empty when ``root`` is not in git."""
    dot = root / ".git"
    try:
        if dot.is_dir():
            gitdir = dot
        elif dot.is_file():
            text = dot.read_text().strip()
            if not text.startswith("gitdir:"):
                return ()
            gitdir = Path(text.removeprefix("gitdir:").strip())
            gitdir = gitdir if gitdir.is_absolute() else (root / gitdir).resolve()
        else:
            return ()
        common_file = gitdir / "commondir"
        if not common_file.is_file():
            return (gitdir,)
        common = Path(common_file.read_text().strip())
        return (gitdir, common if common.is_absolute() else (gitdir / common).resolve())
    except OSError:
        return ()


def commit(root: Path) -> str | None:
    """HEAD's commit id, read from the files (a loose ref, packed-refs, or a detached HEAD); None if unreadable."""
    dirs = git_dirs(root)
    if not dirs:
        return None
    try:
        head = (dirs[0] / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.removeprefix("ref:").strip()
        for d in dirs:
            if (d / ref).is_file():
                return (d / ref).read_text().strip() or None
        packed = dirs[-1] / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
    except OSError:
        return None
    return None


def describe(version: str) -> str:
    """``0.1.0 (checkout /path at 1a2b3c4d5e6f)``, or the version alone for an installed copy."""
    root = checkout()
    if root is None:
        return version
    sha = commit(root)
    return f"{version} (checkout {root} at {sha[:12] if sha else 'an unknown commit'})"
