"""How far K draft candidates for the first token would carry a feature draft on this CPU: exact
acceptance on real (p, q) pairs against what scoring K + 1 tokens costs.

The first drafted token is where a draft's acceptance is highest and where one head call can propose K
candidates at no extra draft cost (K samples of the same q at T = 1, the K most likely tokens of q at
T = 0). This measures, on the held-out positions ``measure_feature_draft`` uses (``data/prompts.jsonl``,
``--prompts`` evenly spaced, ``--max-new-tokens`` continuations sampled from the target):

* T = 0: how often the target's greedy token is among the draft's K most likely tokens;
* T = 1: the single-step acceptance of K i.i.d. drafts under recursive rejection sampling (SpecInfer),
  under K-SEQ (SpecTr) and the best any verifier can reach with K i.i.d. drafts, each in closed form
  per position (``theory_multi``), averaged over positions;

and the predicted speed-up over autoregressive decoding of a step that scores the pending token and the
K candidates in one target call, (1 + acceptance) / (r_{K+1} + c), where r_k is one target call scoring
k tokens over one scoring 1 (a ``bench_score_cost.py`` record; a tree of K siblings costs what a chain
of K tokens costs, up to attention, which is small at these lengths) and c the draft's one-token cost
(its manifest). The engine's own per-step work is left out of both sides: a headroom, not a wall clock.
A benchmark: nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/multidraft_headroom.py --out benchmarks/records/multidraft_headroom_2026-11-24.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specresearch.config import SamplingConfig
from specresearch.core.sampling import logits_to_probs
from specresearch.drafts.registry import draft_from_name
from specresearch.drafts.store import drafts_dir
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.exact import theory_multi
from specresearch.experiments.draft_analysis import read_draft_manifest
from specresearch.experiments.records import write_json_record
from specresearch.models.attention import CPU_SDPA
from specresearch.models.embedded import load_embedded
from specresearch.training.corpus import sample_continuations
from specresearch.training.feature_corpus import target_features

RULES = {"rrs": theory_multi.rrs_acceptance, "kseq": theory_multi.kseq_acceptance, "optimum_iid": theory_multi.optimal_acceptance_iid}


def score_costs(record: str | Path, threads: int = 1, context: int = 256, linear: str = "skinny", attention: str = CPU_SDPA) -> dict[int, float]:
    """r_k of one ``bench_score_cost.py`` record: the rows of ``threads``, ``context``, ``linear`` and
    ``attention`` (by default what ``CausalLM`` uses on CPU)."""
    rows = [json.loads(line) for line in Path(record).read_text().splitlines() if line.strip()]
    costs = {row["k"]: row["r_k"] for row in rows if (row["threads"], row.get("context"), row["linear"], row.get("attention")) ==
             (threads, context, linear, attention)}
    if 1 not in costs:
        raise ValueError(f"{record} has no rows for threads={threads}, context={context}, linear={linear!r}, attention={attention!r}")
    return costs


def first_token_pairs(target, head, prompt_ids, temperature: float, max_new_tokens: int, seed: int, eos) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits ``[N, V]`` at every held-out position of depth 1 (continuations sampled at ``temperature``)."""
    generator = torch.Generator().manual_seed(seed)
    continuations = sample_continuations(target, prompt_ids, [temperature] * len(prompt_ids), max_new_tokens, generator, eos)
    sequences = [torch.cat([ids, c]) for ids, c in zip(prompt_ids, continuations)]
    features, logits = target_features(target, sequences, head.feature_layers)
    p_rows, q_rows = [], []
    with torch.no_grad():
        for b, (seq, prompt) in enumerate(zip(sequences, prompt_ids)):
            hidden = head.rollout(features[b][None], seq[None], torch.ones(1, len(seq), dtype=torch.long), 1)[0]
            slots = torch.arange(len(prompt) - 1, len(seq) - 1)
            p_rows.append(logits[b][slots])
            q_rows.append(head.logits(hidden[0, slots]))
    return torch.cat(p_rows), torch.cat(q_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="eagle3-v8k", help="a shipped feature head or its directory")
    parser.add_argument("--prompts", type=int, default=14)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4, 5, 7])
    parser.add_argument("--score-cost", default="benchmarks/records/bench_score_cost_2026-11-24b.jsonl")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the measurement (the costs are read)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="reports/multidraft_headroom.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    costs = score_costs(args.score_cost)
    missing = [k for k in args.ks if k + 1 not in costs]
    if missing:
        raise SystemExit(f"--score-cost has no r_k for k = K + 1 at K = {missing} (has k = {sorted(costs)})")
    started = time.time()
    lm, tokenizer = load_embedded(device="cpu")
    draft = draft_from_name(args.draft, lm, tokenizer)
    if not hasattr(draft, "head"):
        raise SystemExit(f"--draft must be a feature head, got {type(draft).__name__}")
    directory = drafts_dir() / args.draft if (drafts_dir() / args.draft).is_dir() else Path(args.draft)
    c = read_draft_manifest(directory)["c"]
    prompts = load_prompts("data/prompts.jsonl")
    chosen = evenly_spaced(prompts, args.prompts)
    ids = encode_chat(chosen, tokenizer)
    eos = [tokenizer.eos_token_id]

    p0, q0 = first_token_pairs(lm.model, draft.head, ids, 0.0, args.max_new_tokens, args.seed, eos)
    top = q0.topk(max(args.ks), dim=-1).indices
    hits = top == p0.argmax(-1, keepdim=True)  # [N, K]
    p1, q1 = first_token_pairs(lm.model, draft.head, ids, 1.0, args.max_new_tokens, args.seed, eos)
    config = SamplingConfig(temperature=1.0)
    P, Q = logits_to_probs(p1.double(), config).numpy(), logits_to_probs(q1.double(), config).numpy()
    rows = []
    for k in tqdm(args.ks, desc="K"):
        t1 = {rule: float(np.mean([f(p, q, k) for p, q in zip(P, Q)])) for rule, f in RULES.items()}
        t0 = float(hits[:, :k].any(-1).double().mean())
        cost = costs[k + 1] + c
        rows.append({"K": k, "r_K+1": costs[k + 1], "greedy_top_K": t0, **{f"t1_{rule}": a for rule, a in t1.items()},
                     "speedup_t0": (1 + t0) / cost, "speedup_t1_kseq": (1 + t1["kseq"]) / cost,
                     "speedup_t1_optimum": (1 + t1["optimum_iid"]) / cost})
    record = {"draft": args.draft, "c": c, "score_cost_record": args.score_cost, "prompts": [p["id"] for p in chosen],
              "positions": {"t0": len(p0), "t1": len(p1)}, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "seconds": round(time.time() - started, 1), "rows": rows}
    write_json_record(args.out, record)
    print(f"{args.draft}: c = {c:.3f}, {len(p0)} / {len(p1)} positions (T = 0 / 1); r_k from {args.score_cost}")
    print(f"{'K':>2} {'r_K+1':>6} {'T0 top-K':>9} {'T1 RRS':>7} {'K-SEQ':>6} {'optimum':>8} {'x T0':>6} {'x T1 K-SEQ':>11} {'x T1 opt':>9}")
    for r in rows:
        print(f"{r['K']:>2} {r['r_K+1']:>6.2f} {r['greedy_top_K']:>9.3f} {r['t1_rrs']:>7.3f} {r['t1_kseq']:>6.3f} {r['t1_optimum_iid']:>8.3f} "
              f"{r['speedup_t0']:>6.2f} {r['speedup_t1_kseq']:>11.2f} {r['speedup_t1_optimum']:>9.2f}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
