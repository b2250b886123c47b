"""What a tree step costs here, part by part, and how far the target's cost curve r_n explains it.

On the embedded pair (the shipped head drafting by default), one thread: r_n, a cached target call scoring n tokens
over one scoring 1, for n = 1..``--max-call`` (``engine.cost.score_seconds``); then, per run of
``bench_trees.RUNS`` and held-out chat prompt (``data/prompts.jsonl``, evenly spaced; the same seed for every run),
the engine's own per-step timings (``step_timing=True``): the target call, the draft calls and the step's own work
(sampling, tree building, verification), each over the mean autoregressive step of the same prompt. Beside them:
the tokens the target scored per call (``StepRecord.scored``), r at that width looked up step by step (what the curve
predicts for the target call), tau and the speed over autoregressive decoding. The target call follows the curve; the
draft's K rows per depth and the rule's work make up the rest.

Writes ``benchmarks/records/tree_steps_<cpu>.json`` (command, commit, machine, weights' digests). A benchmark:
nothing is asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_tree_steps.py --prompts 4 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_trees import RUNS

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair
from specresearch.engine.cost import score_seconds
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.experiments.records import record_header, write_json_record
from specresearch.paths import data_dir, repo_root

DEFAULT_RUNS = ("chain block g1", "chain block g2", "traversal K2 g1", "traversal K3 g1", "traversal K2 g2",
                "dynamic K3 g1 n3", "dynamic K2 g2 n4", "dynamic K3 g3 n6")


def step_parts(target, draft, prompts, runs, max_new_tokens: int, temperature: float, ratios) -> list[dict]:
    """Per run: the mean target / draft / own seconds of a step over the mean autoregressive step, and r at the
    width of each step's call, averaged over the prompts' steps."""
    sampling = SamplingConfig(temperature=temperature)
    parts = {label: {"target": [], "draft": [], "own": [], "step": [], "r": [], "scored": [], "tau": [], "speed": []}
             for label in runs}
    for i, ids in enumerate(prompts):
        prompt = [ids.tolist()]
        plain = autoregressive_generate(target, prompt, max_new_tokens=max_new_tokens, sampling=sampling, seed=i,
                                        step_timing=True)
        ar_step = statistics.mean(s.seconds for s in plain.steps)
        for label in runs:
            out = speculative_generate(target, draft, prompt, max_new_tokens=max_new_tokens, sampling=sampling, seed=i,
                                       step_timing=True, **RUNS[label])
            steps = out.steps
            widest = max(s.scored[0] for s in steps)
            if widest > len(ratios):
                raise ValueError(f"{label} scores {widest} tokens in a call: time r that far (--max-call {widest})")
            row = parts[label]
            row["target"].append(statistics.mean(s.target_seconds for s in steps) / ar_step)
            row["draft"].append(statistics.mean(s.draft_seconds for s in steps) / ar_step)
            row["own"].append(statistics.mean(s.overhead_seconds for s in steps) / ar_step)
            row["step"].append(statistics.mean(s.seconds for s in steps) / ar_step)
            row["r"].append(statistics.mean(ratios[s.scored[0] - 1] for s in steps))
            row["scored"].append(statistics.mean(s.scored[0] for s in steps))
            row["tau"].append(out.block_efficiency)
            row["speed"].append(out.speedup_over(plain))
    return [{"run": label, **{key: statistics.mean(values) for key, values in row.items()}}
            for label, row in parts.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="fp16:eagle3-v8k")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-call", type=int, default=8, help="time r_n for n = 1..MAX_CALL")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), choices=sorted(RUNS))
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1 or args.max_call < 2 or args.threads < 1:
        parser.error("--prompts, --max-new-tokens and --threads must be >= 1, --max-call >= 2")
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair(draft=args.draft)
    seconds = score_seconds(target, tuple(range(1, args.max_call + 1)))
    ratios = [seconds[n] / seconds[1] for n in range(1, args.max_call + 1)]
    prompts = encode_chat(evenly_spaced(load_prompts(data_dir("prompts.jsonl")), args.prompts), tokenizer)
    rows = step_parts(target, draft, prompts, args.runs, args.max_new_tokens, args.temperature, ratios)
    record = record_header("benchmarks/bench_tree_steps.py", sys.argv[1:], draft=args.draft, r=ratios,
                           temperature=args.temperature, rows=rows)
    cpu = record["machine"].get("cpu", "cpu").split()[0].lower()
    out = repo_root() / "benchmarks" / "records" / f"tree_steps_{cpu}.json"
    write_json_record(out, record, indent=2)
    print("r_n: " + ", ".join(f"{r:.2f}" for r in ratios))
    header = ("run", "scored", "r", "target", "draft", "own", "step", "tau", "speed")
    print(f"{header[0]:<18} " + " ".join(f"{name:>6}" for name in header[1:]))
    for row in rows:
        print(f"{row['run']:<18} " + " ".join(f"{row[name]:6.2f}" for name in header[1:]) + "x")
    print(f"({out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
