"""The set-up's cached builds (scripts/venvs.py over pdfleet_operator.cachedbuild), with a small stand-in
pin set (one local wheel, ``PDFLEET_PINS_FILE``) under a temporary cache, so they stay quick and need no
network (pip installs from a directory, ``--no-index``):

- a set-up killed half-way (SIGKILL, its pip child with it), then run again, ends with a working venv:
  the incomplete directory is found, removed and built again;
- two set-ups started at once on an empty cache both end with the same, working venv, built once;
- a build that fails is printed and tried once more; two failures raise, naming the log; the marker is
  written only at the end;
- a checkout's layer imports that checkout's code, from a path with a space too, with the shared
  venv's packages reachable, and its console scripts name the checkout;
- a venv of the earlier layout (the project installed editable into it) is migrated in place.
"""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from pdfleet_operator.cachedbuild import COMPLETE, BuildError, ensure_built
from tests.helpers import wait_until

pytestmark = pytest.mark.slow  # each builds a small venv (python -m venv with pip: seconds)

REPO = Path(__file__).resolve().parents[2]
VENVS = REPO / "scripts" / "venvs.py"
FILLER_MODULES = 1500  # enough files that pip takes a moment to install them: a window to kill it in
PY = sys.executable


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(where: Path, name: str = "standin_pin", version: str = "1.0", files: dict[str, bytes] | None = None,
               entry_points: str = "") -> Path:
    """A pure-Python wheel written by hand (what a stand-in pin installs): ``import standin_pin`` gives VALUE."""
    if files is None:
        files = {f"{name}/__init__.py": b"VALUE = 'from the stand-in pin'\n"}
        files |= {f"{name}/filler_{i}.py": f"X = {i}\n".encode() for i in range(FILLER_MODULES)}
    info = f"{name}-{version}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points.encode()
    record = [_record_line(k, v) for k, v in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("wheels")
    make_wheel(d)
    (d / "pins.txt").write_text("standin_pin==1.0\n")
    return d


def env_for(cache: Path, wheels: Path) -> dict[str, str]:
    return {**os.environ, "PDFLEET_CACHE": str(cache), "PDFLEET_PINS_FILE": str(wheels / "pins.txt"),
            "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_NO_CACHE_DIR": "1"}


def venvs(*args: str, env: dict[str, str], script: Path = VENVS) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, str(script), *args], env=env, capture_output=True, text=True, timeout=300)


