"""The audit: is a speculative-decoding rule lossless, how far from the target is it, and how much does it accept?

* :func:`audit` -- the entry point: an engine rule's name, a verifier name, or your own rule.
* :data:`ENGINE_RULES` -- the sampling-mode rules of EAGLE, Medusa, SGLang, vLLM, transformers, llama.cpp and
  TensorRT-LLM / MAX, each with its source (:mod:`specresearch.audit.engines`); :data:`LOSSY_SETTINGS`.
* :func:`rule_from_acceptance` -- both forms (exact and torch) of a rule from its acceptance probability.
* :func:`lossy_frontier` -- the most acceptance any rule buys with a total-variation budget eps.

Laws are enumerated exactly on small models (:mod:`specresearch.exact`); ``docs/audit.md`` has the engines'
table and the frontier.
"""

from specresearch.audit.custom import RESIDUALS, rule_from_acceptance
from specresearch.audit.engines import ENGINE_RULES, LOSSY_SETTINGS, engine_rule
from specresearch.audit.frontier import (
    frontier_closed_form,
    frontier_float,
    lossy_frontier,
)
from specresearch.audit.report import AuditReport, Counterexample, audit, engine_table
from specresearch.audit.rules import (
    Rule,
    expected_accepted,
    optimum,
    output_law,
    step_law,
    total_variation,
)

__all__ = [
    "ENGINE_RULES",
    "LOSSY_SETTINGS",
    "RESIDUALS",
    "AuditReport",
    "Counterexample",
    "Rule",
    "audit",
    "engine_rule",
    "engine_table",
    "expected_accepted",
    "frontier_closed_form",
    "frontier_float",
    "lossy_frontier",
    "optimum",
    "output_law",
    "rule_from_acceptance",
    "step_law",
    "total_variation",
]
