"""Statistical losslessness of the engine on the embedded pair: the README p-value table.

Target: SmolLM2-135M-Instruct (``load_embedded``); draft: its first decoder layer + head
(``truncated_draft(target, 1)``), whose q differs clearly from p (so a wrong residual is visible).
For each sampling config and verifier, ``stats.lossless_test`` runs N speculative generations of one
prompt (k = 3 tokens, gamma = 2) and compares the 3-token law with the exact target law.
The wrong verifier (``stats.wrong_residual_verify``: residual p instead of max(p - q, 0)) must be
rejected; the correct ones must not (their p-values are uniform under H0: FPR = the level you pick). Each row states
the smallest total-variation deviation its N detects (power 0.9 at level 1e-3, ``stats.detectable_tv``), and with
``--json`` each record carries its command, commit, machine and the draft's sha256 (``records.record_header``).

    .venv/bin/python benchmarks/run_lossless.py                 # ~10 min on 1 thread
    .venv/bin/python benchmarks/run_lossless.py --num-samples 100 --json /tmp/lossless.jsonl   # quick
    .venv/bin/python benchmarks/run_lossless.py --draft fp16:eagle3-v8k --samplings T=1.0 --verifiers block \
        --num-samples 25000 --min-expected 25 --json benchmarks/records/lossless_power_fp16-eagle3-v8k.jsonl
    .venv/bin/python benchmarks/run_lossless.py --draft fp16:eagle3-v8k --samplings T=1.0 --verifiers traversal \
        --num-drafts 2 --gamma 2 --num-samples 25000 --min-expected 50 --json benchmarks/records/lossless_trees_fp16-eagle3-v8k.jsonl

``--executor ray`` (``--address`` a cluster's head, ``--workers`` CPUs here) runs each test's seed blocks of
``--batch-size`` generations as Ray tasks, each worker loading the pair once; the counts are those of one process
(``experiments.executor``). With ``--json``, finished blocks are appended to ``<json>.blocks.jsonl`` as they land, and a
rerun of the same command runs only the blocks that file lacks.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import asdict

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name, load_pair, truncated_draft
from specresearch.experiments.executor import add_executor_arguments, make_executor
from specresearch.experiments.records import record_header
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


WRONG = "wrong residual (p, not max(p-q,0))"


def _runs(sampling_name: str, wanted):
    """(name, verifier) pairs: ``--verifiers`` (``wrong`` = the wrong residual), else token and block, and the wrong
    verifier where it runs by default."""
    if wanted:
        return [(WRONG, wrong_residual_verify) if w == "wrong" else (w, w) for w in wanted]
    return [("token", "token"), ("block", "block")] + ([(WRONG, wrong_residual_verify)] if sampling_name in WRONG_FOR else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=400, help="generations per (sampling, verifier)")
    parser.add_argument("--prompt", default="Hello")
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--draft", help="a draft name for drafts.registry.draft_from_name instead (e.g. a shipped feature head)")
    parser.add_argument("--gamma", type=int, default=2)
    parser.add_argument("--k", type=int, default=3, help="generated tokens compared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--samplings", help=f"comma-separated subset of {list(SAMPLINGS)}")
    parser.add_argument("--verifiers", help="comma-separated: token, block, wrong, or a multi-draft rule with --num-drafts")
    parser.add_argument("--num-drafts", type=int, default=1, help="draft paths per step (a tree; a multi-draft --verifiers)")
    parser.add_argument("--draft-law", default="iid", help="iid | without_replacement | dynamic | static (with --num-drafts)")
    parser.add_argument("--tree-nodes", type=int, help="nodes of a dynamic or static tree (default num-drafts x gamma)")
    parser.add_argument("--min-expected", type=float, default=5.0, help="smallest expected count of a cell")
    parser.add_argument("--json", help="also write one JSON record per run to this file")
    parser.add_argument("--batch-size", type=int, default=256, help="generations per seed block (a Ray task)")
    add_executor_arguments(parser)
    args = parser.parse_args()
    executor = make_executor(args, local=None)
    # the workers' recipe for the same pair (drafts.registry.load_pair); the blocks file of a resumable run
    models = functools.partial(load_pair, draft=args.draft or f"truncated:{args.draft_layers}", device="cpu")
    blocks_file = f"{args.json}.blocks.jsonl" if args.json and executor is not None else None
    samplings = {n: s for n, s in SAMPLINGS.items() if not args.samplings or n in args.samplings.split(",")}
    wanted = args.verifiers.split(",") if args.verifiers else None
    torch.set_num_threads(args.threads)

    target, tokenizer = load_embedded(device="cpu")
    draft = truncated_draft(target, args.draft_layers) if args.draft is None else draft_from_name(args.draft, target, tokenizer)
    prompt = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    records = []
    described = f"first {args.draft_layers} layer(s)" if args.draft is None else args.draft
    print(f"prompt {args.prompt!r} ({len(prompt)} tokens), draft = {described}, "
          f"gamma = {args.gamma}, k = {args.k}, N = {args.num_samples} per row, seed = {args.seed}, "
          f"paths per step = {args.num_drafts}\n")
    print("| sampling | verifier | N | cells | detects TV >= | chi-square p | exact Bonferroni p | rejected at 1e-3 | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    tree = {"num_drafts": args.num_drafts, "draft_law": args.draft_law} if args.num_drafts > 1 else {}
    if args.tree_nodes is not None:
        tree["tree_nodes"] = args.tree_nodes
    header = record_header("benchmarks/run_lossless.py", sys.argv[1:], draft=args.draft)
    for index, (name, sampling) in enumerate(samplings.items()):
        law = sequence_law(target, prompt, sampling=sampling, k=args.k, num_samples=args.num_samples,
                           min_expected=args.min_expected)
        for offset, (verifier_name, verifier) in enumerate(_runs(name, wanted)):
            start = time.perf_counter()
            result = lossless_test(target, draft, verifier, prompt, sampling=sampling, gamma=args.gamma, k=args.k,
                                   num_samples=args.num_samples, seed=args.seed + 10 * index + offset, law=law,
                                   min_expected=args.min_expected, batch_size=args.batch_size, executor=executor,
                                   models=models, blocks_file=blocks_file, **tree)
            seconds = time.perf_counter() - start
            print(f"| {name} | {verifier_name} | {result.num_samples} | {len(result.cells)} | {result.detectable_tv():.3f} | "
                  f"{result.p_value:.3g} | {result.bonferroni_p_value:.3g} | {'yes' if result.rejects(1e-3) else 'no'} | "
                  f"{seconds:.0f} |", flush=True)
            record = {k: v for k, v in asdict(result).items() if k not in ("cells", "note")}
            records.append({"sampling": name, "verifier": verifier_name, **record, "wall_seconds": seconds,
                            "cells": len(result.cells), "detectable_tv": result.detectable_tv(),
                            "executor": args.executor, "workers": getattr(executor, "workers", 1), **header, **tree})
    if args.json:
        with open(args.json, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
