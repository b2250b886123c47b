"""Audit by execution of transformers' speculative decoding across vocabularies, the committed record:
``generate(assistant_model=draft, tokenizer=..., assistant_tokenizer=..., do_sample=True)`` (transformers' own
``UniversalSpeculativeDecodingGenerator`` and ``_speculative_sampling``) on a tiny Llama pair over word tokenizers whose
assistant has 12 words the target lacks (``models.families.tiny_usd_pair``), the measured law of the first two tokens
against the target's and against the law predicted from the draft's own law and the q transformers verifies with
(``specresearch.audit.execute``, engine ``transformers-usd``).

    python benchmarks/audit_usd.py [--out benchmarks/records/audit_usd.json] [--scale 1.0]

Resumable (``audit.execute.record_tiny_runs``): configurations already in the record are kept, the rest run and are
written one by one. The rows join docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import sys

from specresearch.audit.execute import TinyRun, tiny_runs_main
from specresearch.models.families import tiny_usd_pair

SEED = 0  # the pair's weights
PROMPT = (11, 14, 32)  # "w9 w12 w30" in the target's words


def build():
    target, draft, target_tokenizer, assistant_tokenizer = tiny_usd_pair(seed=SEED)
    return target, draft, {}, dict(tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)


def _run(n: int, temperature: float = 1.0, options: dict | None = None) -> TinyRun:
    return TinyRun(f"tiny Llama pair over word tokenizers, the assistant with 12 words of its own (seed {SEED})", build,
                   "transformers-usd", 2, n, temperature, options or {}, PROMPT)


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run(8000), _run(6000, 0.7), _run(6000, options={"num_assistant_tokens": 3})]


def main(argv=None) -> int:
    return tiny_runs_main(__doc__, "audit_usd", RUNS, argv)


if __name__ == "__main__":
    sys.exit(main())
