"""`pdfleet-runtime`: the command the operator runs in each pod, plus offline tools.

Sub-commands:
  serve    the runtime pod: one process per local GPU rank, /healthz /readyz /metrics and
           /v1/synthetic on the HTTP port, /drain on the loopback-only admin port, the bootstrap
           endpoint on prefill pods; SIGTERM drains then exits. Exit 0 after a clean stop, 1 when
           the ranks cannot start, 2 on a bad config.
  agent    the container beside an SGLang or vLLM engine: checks the engine against the deployment,
           runs the decode canary as the engine's router sends a request, writes the readiness gate,
           drains as the preStop hook (docs/agent.md). Exit 0 after a clean stop, 2 on a bad config.
  drain    the pod's exec preStop hook: drain this pod (or --cancel) through its admin port on
           127.0.0.1. Exit 0 once drained (or cancelled), 1 when the pod refused or is unreachable.
  synthetic  send synthetic requests to a decode pod's /v1/synthetic and print the results
  parity   build prefill and decode pools, transfer a seeded request set and compare every decode
           byte: in this process (--backend local, mori), or with every rank its own process on
           loopback through the real engine and the prefill/decode protocol (--backend mooncake, nixl). Exit 0 on parity, 1 on a mismatch (naming the first
           differing buffer, layer and offset), 2 when the capability matrix rejects the
           combination (printing the rule and reason) or the arguments are invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pdfleet_runtime import __version__
from pdfleet_runtime.front.routers import FrontedRouter
from pdfleet_runtime.model.faults import ModelFault
from pdfleet_runtime.source import describe

EXIT_OK, EXIT_MISMATCH, EXIT_REJECTED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdfleet-runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pdfleet-runtime {describe(__version__)}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    par = sub.add_parser("parity", help="check prefill -> decode parity: bytes (--layout) or tokens (--model)")
    what = par.add_mutually_exclusive_group(required=True)
    what.add_argument("--layout", help="a preset name (see docs/layouts.md): byte parity of seeded state")
    what.add_argument("--model", type=Path, help="a local model directory (config.json, safetensors): token parity "
                      "against transformers' own greedy generate (docs/reference-engine.md)")
    par.add_argument("--prefill", required=True, help="prefill shape, e.g. tp=4,pp=2")
    par.add_argument("--decode", required=True, help="decode shape, e.g. tp=2,pp=1")
    par.add_argument("--requests", type=int, default=None,
                     help="requests in flight (default 8); with --model and no prompt: prompts drawn from --seed "
                     "(default 2)")
    par.add_argument("--tokens", type=int, default=None,
                     help="tokens of all requests together; the pool capacity (default 4096; --model: 64)")
    par.add_argument("--seed", type=int, default=7, help="seed of state, lengths and allocation (default 7)")
    par.add_argument("--backend", default="local", choices=("local", "mooncake", "nixl", "mori"),
                     help="local: in-process copies, Mooncake's matrix column (default); mooncake, nixl: one "
                     "process per rank through the real engine and the protocol; mori: its column, in-process")
    par.add_argument("--device", default="cpu",
                     help="torch device of the pools (default cpu); with mooncake/nixl, cuda spreads the rank "
                     "processes over the host's GPUs (prefill rank r on GPU r %% n, decode rank r on (r+1) %% n)")
    par.add_argument("--protocol", default=None, choices=("tcp", "nvlink", "rdma", "shm"),
                     help="spec.transfer.protocol of mooncake/nixl (default tcp on cpu, nvlink on cuda)")
    mdl = par.add_argument_group("token parity (--model)")
    mdl.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                     help="a prompt as comma-separated token ids, e.g. 5,17,99 (repeat for more cases)")
    mdl.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                     help="a text prompt, tokenized by the model directory's tokenizer (repeat for more cases)")
    mdl.add_argument("--max-new-tokens", type=int, default=16,
                     help="tokens each case generates, exactly (end-of-sequence does not stop it; default 16)")
    mdl.add_argument("--preset", default=None, help="a layout preset that must agree with config.json")
    mdl.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default: the preset's, or 16)")
    mdl.add_argument("--init-seed", type=int, default=0, help="without weights: the seed they are drawn from")
    mdl.add_argument("--init-range", type=float, default=None,
                     help="without weights: their init range (default: config.json's initializer_range)")
    mdl.add_argument("--fault", default=None, choices=[f.value for f in ModelFault],
                     help="a negative control: make PD state wrong on purpose; parity must fail")
    mdl.add_argument("--nodes", default=None, metavar="P,D",
                     help="pods per replica, prefill,decode (engine backends; e.g. 1,2 spreads a decode replica "
                     "over two pods)")
    par.add_argument("--json", action="store_true", help="print one JSON line")
    gen = sub.add_parser("generate", help="a model's answer without PD (transformers, greedy): what a model pod's "
                         "answer must equal")
    gen.add_argument("--aggregate", action="store_true", required=True,
                     help="aggregate generation in this process (the only kind so far)")
    gen.add_argument("--model", type=Path, required=True, help="the model directory (Hugging Face layout)")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--chat", default=None, help="a user message, rendered with the model's chat template")
    what.add_argument("--prompt", default=None, help="a text prompt")
    what.add_argument("--prompt-ids", default=None, metavar="IDS", help="comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens generated (default 64)")
    gen.add_argument("--json", action="store_true", help="one JSON object: prompt_ids, output_ids, text, "
                     "finish_reason")
    _serve_parser(sub)
    _agent_parser(sub)
    rl = sub.add_parser("router-launch", help="the router pod: sglang-router with its keys read from files")
    rl.add_argument("--api-key-file", required=True, type=Path, help="the deployment's worker key (--api-key)")
    rl.add_argument("--control-plane-keys-file", type=Path, default=None,
                    help="the router's control-plane keys, one 'id:name:role:key' a line")
    rl.add_argument("router_args", nargs=argparse.REMAINDER, help="-- then sglang_router.launch_router's arguments")
    rf = sub.add_parser("router-front", help="the router pod's front: limits, serving routes, the served model")
    rf.add_argument("--listen", default="0.0.0.0:30000", help="host:port clients reach (default 0.0.0.0:30000)")
    rf.add_argument("--router", required=True, choices=[r.value for r in FrontedRouter],
                    help="the router behind the front: its serving routes, and whether it wants the worker key")
    rf.add_argument("--upstream", required=True, help="the router on the pod's loopback, http://127.0.0.1:PORT")
    rf.add_argument("--served-model", required=True, help="the one model name the deployment serves")
    rf.add_argument("--api-key-file", type=Path, default=None,
                    help="the worker key the router was started with (sglang: required; vllm: none)")
    rf.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    rw = sub.add_parser("router-front-wait", help="the router container's preStop hook: wait until the front "
                        "stopped listening (it drains while clients still reach it)")
    rw.add_argument("--port", required=True, type=int, help="the front's port (the router port)")
    rw.add_argument("--within", required=True, type=float, help="seconds at most")
    drn = sub.add_parser("drain", help="drain this pod through its loopback admin port (the preStop hook)")
    drn.add_argument("--config", required=True, type=Path, help="the runtime config (for adminPort)")
    drn.add_argument("--wait", action="store_true", help="return once drained (or the drain budget passed)")
    drn.add_argument("--cancel", action="store_true", help="cancel a drain instead")
    syn = sub.add_parser("synthetic", help="send synthetic requests to a decode pod")
    syn.add_argument("--url", required=True, help="the decode pod's HTTP base URL, e.g. http://127.0.0.1:8080")
    syn.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    syn.add_argument("--count", type=int, default=1, help="requests (default 1)")
    syn.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    syn.add_argument("--timeout", type=float, default=60.0, help="per request, seconds (default 60)")
    syn.add_argument("--worker-key-file", type=Path, default=None,
                     help="the deployment's worker key (Secret <deployment>-worker-auth, item key), sent as "
                     "Authorization: Bearer (pods the operator runs want it)")
    syn.add_argument("--json", action="store_true", help="print one JSON line per request")
    syn.add_argument("--prefill-url", default=None,
                     help="OpenAI mode: the prefill pod's HTTP base URL; each request goes to both pods as SGLang's "
                     "router sends it (/v1/completions with a bootstrap_room) and every answer is checked")
    syn.add_argument("--bootstrap", default=None, help="OpenAI mode: the prefill pod's bootstrap host:port")
    return parser


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    srv = sub.add_parser("serve", help="run the runtime pod server")
    srv.add_argument("--config", required=True, type=Path, help="the runtime config (the operator's ConfigMap)")
    srv.add_argument("--port-offset", type=int, default=None,
                     help="local runs: add N to the HTTP, admin, bootstrap and engine ports (env PDFLEET_PORT_OFFSET)")
    srv.add_argument("--prefill-addresses", default=None,
                     help="local runs: prefill bootstrap addresses host:port,... instead of the headless Service "
                     "(env PDFLEET_PREFILL_ADDRESSES)")
    srv.add_argument("--prefill-addresses-file", type=Path, default=None,
                     help="local runs: a JSON list of prefill bootstrap addresses, re-read on every lookup, instead "
                     "of the headless Service (env PDFLEET_PREFILL_ADDRESSES_FILE)")
    srv.add_argument("--device", choices=("cpu", "cuda"), default=None,
                     help="local runs: where the pools live, over the config's device (no GPU on a kwok node)")
    srv.add_argument("--bind", dest="bind_host", default=None, help="listen address (default 0.0.0.0)")
    srv.add_argument("--kubeconfig", type=Path, default=None,
                     help="write the readiness gate through this kubeconfig (default: in-cluster token if mounted)")
    srv.add_argument("--no-gate", dest="gate", action="store_false", default=None,
                     help="never write the readiness-gate condition")
    srv.add_argument("--canary-tokens", type=int, default=None, help="tokens of each canary (default 64)")
    srv.add_argument("--canary-period", dest="canary_period_s", type=float, default=None,
                     help="re-check period while ready, seconds (default 10)")
    srv.add_argument("--retry-period", dest="retry_period_s", type=float, default=None,
                     help="re-check period while not ready, seconds (default 1)")
    srv.add_argument("--canary-timeout", dest="canary_timeout_s", type=float, default=None,
                     help="one canary's budget, seconds (default 10)")
    srv.add_argument("--floor-gbps", dest="floor_gbps", type=float, default=None,
                     help="canary throughput floor, GB/s (default: per protocol, docs/runtime-server.md)")
    srv.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=None,
                     help="default budget of one request, seconds (default 60)")
    srv.add_argument("--write-timeout", dest="write_timeout_s", type=float, default=None,
                     help="one engine write's budget, seconds (default 30)")
    srv.add_argument("--fence-timeout", dest="fence_timeout_s", type=float, default=None,
                     help="longest a failed request's items wait for the prefill's fence, seconds (default 35)")
    srv.add_argument("--room-ttl", dest="room_ttl_s", type=float, default=None,
                     help="prefill: seconds a bootstrap_room no decode claimed is held (default 10)")
    srv.add_argument("--pin-engine-id", dest="pin_engine_id", action="store_true", default=None,
                     help="vLLM's contract: the engine id is the pod's name, kept across restarts (default: fresh "
                     "per start, as vLLM's)")
    srv.add_argument("--kv-connector", dest="kv_connector", default=None, choices=("pdfleet", "none"),
                     help="decode: 'none' ignores the transfer fields and recomputes every prompt, as an engine "
                     "started without its KV connector (env PDFLEET_KV_CONNECTOR; default pdfleet)")
    srv.add_argument("--log-level", default=None, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    srv.add_argument("--stand-in-for", default=None, help=argparse.SUPPRESS)
    srv.add_argument("--fault-write-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    srv.add_argument("--fault-wire", default=None, help=argparse.SUPPRESS)
    srv.add_argument("--fault-corrupt-received", action="store_true", help=argparse.SUPPRESS)
    srv.add_argument("--fault-corrupt-sent", action="store_true", help=argparse.SUPPRESS)
    srv.add_argument("--fault-scatter-pages", type=int, default=None, help=argparse.SUPPRESS)
    srv.add_argument("--fault-model", default=None, choices=[f.value for f in ModelFault], help=argparse.SUPPRESS)


def _agent_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    agt = sub.add_parser("agent", help="run the agent beside an SGLang or vLLM engine (docs/agent.md)")
    agt.add_argument("--config", required=True, type=Path, help="the runtime config (the operator's ConfigMap)")
    agt.add_argument("--engine-kind", default=None,
                     help="the engine beside the agent: sglang or vllm (spec.engine.kind; default sglang)")
    agt.add_argument("--engine-version", required=True, help="the engine version the deployment declares")
    agt.add_argument("--model-path", type=Path, default=None, help="the model directory shared with the engine")
    agt.add_argument("--engine-url", default=None, help="this pod's engine (default http://127.0.0.1:30000)")
    agt.add_argument("--router-drop-seconds", dest="router_drop_s", type=float, default=None,
                     help="how long a drain waits for routers to drop the pod (default 4, docs/router.md)")
    agt.add_argument("--prefill-engines", default=None,
                     help="local runs: prefill engines host:httpPort:bootstrapPort,... instead of the headless Service")
    agt.add_argument("--check-period", dest="check_period_s", type=float, default=None,
                     help="engine re-check period, seconds (default 5)")
    agt.add_argument("--canary-period", dest="canary_period_s", type=float, default=None,
                     help="canary period while ready, seconds (default 10)")
    agt.add_argument("--retry-period", dest="retry_period_s", type=float, default=None,
                     help="canary period while not ready, seconds (default 1)")
    agt.add_argument("--canary-timeout", dest="canary_timeout_s", type=float, default=None,
                     help="one canary's budget, seconds (default 30)")
    agt.add_argument("--bind", dest="bind_host", default=None, help="listen address (default 0.0.0.0)")
    agt.add_argument("--kubeconfig", type=Path, default=None,
                     help="write the readiness gate through this kubeconfig (default: in-cluster token if mounted)")
    agt.add_argument("--no-gate", dest="gate", action="store_false", default=None,
                     help="never write the readiness-gate condition")
    agt.add_argument("--log-level", default=None, choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def _agent(args: argparse.Namespace) -> int:
    import os

    print(f"pdfleet-runtime {describe(__version__)}", file=sys.stderr, flush=True)  # which code, first in the log
    from pdfleet_runtime.agent.main import agent
    from pdfleet_runtime.agent.options import AgentOptions
    from pdfleet_runtime.config import ConfigError, load_config
    from pdfleet_runtime.pod.options import OptionsError

    try:
        cfg = load_config(args.config)
        flags = {k: getattr(args, k) for k in (
            "engine_kind", "engine_version", "model_path", "engine_url", "router_drop_s", "prefill_engines", "check_period_s",
            "canary_period_s", "retry_period_s", "canary_timeout_s", "bind_host", "kubeconfig", "gate", "log_level")}
        opts = AgentOptions.build(cfg, os.environ, **flags)
    except (ConfigError, OptionsError) as e:
        print(f"pdfleet-runtime agent: {e}", file=sys.stderr)
        return EXIT_REJECTED
    return agent(opts, in_cluster=bool(os.environ.get("KUBERNETES_SERVICE_HOST")))


def _serve(args: argparse.Namespace) -> int:
    import os

    # Which code this pod runs (the checkout and its commit), first in its log.
    print(f"pdfleet-runtime {describe(__version__)}", file=sys.stderr, flush=True)
    from pdfleet_runtime.config import ConfigError, load_config
    from pdfleet_runtime.pod import FaultOptions, OptionsError, ServeOptions, serve

    try:
        cfg = load_config(args.config)
        if args.device is not None:
            cfg = cfg.model_copy(update={"device": args.device})
        flags = {k: getattr(args, k) for k in (
            "port_offset", "prefill_addresses", "prefill_addresses_file", "bind_host", "kubeconfig", "gate",
            "canary_tokens", "canary_period_s", "retry_period_s", "canary_timeout_s", "floor_gbps", "request_timeout_s",
            "write_timeout_s", "fence_timeout_s", "room_ttl_s", "log_level", "stand_in_for", "pin_engine_id", "kv_connector")}
        flags["faults"] = FaultOptions(args.fault_write_delay, args.fault_wire, args.fault_corrupt_received,
                                       args.fault_corrupt_sent, args.fault_scatter_pages,
                                       model=ModelFault(args.fault_model) if args.fault_model else None)
        flags["config_path"] = args.config
        opts = ServeOptions.build(cfg, os.environ, **flags)
    except (ConfigError, OptionsError) as e:
        print(f"pdfleet-runtime serve: {e}", file=sys.stderr)
        return EXIT_REJECTED
    return serve(opts, in_cluster=bool(os.environ.get("KUBERNETES_SERVICE_HOST")))


def _router_launch(args: argparse.Namespace) -> int:
    import logging

    from pdfleet_runtime.front.launch import LaunchError, launch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    argv = args.router_args[1:] if args.router_args[:1] == ["--"] else args.router_args
    try:
        launch(argv, api_key_file=args.api_key_file, control_keys_file=args.control_plane_keys_file)
    except LaunchError as e:
        print(f"pdfleet-runtime router-launch: {e}", file=sys.stderr)
        return EXIT_REJECTED
    return EXIT_OK


def _router_front(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pdfleet_runtime.front.launch import LaunchError, key_text
    from pdfleet_runtime.front.proxy import FrontSettings, serve_front

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = args.listen.rpartition(":")
    try:
        key = None if args.api_key_file is None else key_text(args.api_key_file, "the worker key")
        if not host or not port.isdigit():
            raise LaunchError(f"--listen {args.listen!r}: give host:port")
        settings = FrontSettings(router=FrontedRouter(args.router), served_model=args.served_model,
                                 upstream=args.upstream.rstrip("/"), api_key=key)
    except (LaunchError, ValueError) as e:
        print(f"pdfleet-runtime router-front: {e}", file=sys.stderr)
        return EXIT_REJECTED
    asyncio.run(serve_front(settings, host.strip("[]"), int(port)))
    return EXIT_OK


def _drain(args: argparse.Namespace) -> int:
    import os

    from pdfleet_runtime.config import ConfigError, load_config
    from pdfleet_runtime.pod.admin import call_drain

    try:
        cfg = load_config(args.config)
        raw = os.environ.get("PDFLEET_PORT_OFFSET", "0")  # local runs, as ``serve`` reads it
        port = cfg.admin_port + int(raw)
    except (ConfigError, ValueError) as e:
        print(f"pdfleet-runtime drain: {e}", file=sys.stderr)
        return EXIT_REJECTED
    try:
        code, body = call_drain(port, wait=args.wait, cancel=args.cancel,
                                timeout_s=cfg.drain_timeout_seconds + 60.0)
    except OSError as e:
        print(f"pdfleet-runtime drain: cannot reach the admin port 127.0.0.1:{port}: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    print(json.dumps(body, sort_keys=True))
    return EXIT_OK if code == 200 else EXIT_MISMATCH


def _synthetic(args: argparse.Namespace) -> int:
    import concurrent.futures

    if args.prefill_url:
        from pdfleet_runtime.testing.worker_client import check_openai

        if not args.bootstrap or ":" not in args.bootstrap:
            print("pdfleet-runtime synthetic: --prefill-url needs --bootstrap host:port", file=sys.stderr)
            return EXIT_REJECTED

        def one(i: int) -> dict[str, object]:
            return check_openai(args.prefill_url, args.url, args.bootstrap, i, timeout_s=args.timeout,
                                key=_worker_key(args))
    else:
        def one(i: int) -> dict[str, object]:
            return _synthetic_one(args)

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, args.concurrency)) as pool:
        for res in pool.map(one, range(args.count)):
            failed += not res.get("ok")
            if args.json:
                print(json.dumps(res, sort_keys=True))
            else:
                print(f"{res.get('requestId', res.get('room', '-'))}: {'ok' if res.get('ok') else 'FAILED'} "
                      f"{res.get('bytes', 0)} bytes in {res.get('seconds', 0):.4f}s "
                      f"{res.get('reason') or res.get('problem') or res.get('error') or ''}")
    return EXIT_OK if failed == 0 else EXIT_MISMATCH


def _worker_key(args: argparse.Namespace) -> str | None:
    path = getattr(args, "worker_key_file", None)
    return Path(path).read_text().strip() if path is not None else None


def _synthetic_one(args: argparse.Namespace) -> dict[str, object]:
    import urllib.error
    import urllib.request

    data = json.dumps({"tokens": args.tokens, "timeoutS": args.timeout}).encode()
    key = _worker_key(args)
    req = urllib.request.Request(f"{args.url.rstrip('/')}/v1/synthetic", data=data,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout + 60) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as e:
        return {"ok": False, "status": e.code, **json.loads(e.read() or b"{}")}


def _parity(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _model_parity(args)
    from pdfleet_runtime.layouts import LayoutError, resolve_layout
    from pdfleet_runtime.records import ParallelShape

    # Imported here, not at the top: the harness imports torch, and ``serve``'s pod process must not.
    from pdfleet_runtime.verify import parity
    from pdfleet_runtime.verify.results import ParityConfig

    try:
        cfg = ParityConfig(
            layout=resolve_layout(args.layout), prefill=ParallelShape.parse(args.prefill),
            decode=ParallelShape.parse(args.decode), requests=8 if args.requests is None else args.requests,
            tokens=4096 if args.tokens is None else args.tokens,
            seed=args.seed, backend=args.backend, layout_name=args.layout, device=args.device,
            protocol=args.protocol or ("tcp" if args.device == "cpu" else "nvlink"),
        )
        if cfg.requests < 1 or cfg.tokens < cfg.requests:
            raise LayoutError(f"need --tokens >= --requests >= 1, got {cfg.tokens} and {cfg.requests}")
    except LayoutError as e:
        print(f"pdfleet-runtime parity: {e}", file=sys.stderr)
        return EXIT_REJECTED
    result = parity.run_parity_engine(cfg) if cfg.backend in parity.ENGINE_BACKENDS else parity.run_parity(cfg)
    if args.json:
        print(json.dumps(result.as_json(cfg), sort_keys=True))
    elif result.rejection is not None:
        r = result.rejection
        print(f"rejected by rule {r.rule}: {r.message}\n  reason: {r.reason}")
    else:
        verdict = "parity" if result.ok else "MISMATCH"
        print(f"{verdict}: {cfg.layout_name} prefill {cfg.prefill} -> decode {cfg.decode}, "
              f"{cfg.requests} requests, {cfg.tokens} tokens")
        print(f"  moved {result.bytes_moved} bytes in {result.descriptors} descriptors; "
              f"{result.mismatched_bytes} mismatched bytes")
        for state, n in sorted(result.bytes_by_state.items()):
            print(f"  {state:16s} {n:>14d} bytes  {result.descriptors_by_state.get(state, 0):>8d} descriptors")
        if result.first_mismatch is not None:
            print(f"  first mismatch: {result.first_mismatch.describe()}")
    if result.rejection is not None:
        if args.json:
            print(f"rejected by rule {result.rejection.rule}: {result.rejection.reason}", file=sys.stderr)
        return EXIT_REJECTED
    return EXIT_OK if result.ok else EXIT_MISMATCH


def _prompt_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated token ids, e.g. 5,17,99") from None
    if not ids or any(i < 0 for i in ids):
        raise ValueError(f"--prompt-ids {text!r}: expected non-negative token ids, at least one")
    return ids


def _model_parity(args: argparse.Namespace) -> int:
    """``parity --model``: token parity (verify.model_parity), one JSON object with --json."""
    from pdfleet_runtime.layouts import LayoutError
    from pdfleet_runtime.records import ParallelShape

    # Imported here: the harness imports torch and transformers, and ``serve``'s pod process must not.
    from pdfleet_runtime.verify import model_run
    from pdfleet_runtime.verify.model_results import ModelParityConfig

    try:
        nodes = (1, 1) if args.nodes is None else tuple(int(x) for x in args.nodes.split(","))
        if len(nodes) != 2 or min(nodes) < 1:
            raise ValueError(f"--nodes {args.nodes!r}: expected P,D pods per replica, e.g. 1,2")
        if nodes != (1, 1) and args.backend not in ("mooncake", "nixl"):
            raise ValueError("--nodes spreads a replica over pods of rank processes: it needs --backend mooncake or nixl")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        prompts = [_prompt_ids(t) for t in args.prompt_ids]
        if args.prompt:
            from pdfleet_runtime.rank.model_runner import encode_text

            prompts += [encode_text(args.model, t) for t in args.prompt]
        cfg = ModelParityConfig(
            args.model, tuple(prompts), args.max_new_tokens, ParallelShape.parse(args.prefill),
            ParallelShape.parse(args.decode), args.backend, args.device,
            args.protocol or ("tcp" if args.device == "cpu" else "nvlink"), args.seed, args.preset, args.page_size,
            args.init_seed, args.init_range, ModelFault(args.fault) if args.fault else None, nodes)  # type: ignore[arg-type]
        result = model_run.run(cfg, requests=2 if args.requests is None else args.requests,
                               tokens=64 if args.tokens is None else args.tokens)
    except (LayoutError, ValueError) as e:
        print(f"pdfleet-runtime parity: {e}", file=sys.stderr)
        return EXIT_REJECTED
    if args.json:
        print(json.dumps(result.as_json(cfg), sort_keys=True))
    elif result.rejection is not None:
        r = result.rejection
        print(f"rejected by rule {r.rule}: {r.message}\n  reason: {r.reason}")
    else:
        verdict = "token parity" if result.ok else "MISMATCH"
        print(f"{verdict}: {result.model_type} ({result.dtype}) {cfg.model_dir} prefill {cfg.prefill} -> decode "
              f"{cfg.decode}, {cfg.backend}, {len(result.cases)} cases x {cfg.max_new_tokens} tokens"
              + (f", fault {cfg.fault.value}" if cfg.fault else ""))
        for c in result.cases:
            print(f"  {c.describe()}; PD {list(c.tokens)}; {c.bytes_moved} bytes moved")
    if result.rejection is not None:
        if args.json:
            print(f"rejected by rule {result.rejection.rule}: {result.rejection.reason}", file=sys.stderr)
        return EXIT_REJECTED
    return EXIT_OK if result.ok else EXIT_MISMATCH


def _generate(args: argparse.Namespace) -> int:
    from pdfleet_runtime.model.hf_config import ModelConfigError
    from pdfleet_runtime.verify.aggregate import aggregate_answer

    try:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()] if args.prompt_ids else None
        ans = aggregate_answer(args.model, chat=args.chat, prompt=args.prompt, prompt_ids=ids,
                               max_tokens=args.max_tokens)
    except (ModelConfigError, OSError, ValueError) as e:
        print(f"pdfleet-runtime generate: {e}", file=sys.stderr)
        return EXIT_REJECTED
    print(ans.model_dump_json() if args.json else f"{ans.text!r} ({ans.finish_reason}, {len(ans.output_ids)} tokens)")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "parity":
        return _parity(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "agent":
        return _agent(args)
    if args.command == "synthetic":
        return _synthetic(args)
    if args.command == "router-launch":
        return _router_launch(args)
    if args.command == "router-front":
        return _router_front(args)
    if args.command == "router-front-wait":
        from pdfleet_runtime.front.stopped import wait_stopped

        if wait_stopped(args.port, args.within):
            return EXIT_OK
        print(f"pdfleet-runtime router-front-wait: port {args.port} still listened on after {args.within:g}s",
              file=sys.stderr)
        return EXIT_REJECTED
    if args.command == "drain":
        return _drain(args)
    return 0
