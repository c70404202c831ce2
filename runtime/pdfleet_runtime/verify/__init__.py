"""The verification harness: proves that decode ends up holding exactly the state serving would have.

It imports serving's modules and nothing of serving imports it (import-linter keeps it so). This
package's ``__init__`` re-exports nothing: a spawned bootstrap host imports ``verify.bootstrap_host``
and must not pull torch in with the package.

Reading order:

1. ``results``: what a run is asked (``ParityConfig``) and answers (``ParityResult``, ``Rejection``).
2. ``precheck``: the capability matrix's verdict and the runtime's own shape limits, before any byte moves.
3. ``arena``: seeded background, a request's logical bytes written per rank (``seeded``), the byte check.
4. ``parity``: ``run_parity`` (every rank in this process, ``LocalCopyExecutor``) and ``run_parity_engine``.
5. ``cases``, ``procs``, ``group``: a group of rank processes through a real engine and the protocol;
   ``bootstrap_host`` and ``rank_workers`` are the processes' mains.
"""
