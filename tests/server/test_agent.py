"""``pdfleet-runtime agent`` against real ``serve`` processes STANDING IN for SGLang (which needs GPUs):
a prefill and a decode ``serve`` started with ``--stand-in-for sglang==0.5.23`` speak SGLang's PD worker
contract, /server_info and /metrics names, and the agent beside the decode checks them, runs its canary
as SGLang's router sends a request, and drains by the engine's own metrics.

Covers: ready only through the canary (and the reason says so); the version, the served model and the
model's config.json refused with the field named; the drain (decode and prefill agents at once) waits
for the routers' bound and then for every running request and transfer in flight (all of which
succeed); the built-in runtime's /metrics read by the same parser as SGLang's (tests/unit/agent has
SGLang's bodies).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfleet_runtime.agent.engine_info import engine_load
from pdfleet_runtime.agent.model_config import config_for_layout
from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.layouts import resolve_layout
from pdfleet_runtime.lifetime import die_with_parent
from pdfleet_runtime.testing.local import REPO, free_offset, http
from tests.server.harness import LAYOUT, Pod, config

pytestmark = pytest.mark.slow

STAND_IN = ("--stand-in-for", "sglang==0.5.23")
WRITE_DELAY_S = 1.0


class Agent:
    """One agent process on loopback, beside ``engine`` (its own free ports: pods share 127.0.0.1 here)."""

    def __init__(self, tmp: Path, name: str, cfg: RuntimeConfig, engine: Pod, prefill: Pod | None,
                 model: Path, *args: str) -> None:
        off = free_offset()
        self.cfg = cfg.model_copy(update={"http_port": 8080 + off, "admin_port": 8081 + off})
        path = tmp / f"{name}.yaml"
        path.write_text(self.cfg.to_yaml())
        self.log_path = tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "pdfleet_runtime", "agent", "--config", str(path), "--bind", "127.0.0.1",
               "--engine-url", engine.url, "--model-path", str(model), "--retry-period", "0.3",
               "--canary-timeout", "20", "--check-period", "0.5", *args]
        if prefill is not None:
            p = prefill.cfg
            cmd += ["--prefill-engines", f"127.0.0.1:{p.http_port + prefill.offset}:{p.bootstrap_port + prefill.offset}"]
        if "--engine-version" not in args:
            cmd += ["--engine-version", "0.5.23"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "runtime"),
                                                                           os.environ.get("PYTHONPATH")]))}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=die_with_parent)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.http_port}"

    def readyz(self) -> dict[str, Any]:
        return self.readyz_at(self.url)

    def readyz_at(self, url: str) -> dict[str, Any]:
        try:
            _, body = http("GET", url + "/readyz", None, 5)
        except OSError:
            return {}
        return body if isinstance(body, dict) else {}

    def wait_for(self, problem: str, timeout_s: float = 60) -> dict[str, Any]:
        deadline, body = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            body = self.readyz()
            if body.get("problem") == problem:
                return body
            time.sleep(0.2)
        raise AssertionError(f"never {problem}: last {body}\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _model_dir(tmp: Path, name: str, preset: str) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_for_layout(resolve_layout(preset), "LlamaForCausalLM", "llama")))
    return d


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pod, Pod, Path]]:
    tmp = tmp_path_factory.mktemp("agent")
    cfg = {"served_model_name": "llama-test"}
    prefill = Pod(tmp, "engine-prefill", config("prefill", requests=8).model_copy(update=cfg),
                  args=(*STAND_IN, "--fault-write-delay", str(WRITE_DELAY_S)))
    decode = Pod(tmp, "engine-decode", config("decode", requests=8).model_copy(update=cfg),
                 args=(*STAND_IN, "--canary-period", "3600", "--retry-period", "3600", "--request-timeout", "30"),
                 # The stand-in engine dials only prefill pods its discovery names (as the router's bootstrap
                 # addresses are checked); its own canary is off (an hour apart): the pod's verdict is the agent's.
                 env={"PDFLEET_PREFILL_ADDRESSES": prefill.bootstrap})
    prefill.start()
    decode.start()
    try:
        for pod in (prefill, decode):
            deadline = time.monotonic() + 90
            while _health(pod) != 200:
                assert time.monotonic() < deadline, pod.log()[-3000:]
                time.sleep(0.2)
        yield prefill, decode, tmp
    finally:
        decode.stop()
        prefill.stop()


def _health(pod: Pod) -> int:
    try:
        return http("GET", pod.url + "/health", None, 2)[0]
    except OSError:
        return 0


def router_request(prefill: Pod, decode: Pod, text: str) -> tuple[int, Any]:
    """One request as SGLang's router sends it: the same body to both pods at once; the decode's answer."""
    p = prefill.cfg
    body = {"text": text, "sampling_params": {"max_new_tokens": 8}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port + prefill.offset, "bootstrap_room": secrets.randbits(63)}
    out: dict[str, tuple[int, Any]] = {}
    t = threading.Thread(target=lambda: out.setdefault("p", http("POST", prefill.url + "/generate", body, 60)))
    t.start()
    code, answer = http("POST", decode.url + "/generate", body, 60)
    t.join(60)
    return (code, answer) if out.get("p", (0,))[0] == 200 else out.get("p", (0, "no prefill answer"))


def test_ready_only_through_the_canary(engines: tuple[Pod, Pod, Path]) -> None:
    prefill, decode, tmp = engines
    _, info = http("GET", decode.url + "/server_info", None, 5)
    assert info["version"] == "0.5.23" and "standing in for sglang 0.5.23" in info["stand_in"]
    model = _model_dir(tmp, "model-ok", LAYOUT)
    # No prefill pod reachable: the engine checks pass, the canary cannot, the pod is not ready.
    lonely = Agent(tmp, "agent-no-prefill", decode.cfg, decode, None, model)
    try:
        body = lonely.wait_for("NoPeerFound")
        assert body["ready"] is False and body["engineUp"] is True and not body["engineProblems"]
    finally:
        lonely.stop()
    agent = Agent(tmp, "agent-decode", decode.cfg, decode, prefill, model)
    try:
        body = agent.wait_for("TransferPathVerified")
        assert body["ready"] is True and "canary as SGLang's router sends it: room" in body["reason"]
        maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()  # no torch in the agent's process
        assert "torch" not in maps and "mooncake" not in maps and "aiohttp" in maps, "agent's mapped libraries"
        assert 'pdfleet_agent_canaries_total{outcome="success"}' in _text(agent.url + "/metrics")
        moved = [ln for ln in _text(prefill.url + "/metrics").splitlines()
                 if ln.startswith("pdfleet_room_transfer_bytes_total ")]
        assert moved and float(moved[0].split()[1]) > 0  # the canary's state crossed the prefill's path
    finally:
        agent.stop()


def test_declared_version_model_and_config_are_checked(engines: tuple[Pod, Pod, Path]) -> None:
    prefill, decode, tmp = engines
    good, wrong = _model_dir(tmp, "model-good", LAYOUT), _model_dir(tmp, "model-other", "qwen3-next-hybrid")
    other_name = decode.cfg.model_copy(update={"served_model_name": "another-model"})
    agents = [Agent(tmp, "agent-version", decode.cfg, decode, prefill, good, "--engine-version", "0.5.22"),
              Agent(tmp, "agent-model", other_name, decode, prefill, good),
              Agent(tmp, "agent-config", decode.cfg, decode, prefill, wrong)]
    try:
        version = agents[0].wait_for("EngineMismatch")["reason"]
        assert "version '0.5.23', the deployment declares '0.5.22'" in version
        assert "declares 'another-model'" in agents[1].wait_for("EngineMismatch")["reason"]
        config = agents[2].wait_for("ModelConfigMismatch")["reason"]
        assert "num_hidden_layers = 48, the layout declares 32" in config and "num_key_value_heads" in config
        assert all(not a.readyz().get("ready") for a in agents)
    finally:
        for a in agents:
            a.stop()


def test_the_drain_waits_for_routers_then_for_every_running_request(engines: tuple[Pod, Pod, Path]) -> None:
    prefill, decode, tmp = engines
    model = _model_dir(tmp, "model-drain", LAYOUT)
    agents = {"decode": Agent(tmp, "agent-drain-decode", decode.cfg, decode, prefill, model, "--router-drop-seconds",
                              "0.5"),
              "prefill": Agent(tmp, "agent-drain-prefill", prefill.cfg, prefill, None, model, "--router-drop-seconds",
                               "0.5")}
    try:
        agents["decode"].wait_for("TransferPathVerified")
        agents["prefill"].wait_for("EngineVerified")
        results: list[tuple[float, int, Any]] = []

        def one(i: int) -> None:
            code, body = router_request(prefill, decode, f"request {i} in flight when the drain starts")
            results.append((time.monotonic(), code, body))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10  # until the engines report them (the prefill writes slowly)
        while time.monotonic() < deadline and (engine_load(_text(decode.url + "/metrics")).running < 4
                                               or engine_load(_text(prefill.url + "/metrics")).inflight < 1):
            time.sleep(0.05)
        assert engine_load(_text(prefill.url + "/metrics")).inflight >= 1  # transfers in flight on the prefill
        t0 = time.monotonic()
        drains: dict[str, tuple[float, int, Any]] = {}

        def drain(role: str) -> None:
            code, body = http("POST", f"http://127.0.0.1:{agents[role].cfg.admin_port}/drain?wait=true", None, 60)
            drains[role] = (time.monotonic(), code, body)
        ds = [threading.Thread(target=drain, args=(r,)) for r in agents]
        for t in ds:
            t.start()
        for t in [*ds, *threads]:
            t.join(60)
        assert len(results) == 4 and all(c == 200 for _, c, _ in results), results
        last = max(t for t, _, _ in results)
        for role, (t1, code, body) in drains.items():
            assert code == 200 and body["drained"] is True and body["forced"] is False, (role, body)
            assert body["engine"] == {"running": 0, "queued": 0, "inflight": 0}, (role, body)
            assert t1 - t0 >= 0.5, role  # the routers' bound first
            assert t1 >= last - 0.5, role  # then every request it was given was answered
            assert agents[role].readyz()["problem"] == "Draining"
        # the drain endpoint is the admin port's: loopback only, and never by GET
        assert http("GET", f"http://127.0.0.1:{agents['decode'].cfg.admin_port}/drain", None, 5)[0] == 405
    finally:
        for a in agents.values():
            a.stop()


def test_the_agents_drain_is_refused_outside_the_pod_and_taken_by_the_prestop_command(
        engines: tuple[Pod, Pod, Path]) -> None:
    """Issue 25's tests of ``serve``'s drain (tests/server/test_admin.py), on the agent: its HTTP port on
    127.0.0.2 (standing in for the pod IP) takes no drain by any method, the admin port does not listen
    there and never drains by GET, and the exec preStop command (``pdfleet-runtime drain``) drains it."""
    prefill, _, tmp = engines
    pod_ip = "127.0.0.2"
    agent = Agent(tmp, "agent-admin", prefill.cfg, prefill, None, _model_dir(tmp, "model-admin", LAYOUT),
                  "--bind", pod_ip, "--router-drop-seconds", "0.2")
    url, admin_port = f"http://{pod_ip}:{agent.cfg.http_port}", agent.cfg.admin_port
    try:
        deadline = time.monotonic() + 60
        while not agent.readyz_at(url).get("ready"):
            assert time.monotonic() < deadline and agent.proc.poll() is None, agent.log_path.read_text()[-3000:]
            time.sleep(0.2)
        for method in ("GET", "POST", "DELETE"):
            code, body = http(method, url + "/drain?wait=true", None, 10)
            assert code in (404, 405), (method, code, body)
            assert agent.readyz_at(url).get("ready") is True, method
        with socket.socket() as s:  # the admin port does not listen on the pod's address
            assert s.connect_ex((pod_ip, admin_port)) != 0
        assert http("GET", f"http://127.0.0.1:{admin_port}/drain", None, 10)[0] == 405  # never by GET
        env = {**os.environ, "PYTHONPATH": str(REPO / "runtime")}
        out = subprocess.run([sys.executable, "-m", "pdfleet_runtime", "drain", "--config",
                              str(tmp / "agent-admin.yaml"), "--wait"], env=env, capture_output=True, text=True,
                             timeout=90)
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert '"drained": true' in out.stdout, out.stdout
        assert agent.readyz_at(url).get("problem") == "Draining"
    finally:
        agent.stop()


def _text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def test_the_built_in_runtime_exports_the_names_the_drain_reads(engines: tuple[Pod, Pod, Path]) -> None:
    prefill, decode, _ = engines
    assert engine_load(_text(decode.url + "/metrics")).idle
    text = _text(prefill.url + "/metrics")
    assert "sglang:num_prefill_inflight_queue_reqs{" in text and 'engine_type="prefill"' in text
    assert engine_load(text).idle
