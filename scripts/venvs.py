#!/usr/bin/env python3
"""The project's Python environments, cached and built once (``pdfleet_operator.cachedbuild``).

    python3 scripts/venvs.py deps                 the shared venv of third-party packages; prints its path
    python3 scripts/venvs.py checkout --deps DIR  this checkout's layer over DIR; prints its path
    python3 scripts/venvs.py sglang               the SGLang check venv (tests/sglang); prints its path
    python3 scripts/venvs.py vllm                 the vLLM check venv (tests/vllm); prints its path
    python3 scripts/venvs.py grafana              grafanalib, which builds the dashboard JSON; prints its path

Two levels, so heavy packages are shared and code never is (docs/local-cluster.md, "Whose code runs"):

- ``$PDFLEET_CACHE/venv-<key>``: every pinned third-party package of pyproject.toml (torch, the
  engines, the router, the dev tools), and nothing of pdfleet; keyed by the pins, shared by every
  checkout on the machine (5-6 GB). A venv of the older layout (the project installed editable into
  it, pointing at whichever checkout set up last) is migrated: that install is removed.
- ``$PDFLEET_CACHE/checkouts/<name>-<key>``: a venv of a few kilobytes per checkout, keyed by the
  checkout's real path: its ``.pth`` puts the checkout's ``operator/`` and ``runtime/`` first on
  ``sys.path``, then adds the shared venv's site-packages; its ``bin/`` holds ``pdfleet``,
  ``pdfleet-operator``, ``pdfleet-runtime`` and a copy of every Python script of the shared venv
  (pytest, lint-imports, kopf, ...) run by this layer's interpreter. Whatever runs from it imports
  this checkout's code, wherever the checkout lives (a path with a space too).

Stdlib only: it runs with the machine's ``python3`` before any venv exists. ``PDFLEET_PINS_FILE``
names a requirements file used instead of pyproject.toml's pins (the set-up tests' small stand-in set).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))
from pdfleet_operator.cachedbuild import BuildError, ensure_built, locked, run_logged, say  # noqa: E402

LAYER_REV = "1"
"""Bump when the layer's recipe changes, so every checkout's layer is made again."""
TAG = "setup"
SKIP_SCRIPTS = re.compile(r"^(python[\d.]*|pip[\d.]*|activate.*|Activate\.ps1|deactivate)$")

# Run by the shared venv's interpreter after pip: every installed distribution's files are there
# (pip killed half-way, or failing as in issue 38, leaves some missing).
_CHECK_FILES = r"""
import importlib.metadata as md, pathlib, sys
bad = []
for dist in md.distributions():
    missing = [f for f in dist.files or () if not pathlib.Path(dist.locate_file(f)).exists()]
    if missing:
        bad.append(f"{dist.metadata['Name']}: {len(missing)} files missing, e.g. {missing[0]}")
if bad:
    sys.exit("incomplete install: " + "; ".join(bad[:5]))
"""

# Run by a checkout's layer: its code is this checkout's, and the shared packages are reachable.
_CHECK_LAYER = r"""
import pathlib, sys
repo, deps_site = pathlib.Path(sys.argv[1]), sys.argv[2]
import pdfleet_operator, pdfleet_runtime
for mod in (pdfleet_operator, pdfleet_runtime):
    where = pathlib.Path(mod.__file__).resolve()
    if repo not in where.parents:
        sys.exit(f"{mod.__name__} resolves to {where}, not under {repo}")
if deps_site not in sys.path:
    sys.exit(f"the shared site-packages {deps_site} is not on sys.path: {sys.path}")
