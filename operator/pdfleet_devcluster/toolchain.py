"""Build the local control plane's binaries from Go modules, cached by version.

There is no Docker engine and no release download here, only the Go module
proxy, so every binary (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kube-proxy, kubectl, kwok, helm,
CoreDNS) is compiled from its module, the way
controller-runtime's envtest gets real binaries.  Kubernetes and etcd cannot
be `go install`ed directly (their own `replace => ./staging` lines are ignored
when they are a dependency), so each is built inside a small generated wrapper
module that replaces every staging module by its published version.

Everything lands under ``cache_root()/toolchain/<key>/`` (outside git); the
Go module and build caches live beside it so a second run takes seconds and
deleting the cache root gives a truly cold build. The directory is built as every cached build is
(``cachedbuild.ensure_built``): under its lock, marked complete at the end, a failed attempt printed and
tried once more. A directory found incomplete keeps each binary that runs and reports its version (a
build killed while writing one leaves a binary that does not); the rest is built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdfleet_operator.cachedbuild import BuildError, die_with_parent, ensure_built, is_complete

__all__ = [
    "PINS",
    "Pins",
    "ToolchainError",
    "binary",
    "cache_root",
    "ensure_toolchain",
    "go_env",
    "toolchain_dir",
]

MODULE_PATH = "k8s.io/kubernetes"


class ToolchainError(BuildError):
    """A step of the build failed; the message names the step and the log file."""


@dataclass(frozen=True)
class Pins:
    """Versions built together.  Each go.mod's `go` line must be <= the local Go."""

    kubernetes: str = "v1.36.3"
    etcd: str = "v3.6.16"
    kwok: str = "v0.8.0"
    helm: str = "v3.22.0"
    coredns: str = "v1.15.0"
    # Built only for the Kubernetes release: one apiserver, one kubectl.
    kube_cmds: tuple[str, ...] = field(
        default=("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kube-proxy")
    )

    @property
    def staging(self) -> str:
        """Staging modules are published as v0.<minor>.<patch> of the release."""
        return "v0" + self.kubernetes[2:]

    def key(self) -> str:
        text = json.dumps(self.__dict__, sort_keys=True, default=list) + SCRIPT_REV
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# Bump when the build recipe changes so old outputs are not reused.
SCRIPT_REV = "1"
PINS = Pins()
# CoreDNS with only the plugins the cluster's Corefile uses (the full build pulls every cloud SDK):
# the plugin chain order is CoreDNS's own (core/dnsserver/zdirectives.go), restricted to these.
COREDNS_PLUGINS = ("errors", "log", "health", "ready", "loop", "kubernetes", "cache")
_COREDNS_MAIN = """package main

import (
\t"github.com/coredns/coredns/core/dnsserver"
\t"github.com/coredns/coredns/coremain"
{imports}
)

func init() {{ dnsserver.Directives = []string{{{directives}}} }}

func main() {{ coremain.Run() }}
"""


def cache_root() -> Path:
    """``$PDFLEET_CACHE``, else ``$XDG_CACHE_HOME/pdfleet``, else ``~/.cache/pdfleet``."""
    env = os.environ.get("PDFLEET_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "pdfleet" if xdg else Path.home() / ".cache" / "pdfleet"


def toolchain_dir(pins: Pins = PINS) -> Path:
    return cache_root() / "toolchain" / f"k8s-{pins.kubernetes}-{pins.key()}"


def binary(name: str, pins: Pins = PINS) -> Path:
    """Path of a built binary (it may not exist yet: call ensure_toolchain)."""
    return toolchain_dir(pins) / "bin" / name


def go_env() -> dict[str, str]:
    """The environment of every Go build here: the caches under ``cache_root()``, CGO off, the local Go only."""
    root = cache_root() / "go"
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(root / "mod"),
        GOCACHE=str(root / "build"),
        GOPATH=str(root / "path"),
        GOFLAGS="-modcacherw -buildvcs=false",
        GOTOOLCHAIN="local",
        CGO_ENABLED="0",
        GOPROXY=os.environ.get("GOPROXY", "https://proxy.golang.org,direct"),
    )
    return env


