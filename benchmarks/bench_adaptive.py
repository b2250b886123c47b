"""Adaptive draft lengths (``speculative_generate(stop_below=)``) against fixed gammas, side by side in one run.

The shipped feature head in float16 (``fp16:eagle3-v8k``) drafts for SmolLM2-135M-Instruct, block verification,
one thread, held-out chat prompts (``data/prompts.jsonl``, evenly spaced), 48 new tokens. For each prompt and
temperature, autoregressive decoding and every run below go in turn with the same per-prompt seed (``--repeats N``:
N times, the runs in a shuffled order); the record holds tokens per target call (tau) and tokens/s over autoregressive
decoding of the same prompt in the same round, and the summary the speed pooled over prompts with bootstrap intervals.
Writes ``benchmarks/records/adaptive_<cpu>.csv`` and ``.json`` (command, commit, machine, the head's sha256).
A benchmark: nothing is asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_adaptive.py --prompts 8 --threads 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.experiments.draft_analysis import pooled_speeds
from specresearch.experiments.records import machine_info, record_header
from specresearch.paths import data_dir, repo_root

RUNS = {"gamma 1": dict(gamma=1), "gamma 2": dict(gamma=2), "gamma 3": dict(gamma=3),
        "gamma <= 4, stop below 0.5": dict(gamma=4, stop_below=0.5), "gamma <= 4, stop below 0.7": dict(gamma=4, stop_below=0.7),
        "gamma <= 4, stop below 0.9": dict(gamma=4, stop_below=0.9)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="times each prompt and temperature, runs shuffled")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair(draft="fp16:eagle3-v8k")
    prompts = evenly_spaced(load_prompts(data_dir() / "prompts.jsonl"), args.prompts)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = encode_chat([prompt], tokenizer)[0].tolist()
        for temperature, repeat in itertools.product((0.0, 1.0), range(args.repeats)):
            sampling, seed, eos = SamplingConfig(temperature=temperature), [i], tokenizer.eos_token_id
            ar = autoregressive_generate(target, [ids], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed, eos_token_id=eos)
            labels = list(RUNS)
            if args.repeats > 1:
                labels = random.Random(f"{i} {temperature} {repeat}").sample(labels, len(labels))
            for label in labels:
                out = speculative_generate(target, draft, [ids], verifier="block", max_new_tokens=args.max_new_tokens,
                                           sampling=sampling, seed=seed, eos_token_id=eos, **RUNS[label])
                rows.append({"prompt_id": prompt["id"], "temperature": temperature, "repeat": repeat, "run": label,
                             "tau": out.block_efficiency, "draft_calls": out.draft_calls,
                             "target_calls": out.target_calls, "tokens": out.num_tokens, "seconds": out.seconds,
                             "ar_tokens": ar.num_tokens, "ar_seconds": ar.seconds,
                             "vs_autoregressive": out.tokens_per_second / ar.tokens_per_second})
    import pandas as pd

    machine = machine_info()
    stem = repo_root() / "benchmarks" / "records" / f"adaptive_{machine.get('cpu', 'cpu').split()[0].lower()}"
    frame = pd.DataFrame(rows)
    frame.to_csv(stem.with_suffix(".csv"), index=False)
    header = record_header("benchmarks/bench_adaptive.py", sys.argv[1:], draft="fp16:eagle3-v8k")
    stem.with_suffix(".json").write_text(json.dumps(header, indent=2) + "\n")
    summary = frame.groupby(["temperature", "run"], sort=False).agg(
        tau=("tau", "mean"), vs_autoregressive=("vs_autoregressive", lambda v: statistics.median(v)))
    pooled = pooled_speeds(frame).set_index(["temperature", "run"])[["pooled", "low", "high"]]
    print(summary.join(pooled).round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