"""


def cache_root() -> Path:
    """``$PDFLEET_CACHE``, else ``$XDG_CACHE_HOME/pdfleet``, else ``~/.cache/pdfleet`` (as toolchain.cache_root)."""
    if os.environ.get("PDFLEET_CACHE"):
        return Path(os.environ["PDFLEET_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "pdfleet" if xdg else Path.home() / ".cache" / "pdfleet"


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:12]


# ---- the shared venv ------------------------------------------------------------------------------
def pins() -> tuple[list[str], str]:
    """(the requirements, the venv's key). The key is the one the earlier layout used, so a machine's
    existing venv is found and migrated rather than built again."""
    standin = os.environ.get("PDFLEET_PINS_FILE")
    if standin:
        reqs = sorted(ln.split("#")[0].strip() for ln in Path(standin).read_text().splitlines()
                      if ln.split("#")[0].strip())
        return reqs, _sha("\n".join(reqs))
    p = _project()
    reqs = sorted(p["dependencies"]) + sorted(d for v in p["optional-dependencies"].values() for d in v)
    return reqs, _sha("\n".join(reqs))


def _pip(venv: Path, log: Path, *args: str) -> None:
    run_logged([venv / "bin" / "python", "-m", "pip", "install", "-q", "--progress-bar", "off",
                "--disable-pip-version-check", *args], log, f"pip install {' '.join(args)}")


def ensure_deps() -> Path:
    reqs, key = pins()
    venv = cache_root() / f"venv-{key}"
    log = cache_root() / "logs" / f"venv-{key}.log"

    def build(path: Path) -> None:
        say(TAG, f"  pip install of {len(reqs)} pinned packages (torch is a large wheel: minutes on a cold pip "
                 f"cache); log {log}")
        run_logged([sys.executable, "-m", "venv", path], log, "python -m venv")
        (path / "requirements.txt").write_text("\n".join(reqs) + "\n")
        _pip(path, log, "-r", str(path / "requirements.txt"))

    def check(path: Path) -> None:
        run_logged([path / "bin" / "python", "-c", _CHECK_FILES], log, "check the installed files")

    ensure_built(venv, f"the shared venv venv-{key}", build, check=check, tag=TAG)
    _migrate(venv)
    return venv


def _migrate(venv: Path) -> None:
    """The earlier layout installed the project editable into this venv (pointing at the checkout that
    set up last); each checkout has its own layer now, so that install goes (under the venv's lock)."""
    if not list(venv.glob("lib/python*/site-packages/pdfleet-*.dist-info")):
        return
    real = venv.resolve()
    with locked(real.with_name(real.name + ".lock"), f"the shared venv {venv.name}", TAG):
        if list(venv.glob("lib/python*/site-packages/pdfleet-*.dist-info")):
            say(TAG, f"{venv.name}: removing the editable install of pdfleet it held (the earlier layout: one "
                     "checkout's code for all); each checkout now runs from its own layer")
            run_logged([venv / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q", "pdfleet"],
                       cache_root() / "logs" / f"{venv.name}.log", "pip uninstall pdfleet")


# ---- a checkout's layer ---------------------------------------------------------------------------
def _site(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def _shebang(python: Path) -> str:
    """``#!python``, or pip's /bin/sh trampoline where the path has a space (a shebang cannot)."""
    p = str(python)
    if len(p) < 120 and not re.search(r"\s", p):
        return f"#!{p}\n"
    return f"#!/bin/sh\n'''exec' {shlex.quote(p)} \"$0\" \"$@\"\n' '''\n"


def _script_body(path: Path, deps: Path) -> str | None:
    """A Python console script of the shared venv, less its interpreter line(s); None for anything else."""
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError):
        return None  # a binary (ruff) runs as it is from the shared venv's bin
    lines = text.splitlines(keepends=True)
    bindir = str(deps / "bin")
    if lines and lines[0].startswith("#!") and bindir in lines[0] and "python" in lines[0]:
        return "".join(lines[1:])
    if len(lines) > 2 and lines[0] == "#!/bin/sh\n" and lines[1].startswith("'''exec'") and bindir in lines[1]:
        end = next((i for i, ln in enumerate(lines) if ln == "' '''\n"), None)
        return "".join(lines[end + 1:]) if end is not None else None
    return None


def ensure_checkout(deps: Path) -> Path:
    repo = REPO
    if "\n" in str(repo):
        raise BuildError(f"the checkout's path {str(repo)!r} holds a newline: move it (a .pth line cannot)")
    scripts = _project().get("scripts", {})
    key = _sha(json.dumps([str(repo), str(deps.resolve()), scripts, LAYER_REV]))
    name = re.sub(r"[^A-Za-z0-9._-]", "_", repo.name)[:40]
    layer = cache_root() / "checkouts" / f"{name}-{key}"
    log = cache_root() / "logs" / f"checkout-{name}-{key}.log"

    def build(path: Path) -> None:
        run_logged([deps / "bin" / "python", "-m", "venv", "--without-pip", path], log, "python -m venv")
        site, deps_site = Path(_site(path / "bin" / "python")), _site(deps / "bin" / "python")
        # Path lines are added in order: the checkout first, so nothing in the shared venv can shadow it.
        (site / "_pdfleet_checkout.pth").write_text(
            f"{repo / 'operator'}\n{repo / 'runtime'}\nimport site; site.addsitedir({deps_site!r})\n")
        bang = _shebang(path / "bin" / "python")
        for entry in sorted((deps / "bin").iterdir()):
            if SKIP_SCRIPTS.match(entry.name) or entry.name in scripts or not entry.is_file():
                continue
            body = _script_body(entry, deps)
            if body is not None:
                _write_script(path / "bin" / entry.name, bang + body)
        for script, target in scripts.items():
            module, _, func = target.partition(":")
            _write_script(path / "bin" / script, f"{bang}import sys\nfrom {module} import {func}\n\n"
                                                  f"if __name__ == \"__main__\":\n    sys.exit({func}())\n")
        (path / "checkout.json").write_text(json.dumps({"checkout": str(repo), "deps": str(deps)}, indent=1) + "\n")

    def check(path: Path) -> None:
        run_logged([path / "bin" / "python", "-c", _CHECK_LAYER, repo, _site(deps / "bin" / "python")], log,
                   "check the layer")

    return ensure_built(layer, f"the layer of checkout {repo}", build, check=check, tag=TAG)


def _write_script(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)


# ---- the engines' check venvs ---------------------------------------------------------------------
def _python311(why: str) -> tuple[str, bytes]:
    """python3.11 and its ``sys.version_info[:2]`` line (part of the check venvs' keys)."""
    py = shutil.which("python3.11") or sys.executable
    version = subprocess.run([py, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    if version.strip() != "(3, 11)":
        raise BuildError(f"{why}: python3.11 is needed (found {version.strip()})")
    return py, version.encode()


def ensure_vllm() -> Path:
    """vLLM 0.33.0 and vllm-router with every dependency pinned (scripts/vllm/requirements.txt), keyed by
    that file and the Python version; a venv of its own (vLLM pins torch 2.14.0, SGLang 2.14.1)."""
    pins_file = REPO / "scripts" / "vllm" / "requirements.txt"
    py, version = _python311("the vLLM pins are resolved for CPython 3.11")
    key = hashlib.sha256(pins_file.read_bytes() + version).hexdigest()[:12]
    venv = cache_root() / f"vllm-venv-{key}"
    log = cache_root() / "logs" / f"vllm-venv-{key}.log"

    def build(path: Path) -> None:
        say(TAG, f"  pip install of vLLM's pins (vllm==0.33.0: about 5 minutes, 4.6 GB of downloads and a 9.5 GB "
                 f"venv on a cold pip cache); log {log}")
        run_logged([py, "-m", "venv", path], log, "python -m venv")
        # with its dependencies: pip checks that the pinned set is consistent as it installs it
        _pip(path, log, "-r", str(pins_file))

    def check(path: Path) -> None:
        run_logged([path / "bin" / "python", "-c", _CHECK_FILES], log, "check the installed files")

    return ensure_built(venv, f"the vLLM check venv vllm-venv-{key}", build, check=check, tag="vllm-venv")


def ensure_sglang() -> Path:
    """SGLang and what its parser and start-up hooks need on a CPU machine, keyed by the pins in
    scripts/sglang/ and the Python version (the key the earlier sglang-venv.sh used)."""
    pins_dir = REPO / "scripts" / "sglang"
    py, version = _python311("SGLang 0.5.23 ships a cp311 wheel only")
    key = hashlib.sha256((pins_dir / "requirements.txt").read_bytes() + (pins_dir / "engine.txt").read_bytes()
                         + version).hexdigest()[:12]
    venv = cache_root() / f"sglang-venv-{key}"
    log = cache_root() / "logs" / f"sglang-venv-{key}.log"

    def build(path: Path) -> None:
        say(TAG, f"  pip install of SGLang's pins (torch is a large wheel: minutes on a cold pip cache); log {log}")
        run_logged([py, "-m", "venv", path], log, "python -m venv")
        _pip(path, log, "-r", str(pins_dir / "requirements.txt"))
        _pip(path, log, "--no-deps", "-r", str(pins_dir / "engine.txt"))

    def check(path: Path) -> None:
        run_logged([path / "bin" / "python", "-c", _CHECK_FILES], log, "check the installed files")

    return ensure_built(venv, f"the SGLang check venv sglang-venv-{key}", build, check=check, tag="sglang-venv")


def ensure_grafana() -> Path:
    """grafanalib (scripts/grafana/requirements.txt), keyed by that file and the Python version: it builds the
    committed dashboard JSON (scripts/grafana/dashboard.py), a few hundred kilobytes, kept out of the shared venv's pins."""
    pins_file = REPO / "scripts" / "grafana" / "requirements.txt"
    py = sys.executable
    version = subprocess.run([py, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             check=True, timeout=60).stdout
    key = hashlib.sha256(pins_file.read_bytes() + version).hexdigest()[:12]
    venv = cache_root() / f"grafana-venv-{key}"
    log = cache_root() / "logs" / f"grafana-venv-{key}.log"

    def build(path: Path) -> None:
        say(TAG, f"  pip install of grafanalib's pins; log {log}")
        run_logged([py, "-m", "venv", path], log, "python -m venv")
        _pip(path, log, "-r", str(pins_file))

    def check(path: Path) -> None:
        run_logged([path / "bin" / "python", "-c", "import grafanalib.core"], log, "import grafanalib")

    return ensure_built(venv, f"the grafanalib venv grafana-venv-{key}", build, check=check, tag="grafana-venv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("deps", help="the shared venv of third-party packages")
    co = sub.add_parser("checkout", help="this checkout's layer over the shared venv")
    co.add_argument("--deps", type=Path, required=True, help="the shared venv (what `deps` printed)")
    sub.add_parser("sglang", help="the SGLang check venv")
    sub.add_parser("vllm", help="the vLLM check venv")
    sub.add_parser("grafana", help="grafanalib's venv (the dashboard generator)")
    args = parser.parse_args(argv)
    try:
        if args.what == "deps":
            path = ensure_deps()
        elif args.what == "checkout":
            path = ensure_checkout(args.deps)
        elif args.what == "vllm":
            path = ensure_vllm()
        elif args.what == "grafana":
            path = ensure_grafana()
        else:
            path = ensure_sglang()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
