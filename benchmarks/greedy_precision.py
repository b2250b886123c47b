"""Greedy speculative decoding against greedy autoregressive decoding, token for token, in float32 and in bfloat16.

In exact arithmetic greedy speculative decoding emits autoregressive decoding's tokens. In floating point a call that
scores gamma + 1 tokens at once rounds differently from gamma + 1 one-token calls (other matrix shapes, other
reduction orders), and where two tokens' logits nearly tie the argmax can flip; from there the texts part (even
the first token: plain decoding feeds the prompt's last token alone, speculative decoding with its drafts). float32's
rounding is too small to flip the embedded target's argmax on these prompts; bfloat16's (8 bits of mantissa) is not.
This is arithmetic, not the verifier: transformers' own assisted generation (``generate(assistant_model=...)``) is run
on the same models, prompts and dtype against its own greedy ``generate``, side by side.

For each dtype the embedded target and the distilled draft ``v8k-4l`` are loaded as transformers builds them (no
fused projections, no skinny kernels: both loops run the same modules), then for each of ``--prompts`` MT-Bench first
turns (chat template, evenly spaced over the categories): ours, ``autoregressive_generate`` vs ``speculative_generate``
(block verification, gamma ``--gamma``, T = 0); the peer, ``generate(do_sample=False)`` vs the same with the draft as
``assistant_model``. A row records whether the two agree for ``--tokens`` tokens (no EOS) and where they first differ.
A measurement: nothing is asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/greedy_precision.py --prompts 8 --out benchmarks/records/greedy_precision.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompt_set
from specresearch.experiments.records import record_header, write_json_record

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GREEDY = SamplingConfig(temperature=0.0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (or where the shorter ends), None where they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(dtype: torch.dtype, prompts: list[dict], tokens: int, gamma: int) -> list[dict]:
    """One row per prompt: where ours and transformers' speculative decoding first leave their greedy decoding."""
    target, draft, tokenizer = load_pair(dtype=dtype, skinny_linear=False, fuse_projections=False)
    draft.model.to(dtype)
    prompts = encode_chat(prompts, tokenizer)
    rows = []
    for index, ids in enumerate(tqdm(prompts, desc=str(dtype).removeprefix("torch."), file=sys.stderr)):
        prompt = ids.tolist()
        plain = list(autoregressive_generate(target, [prompt], max_new_tokens=tokens, sampling=GREEDY,
                                             eos_token_id=[]).tokens[0])
        ours = list(speculative_generate(target, draft, [prompt], verifier="block", gamma=gamma, max_new_tokens=tokens,
                                         sampling=GREEDY, eos_token_id=[]).tokens[0])
        inputs = dict(input_ids=ids[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                      pad_token_id=0)
        with torch.no_grad():
            generated = target.model.generate(**inputs)[0, len(prompt):].tolist()
            assisted = target.model.generate(**inputs, assistant_model=draft.model)[0, len(prompt):].tolist()
        rows.append({"dtype": str(dtype).removeprefix("torch."), "prompt": index, "ours_first_difference":
                     first_difference(plain, ours), "peer_first_difference": first_difference(generated, assisted),
                     "ours_plain_equals_peer_plain": plain == generated})
    return rows


def summary(rows: list[dict]) -> dict:
    """Per dtype: rows where speculative decoding kept greedy decoding's tokens, ours and the peer's."""
    out = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        cell = [r for r in rows if r["dtype"] == dtype]
        out[dtype] = {"prompts": len(cell),
                      "ours_identical": sum(r["ours_first_difference"] is None for r in cell),
                      "peer_identical": sum(r["peer_first_difference"] is None for r in cell),
                      "ours_first_differences": sorted(r["ours_first_difference"] for r in cell
                                                       if r["ours_first_difference"] is not None),
                      "peer_first_differences": sorted(r["peer_first_difference"] for r in cell
                                                       if r["peer_first_difference"] is not None)}
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns, evenly spaced")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt (no EOS)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="write the record here (JSON)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = evenly_spaced(load_prompt_set("mt-bench"), args.prompts)
    rows = [row for dtype in DTYPES.values() for row in compare(dtype, prompts, args.tokens, args.gamma)]
    result = summary(rows)
    for dtype, cell in result.items():
        print(f"{dtype}: speculative = greedy on {cell['ours_identical']}/{cell['prompts']} prompts (ours), "
              f"{cell['peer_identical']}/{cell['prompts']} (transformers' assisted generation); first differences "
              f"at tokens {cell['ours_first_differences']} / {cell['peer_first_differences']}")
    if args.out:
        header = record_header("benchmarks/greedy_precision.py", argv, draft="v8k-4l", torch=torch.__version__)
        write_json_record(args.out, {**header, "summary": result, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
