"""The engines' rules on real next-token laws: the record behind docs/audit.md's real-model table and notebook 11.

SmolLM2-135M-Instruct with the shipped feature head (``eagle3-v8k``), T = 1, 200 prefixes of 20 held-out chat prompts
(``data/prompts.jsonl``, evenly spaced), each continued by the target; every engine rule's single step (gamma = 1,
tree rules with the top 4 candidates of q) in float64 (``specresearch.audit.real``), and llama.cpp's example at its own
defaults (one branch, T = 0.8, both rows through its sampler chain, ``audit.real.llamacpp_chain``). Writes
``benchmarks/records/audit_real.csv`` (one row per rule and setting: mean TV, KL(r || p), acceptance, lossless
optimum on the same candidates, frontier at the rule's TV) and ``.json`` (command, commit, machine, the head's
sha256, the one-hot cost). Computed, not timed: the numbers do not depend on the machine beyond float rounding.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_real.py
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pandas as pd

from specresearch.audit import LOSSY_SETTINGS
from specresearch.audit.engines import ENGINE_RULES
from specresearch.audit.real import llamacpp_chain, next_token_rows, one_hot_cost, summarise
from specresearch.drafts.registry import load_pair
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.experiments.records import record_header
from specresearch.paths import data_dir, repo_root

NUM_PREFIXES, NUM_PROMPTS, NUM_DRAFTS, DRAFT, TEMPERATURE = 200, 20, 4, "eagle3-v8k", 1.0
LLAMACPP_CHAIN = dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8)  # llama-speculative's defaults
CHAIN_LABEL = "n_parallel = 1, T = 0.8, top-k 40 / top-p 0.95 / min-p 0.05 chain"


def main() -> int:
    target, draft, tokenizer = load_pair(draft=DRAFT)
    prompts = encode_chat(evenly_spaced(load_prompts(data_dir() / "prompts.jsonl"), NUM_PROMPTS), tokenizer)
    p, q = next_token_rows(target, draft, prompts, num_prefixes=NUM_PREFIXES, temperature=TEMPERATURE)
    settings = [(name, {}) for name in ENGINE_RULES] + list(LOSSY_SETTINGS.items())
    points = [summarise(name, p, q, num_drafts=NUM_DRAFTS, **params) for name, params in settings]
    # llama-speculative at its own defaults: one branch, T = 0.8, each model's list what its sampler chain leaves
    chained = [llamacpp_chain(rows, **LLAMACPP_CHAIN) for rows in (p, q)]
    for lists, label in (("support", "lists paired by id as the example does"), ("full", "residual token by token")):
        point = summarise("llamacpp-example", *chained, num_drafts=1, lists=lists)
        points.append(dataclasses.replace(point, settings=f"{CHAIN_LABEL}, {label}"))
    frame = pd.DataFrame([{**vars(pt), "bought_per_tv": pt.bought} for pt in points])
    stem = repo_root() / "benchmarks" / "records" / "audit_real"
    frame.to_csv(stem.with_suffix(".csv"), index=False)
    header = record_header("benchmarks/audit_real.py", sys.argv[1:], draft=DRAFT, prefixes=len(p), prompts=NUM_PROMPTS,
                           temperature=TEMPERATURE, num_drafts=NUM_DRAFTS, one_hot_cost=one_hot_cost(p, q, NUM_DRAFTS))
    stem.with_suffix(".json").write_text(json.dumps(header, indent=2) + "\n")
    print(frame.round(4).to_string(index=False))
    print(json.dumps(header["one_hot_cost"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
