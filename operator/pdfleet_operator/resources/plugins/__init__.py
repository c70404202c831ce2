"""Engines and routers as plug-ins: one contract each (``contract``: ``EnginePlugin``, ``RouterPlugin``),
implementations by kind (``builtin``, ``sglang``, ``vllm``; ``sglang_router``, ``vllm_router``) and the
``registry`` the generic rendering calls (it alone imports the implementations)."""
