"""The router pod: the router (sglang-router launched with its keys from files, ``launch``, or vllm-router)
behind pdfleet's front (``proxy``), which passes each router kind's serving routes only (``routers``).

A router pod runs two containers of the router image (pdfleet-runtime and the router). For sglang-router 0.3.2:

- ``router``: ``pdfleet-runtime router-launch`` starts sglang-router in this process with its worker
  key (``--api-key``: sent to every worker as ``Authorization: Bearer``) and its control-plane keys
  read from the mounted Secrets, never from a command line or the environment; it listens on the
  pod's loopback only. Beside it, on a thread of that process, ``stale_workers`` deletes the router's
  workers whose pods are gone (0.3.2's discovery keeps those of pods that went not-Ready first, every
  drained pod, and a reused address then turns such a worker into the wrong role);
- ``front``: ``pdfleet-runtime router-front`` listens on the router port for clients: per-source and
  total connection caps, header and body deadlines, a body size limit, only the serving routes, and
  a request naming a model other than the one served refused (404) before the router sees it, so
  no client-chosen value becomes a label of the router's metrics. It adds the worker key to what it
  forwards (sglang-router with ``--api-key`` wants it from its clients too), so clients need none.

For vllm-router 0.1.17 the ``router`` container runs ``vllm-router --host 127.0.0.1`` itself (no keys) and the
front passes its serving routes, keeping its keyless worker API (``/remove_worker``, ``/workers``, ...) on the
loopback, and adds no key.

Reading order: ``routers``, ``launch``, ``stale_workers``, then ``proxy``. None imports torch or an engine.
"""
