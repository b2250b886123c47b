"""Batched torch verifiers and sampling transforms: tensors in, tensors out (no models, no I/O).

* :mod:`~specresearch.core.sampling` -- logits to sampling distributions (temperature, top-k, top-p, epsilon).
* :mod:`~specresearch.core.verify` -- single-draft verifiers: token, block, greedy.
* :mod:`~specresearch.core.verify_multi` -- multi-draft verifiers: rrs, rrs without replacement, kseq, gbv, traversal.
"""
