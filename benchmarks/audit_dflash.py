"""Audit by execution of transformers' DFlash path, the committed record: ``generate(assistant_model=assistant,
speculation_type="dflash", do_sample=True)`` (transformers' own ``DFlashTokenCandidateGenerator`` and
``_speculative_sampling``) on a tiny Llama with a tiny DFlash block drafter (``models.families.tiny_dflash_pair``),
the measured law of the first two tokens against the target's (``specresearch.audit.execute``, engine
``transformers-dflash``).

    python benchmarks/audit_dflash.py [--out benchmarks/records/audit_dflash.json] [--scale 1.0]

Resumable (``audit.execute.record_tiny_runs``): configurations already in the record are kept, the rest run and are
written one by one. The rows join docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import functools
import sys

from specresearch.audit.execute import TinyRun, tiny_runs_main
from specresearch.models.families import tiny_dflash_pair

SEED = 0  # the pair's weights


def build(block_size: int):
    return (*tiny_dflash_pair(seed=SEED, block_size=block_size), {})


def _run(n: int, block_size: int, temperature: float = 1.0, options: dict | None = None) -> TinyRun:
    return TinyRun(f"tiny Llama with a DFlash drafter of block {block_size} (seed {SEED})",
                   functools.partial(build, block_size), "transformers-dflash", 2, n, temperature, options or {})


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run(16000, 3), _run(8000, 3, 0.7, {"top_k": 20}), _run(8000, 5)]


def main(argv=None) -> int:
    return tiny_runs_main(__doc__, "audit_dflash", RUNS, argv)


if __name__ == "__main__":
    sys.exit(main())
