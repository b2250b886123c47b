"""Wall clock of several drafts side by side, in one run: speed over autoregressive decoding, per category.

For every prompt (first user turn of ``data/prompts.jsonl``, chat template; ``--per-category`` evenly
spaced prompts of each of ``--categories``) and every temperature, in this order and timed one after
the other: autoregressive decoding of the target, then speculative decoding (token verification) with
each ``--drafts`` name (``drafts.registry.draft_from_name``: ``ngram``, a shipped draft such as ``v8k-4l`` or
``eagle3-v8k``, a combined ``ngram+NAME`` and its variants ``@draft-gamma=none``, ``@every-slot``,
``@min-match=N``, ``@plan-match=N``, ``drafts.registry.combined_draft``) at each ``--gammas``. Same seed for every method of a prompt,
EOS stops a row, ``--max-new-tokens`` at most. A speed-up is (tokens / seconds) of a method over that of
the autoregressive runs of the same prompts, summed per category and over all prompts; the
acceptance rate is the engine's (accepted / drafted). Before and after the runs it times one cached target
call scoring k = 1 and gamma + 1 tokens (``bench.score_seconds``): what verification costs in target
forwards here. A benchmark: rows to ``--out`` (JSON lines; the machine, ``machine_info``, with the command,
commit, date and weights' digests as a ``method = machine`` row first, each prompt's runs as soon as they are
timed, so an interrupted run keeps the prompts it finished for ``--table``, the score timings as
``method = target_score`` rows last) and Markdown tables; nothing asserted on time. Both the speed-ups and the
best gamma depend on the machine (how much more a call scoring gamma + 1 tokens costs than one scoring 1).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_wallclock.py --threads 1 \\
        --drafts ngram eagle3-v8k ngram+eagle3-v8k v8k-4l ngram+v8k-4l --gammas 1 2 4

``--table RECORD`` prints the tables of a finished run again, with 95% bootstrap intervals over the prompts
(``draft_analysis.speedup_intervals``, 1,000 resamples, seed 0) and, for each ``--paired A GAMMA_A B GAMMA_B``,
the paired interval of speed-up A - speed-up B, and the ceiling each draft would reach with its acceptance were drafting
free (``draft_analysis.free_draft_rows``); no model is loaded:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_wallclock.py --table benchmarks/records/bench_wallclock_2026-11-24c.jsonl \\
        --paired ngram+eagle3-v8k 3 eagle3-v8k 1 --paired eagle3-v8k 1 v8k-4l 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name, weights_digests
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments import bench
from specresearch.experiments.draft_analysis import (
    free_draft_rows,
    read_wallclock,
    speedup_intervals,
    wallclock_table,
)
from specresearch.experiments.records import machine_info, record_header
from specresearch.models.embedded import load_embedded
from specresearch.models.kernels import SkinnyLinear

CATEGORIES = ("code", "math_reasoning", "multi_turn_chat", "question_answering", "retrieval_augmented", "summarization",
              "translation")


def run(lm, tokenizer, drafts: dict, args, sink) -> list[dict]:
    """Every method on every prompt and temperature; each prompt's rows are written to ``sink`` (JSON lines)
    as soon as they are timed."""
    config = bench.BenchConfig(categories=tuple(args.categories), temperatures=tuple(args.temperatures), gammas=tuple(args.gammas),
                               max_new_tokens=args.max_new_tokens)
    prompts = []
    for category in args.categories:
        prompts += bench.load_bench_prompts(tokenizer, dataclasses.replace(config, categories=(category,), num_prompts=args.per_category))
    eos = tokenizer.eos_token_id
    warm = [list(prompts[0].token_ids)]
    for draft in drafts.values():  # untimed: caches, kernels
        speculative_generate(lm, draft, warm, gamma=max(args.gammas), max_new_tokens=4, seed=[0])
    autoregressive_generate(lm, warm, max_new_tokens=4, seed=[0])
    methods = [("autoregressive", None, 0)] + [(name, draft, g) for name, draft in drafts.items() for g in args.gammas]
    rows = []
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        done = len(rows)
        for temperature in args.temperatures:
            common = dict(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(temperature=temperature),
                          seed=[bench.run_seed(prompt.id, args.seed)], eos_token_id=eos)
            for name, draft, gamma in methods:
                if draft is None:
                    out = autoregressive_generate(lm, [list(prompt.token_ids)], **common)
                else:
                    out = speculative_generate(lm, draft, [list(prompt.token_ids)], verifier="token", gamma=gamma, **common)
                rows.append({"prompt": prompt.id, "category": prompt.category, "temperature": temperature, "method": name, "gamma": gamma,
                             "tokens": out.num_tokens, "seconds": out.seconds, "prefill_seconds": out.prefill_seconds, "steps": len(out.steps),
                             "target_seconds": sum(s.target_seconds for s in out.steps),
                             "draft_seconds": sum(s.draft_seconds for s in out.steps),
                             "acceptance_rate": None if draft is None else out.acceptance_rate})
        sink.writelines(json.dumps(r) + "\n" for r in rows[done:])
        sink.flush()
        print(f"[{i + 1}/{len(prompts)}] {prompt.id} ({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def table(summary, gammas) -> str:
    """Markdown: one row per (prompts, T), one column per draft with its speed-ups at each gamma."""
    methods = [m for m in dict.fromkeys(summary["method"]) if m != "autoregressive"]
    lines = ["| prompts | T | autoregressive tok/s | " + " | ".join(f"{m} (gamma {'/'.join(map(str, gammas))})" for m in methods) + " |",
             "|---|---|---|" + "---|" * len(methods)]
    for (group, t), part in summary.groupby(["group", "temperature"], sort=False):
        at = {(r.method, r.gamma): r for r in part.itertuples()}
        cells = [" / ".join(f"{at[m, g].vs_autoregressive:.2f}" for g in gammas) for m in methods]
        lines.append(f"| {group} | {t:g} | {at['autoregressive', 0].tokens_per_second:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--drafts", nargs="+", default=["ngram", "eagle3-v8k", "ngram+eagle3-v8k", "v8k-4l", "ngram+v8k-4l"])
    parser.add_argument("--gammas", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    parser.add_argument("--per-category", type=int, default=2, help="prompts per category, evenly spaced")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target-linear", choices=("auto", "skinny", "plain"), default="auto",
                        help="the target's linear layers, for every method alike: CausalLM's CPU default (auto: SkinnyLinear for the "
                             "row counts it times faster here), SkinnyLinear for 1-8 rows, or plain nn.Linear with transformers' sdpa")
    parser.add_argument("--out", default="reports/bench_wallclock.jsonl")
    parser.add_argument("--table", metavar="RECORD", help="only print the tables of a finished run's record, with intervals")
    parser.add_argument("--paired", nargs=4, action="append", default=[], metavar=("A", "GAMMA_A", "B", "GAMMA_B"),
                        help="with --table: a paired bootstrap interval of speed-up A - speed-up B (repeatable)")
    args = parser.parse_args()
    if args.table:
        try:
            pairs = [((a, int(ga)), (b, int(gb))) for a, ga, b, gb in args.paired]
        except ValueError:
            parser.error(f"--paired takes A GAMMA_A B GAMMA_B with integer gammas, got {args.paired}")
        frame, score_cost = read_wallclock(args.table)
        rows = [json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]
        machine = [r for r in rows if r.get("method") == "machine"]
        if machine:
            print("machine: " + ", ".join(f"{k} {v}" for k, v in machine[0].items() if k != "method"))
        print(f"one cached target call scoring k tokens over one scoring 1: {', '.join(f'r_{k} = {r:.2f}' for k, r in score_cost.items())}")
        report(frame, sorted(set(frame["gamma"]) - {0}), pairs)
        return
    if any(g < 1 for g in args.gammas) or args.per_category < 1 or args.max_new_tokens < 1:
        parser.error("--gammas, --per-category and --max-new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    lm, tokenizer = load_embedded(device="cpu", skinny_linear={"auto": None, "skinny": True, "plain": False}[args.target_linear])
    skinny_rows = sorted({r for m in lm.model.modules() if isinstance(m, SkinnyLinear) for r in m.skinny_rows})
    print(f"target's linear layers: {args.target_linear}; row counts computed as (W @ x^T)^T: {skinny_rows or 'none'}")
    drafts = {name: draft_from_name(name, lm, tokenizer) for name in args.drafts}
    ks = sorted({1, *(g + 1 for g in args.gammas)})
    costs = bench.score_seconds(lm, ks)  # before and after the runs: the machine's load may drift
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        made = record_header("benchmarks/bench_wallclock.py", sys.argv[1:])  # command, commit, date, target's digest
        f.write(json.dumps({"method": "machine", **machine_info(), "target_linear": args.target_linear,
                            "skinny_rows": skinny_rows, **{k: v for k, v in made.items() if k != "machine"},
                            "draft_sha256": {name: weights_digests(name) for name in args.drafts}}) + "\n")
        rows = run(lm, tokenizer, drafts, args, f)
        after = bench.score_seconds(lm, ks)
        f.writelines(json.dumps({"method": "target_score", "k": k, "ms_before": 1e3 * costs[k], "ms_after": 1e3 * after[k]}) + "\n"
                     for k in ks)
    print("\none cached target call scoring k tokens (context 64, B = 1), before / after the runs:\n")
    for k in ks:
        print(f"  k = {k}: {1e3 * costs[k]:.1f} / {1e3 * after[k]:.1f} ms = {costs[k] / costs[1]:.2f} / {after[k] / after[1]:.2f} x k = 1")
    report(pd.DataFrame(rows), args.gammas)
    print(f"\n{len(rows)} runs, {args.threads} thread(s); rows in {args.out}")


def report(frame: pd.DataFrame, gammas, pairs=()) -> None:
    """The Markdown tables of a run: speed-ups per category and gamma, acceptance, bootstrap intervals over all prompts."""
    by_category = wallclock_table(frame, by=("category", "temperature")).rename(columns={"category": "group"})
    overall = wallclock_table(frame).assign(group="all")
    print("\nspeed-up over autoregressive decoding (token verification), per gamma:\n")
    print(table(pd.concat([by_category, overall], ignore_index=True), gammas))
    print("\nacceptance rate (all prompts):\n")
    for r in overall[overall["method"] != "autoregressive"].itertuples():
        print(f"  T={r.temperature:g} {r.method} gamma {r.gamma}: {r.acceptance_rate:.3f}")
    if "prefill_seconds" in frame:
        print("\nwhere the time goes (all prompts): ms per generation in prefill; ms per step in the target, the draft, the rest:\n")
        split = frame.assign(rest_seconds=frame["seconds"] - frame["prefill_seconds"] - frame["target_seconds"] - frame["draft_seconds"])
        sums = split.groupby(["temperature", "method", "gamma"], sort=False)[
            ["prefill_seconds", "target_seconds", "draft_seconds", "rest_seconds", "steps"]].sum()
        runs = split.groupby(["temperature", "method", "gamma"], sort=False).size()
        for (t, method, gamma), r in sums.iterrows():
            per_step = {k: 1e3 * r[f"{k}_seconds"] / r["steps"] for k in ("target", "draft", "rest")}
            print(f"  T={t:g} {method} gamma {gamma}: prefill {1e3 * r['prefill_seconds'] / runs[t, method, gamma]:.1f}; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items()))
    speedups, differences = speedup_intervals(frame, pairs)
    print("\nall prompts, 95% bootstrap intervals over the prompts (1,000 resamples, seed 0):\n")
    for r in speedups.itertuples():
        print(f"  T={r.temperature:g} {r.method} gamma {r.gamma}: {r.speedup:.2f} [{r.low:.2f}, {r.high:.2f}]")
    for r in differences.itertuples():
        print(f"  T={r.temperature:g} {r.a} - {r.b}: {r.difference:+.2f} [{r.low:+.2f}, {r.high:+.2f}] (paired)")
    if "target_seconds" in frame:
        ceilings = speedup_intervals(free_draft_rows(frame))[0]
        print("\nthe ceiling with the same acceptance, were drafting and the engine's per-step work free (each run's prefill and"
              "\ntarget seconds only; draft_analysis.free_draft_rows), same intervals:\n")
        for r in ceilings.itertuples():
            print(f"  T={r.temperature:g} {r.method} gamma {r.gamma}: {r.speedup:.2f} [{r.low:.2f}, {r.high:.2f}]")


if __name__ == "__main__":
    main()
