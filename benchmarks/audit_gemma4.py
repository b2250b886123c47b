"""Audit by execution of transformers' Gemma 4 assistant path, the committed record: ``generate(assistant_model=
assistant, do_sample=True)`` with a Gemma 4 assistant (transformers' own ``SinglePositionMultiTokenCandidateGenerator``
and ``_speculative_sampling``) on a tiny random-weight Gemma 4 pair (``models.families.tiny_gemma4_pair``; no Gemma 4
model is embedded), the measured law of the first two tokens against the target's and against the law the rule
``hf-assisted`` with ``assistant="greedy"`` predicts (``specresearch.audit.execute``, engine
``transformers-gemma4-assistant``).

    python benchmarks/audit_gemma4.py [--out benchmarks/records/audit_gemma4.json] [--scale 1.0]

Resumable (``audit.execute.record_tiny_runs``): configurations already in the record are kept, the rest run and are
written one by one. The rows join docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import sys

from specresearch.audit.execute import TinyRun, tiny_runs_main
from specresearch.models.families import tiny_gemma4_pair

SEED = 0  # the pair's weights


def build():
    return (*tiny_gemma4_pair(seed=SEED), {})


def _run(n: int, temperature: float = 1.0, options: dict | None = None) -> TinyRun:
    return TinyRun(f"tiny Gemma 4 pair (seed {SEED})", build, "transformers-gemma4-assistant", 2, n, temperature,
                   options or {}, (5, 9, 17, 3))


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run(12000), _run(8000, 0.7, {"top_k": 20}), _run(8000, options={"num_assistant_tokens": 3})]


def main(argv=None) -> int:
    return tiny_runs_main(__doc__, "audit_gemma4", RUNS, argv)


if __name__ == "__main__":
    sys.exit(main())
