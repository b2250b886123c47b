"""Statistical losslessness of the engine on the embedded pair: the README p-value table.

Target: SmolLM2-135M-Instruct (``load_embedded``); draft: its first decoder layer + head
(``truncated_draft(target, 1)``), whose q differs clearly from p (so a wrong residual is visible).
For each sampling config and verifier, ``stats.lossless_test`` runs N speculative generations of one
prompt (k = 3 tokens, gamma = 2) and compares the 3-token law with the exact target law.
The wrong verifier (``stats.wrong_residual_verify``: residual p instead of max(p - q, 0)) must be
rejected; the correct ones must not (their p-values are uniform under H0: FPR = the level you pick).

    .venv/bin/python benchmarks/run_lossless.py                 # ~10 min on 1 thread
    .venv/bin/python benchmarks/run_lossless.py --num-samples 100 --json /tmp/lossless.jsonl   # quick
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name, truncated_draft
from specresearch.experiments.stats import (
    lossless_test,
    sequence_law,
    wrong_residual_verify,
)
from specresearch.models.embedded import load_embedded

SAMPLINGS = {
    "T=0.6": SamplingConfig(temperature=0.6),
    "T=1.0": SamplingConfig(temperature=1.0),
    "T=1.0, top-k=50": SamplingConfig(temperature=1.0, top_k=50),
    "T=1.0, top-p=0.9": SamplingConfig(temperature=1.0, top_p=0.9),
}
WRONG_FOR = ("T=0.6", "T=1.0")  # the wrong verifier runs on these (time budget)


def _runs(sampling_name: str):
    verifiers = [("token", "token"), ("block", "block")]
    if sampling_name in WRONG_FOR:
        verifiers.append(("wrong residual (p, not max(p-q,0))", wrong_residual_verify))
    return verifiers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=400, help="generations per (sampling, verifier)")
    parser.add_argument("--prompt", default="Hello")
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--draft", help="a draft name for drafts.draft_from_name instead (e.g. a shipped feature head)")
    parser.add_argument("--gamma", type=int, default=2)
    parser.add_argument("--k", type=int, default=3, help="generated tokens compared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write one JSON record per run to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_embedded(device="cpu")
    draft = truncated_draft(target, args.draft_layers) if args.draft is None else draft_from_name(args.draft, target, tokenizer)
    prompt = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    records = []
    described = f"first {args.draft_layers} layer(s)" if args.draft is None else args.draft
    print(f"prompt {args.prompt!r} ({len(prompt)} tokens), draft = {described}, "
          f"gamma = {args.gamma}, k = {args.k}, N = {args.num_samples} per row, seed = {args.seed}\n")
    print("| sampling | verifier | N | cells | chi-square p | exact Bonferroni p | rejected at 1e-3 | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for index, (name, sampling) in enumerate(SAMPLINGS.items()):
        law = sequence_law(target, prompt, sampling=sampling, k=args.k, num_samples=args.num_samples)
        for offset, (verifier_name, verifier) in enumerate(_runs(name)):
            start = time.perf_counter()
            result = lossless_test(target, draft, verifier, prompt, sampling=sampling, gamma=args.gamma, k=args.k,
                                   num_samples=args.num_samples, seed=args.seed + 10 * index + offset, law=law)
            seconds = time.perf_counter() - start
            print(f"| {name} | {verifier_name} | {result.num_samples} | {len(result.cells)} | {result.p_value:.3g} | "
                  f"{result.bonferroni_p_value:.3g} | {'yes' if result.rejects(1e-3) else 'no'} | {seconds:.0f} |",
                  flush=True)
            record = {k: v for k, v in asdict(result).items() if k not in ("cells", "note")}
            records.append({"sampling": name, "verifier": verifier_name, **record, "wall_seconds": seconds})
    if args.json:
        with open(args.json, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
