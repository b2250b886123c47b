"""Audit by execution of transformers' Gemma 4 assistant path, the committed record: ``generate(assistant_model=
assistant, do_sample=True)`` with a Gemma 4 assistant (transformers' own ``SinglePositionMultiTokenCandidateGenerator``
and ``_speculative_sampling``) on a tiny random-weight Gemma 4 pair (``models.families.tiny_gemma4_pair``; no Gemma 4
model is embedded), the measured law of the first two tokens against the target's and against the law the rule
``hf-assisted`` with ``assistant="greedy"`` predicts (``specresearch.audit.execute``, engine
``transformers-gemma4-assistant``).

    python benchmarks/audit_gemma4.py [--out benchmarks/records/audit_gemma4.json] [--scale 1.0]

Resumable: configurations already in the record are kept, the rest run and are written one by one. The rows join
docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specresearch.audit.execute import execute
from specresearch.audit.report import config_key
from specresearch.experiments.records import git_commit, record_header, write_json_record
from specresearch.models.families import tiny_gemma4_pair

PROMPT = [5, 9, 17, 3]
SEED = 0  # the pair's weights
MODEL = f"tiny Gemma 4 pair (seed {SEED})"
# (n_tokens, N, temperature, options); each row records the TV its N detects (cells of expected count >= 20)
CONFIGS = [
    (2, 12000, 1.0, {}),
    (2, 8000, 0.7, {"top_k": 20}),
    (2, 8000, 1.0, {"num_assistant_tokens": 3}),
]
MIN_EXPECTED = 20.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/records/audit_gemma4.json")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else record_header(
        "benchmarks/audit_gemma4.py", sys.argv[1:] if argv is None else argv, rows=[])
    done = {config_key(r["engine"], r["n_tokens"], r["temperature"], r["options"], [r["model"], r["prompt"]])
            for r in record["rows"]}
    torch.set_num_threads(args.threads)
    for n_tokens, n, temperature, options in CONFIGS:
        if config_key("transformers-gemma4-assistant", n_tokens, temperature, options, [MODEL, PROMPT]) in done:
            continue
        target, assistant = tiny_gemma4_pair(seed=SEED)
        result = execute("transformers-gemma4-assistant", prompt=PROMPT, n_tokens=n_tokens, temperature=temperature,
                         num_samples=max(20, round(n * args.scale)), target=target, draft=assistant,
                         min_expected=MIN_EXPECTED, **options)
        print(result, flush=True)
        record["rows"].append({"model": MODEL, "prompt": PROMPT, "commit": git_commit()} | result.as_record())
        write_json_record(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
