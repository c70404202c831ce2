"""The reference engine's rank-side code (torch and transformers; rank processes and the parity harness only).

Reading order: ``cache_pools`` (the one cache <-> pool mapping both sides share), ``model_runner`` (load a
local model, prefill, decode, the aggregate reference), ``faults`` (the negative controls applied to state).
The pod process never imports this package (import-linter keeps it so).
"""
