"""What a feature head's vocabulary subset costs: how often the target's next token lies outside it.

A subset head (`eagle3-v8k`: 8,192 of the target's 49,152 tokens, the ones with the most teacher probability over
the training corpus) gives q(x) = 0 off its subset, so no draft it makes can be a token outside it. For
``--prompts`` evenly spaced prompts of each ``--sets`` (``mt-bench``, ``humaneval``: first turns; ``chat``:
``data/prompts.jsonl``), the target continues each prompt by ``--max-new-tokens`` tokens at each ``--temperatures``
(seed = the prompt's index), and at every continuation position this reports, averaged over the positions:

* ``top_outside``: the target's most likely token is off the subset; ``mass_outside``: p's mass off it (at T);
* ``top_outside_in_context``: ... and that token occurs earlier in the prompt or the continuation;
* ``agree``: the head's depth-1 agreement from the target's true features: at T = 0 its top token is the target's, at
  T > 0 alpha = sum_x min(p, q), both at T;
* ``agree_context_rows``: the same when the context's off-subset tokens are added to the head's support with the
  target's own output rows, each such logit placed relative to the head's top subset token,
  ``l(t) = h . w_t - h . w_top + l_head(top)`` (q is what the draft computes either way, so it stays lossless);
* ``agree_full_readout``: the head's predicted feature read out by the target's whole output layer;
* ``top_outside_<K>``: the target's most likely token is off the K tokens sampled most often in the head's training
  corpus (its committed token ids, ``data/corpora/``), for each ``--subset-sizes`` K: what a larger subset would
  cover (the head's own subset ranks tokens by teacher probability over the same corpus, ``corpus_overlap`` says how
  close the two 8,192-token rankings are).

The head runs with its stored weights widened to float32. A measurement: nothing asserted. The record (``--out``,
JSON) carries its command, commit, machine and weights' digests (``record_header``).

    PYTHONPATH=. .venv/bin/python benchmarks/subset_coverage.py --out benchmarks/records/subset_coverage_eagle3-v8k.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.feature import feature_head_dir
from specresearch.drafts.registry import load_pair
from specresearch.engine.generate import autoregressive_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompt_set, load_prompts
from specresearch.experiments.records import record_header, write_json_record
from specresearch.paths import data_dir

SETS = ("mt-bench", "humaneval", "chat")


def corpus_ranking(head_dir: Path, vocab_size: int) -> torch.Tensor:
    """Token ids by how often the target sampled them in the head's training corpus, most frequent first."""
    import numpy as np

    from specresearch.drafts.store import read_manifest
    from specresearch.training.feature_corpus import corpus_token_file

    path = corpus_token_file(read_manifest(head_dir)["corpus"]["cache_key"])
    with np.load(path, allow_pickle=False) as data:
        tokens, lengths, prompt_lengths = data["tokens"].astype(np.int64), data["lengths"], data["prompt_lengths"]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    generated = np.ones(len(tokens), dtype=bool)
    for start, prompt_length in zip(starts, prompt_lengths):
        generated[start:start + prompt_length] = False
    counts = torch.from_numpy(np.bincount(tokens[generated], minlength=vocab_size)).double()
    return torch.sort(counts, descending=True, stable=True).indices


def set_prompts(name: str) -> list[dict]:
    return load_prompts(data_dir() / "prompts.jsonl") if name == "chat" else load_prompt_set(name)


