"""Measure trained drafts against the embedded target: alpha, greedy agreement and cost ratio c.

Usage (from the repository root; one thread, as on the shared reference machine):

    .venv/bin/python benchmarks/bench_draft.py --threads 1                 # every draft in data/drafts/
    .venv/bin/python benchmarks/bench_draft.py --threads 1 --draft v8k-4l --prompts 14 --tokens 64
    .venv/bin/python benchmarks/bench_draft.py --threads 1 --baseline      # + untrained 1-layer baseline
    .venv/bin/python benchmarks/bench_draft.py --threads 1 --alpha-from-manifest --draft v8k-4l path/to/v8k-2l

``--draft`` takes shipped names or draft directories (``specresearch distill --out DIR``).
``--alpha-from-manifest`` reuses the alpha and greedy agreement the training run recorded (the same
seeded measurement on the same held-out prompts, so identical up to float rounding) and times c only.

For each draft: alpha = E[sum_x min(p, q)] at T = 0.2, 0.6, 1.0 along continuations the target samples
at that temperature, and the greedy agreement rate along its greedy continuations, on ``--prompts``
prompts taken evenly from the held-out ``data/prompts.jsonl`` (first turn, chat template), seed 0
(``specresearch.training.measure.measure_draft``); c = median draft / median target time of one cached
single-token forward at B = 1, the two timed in turn (``measure_cost_ratio``). ``--baseline`` adds the
untrained draft (target layer 0 + final norm + head) as a reference row. Rows are written as JSON lines
to ``--out`` and printed as a Markdown table with the Leviathan et al. speed-up at the best gamma
(``specresearch.exact.theory``); nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specresearch.drafts.distilled import load_draft
from specresearch.drafts.feature import is_feature_draft_dir
from specresearch.drafts.store import manifest_path, read_manifest, shipped_drafts
from specresearch.engine.prompts import encode_chat, load_prompts
from specresearch.exact.theory import optimal_gamma, walltime_improvement
from specresearch.models.embedded import load_embedded
from specresearch.training import distill
from specresearch.training.measure import measure_cost_ratio, measure_draft

TEMPERATURES = (0.2, 0.6, 1.0)


def measure(target, draft, name, prompt_ids, eos, args, recorded=None) -> dict:
    if recorded is None:
        stats = measure_draft(target, draft, prompt_ids, temperatures=TEMPERATURES, max_new_tokens=args.tokens,
                                      eos_token_ids=eos, progress=False).as_dict()
        prompts, tokens = len(prompt_ids), args.tokens
    else:
        stats = {k: recorded[k] for k in ("alpha", "greedy_agreement", "positions")}
        prompts, tokens = len(recorded["prompt_ids"]), recorded["max_new_tokens"]
    cost = measure_cost_ratio(target, draft, repeats=args.repeats)
    row = {"draft": name, "prompts": prompts, "tokens": tokens, **stats, **cost}
    alpha = min(stats["alpha"]["1.0"], 0.999)
    gamma = optimal_gamma(alpha, cost["c"])
    row.update({"best_gamma_T1": gamma, "speedup_T1": float(walltime_improvement(alpha, gamma, cost["c"]))})
    return row


def table(rows) -> str:
    lines = ["| draft | alpha T=0.2 | alpha T=0.6 | alpha T=1.0 | greedy agree | c | draft ms | target ms | best gamma | speed-up (T=1) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["alpha"]
        lines.append(f"| {r['draft']} | {a['0.2']:.3f} | {a['0.6']:.3f} | {a['1.0']:.3f} | {r['greedy_agreement']:.3f} | "
                     f"{r['c']:.3f} | {r['draft_ms']:.1f} | {r['target_ms']:.1f} | {r['best_gamma_T1']} | {r['speedup_T1']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", nargs="*", help="names under data/drafts/ or draft directories (default: all shipped)")
    parser.add_argument("--alpha-from-manifest", action="store_true", help="reuse the recorded alpha; time c only")
    parser.add_argument("--prompts", type=int, default=14, help="held-out prompts, evenly spaced")
    parser.add_argument("--tokens", type=int, default=64, help="continuation length per prompt and temperature")
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards per model for c")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", action="store_true", help="also measure the untrained tiny-1l initialisation")
    parser.add_argument("--out", default="reports/bench_draft.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lm, tokenizer = load_embedded("smollm2-135m-instruct", device="cpu")
    target, eos = lm.model, [tokenizer.eos_token_id]
    heldout = load_prompts(distill.drafts_dir().parent / "prompts.jsonl")
    chosen = [heldout[round(i * len(heldout) / args.prompts)] for i in range(min(args.prompts, len(heldout)))]
    prompt_ids = encode_chat(chosen, tokenizer)
    names = args.draft or [n for n in shipped_drafts() if not is_feature_draft_dir(distill.drafts_dir() / n)]  # feature heads: bench_feature_draft.py
    directories = [Path(n) if manifest_path(n).exists() else distill.drafts_dir() / n for n in names]
    drafts = [(d.name, load_draft(target, d), read_manifest(d)) for d in directories]
    if args.baseline:
        drafts.append(("untrained tiny-1l", distill.build_draft(target, distill.DraftConfig.from_name("tiny-1l")).eval(), None))
    rows = [measure(target, draft, name, prompt_ids, eos, args, manifest["measurement"] if manifest and args.alpha_from_manifest else None)
            for name, draft, manifest in drafts]

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    print(f"\n{len(chosen)} held-out prompts x {args.tokens} tokens per temperature; {args.threads} thread(s); rows in {args.out}")


if __name__ == "__main__":
    main()
