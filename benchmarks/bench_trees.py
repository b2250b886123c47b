"""Draft trees against chains and autoregressive decoding on the embedded pair, side by side in one run.

Two measurements, both on SmolLM2-135M-Instruct with the distilled ``v8k-4l`` draft by default (``--draft``: any
draft; the engine copies its rows to draft K paths), one thread by default:

Runs are labelled by rule, paths K, depth g (gamma) and, for top-k trees, nodes n: "dynamic K3 g3 n6" is EAGLE-2's
dynamic tree (``draft_law="dynamic"``, one-hot rule). Each row records tau, the tokens emitted per token the target
scored (``per_scored``: what a call buys per unit of its width), the speed over autoregressive decoding, and on
sampled trees ``tau_<rule>``: 1 + each sequential rule's E[accepted] on the same trees (``core.tree_expectations``),
the rules compared without the acceptance coins' noise.

1. ``tree_cost``: one cached target call scoring n tokens as a tree (``score_tree``: 4-D mask, positions by depth)
   against the same call scoring n tokens as a chain (``score``), B = 1, a 64-token context, interleaved medians.
   The tree's extra cost is the mask and the gather of the accepted path afterwards.
2. ``generate``: for each held-out chat prompt (``data/prompts.jsonl``, evenly spaced) and temperature, autoregressive
   decoding, the chain (block verification) and tree rules, run in turn with the same per-prompt seed; tokens per
   target call (tau) and wall clock against autoregressive decoding of the same prompt in the same round.

Writes ``benchmarks/records/trees_<machine>.csv`` and ``.json`` (command, commit, machine, the weights' sha256).
A benchmark: nothing is asserted. The CSV is rewritten after each prompt; ``--resume`` keeps the prompts it holds
and runs the others. ``--executor ray`` (``--workers``, ``--address``: ``experiments.executor``) runs each prompt as a
Ray task, every worker loading the pair once; a prompt's speculative and autoregressive runs share its worker, so
the speed-ups stay paired (on one machine the workers share its memory bandwidth: compare ratios, not tokens/s).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_trees.py --prompts 8 --max-new-tokens 48 --threads 1
    PYTHONPATH=. .venv/bin/python benchmarks/bench_trees.py --draft fp16:eagle3-v8k --temperatures 1 \
        --runs "chain block g1" "chain block g2" "traversal K2 g1" "traversal K3 g1" "traversal K2 g2" \
        "rrs w/o repl. K2 g1" --out benchmarks/records/trees_head_amd
    PYTHONPATH=. .venv/bin/python benchmarks/bench_trees.py --prompt-set mt-bench --prompts 16 --executor ray --workers 2
    PYTHONPATH=. .venv/bin/python benchmarks/bench_trees.py --table benchmarks/records/trees_head_h100.csv \
        benchmarks/records/trees_t0_chat_h100_2.csv benchmarks/records/trees_t0_chat_h100_3.csv   # replicates, pooled
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from specresearch.config import SamplingConfig
from specresearch.core.tree_expectations import TREE_EXPECTATIONS
from specresearch.drafts.registry import load_pair
from specresearch.engine.cost import tree_options
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import (
    encode_chat,
    evenly_spaced,
    load_prompts,
    prompt_set_file,
)
from specresearch.engine.timing import TimedCall, interleaved_medians
from specresearch.experiments.draft_analysis import pooled_speeds
from specresearch.experiments.executor import add_executor_arguments, loaded, make_executor, run_into_csv
from specresearch.experiments.records import machine_info, record_files, record_header
from specresearch.paths import data_dir, repo_root

RUNS = {  # label -> speculative_generate options
    "chain block g1": dict(verifier="block", gamma=1),
    "chain block g2": dict(verifier="block", gamma=2),
    "chain block g3": dict(verifier="block", gamma=3),
    "traversal K2 g2": dict(verifier="traversal", num_drafts=2, gamma=2),
    "traversal K3 g3": dict(verifier="traversal", num_drafts=3, gamma=3),
    "traversal K2 g3": dict(verifier="traversal", num_drafts=2, gamma=3),
    "traversal K4 g3": dict(verifier="traversal", num_drafts=4, gamma=3),
    "rrs w/o repl. K3 g2": dict(verifier="rrs_without_replacement", num_drafts=3, gamma=2, draft_law="without_replacement"),
    "gbv K2 g3": dict(verifier="gbv", num_drafts=2, gamma=3),
    "gbv K3 g8": dict(verifier="gbv", num_drafts=3, gamma=8),
    "traversal K2 g1": dict(verifier="traversal", num_drafts=2, gamma=1),
    "traversal K3 g1": dict(verifier="traversal", num_drafts=3, gamma=1),
    "rrs w/o repl. K2 g1": dict(verifier="rrs_without_replacement", num_drafts=2, gamma=1, draft_law="without_replacement"),
    # EAGLE-2's deterministic tree: top-K children per expanded node, depth g, the n most probable nodes; one-hot rule
    "dynamic K2 g1 n2": tree_options((2, 1, 2)),
    "dynamic K3 g1 n3": tree_options((3, 1, 3)),
    "dynamic K2 g2 n3": tree_options((2, 2, 3)),
    "dynamic K2 g2 n4": tree_options((2, 2, 4)),
    "dynamic K2 g3 n4": tree_options((2, 3, 4)),
    "dynamic K2 g3 n5": tree_options((2, 3, 5)),
    "dynamic K3 g3 n6": tree_options((3, 3, 6)),
    "dynamic K4 g4 n10": tree_options((4, 4, 10)),
    # wider and deeper trees, for a device whose call costs about the same up to tens of tokens (a GPU)
    "chain block g4": dict(verifier="block", gamma=4),
    "dynamic K4 g6 n16": tree_options((4, 6, 16)),
    "dynamic K8 g6 n32": tree_options((8, 6, 32)),
    "dynamic K10 g6 n60": tree_options((10, 6, 60)),
}
DEFAULT_RUNS = ("chain block g2", "chain block g3", "traversal K2 g2", "traversal K3 g3", "rrs w/o repl. K3 g2", "gbv K2 g3")


def tree_cost(target, sizes=(4, 8), context: int = 64, repeats: int = 30) -> list[dict]:
    """Median seconds of a target call scoring n tokens as a chain and as a (binary) tree of n nodes."""
    device = target.device
    ids = torch.randint(100, 5000, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for n in sizes:
        tokens = torch.randint(100, 5000, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]  # a binary tree in breadth-first order
        visible = torch.eye(n, dtype=torch.bool)
        depth = torch.zeros(1, n, dtype=torch.long)
        for i, p in enumerate(parents):
            if p >= 0:
                visible[i] |= visible[p]
                depth[0, i] = depth[0, p] + 1
        kept = torch.zeros(1, n, dtype=torch.bool)
        kept[0, 0] = True
        visible, depth, kept = visible.to(device), depth.to(device), kept.to(device)

        def start():
            target.prefill(ids, torch.ones_like(ids))

        def tree():
            target.begin_tree()
            target.score_tree(tokens, depth, visible[None])
            target.end_tree(kept)

        chain = TimedCall(lambda: target.score(tokens), setup=start)
        seconds = interleaved_medians([chain, TimedCall(tree, setup=start)], repeats=repeats, device=device)
        rows.append({"n": n, "chain_seconds": seconds[0], "tree_seconds": seconds[1], "tree_over_chain": seconds[1] / seconds[0]})
    return rows


def generate(target, draft, tokenizer, prompts, temperatures, max_new_tokens: int, runs=DEFAULT_RUNS,
             done=lambda rows: None, first: int = 0, repeats: int = 1) -> list[dict]:
    """The rows of every prompt, temperature and run; ``done(rows)`` after each prompt (the rows so far). Prompt i
    draws with seed 1000 + first + i, so a run over the later prompts (``first``) continues an earlier one. With
    ``repeats`` > 1 each prompt and temperature is timed that many times, each time an autoregressive run and then the
    runs in a shuffled order (column ``repeat``), so drift on a shared machine falls on all runs alike."""
    rows = []
    for i, prompt in enumerate(prompts, start=first):
        ids = encode_chat([prompt], tokenizer)[0].tolist()
        for temperature, repeat in itertools.product(temperatures, range(repeats)):
            sampling, seed = SamplingConfig(temperature=temperature), [1000 + i]
            ar = autoregressive_generate(target, [ids], max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                         eos_token_id=tokenizer.eos_token_id)
            order = list(runs) if repeats == 1 else random.Random(f"{i} {temperature} {repeat}").sample(runs, len(runs))
            for label in order:
                options = RUNS[label]
                sampled_tree = options.get("num_drafts", 1) > 1 and options.get("draft_law", "iid") in ("iid", "without_replacement")
                rules = tuple(m for m in TREE_EXPECTATIONS if m != "kseq" or options.get("gamma") == 1)  # K-SEQ: one token
                out = speculative_generate(target, draft, [ids], max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                           eos_token_id=tokenizer.eos_token_id, **options,
                                           expectations=rules if sampled_tree else ())
                counterfactual = {f"tau_{m}": statistics.mean(1 + s.expected[m][0] for s in out.steps)
                                  if sampled_tree and m in rules else float("nan") for m in TREE_EXPECTATIONS}
                rows.append({"prompt_id": prompt["id"], "temperature": temperature, "repeat": repeat, "run": label,
                             "tau": out.block_efficiency,
                             **counterfactual, "per_scored": out.tokens_per_scored, "target_calls": out.target_calls,
                             "tokens": out.num_tokens, "seconds": out.seconds, "ar_tokens": ar.num_tokens,
                             "ar_seconds": ar.seconds, "vs_autoregressive": out.tokens_per_second / ar.tokens_per_second})
        done(rows)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="record stem (default benchmarks/records/trees_<cpu>)")
    parser.add_argument("--draft", default="v8k-4l", help="any draft name (every draft kind draws trees)")
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), choices=sorted(RUNS))
    parser.add_argument("--prompt-set", choices=["mt-bench", "humaneval"], help="a paper's prompt set instead of data/prompts.jsonl")
    parser.add_argument("--start", type=int, default=0, help="skip the first prompts (a run that continues one stopped early)")
    parser.add_argument("--cost-sizes", type=int, nargs="+", default=[4, 8], help="tree sizes n of the chain-vs-tree call timing")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, auto, ... (timed there; the clock waits for the device)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time each prompt and temperature this many times, the runs in a shuffled order")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the target's weights and activations (autoregressive decoding runs the same target)")
    parser.add_argument("--resume", action="store_true", help="keep the prompts the CSV holds, run the others")
    add_executor_arguments(parser)
    parser.add_argument("--table", nargs="+", metavar="CSV",
                        help="summarise these records instead of running, pooled per prompt: replicates of one "
                             "design, or its runs on further prompts")
    args = parser.parse_args()
    if args.table:
        print(summarise(read_replicates(args.table)).round(3).to_string())
        return 0
    if not 0 <= args.start < args.prompts:
        parser.error(f"--start must be in [0, --prompts = {args.prompts}), got {args.start}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.cost_sizes) < 1:
        parser.error(f"--cost-sizes must be tree sizes >= 1, got {args.cost_sizes}")
    torch.set_num_threads(args.threads)
    executor = make_executor(args)
    pair = functools.partial(warm_pair, args.draft, args.device, args.dtype, args.threads)  # each worker's, once
    target, draft, tokenizer = loaded(pair)
    source = prompt_set_file(args.prompt_set) if args.prompt_set else data_dir() / "prompts.jsonl"
    prompts = evenly_spaced(load_prompts(source), args.prompts)[args.start:]
    cost = tree_cost(target, sizes=tuple(args.cost_sizes))
    machine = machine_info()
    stem = Path(args.out) if args.out else repo_root() / "benchmarks" / "records" / f"trees_{machine.get('cpu', 'cpu').split()[0].lower()}"
    csv_path, json_path = record_files(stem)  # the stem may hold dots
    stem.parent.mkdir(parents=True, exist_ok=True)
    header = record_header("benchmarks/bench_trees.py", sys.argv[1:], draft=args.draft, tree_cost=cost,
                           executor=args.executor, workers=getattr(executor, "workers", 1))
    json_path.write_text(json.dumps(header, indent=2) + "\n")
    print(json.dumps(cost, indent=1), flush=True)
    import pandas as pd

    blocks = [PromptBlock(pair, prompt, args.start + i, tuple(args.temperatures), args.max_new_tokens, tuple(args.runs),
                          args.repeats) for i, prompt in enumerate(prompts)]
    rows = run_into_csv(executor, run_prompt, blocks, [p["id"] for p in prompts], csv_path, key_column="prompt_id",
                        resume=args.resume)
    print(summarise(pd.DataFrame(rows)).round(3).to_string())
    return 0


def warm_pair(draft: str, device: str, dtype: str, threads: int):
    """The pair and tokenizer (``load_pair``), warmed up by one short generation: a worker's recipe."""
    torch.set_num_threads(threads)
    target, draft_model, tokenizer = load_pair(draft=draft, device=device, dtype=getattr(torch, dtype))
    speculative_generate(target, draft_model, [[1, 2, 3, 4]], max_new_tokens=4)
    return target, draft_model, tokenizer


