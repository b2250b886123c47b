"""Which of a feature head's layers tolerate int8 weights: q's distance from the float16 head's, one layer at a time.

For ``--prompts`` evenly spaced held-out chat prompts (``data/prompts.jsonl``), the target samples ``--max-new-tokens``
tokens at T = 1 (seed = the prompt's index); on each prompt and its continuation the head predicts every next token
from the target's true features (depth 1). Against the head with float16 weights (``fp16:NAME``), each variant reports
the mean total-variation distance of q over the positions and the share of positions where q's top token changes:

* each linear layer alone in int8 (``models.kernels.use_int8_weights``: one float32 scale per output row), the rest
  float16;
* every layer in int8;
* ``int8:NAME`` as ``drafts.registry.int8_weight_draft`` stores it.

Per layer, also the rounding's relative size, ``|W8 * scale - W| / |W|`` (Frobenius). A measurement: nothing asserted.
The record (``--out``, JSON) carries its command, commit, machine and weights' digests (``record_header``).

    PYTHONPATH=. .venv/bin/python benchmarks/int8_layers.py --out benchmarks/records/int8_layers_eagle3-v8k.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.distilled import SubsetHead
from specresearch.drafts.registry import draft_from_name, load_pair
from specresearch.engine.generate import autoregressive_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.experiments.records import record_header, write_json_record
from specresearch.models.kernels import int8_rows, use_int8_weights
from specresearch.paths import data_dir


def head_logits(target, draft, sequence: list[int]) -> torch.Tensor:
    """The head's next-token logits ``[L, V]`` at every slot of ``sequence``, from the target's true features."""
    ids = torch.tensor([sequence])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    draft.reset(1)
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    return draft.score(ids)[0].float()


def distance(target, draft, sequences, reference) -> dict:
    """Mean total variation of q from ``reference``'s and the share of positions whose top token differs."""
    tv, changed, positions = 0.0, 0, 0
    for sequence, base in zip(sequences, reference):
        logits = head_logits(target, draft, sequence)
        tv += float(0.5 * (logits.softmax(-1) - base.softmax(-1)).abs().sum(-1).sum())
        changed += int((logits.argmax(-1) != base.argmax(-1)).sum())
        positions += logits.shape[0]
    return {"total_variation": tv / positions, "top_token_changed": changed / positions, "positions": positions}


def rounding(weight: torch.Tensor) -> float:
    """``|W8 * scale - W| / |W|`` of ``models.kernels.int8_rows``."""
    weight = weight.detach().float()
    rows, scale = int8_rows(weight)
    return float((rows.float() * scale[:, None] - weight).norm() / weight.norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="eagle3-v8k", help="a feature head (shipped name or directory)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="reports/int8_layers.json")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    target, reference_draft, tokenizer = load_pair(draft=f"fp16:{args.draft}")
    if not hasattr(reference_draft, "head"):
        parser.error(f"--draft {args.draft!r} is not a feature head")
    sequences = []
    for index, prompt in enumerate(evenly_spaced(load_prompts(data_dir() / "prompts.jsonl"), args.prompts)):
        ids = encode_chat([prompt], tokenizer)[0].tolist()
        out = autoregressive_generate(target, [ids], max_new_tokens=args.max_new_tokens,
                                      sampling=SamplingConfig(temperature=1.0), seed=[index])
        sequences.append(ids + list(out.tokens[0]))
    with torch.no_grad():
        reference = [head_logits(target, reference_draft, s) for s in sequences]
    names = [n for n, m in reference_draft.head.named_modules()
             if isinstance(m, (torch.nn.Linear, SubsetHead)) and m.weight.ndim == 2]
    rows = []
    for name in [*names, "every layer", f"int8:{args.draft}"]:
        if name == f"int8:{args.draft}":
            draft = draft_from_name(name, target)
        else:
            draft = draft_from_name(f"fp16:{args.draft}", target)
            modules = dict(draft.head.named_modules())
            for layer in names if name == "every layer" else [name]:
                use_int8_weights(modules[layer], (SubsetHead,), shared_with=target.model)
        row = {"int8": name}
        if name in names:
            row["rounding"] = rounding(dict(reference_draft.head.named_modules())[name].weight)
        with torch.no_grad():
            row.update(distance(target, draft, sequences, reference))
        rows.append(row)
        print(f"{name:32s} TV {row['total_variation']:.4f}  top token changed {row['top_token_changed']:.3f}"
              + (f"  rounding {row['rounding']:.4f}" if "rounding" in row else ""), flush=True)
    record = {**record_header("benchmarks/int8_layers.py", sys.argv[1:], draft=f"int8:{args.draft}"),
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "rows": rows}
    write_json_record(args.out, record)
    print(f"record in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
