"""Bodies in SGLang 0.5.23's shapes, written from its source (the wheel's ``sglang/srt``), not captured
from a running server (SGLang needs GPUs). Each names the function that builds it."""

from __future__ import annotations

# python/sglang/srt/entrypoints/http_server.py `server_info`: build_server_info(server_args, scheduler_info)
# (utils/common.py: ServerArgs.resolved_dict(), "launch_command", scheduler_info, "kv_events"), then
# "startup_time", "internal_states" (one dict per DP rank), "version" (sglang.__version__), "frontend".
SERVER_INFO = {
    "model_path": "/models/llama", "tokenizer_path": "/models/llama", "served_model_name": "llama-test",
    "host": "0.0.0.0", "port": 30000, "tp_size": 1, "pp_size": 1, "dp_size": 1, "load_format": "auto",
    "disaggregation_mode": "decode", "disaggregation_transfer_backend": "mooncake",
    "disaggregation_bootstrap_port": 8998, "disaggregation_ib_device": None, "enable_metrics": True,
    "max_total_tokens": None, "mem_fraction_static": 0.85,
    "launch_command": "python3 -m sglang.launch_server --model-path /models/llama --disaggregation-mode decode",
    "max_total_num_tokens": 2048, "max_req_input_len": 2042, "kv_events": None, "startup_time": 1764600000.0,
    "internal_states": [{"avg_spec_accept_length": None, "last_gen_throughput": 0.0, "memory_usage": {}}],
    "version": "0.5.23", "frontend": "python",
}

# python/sglang/srt/entrypoints/http_server.py `model_info`.
MODEL_INFO = {
    "model_path": "/models/llama", "served_model_name": "llama-test", "tokenizer_path": "/models/llama",
    "is_generation": True, "preferred_sampling_params": None, "weight_version": "default", "load_format": "auto",
    "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "decode",
    "has_image_understanding": False, "has_audio_understanding": False, "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
}

# python/sglang/srt/observability/metrics_collector.py: SchedulerMetricsCollector gauges (multiprocess_mode
# "mostrecent"), labels {model_name, engine_type, tp_rank, pp_rank, moe_ep_rank} per scheduler, plus
# priority="" for the total and priority="<n>" per-priority breakdowns (`_log_gauge_queue_count`) when
# priority scheduling is on. Two TP ranks of one prefill engine, priority scheduling on.
_L = 'model_name="llama-test",engine_type="prefill",pp_rank="0",moe_ep_rank="0"'
METRICS = f"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{_L},tp_rank="0",priority=""}} 2.0
sglang:num_running_reqs{{{_L},tp_rank="0",priority="1"}} 2.0
sglang:num_running_reqs{{{_L},tp_rank="1",priority=""}} 1.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{_L},tp_rank="0",priority=""}} 0.0
sglang:num_queue_reqs{{{_L},tp_rank="1",priority=""}} 3.0
# HELP sglang:num_prefill_inflight_queue_reqs The number of requests in the prefill inflight queue.
# TYPE sglang:num_prefill_inflight_queue_reqs gauge
sglang:num_prefill_inflight_queue_reqs{{{_L},tp_rank="0"}} 4.0
sglang:num_prefill_inflight_queue_reqs{{{_L},tp_rank="1"}} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{_L},tp_rank="0"}} 0.25
"""

IDLE_METRICS = METRICS.replace("} 2.0", "} 0.0").replace("} 1.0", "} 0.0").replace("} 3.0", "} 0.0").replace(
    "} 4.0", "} 0.0")