class PromptBlock(NamedTuple):
    """One prompt of the sweep: its index (its seed is 1000 + index), the temperatures and runs."""

    pair: object
    prompt: dict
    index: int
    temperatures: tuple
    max_new_tokens: int
    runs: tuple
    repeats: int


def run_prompt(block: PromptBlock) -> list[dict]:
    """The rows of one prompt (``generate`` on it alone), in the worker that runs it."""
    target, draft, tokenizer = loaded(block.pair)
    return generate(target, draft, tokenizer, [block.prompt], list(block.temperatures), block.max_new_tokens,
                    block.runs, first=block.index, repeats=block.repeats)


def read_replicates(paths):
    """The rows of several records of one design (replicates of the same prompts, or runs on other prompts) as one
    frame whose ``repeat`` tells the records apart, so that :func:`summarise` pools them per prompt."""
    import pandas as pd

    frames = []
    for index, path in enumerate(paths):
        frame = pd.read_csv(path)
        needed = {"prompt_id", "temperature", "run", "tau", "tokens", "seconds", "ar_tokens", "ar_seconds"}
        missing = needed - set(frame)
        if missing:
            raise ValueError(f"{path} is not a bench_trees record: no {sorted(missing)} columns")
        frame["repeat"] = index * 1000 + (frame["repeat"] if "repeat" in frame else 0)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def summarise(frame):
    """Per temperature and run: mean tau and tokens per node scored, the median of the per-prompt speed-ups, and the
    speed pooled over prompts and repeats (total tokens over total seconds, against the paired autoregressive runs)
    with a 95 % bootstrap interval over the prompts."""
    summary = frame.groupby(["temperature", "run"]).agg(tau=("tau", "mean"), per_scored=("per_scored", "mean"),
                                                        vs_ar=("vs_autoregressive", lambda v: statistics.median(v)))
    pooled = pooled_speeds(frame).set_index(["temperature", "run"])[["pooled", "low", "high"]]
    return summary.join(pooled)


if __name__ == "__main__":
    sys.exit(main())