def works(deps: Path) -> bool:
    out = subprocess.run([str(deps / "bin" / "python"), "-c", "import standin_pin; print(standin_pin.VALUE)"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() == "from the stand-in pin"


def deps_dirs(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("venv-*") if p.is_dir())


def test_a_setup_killed_half_way_then_run_again_ends_with_a_working_venv(tmp_path: Path, wheels: Path) -> None:
    cache = tmp_path / "cache"
    env = env_for(cache, wheels)
    proc = subprocess.Popen([PY, str(VENVS), "deps"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Half-way: the venv exists (pip is installing into it) and is not complete.
    wait_until(lambda: any((d / "pyvenv.cfg").exists() for d in deps_dirs(cache)), timeout=120,
               what="the venv being built")
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up of its own; its pip child dies with it (PDEATHSIG)
    proc.communicate(timeout=30)
    (venv,) = deps_dirs(cache)
    assert not (venv / COMPLETE).exists(), "the build finished before it was killed: not half-way"
    wait_until(lambda: not _writers(venv), timeout=30, what="no process left writing the killed venv")

    again = venvs("deps", env=env)
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip()) == venv
    assert "removing" in again.stderr and "incomplete" in again.stderr, again.stderr
    assert (venv / COMPLETE).exists() and works(venv)
    assert "built the shared venv" in again.stderr and " in " in again.stderr  # what it did and how long it took
    # A third run trusts the marker: nothing is built again.
    third = venvs("deps", env=env)
    assert third.returncode == 0 and "building" not in third.stderr, third.stderr


def _writers(venv: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(venv)], capture_output=True, text=True)
    return [ln for ln in out.stdout.splitlines() if "pgrep" not in ln]


def test_two_setups_at_once_on_an_empty_cache_both_end_with_one_working_venv(tmp_path: Path, wheels: Path) -> None:
    cache = tmp_path / "cache"
    env = env_for(cache, wheels)
    script = f"set -e; d=$({PY} {VENVS} deps); {PY} {VENVS} checkout --deps \"$d\""
    procs = [subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]  # the same layer
    (venv,) = deps_dirs(cache)
    assert (venv / COMPLETE).exists() and works(venv)
    log = (cache / "logs" / f"{venv.name}.log").read_text()
    assert log.count("-m venv") == 1, log  # built once: the other waited for its lock
    assert any("waiting for" in err or "finished by the other set-up" in err for _, err in outs), outs
    layer = Path(outs[0][0].strip())
    out = subprocess.run([str(layer / "bin" / "python"), "-c", "import standin_pin, pdfleet_runtime; "
                          "print(standin_pin.VALUE, pdfleet_runtime.__file__)"], capture_output=True, text=True)
    assert out.stdout.split(" ", 4)[-1].strip() == str(REPO / "runtime" / "pdfleet_runtime" / "__init__.py"), out


def test_a_failed_build_is_printed_and_tried_once_more(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def flaky(path: Path) -> None:
        calls.append(path)
        (path / "half").write_text("x")
        if len(calls) == 1:
            raise BuildError("pip stopped: AssertionError (the first attempt)")
        assert not (path / COMPLETE).exists()  # never marked before the build's end
        (path / "done").write_text("y")

    out = ensure_built(tmp_path / "thing", "a thing", flaky)
    assert len(calls) == 2 and (out / COMPLETE).exists() and (out / "done").exists()
    err = capsys.readouterr().err
    assert "attempt 1 of 2 failed" in err and "AssertionError (the first attempt)" in err
    assert "removing" in err  # the failed attempt's leftovers went before the second

    def broken(path: Path) -> None:
        raise BuildError("no network")

    with pytest.raises(BuildError, match=r"2 attempts failed.*no network"):
        ensure_built(tmp_path / "other", "another thing", broken)
    assert not (tmp_path / "other" / COMPLETE).exists()


def test_concurrent_builds_in_one_process_build_once(tmp_path: Path) -> None:
    """Two threads: flock is per open file, so the second waits for the first even within a process."""
    calls = []

    def slow(path: Path) -> None:
        calls.append(path)
        time.sleep(1.0)

    threads = [threading.Thread(target=ensure_built, args=(tmp_path / "x", "x", slow)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1 and (tmp_path / "x" / COMPLETE).exists()


def test_a_layer_runs_its_own_checkout_from_a_path_with_a_space(tmp_path: Path, wheels: Path) -> None:
    """A copy of the checkout under a directory with a space: its layer's scripts (a /bin/sh trampoline: a
    shebang cannot hold a space) import that copy's code, not this checkout's."""
    cache = tmp_path / "a dir with space" / "cache"  # the venvs' paths too: their scripts need the trampoline
    env = env_for(cache, wheels)
    deps = venvs("deps", env=env)
    assert deps.returncode == 0, deps.stderr
    copy = tmp_path / "a dir with space" / "clone"
    subprocess.run(["bash", "-c", f"mkdir -p '{copy}' && git -C {REPO} ls-files -z -co --exclude-standard "
                    f"| (cd {REPO} && xargs -0 cp --parents -t '{copy}')"], check=True, timeout=120)
    layer = venvs("checkout", "--deps", deps.stdout.strip(), env=env, script=copy / "scripts" / "venvs.py")
    assert layer.returncode == 0, layer.stderr
    bindir = Path(layer.stdout.strip()) / "bin"
    assert (bindir / "pdfleet-runtime").read_text().startswith("#!/bin/sh\n")  # the trampoline
    version = subprocess.run([str(bindir / "pdfleet-runtime"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and f"checkout {copy}" in version.stdout, version
    out = subprocess.run([str(bindir / "python"), "-c", "import pdfleet_operator, standin_pin; "
                          "print(pdfleet_operator.__file__)"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(copy / "operator" / "pdfleet_operator" / "__init__.py"), out


def test_a_venv_of_the_earlier_layout_is_migrated_in_place(tmp_path: Path, wheels: Path) -> None:
    """The earlier set-up installed the project editable into the one venv (pointing at the checkout that set up
    last). The next set-up keeps the venv (its key is the same) and removes that install: the venv then holds
    third-party packages only, and a layer over it imports its own checkout."""
    cache = tmp_path / "cache"
    env = env_for(cache, wheels)
    first = venvs("deps", env=env)
    assert first.returncode == 0, first.stderr
    venv = Path(first.stdout.strip())
    # What the earlier setup.sh's `pip install -e .` left: pdfleet's dist-info, a .pth naming a checkout's
    # packages, and the console scripts (here as a wheel of those files: no build backend offline).
    other = tmp_path / "other-checkout"
    wheel = make_wheel(tmp_path / "old", "pdfleet", "0.1.0",
                       {"__editable__.pdfleet-0.1.0.pth": f"{other / 'operator'}\n{other / 'runtime'}\n".encode()},
                       "[console_scripts]\npdfleet-runtime = pdfleet_runtime.cli:main\n")
    old = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr
    assert (venv / "bin" / "pdfleet-runtime").exists()
    assert list(venv.glob("lib/python*/site-packages/pdfleet-*.dist-info"))
    again = venvs("deps", env=env)
    assert again.returncode == 0 and Path(again.stdout.strip()) == venv, again.stderr
    assert "removing the editable install of pdfleet" in again.stderr and "building" not in again.stderr, again.stderr
    assert not list(venv.glob("lib/python*/site-packages/pdfleet-*.dist-info"))
    assert not (venv / "bin" / "pdfleet-runtime").exists() and works(venv)
    assert not list(venv.glob("lib/python*/site-packages/__editable__*"))  # nothing of pdfleet in the shared venv
    layer = venvs("checkout", "--deps", str(venv), env=env)
    assert layer.returncode == 0, layer.stderr
