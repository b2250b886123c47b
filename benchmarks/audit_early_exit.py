"""Audit by execution of transformers' early-exit self-speculation, the committed record:
``generate(assistant_early_exit=1, do_sample=True)`` (transformers' own ``EarlyExitCandidateGenerator``, LayerSkip's
drafting with the target's first layers and its head, and ``_speculative_sampling``) on a tiny two-layer Llama
(``models.families.tiny_family_model``), the measured law of the first two tokens against the target's
(``specresearch.audit.execute``, engine ``transformers-early-exit``).

    python benchmarks/audit_early_exit.py [--out benchmarks/records/audit_early_exit.json] [--scale 1.0]

Resumable (``audit.execute.record_tiny_runs``): configurations already in the record are kept, the rest run and are
written one by one. The rows join docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import sys

from specresearch.audit.execute import TinyRun, tiny_runs_main
from specresearch.models.families import tiny_family_model

SEED = 0  # the model's weights


def build():
    return tiny_family_model("llama", "sdpa", seed=SEED, init_std=0.5), None, {}


def _run(n: int, temperature: float = 1.0, options: dict | None = None) -> TinyRun:
    return TinyRun(f"tiny two-layer Llama (seed {SEED})", build, "transformers-early-exit", 2, n, temperature,
                   {"assistant_early_exit": 1, **(options or {})})


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run(16000), _run(8000, 0.7, {"top_k": 20}), _run(8000, options={"num_assistant_tokens": 3})]


def main(argv=None) -> int:
    return tiny_runs_main(__doc__, "audit_early_exit", RUNS, argv)


if __name__ == "__main__":
    sys.exit(main())
