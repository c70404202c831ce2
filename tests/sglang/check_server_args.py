"""SGLang's own verdict on rendered engine commands; runs in the SGLang venv (scripts/sglang-venv.sh).

    python check_server_args.py CASES.json RESULTS.json

Each case is ``{"id", "argv", "env"}``: the argv after ``python3 -m sglang.launch_server`` and the
engine container's environment. SGLang is imported once here; every case runs in a forked child (its
start-up hooks change ``os.environ`` and module state) with exactly the case's environment, through
``prepare_server_args(argv)``, ``ServerArgs.resolve_once()`` and ``check_server_args()`` (the next step
of ``Engine``'s launch, before any GPU work) inside SGLang's test hook
``override_platform`` (an SM90 CUDA machine). The caller runs this under a private mount namespace whose
``/sys/class`` is a tmpfs holding ``infiniband/<device>`` entries (SGLang's IB check reads it).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import sys
import time
import traceback

PLATFORM = {"is_cuda": True, "is_sm90": True, "device_sm": 90, "device_capability": (9, 0), "has_flashinfer": False}
CASE_TIMEOUT_S = 120


def _child(case: dict, w: int) -> None:
    signal.alarm(CASE_TIMEOUT_S)
    out = io.StringIO()
    result: dict
    try:
        os.environ.clear()
        os.environ.update(case["env"])
        sys.stdout = sys.stderr = out
        import logging

        logging.disable(logging.CRITICAL)
        from sglang.srt.runtime_context import override_platform
        from sglang.srt.server_args import prepare_server_args

        with override_platform(**PLATFORM):
            args = prepare_server_args(list(case["argv"]))
            args.resolve_once()
            args.check_server_args()  # what Engine runs next at launch, before any GPU work
        result = {"ok": True}
    except SystemExit as exc:  # argparse: unknown flag or bad value
        errors = [line for line in out.getvalue().splitlines() if ": error: " in line]
        result = {"ok": False, "type": "SystemExit",
                  "message": f"exit {exc.code}: {errors[-1] if errors else out.getvalue()[-500:]}"}
    except BaseException as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)
                      if "sglang" in f.filename), "")
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc)[:2000], "where": where}
    if case.get("report_modules"):
        result["modules"] = sorted(set(sys.modules) - _PARENT_MODULES)
    os.write(w, json.dumps(result).encode())
    os._exit(0)


_PARENT_MODULES: set[str] = set()


def warm_up(cases: list[dict]) -> int:
    """Import in the parent what a case imports lazily (SGLang's hooks import as they go), so each
    child starts warm: one probe child per model directory reports the modules it loaded."""
    import importlib

    _PARENT_MODULES.update(sys.modules)
    probes = {}
    for case in cases:
        model = case["argv"][case["argv"].index("--model-path") + 1]
        probes.setdefault(model, {**case, "report_modules": True})
    loaded = 0
    for probe in probes.values():
        for name in run_case(probe).get("modules", ()):
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
                loaded += 1
            except Exception:  # a module that imports only in a child's state: the child imports it
                pass
    return loaded


def run_case(case: dict) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(case, w)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + CASE_TIMEOUT_S + 10
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 1.0)
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"ok": False, "type": "ChildDied", "message": f"wait status {status}"}
    return json.loads(b"".join(chunks))


def main(cases_file: str, results_file: str) -> int:
    t0 = time.monotonic()
    import sglang
    import sglang.srt.server_args  # the ~20 s import, once, before forking

    with open(cases_file) as f:
        cases = json.load(f)
    warm_up(cases)
    imported = time.monotonic() - t0
    results = {}
    for case in cases:
        results[case["id"]] = run_case(case)
    with open(results_file, "w") as f:
        json.dump({"sglang": sglang.__version__, "import_s": round(imported, 1),
                   "cases_s": round(time.monotonic() - t0 - imported, 1), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