def _log(msg: str) -> None:
    print(f"[toolchain] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path, logfile: Path, step: str) -> str:
    """Run one go command; on failure raise with the tail of its log."""
    start = time.monotonic()
    with logfile.open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.run(
            cmd, cwd=cwd, env=go_env(), stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=die_with_parent
        )
    if proc.returncode != 0:
        tail = "".join(logfile.read_text().splitlines(keepends=True)[-25:])
        raise ToolchainError(f"{step} failed (exit {proc.returncode}); log {logfile}:\n{tail}")
    _log(f"  {step}: {time.monotonic() - start:.0f}s")
    return proc.stdout


def _staging_replaces(work: Path, pins: Pins, logfile: Path) -> list[str]:
    """Derive the staging module list from the served go.mod, never hard-code it."""
    out = _run(
        ["go", "mod", "download", "-json", f"{MODULE_PATH}@{pins.kubernetes}"],
        work,
        logfile,
        "download k8s.io/kubernetes go.mod",
    )
    gomod = Path(json.loads(out)["GoMod"]).read_text()
    names = re.findall(r"^\s*(?:replace\s+)?(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod, re.M)
    if not names:
        raise ToolchainError("no staging replaces found in k8s.io/kubernetes go.mod")
    return sorted(set(names))


def _godebug(gomod_text: str) -> str:
    m = re.search(r"^godebug\s+(.+)$", gomod_text, re.M)
    return f"godebug {m.group(1).strip()}\n" if m else ""


def _version_ldflags(pins: Pins) -> str:
    major, minor = pins.kubernetes[1:].split(".")[:2]
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={pins.kubernetes}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    return "-s -w " + " ".join(flags)


def _build_kubernetes(pins: Pins, out: Path, logfile: Path) -> None:
    work = out.parent / "work" / "kubernetes"
    work.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text("module pdfleet.local/k8s\n\ngo 1.26.0\n")
    staging = _staging_replaces(work, pins, logfile)
    upstream = Path(
        json.loads(
            _run(
                ["go", "mod", "download", "-json", f"{MODULE_PATH}@{pins.kubernetes}"],
                work,
                logfile,
                "locate go.mod",
            )
        )["GoMod"]
    ).read_text()
    go_line = re.search(r"^go\s+(\S+)$", upstream, re.M)
    lines = [
        "module pdfleet.local/k8s\n",
        f"go {go_line.group(1) if go_line else '1.26.0'}\n",
        _godebug(upstream),
        f"require {MODULE_PATH} {pins.kubernetes}\n",
        "replace (\n",
        *[f"\t{name} => {name} {pins.staging}\n" for name in staging],
        ")\n",
    ]
    (work / "go.mod").write_text("\n".join(lines))
    pkgs = [f"{MODULE_PATH}/cmd/{c}" for c in pins.kube_cmds]
    _run(["go", "get", *[f"{p}@{pins.kubernetes}" for p in pkgs]], work, logfile, "resolve modules")
    _log(f"  compiling {', '.join(pins.kube_cmds)} (the long step on a cold cache)")
    _run(
        ["go", "build", "-trimpath", "-ldflags", _version_ldflags(pins), "-o", str(out) + "/", *pkgs],
        work,
        logfile,
        "build kubernetes",
    )


def _build_etcd(pins: Pins, out: Path, logfile: Path) -> None:
    work = out.parent / "work" / "etcd"
    work.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text("module pdfleet.local/etcd\n\ngo 1.26.0\n")
    mod = "go.etcd.io/etcd/server/v3"
    _run(["go", "get", f"{mod}@{pins.etcd}"], work, logfile, "resolve etcd")
    _run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "etcd"), mod], work, logfile, "build etcd")


