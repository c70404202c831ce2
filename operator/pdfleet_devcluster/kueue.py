"""Kueue built from Go modules, on demand only: pinned, cached and locked as the toolchain is.

``sigs.k8s.io/kueue`` v0.17.0 is served by the Go module proxy and its go.mod has no ``replace`` lines, so
it builds inside a small wrapper module (``go 1.25``: no newer toolchain is fetched). Two binaries land in
``cache_root()/kueue/<version>-<key>/bin``:

* ``kueue``: Kueue's manager (``sigs.k8s.io/kueue/cmd/kueue``), for a local cluster that runs Kueue;
* ``config/``: Kueue's CRDs (``bases/``) and webhook configurations (``manifests.yaml``) from the module, which
  ``kueue_run`` applies to a local cluster before it starts the manager;
* ``kueue-podcheck``: reads Pods (a JSON list on stdin) and answers, per pod, what Kueue's own code makes
  of it: its pod webhook's create validation, the queue, group name, total count and serving flag read
  through Kueue's constants, and the role hash that sorts a group's pods into Kueue pod sets. The tests
  check the operator's rendering with it (tests/unit/operator/test_gang_kueue.py) without running Kueue.

Nothing builds it unless asked: ``ensure_kueue()``, ``python -m pdfleet_devcluster.kueue``, or those tests
with ``PDFLEET_BUILD_KUEUE=1``. ``pdfleet dev build`` (the CI set-up) never does: about 400 MB of modules
and 11.5 minutes of compiling on 2 busy cores, cold (measured 2026-12-05).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdfleet_devcluster.toolchain import cache_root, go_env
from pdfleet_operator.cachedbuild import BuildError, ensure_built, is_complete, run_logged, say

__all__ = ["CONFIG_FILES", "KUEUE_PINS", "KueuePins", "ensure_kueue", "kueue_dir", "podcheck"]

MODULE = "sigs.k8s.io/kueue"


@dataclass(frozen=True)
class KueuePins:
    version: str = "v0.17.0"
    go: str = "1.25.0"  # Kueue v0.17.0's go.mod asks for 1.25: the local Go (1.26) builds it as it is

    def key(self) -> str:
        text = json.dumps(self.__dict__, sort_keys=True) + _PODCHECK + BUILD_REV
        return hashlib.sha256(text.encode()).hexdigest()[:12]


KUEUE_PINS = KueuePins()
BUILD_REV = "2"  # bump when the recipe changes: 2 keeps Kueue's CRDs and webhook manifests beside the binaries
# Kept from the module (the Go module zip holds Kueue's config/): what kueue_run applies to a local cluster.
CONFIG_FILES = ("config/components/crd/bases", "config/components/webhook/manifests.yaml")

# What the check program does is read Kueue's own names and run its own validation: nothing is restated here.
_PODCHECK = """package main

import (
\t"context"
\t"encoding/json"
\t"fmt"
\t"os"

\tcorev1 "k8s.io/api/core/v1"

\tctrlconstants "sigs.k8s.io/kueue/pkg/controller/constants"
\t"sigs.k8s.io/kueue/pkg/controller/jobs/pod"
\tpodconstants "sigs.k8s.io/kueue/pkg/controller/jobs/pod/constants"
\tutilpod "sigs.k8s.io/kueue/pkg/util/pod"
)

type answer struct {
\tName       string `json:"name"`
\tError      string `json:"error"`
\tQueue      string `json:"queue"`
\tGroup      string `json:"group"`
\tTotalCount string `json:"totalCount"`
\tServing    bool   `json:"serving"`
\tRoleHash   string `json:"roleHash"`
\tGate       string `json:"gate"`
}

