"""The verification harness: proves that decode ends up holding exactly the state serving would have.

It imports serving's modules and nothing of serving imports it (import-linter keeps it so). Its
multi-process runs drive the serving rank processes themselves (``rank.process`` through
``pod.launcher``), so parity proves the process that serves. This package's ``__init__``
re-exports nothing (the parity command imports only what it runs).

Reading order:

1. ``results``: what a run is asked (``ParityConfig``) and answers (``ParityResult``, ``Rejection``).
2. ``precheck``: the capability matrix's verdict and the runtime's own shape limits, before any byte moves.
3. ``arena``: seeded background, a request's logical bytes written per rank (``seeded``), the byte check.
4. ``parity``: ``run_parity`` (every rank in this process, ``LocalCopyExecutor``) and ``run_parity_engine``.
5. ``cases``, ``group``: a case's prefill and decode pods of serving rank processes, through a real
   engine and the protocol, seeded and checked over the rank pipe (``SeededArenaOp``, ``ArenaCheckOp``).
6. ``aggregate``: a model's answer without PD in a process of its own (``pdfleet-runtime generate
   --aggregate``), what a model pod's answer must equal (the demo's and end-to-end checks).
"""
