"""Models: the model and draft Protocols, the causal-LM wrapper (KV cache, rollback), CPU kernels, embedded models.

* :mod:`~specresearch.models.causal_lm` -- :class:`CausalLM`, a transformers causal LM behind prefill / score / rollback.
* :mod:`~specresearch.models.embedded` -- the offline target shipped inside a PyPI wheel (SmolLM2-135M-Instruct).
"""
