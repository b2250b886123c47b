"""A feature draft (EAGLE-style head) beside the distilled LM draft on the embedded target: alpha per depth, c.

One run, the same held-out prompts and the same target-sampled continuations (``data/prompts.jsonl``,
first turn, ``--prompts`` evenly spaced, seed 0, ``--tokens`` tokens per temperature):

* the feature head: alpha at T = 0.2 / 0.6 / 1.0 and greedy agreement for draft depths 1..``--depths``
  (``feature_distill.measure_feature_draft``: depth d reads the head's own features for the d - 1
  previous slots, as when drafting), and c = its one-token drafting step / the target's one-token
  forward (cached, B = 1, timed in turn: ``measure_feature_cost``);
* the distilled LM draft (``--baseline``, default ``v8k-4l``): alpha and greedy agreement
  (``measure_draft``: the same sequences as depth 1 above) and c (``measure_cost_ratio``).

The predicted speed-up is E[tokens per target call] / (1 + gamma c), with E = 1 + sum_k prod_{i<=k} alpha_i
from the per-depth alphas (the distilled draft: its one alpha at every depth, Leviathan et al. 2023), at
the best gamma <= ``--depths``. A benchmark: rows to ``--out`` (JSON lines) and a Markdown table; nothing
asserted on time.

    .venv/bin/python benchmarks/bench_feature_draft.py --threads 1 --feature eagle3-v8k
    .venv/bin/python benchmarks/bench_feature_draft.py --threads 1 --feature DIR --alpha-from-manifest
    .venv/bin/python benchmarks/bench_feature_draft.py --threads 1 --alpha-from-manifest --generate-prompts 3 --gamma 1 2 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specresearch.drafts.distilled import load_draft
from specresearch.drafts.feature import FeatureDraft, load_feature_head
from specresearch.drafts.store import manifest_path, read_manifest
from specresearch.engine.prompts import encode_chat, load_prompts
from specresearch.experiments.draft_analysis import best_speedup
from specresearch.models.embedded import load_embedded
from specresearch.training import distill
from specresearch.training.feature_measure import (
    measure_feature_cost,
    measure_feature_draft,
)
from specresearch.training.measure import measure_cost_ratio, measure_draft

TEMPERATURES = (0.2, 0.6, 1.0)


def _directory(name: str) -> Path:
    return Path(name) if manifest_path(name).exists() else distill.drafts_dir() / name


def feature_row(lm, tokenizer, directory: Path, prompt_ids, eos, args) -> dict:
    head = load_feature_head(lm.model, directory)
    manifest = read_manifest(directory)
    if args.alpha_from_manifest:
        stats = {k: manifest["measurement"][k] for k in ("alpha_by_depth", "greedy_agreement_by_depth", "positions")}
    else:
        stats = measure_feature_draft(lm.model, head, prompt_ids, temperatures=TEMPERATURES, depths=args.depths,
                                      max_new_tokens=args.tokens, eos_token_ids=eos, progress=False).as_dict()
    cost = measure_feature_cost(lm, FeatureDraft(head), repeats=args.repeats)
    gamma, speedup = best_speedup(stats["alpha_by_depth"]["1.0"], cost["c"])
    return {"draft": directory.name, "kind": "feature", **stats, **cost, "best_gamma_T1": gamma, "speedup_T1": speedup}


def baseline_row(lm, directory: Path, prompt_ids, eos, args) -> dict:
    draft = load_draft(lm.model, directory)
    manifest = read_manifest(directory)
    if args.alpha_from_manifest:
        stats = {k: manifest["measurement"][k] for k in ("alpha", "greedy_agreement", "positions")}
    else:
        stats = measure_draft(lm.model, draft, prompt_ids, temperatures=TEMPERATURES, max_new_tokens=args.tokens,
                                      eos_token_ids=eos, progress=False).as_dict()
    cost = measure_cost_ratio(lm.model, draft, repeats=args.repeats)
    by_depth = {t: [a] * args.depths for t, a in stats["alpha"].items()}
    gamma, speedup = best_speedup(by_depth["1.0"], cost["c"])
    return {"draft": directory.name, "kind": "distilled LM", "alpha_by_depth": by_depth,
            "greedy_agreement_by_depth": [stats["greedy_agreement"]] * args.depths, "positions": stats["positions"], **cost,
            "best_gamma_T1": gamma, "speedup_T1": speedup}


def generation_rows(lm, tokenizer, drafts: dict, args) -> list[dict]:
    """Wall clock on chat prompts (first turn of one prompt per category, chat template): autoregressive and
    speculative (token verification) with each draft, interleaved prompt by prompt, per temperature."""
    from specresearch.config import SamplingConfig
    from specresearch.engine.generate import (
        autoregressive_generate,
        speculative_generate,
    )

    seen, prompts = set(), []
    for row in load_prompts(distill.drafts_dir().parent / "prompts.jsonl"):
        if row["category"] not in seen:
            seen.add(row["category"])
            prompts.append(encode_chat([row], tokenizer)[0].tolist())
    prompts = prompts[: args.generate_prompts]
    rows = []
    for temperature in args.generate_temperatures:
        sampling = SamplingConfig(temperature=temperature)
        runs = [("autoregressive", None, 0)] + [(name, draft, gamma) for gamma in args.gamma for name, draft in drafts.items()]
        totals = {(name, gamma): [0, 0.0, []] for name, _, gamma in runs}
        for i, prompt in enumerate(prompts):
            common = dict(max_new_tokens=args.generate_tokens, sampling=sampling, seed=i, eos_token_id=[])
            for name, draft, gamma in runs:
                if draft is None:
                    out = autoregressive_generate(lm, [prompt], **common)
                else:
                    out = speculative_generate(lm, draft, [prompt], verifier="token", gamma=gamma, **common)
                    totals[name, gamma][2].append(out.acceptance_rate)
                totals[name, gamma][0] += out.num_tokens
                totals[name, gamma][1] += out.seconds
        base = totals["autoregressive", 0][0] / totals["autoregressive", 0][1]
        for (name, gamma), (tokens, seconds, alphas) in totals.items():
            rows.append({"method": name, "temperature": temperature, "gamma": gamma, "tokens": tokens,
                         "seconds": seconds, "tokens_per_second": tokens / seconds, "vs_autoregressive": tokens / seconds / base,
                         "acceptance_rate": sum(alphas) / len(alphas) if alphas else None})
    return rows


def distill_draft(lm, directory: Path):
    from specresearch.models.causal_lm import CausalLM

    return CausalLM(load_draft(lm.model, directory), device=lm.device)


def table(rows) -> str:
    lines = ["| draft | kind | alpha d=1 T=0.2 | T=0.6 | T=1.0 | alpha T=1.0 by depth | greedy agree by depth | c | draft ms | target ms | "
             "best gamma | predicted speed-up (T=1) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["alpha_by_depth"]
        lines.append(f"| {r['draft']} | {r['kind']} | {a['0.2'][0]:.3f} | {a['0.6'][0]:.3f} | {a['1.0'][0]:.3f} | "
                     f"{' / '.join(f'{x:.3f}' for x in a['1.0'])} | {' / '.join(f'{x:.3f}' for x in r['greedy_agreement_by_depth'])} | "
                     f"{r['c']:.3f} | {r['draft_ms']:.1f} | {r['target_ms']:.1f} | {r['best_gamma_T1']} | {r['speedup_T1']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feature", nargs="+", default=["eagle3-v8k"], help="feature heads: names under data/drafts/ or directories")
    parser.add_argument("--baseline", nargs="*", default=["v8k-4l"], help="distilled LM drafts measured beside them")
    parser.add_argument("--alpha-from-manifest", action="store_true", help="reuse the recorded alphas (same seeded measurement); time c only")
    parser.add_argument("--prompts", type=int, default=14, help="held-out prompts, evenly spaced")
    parser.add_argument("--tokens", type=int, default=64, help="continuation length per prompt and temperature")
    parser.add_argument("--depths", type=int, default=4, help="draft depths measured")
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards per model for c")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="reports/bench_feature_draft.jsonl")
    parser.add_argument("--generate-prompts", type=int, default=0, help="also time generation on this many chat prompts (<= 7)")
    parser.add_argument("--generate-tokens", type=int, default=48)
    parser.add_argument("--generate-temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--gamma", type=int, nargs="+", default=[1, 2, 3], help="draft tokens per step in the generation timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lm, tokenizer = load_embedded("smollm2-135m-instruct", device="cpu")
    eos = [tokenizer.eos_token_id]
    heldout = load_prompts(distill.drafts_dir().parent / "prompts.jsonl")
    chosen = [heldout[round(i * len(heldout) / args.prompts)] for i in range(min(args.prompts, len(heldout)))]
    prompt_ids = encode_chat(chosen, tokenizer)
    rows = [feature_row(lm, tokenizer, _directory(n), prompt_ids, eos, args) for n in args.feature]
    rows += [baseline_row(lm, _directory(n), prompt_ids, eos, args) for n in args.baseline]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    if args.generate_prompts:
        drafts = {n: FeatureDraft(load_feature_head(lm.model, _directory(n)), max_context=lm.max_context) for n in args.feature}
        drafts.update({n: distill_draft(lm, _directory(n)) for n in args.baseline})
        generated = generation_rows(lm, tokenizer, drafts, args)
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in generated)
        print("\n| method | T | gamma | tokens | seconds | tokens/s | vs autoregressive | acceptance rate |\n|---|---|---|---|---|---|---|---|")
        for r in generated:
            rate = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
            print(f"| {r['method']} | {r['temperature']} | {r['gamma']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_second']:.2f} | "
                  f"{r['vs_autoregressive']:.3f} | {rate} |")
    print(f"\n{len(chosen)} held-out prompts x {args.tokens} tokens per temperature; {args.threads} thread(s); rows in {args.out}")


if __name__ == "__main__":
    main()