def _build_coredns(pins: Pins, out: Path, logfile: Path) -> None:
    work = out.parent / "work" / "coredns"
    work.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text("module pdfleet.local/coredns\n\ngo 1.26.0\n")
    imports = "\n".join(f'\t_ "github.com/coredns/coredns/plugin/{p}"' for p in COREDNS_PLUGINS)
    directives = ", ".join(f'"{p}"' for p in COREDNS_PLUGINS)
    (work / "main.go").write_text(_COREDNS_MAIN.format(imports=imports, directives=directives))
    _run(["go", "get", f"github.com/coredns/coredns@{pins.coredns}"], work, logfile, "resolve coredns")
    _run(["go", "mod", "tidy"], work, logfile, "tidy coredns")
    _run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "coredns"), "."], work, logfile,
         "build coredns")


def _install(mod_cmd: str, version: str, out: Path, logfile: Path, step: str) -> None:
    work = out.parent / "work"
    work.mkdir(parents=True, exist_ok=True)
    env_gobin = ["env", f"GOBIN={out}"]
    _run([*env_gobin, "go", "install", "-trimpath", "-ldflags", "-s -w", f"{mod_cmd}@{version}"], work, logfile, step)


def _built(out: Path, names: tuple[str, ...]) -> bool:
    return all((out / n).is_file() and os.access(out / n, os.X_OK) for n in names)


# How each binary reports its version (the rest take --version).
VERSION_ARGS = {"kubectl": ("version", "--client"), "helm": ("version",), "coredns": ("-version",)}


def _runs(path: Path) -> bool:
    """A binary that starts and reports its version: a build killed while writing it left one that does not."""
    try:
        proc = subprocess.run([str(path), *VERSION_ARGS.get(path.name, ("--version",))], capture_output=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _steps(pins: Pins, out: Path, logfile: Path) -> list[tuple[tuple[str, ...], Callable[[], None], str]]:
    return [
        (("etcd",), lambda: _build_etcd(pins, out, logfile), f"etcd {pins.etcd}"),
        (pins.kube_cmds, lambda: _build_kubernetes(pins, out, logfile), f"kubernetes {pins.kubernetes}"),
        (("kwok",), lambda: _install("sigs.k8s.io/kwok/cmd/kwok", pins.kwok, out, logfile, "build kwok"), f"kwok {pins.kwok}"),
        (("helm",), lambda: _install("helm.sh/helm/v3/cmd/helm", pins.helm, out, logfile, "build helm"), f"helm {pins.helm}"),
        (("coredns",), lambda: _build_coredns(pins, out, logfile), f"coredns {pins.coredns}"),
    ]


def _names(pins: Pins) -> tuple[str, ...]:
    return ("etcd", *pins.kube_cmds, "kwok", "helm", "coredns")


def _build_all(pins: Pins, top: Path) -> None:
    """Each step whose binaries do not all run is built (what it left before removed first)."""
    out = top / "bin"
    out.mkdir(parents=True, exist_ok=True)
    logfile = top / "build.log"
    for names, build, label in _steps(pins, out, logfile):
        if all((out / n).is_file() and _runs(out / n) for n in names):
            continue
        for n in names:
            (out / n).unlink(missing_ok=True)
        _log(f"building {label} (log: {logfile})")
        start = time.monotonic()
        build()
        if not _built(out, names):
            raise ToolchainError(f"{label}: build finished but {names} missing in {out}")
        _log(f"built {label} in {time.monotonic() - start:.0f}s")


def ensure_toolchain(pins: Pins = PINS) -> Path:
    """Build whatever is missing; return the bin directory.  Idempotent; safe to call from several
    processes at once (one builds, the others wait for its lock and then use what it built)."""
    top = toolchain_dir(pins)
    out = top / "bin"
    if is_complete(top) and _built(out, _names(pins)):
        return out
    if shutil.which("go") is None:
        raise ToolchainError("the `go` command is not on PATH; install Go >= 1.26")
    total = time.monotonic()
    try:
        ensure_built(top, f"the toolchain k8s-{pins.kubernetes}-{pins.key()}", lambda p: _build_all(pins, p),
                     salvage=True, tag="toolchain")
    except BuildError as exc:
        raise ToolchainError(str(exc)) from exc
    _log(f"toolchain ready in {out} ({time.monotonic() - total:.1f}s)")
    return out


def main() -> int:
    try:
        print(ensure_toolchain())
    except ToolchainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