def agreement(logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per position: [top token equal] at T = 0, sum_x min(p, q) at T > 0 (both laws at T)."""
    if temperature == 0:
        return (logits.argmax(-1) == target_logits.argmax(-1)).double()
    q = (logits / temperature).softmax(-1)
    p = (target_logits / temperature).softmax(-1)
    return torch.minimum(p, q).sum(-1).double()


@torch.no_grad()
def positions(target, head, prompt: list[int], continuation: list[int], temperature: float, inside: torch.Tensor,
              larger: dict[int, torch.Tensor]) -> dict:
    """Each measure of the module docstring at each continuation position, ``{name: [n] float64}``."""
    ids = torch.tensor([prompt + continuation])
    P, L = len(prompt), ids.shape[1]
    out = target.model(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in head.feature_layers], -1).float()
    predicted = head.rollout(features, ids, torch.ones_like(ids), passes=1)[0][0]  # [L, H]: slot j predicts x_{j+1}
    slots = torch.arange(P - 1, L - 1)  # the slots whose next token is a continuation token
    target_logits = out.logits[0, slots].float()
    head_logits = head.logits(predicted[slots]).float()
    rows = head._frozen["head"].weight.detach().float()
    full = predicted[slots] @ rows.T  # [n, V]
    top = target_logits.argmax(-1)
    p = (target_logits / (temperature or 1.0)).softmax(-1)
    context_rows = head_logits.clone()
    in_context = torch.zeros(len(slots), dtype=torch.bool)
    sequence = ids[0].tolist()
    for i, j in enumerate(slots.tolist()):
        seen = torch.tensor(sorted(set(sequence[:j + 1])), dtype=torch.long)
        extra = seen[~inside[seen]]
        in_context[i] = bool((extra == top[i]).any())
        if len(extra):
            best = int(head_logits[i].argmax())
            context_rows[i, extra] = full[i, extra] - full[i, best] + head_logits[i, best]
    off = ~inside[top]
    return {"top_outside": off.double(),
            "mass_outside": p[:, ~inside].sum(-1).double() if temperature else off.double(),
            "top_outside_in_context": (off & in_context).double(),
            "agree": agreement(head_logits, target_logits, temperature),
            "agree_context_rows": agreement(context_rows, target_logits, temperature),
            "agree_full_readout": agreement(full, target_logits, temperature),
            **{f"top_outside_{size}": (~mask[top]).double() for size, mask in larger.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="eagle3-v8k", help="a feature head with a subset head (shipped name or directory)")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per set")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--subset-sizes", type=int, nargs="*", default=[8192, 16384, 32768],
                        help="sizes of the corpus-frequency subsets whose coverage is also counted")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="reports/subset_coverage.json")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be >= 1")
    if any(t < 0 for t in args.temperatures):
        parser.error(f"--temperatures must be >= 0, got {args.temperatures}")
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair(draft=args.draft)
    head = getattr(draft, "head", None)
    if head is None or head.subset_head is None:
        parser.error(f"--draft {args.draft!r} is not a feature head with a vocabulary subset")
    head.eval()
    inside = torch.zeros(head.vocab_size, dtype=torch.bool)
    inside[head.subset_head.token_ids] = True
    if any(not 0 < size <= head.vocab_size for size in args.subset_sizes):
        parser.error(f"--subset-sizes must lie in [1, {head.vocab_size}], got {args.subset_sizes}")
    ranking = corpus_ranking(feature_head_dir(args.draft), head.vocab_size) if args.subset_sizes else None
    larger = {}
    for size in args.subset_sizes:
        larger[size] = torch.zeros(head.vocab_size, dtype=torch.bool)
        larger[size][ranking[:size]] = True
    own = int(inside.sum())
    overlap = int((inside & larger[own]).sum()) if own in larger else None  # the two rankings' shared tokens
    rows = []
    for name in args.sets:
        prompts = evenly_spaced(set_prompts(name), args.prompts)
        for temperature in args.temperatures:
            measures: dict[str, list[torch.Tensor]] = {}
            for index, prompt in enumerate(prompts):
                ids = encode_chat([prompt], tokenizer)[0].tolist()
                out = autoregressive_generate(target, [ids], max_new_tokens=args.max_new_tokens,
                                              sampling=SamplingConfig(temperature=temperature), seed=[index])
                for key, value in positions(target, head, ids, list(out.tokens[0]), temperature, inside, larger).items():
                    measures.setdefault(key, []).append(value)
            columns = {key: torch.cat(values) for key, values in measures.items()}
            n = len(columns["agree"])
            row = {"set": name, "temperature": temperature, "prompts": len(prompts), "positions": n,
                   **{key: float(value.mean()) for key, value in columns.items()}}
            rows.append(row)
            print(f"{name:9s} T={temperature:g}  positions {int(n):4d}  top outside {row['top_outside']:.3f} "
                  f"(in context {row['top_outside_in_context']:.3f})  mass outside {row['mass_outside']:.3f}  "
                  f"agree {row['agree']:.3f}  +context rows {row['agree_context_rows']:.3f}  "
                  f"full readout {row['agree_full_readout']:.3f}  "
                  + "  ".join(f"outside top-{size} {row[f'top_outside_{size}']:.3f}" for size in larger), flush=True)
    record = {**record_header("benchmarks/subset_coverage.py", sys.argv[1:], draft=args.draft),
              "subset_size": int(inside.sum()), "vocab_size": head.vocab_size, "max_new_tokens": args.max_new_tokens,
              "corpus_overlap": overlap,
              "rows": rows}
    write_json_record(args.out, record)
    print(f"record in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
