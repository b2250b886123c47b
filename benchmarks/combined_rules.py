"""Where prompt lookup matches, should the combined draft propose lookup's token, the head's, or a mixture?

The combined draft (``drafts.combined.LookupOrDraft``) drafts from prompt lookup's law where the context ends in a
match and from the feature head elsewhere. At T > 0 it could instead sample from a mixture
``LAM * lookup + (1 - LAM) * head`` there (any law it samples from and hands to the verifier keeps the loop
lossless); min is concave, so a mixture accepts at least the LAM-weighted mean of the two at every
position, and more where the two cover different parts of p. It costs the head's step (c) on every
drafted token, where lookup alone is nearly free.

Untimed: per held-out prompt, one continuation sampled from the target (seed = the prompt's index) and
``feature_distill.measure_lookup_rules`` on it: each rule's per-position alpha (all positions and the
matched ones) and the token-verification loop's exact expectations with the combined draft's plan (a step
that starts after a match drafts gamma tokens, any other one ``--draft-gamma``). 95% bootstrap intervals
over prompts (1,000 resamples, seed 0); differences between rules are paired (the same sequences). The
speed column is a model, not a timing: tokens per step / (1 + c * head tokens drafted per step), with the
head computing every drafted token of the head and mixture rules and the combined rule's head tokens
bounded below by the drafted tokens of the steps that start without a match (lookup's own cost and the
lazy catch-up are not counted). A benchmark: nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/combined_rules.py --draft fp16:eagle3-v8k --out benchmarks/records/combined_rules_fp16_eagle3-v8k_<date>.json
    PYTHONPATH=. .venv/bin/python benchmarks/combined_rules.py --table benchmarks/records/combined_rules_fp16_eagle3-v8k_<date>.json

(70 prompts: 26 min on one thread beside a training run on the 2-core Xeon.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specresearch.drafts.feature import load_feature_draft
from specresearch.drafts.registry import (
    with_weight_storage,
    without_weight_prefix,
)
from specresearch.drafts.store import drafts_dir, shipped_drafts
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.experiments.records import write_json_record
from specresearch.models.embedded import load_embedded
from specresearch.training.feature_measure import measure_lookup_rules

ROOT = Path(__file__).resolve().parent.parent


def ratio_boot(num: np.ndarray, den: np.ndarray, picks: np.ndarray) -> tuple[float, np.ndarray]:
    """Pooled num / den over prompts and its bootstrap replicates (``picks [n_boot, prompts]``); a replicate
    whose denominator is 0 (no matched position among the prompts drawn) is NaN and left out of the interval."""
    num_b, den_b = num[picks].sum(1), den[picks].sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(num.sum() / den.sum()) if den.sum() else float("nan"), np.where(den_b > 0, num_b / den_b, np.nan)


def summarise(per_prompt: list[dict], rules: list[str], gamma: int, c: float, rng: np.random.Generator, n_boot: int = 1000) -> dict:
    """Per rule: alpha (depth 1, all and matched positions), the loop's acceptance, tokens per step and modelled
    speed at ``gamma``, each (point, low, high); and each rule minus the combined rule, paired."""
    picks = rng.integers(0, len(per_prompt), size=(n_boot, len(per_prompt)))
    stats, boots = {}, {}
    for rule in rules:
        rows = [r["rules"][rule] for r in per_prompt]
        loop = np.array([r["loop"][gamma - 1] for r in rows], dtype=float)  # (examined, accepted, steps, drafted, head's)
        measures = {
            "alpha": ratio_boot(np.array([r["alpha"][0] for r in rows]), np.array([r["positions"][0] for r in rows], dtype=float), picks),
            "alpha matched": ratio_boot(np.array([r["alpha_matched"][0] for r in rows]), np.array([r["matched"][0] for r in rows], dtype=float), picks),
            "loop acceptance": ratio_boot(loop[:, 1], loop[:, 0], picks),
            "tokens/step": ratio_boot(loop[:, 1] + loop[:, 2], loop[:, 2], picks),
            "speed model": ratio_boot(loop[:, 1] + loop[:, 2], loop[:, 2] + c * loop[:, 4], picks),
        }
        stats[rule] = {k: (v[0], *np.nanquantile(v[1], [0.025, 0.975])) for k, v in measures.items()}
        boots[rule] = measures
    diffs = {rule: {k: (boots[rule][k][0] - boots["combined"][k][0], *np.nanquantile(boots[rule][k][1] - boots["combined"][k][1], [0.025, 0.975]))
                    for k in boots[rule]} for rule in rules if rule != "combined"}
    return {"stats": stats, "minus_combined": diffs}


def print_tables(record: dict) -> None:
    """Each group's (all prompts, then each category with two or more) table per gamma, from a record's prompts."""
    per_prompt = record["per_prompt"]
    rules = list(per_prompt[0]["rules"])
    groups = {"all": per_prompt, **{f"category {c}": [r for r in per_prompt if r["category"] == c]
                                     for c in ("retrieval_augmented", "summarization")}}
    groups = {name: rows for name, rows in groups.items() if len(rows) >= 2}
    print(f"\n{record['draft']} at T = {record['temperature']:g}, {len(per_prompt)} held-out prompts, {record['max_new_tokens']} tokens; "
          f"steps without a match draft {record['draft_gamma']}; speed model with c = {record['c']:g}; 95% bootstrap over prompts\n")
    keys = ["alpha", "alpha matched", "loop acceptance", "tokens/step", "speed model"]
    for gamma in range(1, len(per_prompt[0]["rules"]["head"]["loop"]) + 1):
        for name, rows in groups.items():
            summary = summarise(rows, rules, gamma, record["c"], np.random.default_rng(0))
            print(f"### {name}, gamma {gamma}\n")
            print("| rule | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
            for rule in rules:
                print(f"| {rule} | " + " | ".join(f"{p:.3f} [{lo:.3f}, {hi:.3f}]" for k in keys for p, lo, hi in [summary["stats"][rule][k]]) + " |")
                if rule != "combined":
                    d = summary["minus_combined"][rule]
                    print(f"| {rule} - combined | " + " | ".join(f"{p:+.3f} [{lo:+.3f}, {hi:+.3f}]" for k in keys for p, lo, hi in [d[k]]) + " |")
            print()


def rounded(value, digits: int = 7):
    """``value`` with every float rounded to ``digits`` decimals (a smaller record; far below the intervals)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--draft", default="fp16:eagle3-v8k", help="a shipped feature head or its directory (fp16:NAME: float16 weights)")
    parser.add_argument("--count", type=int, default=70, help="held-out prompts (data/prompts.jsonl), evenly spaced")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--mixes", nargs="+", type=float, default=[0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--depths", type=int, default=4)
    parser.add_argument("--draft-gamma", type=int, default=1, help="draft length of a step that starts without a match")
    parser.add_argument("--c", type=float, default=0.06, help="the head's drafting step over the target's (for the speed model)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="reports/combined_rules.json")
    parser.add_argument("--table", metavar="RECORD", help="print the tables of a record this script wrote (--c applies), measure nothing")
    args = parser.parse_args()
    if args.table:
        record = json.loads(Path(args.table).read_text())
        print_tables({**record, "c": args.c})
        return
    if args.count < 2 or args.depths < 1 or args.max_new_tokens < 1 or args.temperature <= 0:
        parser.error("--count must be >= 2, --depths and --max-new-tokens >= 1, --temperature > 0")
    torch.set_num_threads(args.threads)
    base = without_weight_prefix(args.draft)
    directory = drafts_dir() / base if base in shipped_drafts() else Path(base)
    prompts = load_prompts(ROOT / "data" / "prompts.jsonl")
    prompts = evenly_spaced(prompts, args.count)
    target, tokenizer = load_embedded(device="cpu")
    draft = load_feature_draft(target, directory)
    head = with_weight_storage(draft, args.draft, target).head
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    started = time.perf_counter()
    per_prompt = []
    for i, (prompt, ids) in enumerate(tqdm(list(zip(prompts, encode_chat(prompts, tokenizer))), desc="prompts")):
        rules = measure_lookup_rules(target.model, head, ids, temperature=args.temperature, mixes=args.mixes, depths=args.depths,
                                     draft_gamma=args.draft_gamma, max_new_tokens=args.max_new_tokens, seed=i, eos_token_ids=eos)
        per_prompt.append({"prompt": prompt["id"], "category": prompt.get("category"), "rules": rounded(rules)})
    record = {"draft": args.draft, "temperature": args.temperature, "count": len(per_prompt), "max_new_tokens": args.max_new_tokens,
              "draft_gamma": args.draft_gamma, "c": args.c, "threads": args.threads, "seconds": round(time.perf_counter() - started, 1),
              "per_prompt": per_prompt}
    write_json_record(args.out, record, indent=None)
    print_tables(record)
    print(f"{len(per_prompt)} prompts in {record['seconds']:.0f} s; record in {args.out} (its tables again: --table {args.out})")


if __name__ == "__main__":
    main()
