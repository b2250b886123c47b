"""The alpha dial: token vs block verification on SmolLM2-135M with drafts of controlled quality.

One batched ``bench.run_batched`` sweep per draft (``specresearch.drafts.dial``: the target mixed with the
shipped draft v8k-4l at weight lam; lam = 0 is v8k-4l itself, run directly), T in {0.2, 0.6, 1.0},
gamma in {8, 4}, token and block verification, 14 prompts (two per category) x 20 tokens, records (with
the per-step expected counts of both verifiers) in ``<out>/<draft>.csv``. Dial drafts run the target for
every draft token: only BE is meaningful with them, never wall-clock (batched runs record no timings).

Resumable: rerun the same command and only the (draft, T, gamma, prompt) rows still missing are run.

    nohup python benchmarks/run_dial_sweep.py --threads 1 > results/dial_sweep.log 2>&1 &
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from specresearch.drafts.registry import draft_from_name
from specresearch.experiments import bench
from specresearch.experiments.records import write_run_info
from specresearch.models.embedded import load_embedded

DRAFTS = ("v8k-4l", "dial-mix:0.5", "dial-mix:0.25", "dial-mix:0.75")
CONFIG = bench.BenchConfig(temperatures=(0.2, 0.6, 1.0), gammas=(8, 4), max_new_tokens=20, num_prompts=14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/sweeps/dial", help="directory of the per-draft record files")
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS))
    parser.add_argument("--prompts", type=int, default=CONFIG.num_prompts,
                        help="evenly spaced (14: two per category; the 7 of one per category are among them)")
    parser.add_argument("--max-new-tokens", type=int, default=CONFIG.max_new_tokens)
    parser.add_argument("--gammas", nargs="+", type=int, default=list(CONFIG.gammas))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = dataclasses.replace(CONFIG, max_new_tokens=args.max_new_tokens, num_prompts=args.prompts,
                                 gammas=tuple(args.gammas))
    target, tokenizer = load_embedded(device="cpu")
    prompts = bench.load_bench_prompts(tokenizer, config)
    for gamma in config.gammas:  # gamma = 8 (the paper's) for every draft first
        for name in args.drafts:
            path = Path(args.out) / f"{name.replace(':', '_')}.csv"
            write_run_info(path, command=" ".join(["python", *sys.argv]), draft=name, batched=True,
                                 config=dataclasses.asdict(config), gamma=gamma, prompts=[p.id for p in prompts])
            start = time.perf_counter()
            at_gamma = dataclasses.replace(config, gammas=(gamma,))
            bench.run_batched(target, draft_from_name(name, target), prompts, at_gamma, path, run_id=name,
                              eos_token_id=tokenizer.eos_token_id)
            print(f"{name}, gamma = {gamma}: {time.perf_counter() - start:.0f} s -> {path}", flush=True)


if __name__ == "__main__":
    main()
