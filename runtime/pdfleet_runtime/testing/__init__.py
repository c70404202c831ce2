"""What tests, benchmarks and local checks drive the runtime with: no pod process imports this package.

``local`` (``LocalPod``: one ``pdfleet-runtime serve`` as a local process on loopback, and its HTTP surface),
``worker_client`` (a router's step as a client: one OpenAI request to a prefill and a decode pod, every
answer checked; ``pdfleet-runtime synthetic --prefill-url``), ``chat`` (``ChatTraffic``: concurrent chat
completions through an endpoint, every answer verified; the ``openai`` client, a dev dependency) and
``scrape`` (a Prometheus endpoint's samples). What the tests and the benchmarks share lives here, not in
``tests/``.
"""