func main() {
\tvar pods []corev1.Pod
\tif err := json.NewDecoder(os.Stdin).Decode(&pods); err != nil {
\t\tfmt.Fprintln(os.Stderr, "reading pods:", err)
\t\tos.Exit(2)
\t}
\tout := make([]answer, 0, len(pods))
\tfor i := range pods {
\t\tp := &pods[i]
\t\ta := answer{
\t\t\tName:       p.Name,
\t\t\tQueue:      p.Labels[ctrlconstants.QueueLabel],
\t\t\tGroup:      p.Labels[podconstants.GroupNameLabel],
\t\t\tTotalCount: p.Annotations[podconstants.GroupTotalCountAnnotation],
\t\t\tServing:    p.Annotations[podconstants.GroupServingAnnotationKey] == podconstants.GroupServingAnnotationValue,
\t\t\tGate:       podconstants.SchedulingGateName,
\t\t}
\t\tif _, err := (&pod.PodWebhook{}).ValidateCreate(context.Background(), p); err != nil {
\t\t\ta.Error = err.Error()
\t\t}
\t\thash, err := utilpod.GenerateRoleHash(&p.Spec)
\t\tif err != nil {
\t\t\ta.Error = err.Error()
\t\t}
\t\ta.RoleHash = hash
\t\tout = append(out, a)
\t}
\tif err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
\t\tos.Exit(2)
\t}
}
"""


def kueue_dir(pins: KueuePins = KUEUE_PINS) -> Path:
    return cache_root() / "kueue" / f"{pins.version}-{pins.key()}"


def _build(pins: KueuePins, top: Path) -> None:
    work, out, log = top / "work", top / "bin", top / "build.log"
    (work / "podcheck").mkdir(parents=True, exist_ok=True)
    out.mkdir(exist_ok=True)
    (work / "go.mod").write_text(f"module pdfleet.local/kueue\n\ngo {pins.go}\n")
    (work / "podcheck" / "main.go").write_text(_PODCHECK)
    env = go_env()
    for step, cmd in (
        ("resolve kueue", ["go", "get", f"{MODULE}@{pins.version}"]),
        ("tidy", ["go", "mod", "tidy"]),
        # the manager's own dependencies (tidy keeps only the check program's)
        ("resolve the manager", ["go", "get", f"{MODULE}/cmd/kueue@{pins.version}"]),
    ):
        start = time.monotonic()
        run_logged(cmd, log, step, env=env, cwd=work)
        say("kueue", f"  {step}: {time.monotonic() - start:.0f}s")
    source = Path(json.loads(run_logged(["go", "mod", "download", "-json", f"{MODULE}@{pins.version}"], log,
                                        "locate the module", env=env, cwd=work))["Dir"])
    for rel in CONFIG_FILES:
        dest = top / "config" / Path(rel).name
        if (source / rel).is_dir():
            shutil.copytree(source / rel, dest, dirs_exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / rel, dest)
        for p in [dest, *dest.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)  # the module cache is read-only
    start = time.monotonic()
    run_logged(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "kueue"), f"{MODULE}/cmd/kueue"],
               log, "build kueue", env=env, cwd=work)
    run_logged(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "kueue-podcheck"), "./podcheck"],
               log, "build kueue-podcheck", env=env, cwd=work)
    say("kueue", f"  compile: {time.monotonic() - start:.0f}s")


def _check(top: Path) -> None:
    proc = subprocess.run([str(top / "bin" / "kueue-podcheck")], input="[]", capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0 or proc.stdout.strip() != "[]":
        raise BuildError(f"kueue-podcheck does not run: {proc.stderr.strip() or proc.stdout.strip()}")


def ensure_kueue(pins: KueuePins = KUEUE_PINS) -> Path:
    """Build Kueue's manager and the pod check once (minutes, cold); return their bin directory."""
    top = kueue_dir(pins)
    if is_complete(top):
        return top / "bin"
    if shutil.which("go") is None:
        raise BuildError("the `go` command is not on PATH; install Go >= 1.25")
    ensure_built(top, f"Kueue {pins.version}", lambda p: _build(pins, p), check=_check, tag="kueue")
    return top / "bin"


def podcheck(pods: list[dict], pins: KueuePins = KUEUE_PINS) -> list[dict]:
    """What Kueue's code makes of ``pods`` (see the module docstring); the binary must be built."""
    binary = kueue_dir(pins) / "bin" / "kueue-podcheck"
    proc = subprocess.run([str(binary)], input=json.dumps(pods), capture_output=True, text=True, timeout=120,
                          check=True)
    answers: list[dict] = json.loads(proc.stdout)
    return answers


def main() -> int:
    try:
        print(ensure_kueue())
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
