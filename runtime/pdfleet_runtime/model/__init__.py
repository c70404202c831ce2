"""Pure model facts (no torch, no transformers): a Hugging Face ``config.json`` read into pdfleet's terms.

``hf_config``: the state layout a model's ``config.json`` implies (``layout_from_config``), whether a preset
named beside it agrees (``layout_for_model``), and the bounds a model directory must keep. The operator
and the pod process may import this package; the rank processes' model runner (``rank/``) builds on it.
"""
