"""Speed of the generation engine on the embedded SmolLM2-135M-Instruct target (a benchmark, not a test).

One run, same prompts, same draft, same gamma, same sampling:
  * autoregressive decoding of the target (ours, and transformers' ``generate`` for reference);
  * our speculative generation with token and with block verification;
  * the same block verification through transformers' own entry point,
    ``target.generate(..., custom_generate=specresearch.engine.hf.speculative(draft, verifier="block", gamma=gamma))``
    (``hf/block``: generate's input preparation + our engine);
  * transformers' assisted generation (``generate(assistant_model=..., do_sample=True)``) with a constant
    number of assistant tokens = gamma (``num_assistant_tokens_schedule="constant"`` and the dynamic
    confidence threshold switched off, ``assistant_confidence_threshold=0``, so it drafts exactly gamma).
The draft is ``--draft``, any name ``drafts.registry.draft_from_name`` knows: by default the shipped distilled
``v8k-4l`` (a transformers Llama with a trained 8192-token head that returns full-vocabulary logits, so
transformers' assisted generation runs the very same model), or ``truncated:N`` (the target's first N
layers), or a checkpoint path with the target's tokenizer.

Prints a table (tokens/s, block efficiency, ratios) and the engine's overhead per step (all but the two
models' forward passes) against one target forward; ``--out`` writes the rows as JSON lines.

    .venv/bin/python benchmarks/bench_generate.py --max-new-tokens 48   # ~2 min (the README table)
    .venv/bin/python benchmarks/bench_generate.py --quick          # 2 prompts x 24 tokens
    .venv/bin/python benchmarks/bench_generate.py --device cuda    # on a GPU (same table)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.hf import speculative
from specresearch.models.embedded import load_embedded

_DATA = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"


def _prompts(tokenizer, n: int) -> list[str]:
    """The first turn of one prompt per category of data/prompts.jsonl, in the chat template."""
    rows, seen = [], set()
    for line in _DATA.read_text().splitlines():
        record = json.loads(line)
        if record["category"] not in seen:
            seen.add(record["category"])
            rows.append(record["turns"][0])
    chat = [{"role": "user", "content": text} for text in rows[:n]]
    return [tokenizer.apply_chat_template([m], add_generation_prompt=True, tokenize=False) for m in chat]


class _ForwardMeter:
    """Counts and times the forward calls of an HF model through forward pre/post hooks (public torch API;
    nothing patched). The time inside the forwards bounds what any engine could gain with the same models:
    an engine with zero overhead would take ``forward_seconds``. On an asynchronous device (cuda, mps) the
    hooks see launch times only, so the forward share they give is a lower bound there."""

    def __init__(self, module):
        self.calls, self.seconds, self._start = 0, 0.0, 0.0
        self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.calls += 1
        self.seconds += time.perf_counter() - self._start

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _ours(method, target, draft, prompt, seed, tokenizer, args, sampling) -> dict:
    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed, tokenizer=tokenizer)
    if method == "autoregressive":
        result = autoregressive_generate(target, [prompt], **kwargs)
    else:
        result = speculative_generate(target, draft, [prompt], verifier=method, gamma=args.gamma, **kwargs)
    forward = sum(step.target_seconds + step.draft_seconds for step in result.steps)
    return dict(tokens=result.num_tokens, seconds=result.seconds, target_calls=result.target_calls, result=result,
                forward_seconds=forward + result.prefill_seconds)


def _hf(assisted: bool, target, draft, prompt, seed, tokenizer, args, sampling) -> dict:
    draft.model.generation_config.num_assistant_tokens = args.gamma
    draft.model.generation_config.num_assistant_tokens_schedule = "constant"
    draft.model.generation_config.assistant_confidence_threshold = 0.0  # falsy: no early stop of drafting
    target_meter, draft_meter = _ForwardMeter(target.model), _ForwardMeter(draft.model)
    enc = tokenizer([prompt], return_tensors="pt")
    torch.manual_seed(seed)  # transformers' sampling draws from the global RNG
    start = time.perf_counter()
    out = target.model.generate(
        **enc, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=sampling.temperature, top_k=0,
        top_p=1.0, assistant_model=draft.model if assisted else None, pad_token_id=tokenizer.pad_token_id,
    )
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    seconds = time.perf_counter() - start
    target_meter.remove()
    draft_meter.remove()
    new_tokens = out.shape[1] - enc["input_ids"].shape[1]
    return dict(tokens=new_tokens, seconds=seconds, target_calls=target_meter.calls,  # its prefill yields a token too
                forward_seconds=target_meter.seconds + draft_meter.seconds)


def _hf_custom(target, draft, prompt, seed, tokenizer, args, sampling) -> dict:
    """Our block verification called as ``target.generate(..., custom_generate=speculative(draft))``."""
    enc = tokenizer([prompt], return_tensors="pt")
    start = time.perf_counter()
    out = target.model.generate(
        **enc, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=sampling.temperature, top_k=0,
        top_p=1.0, pad_token_id=tokenizer.pad_token_id, seed=seed, return_dict_in_generate=True,
        custom_generate=speculative(draft, verifier="block", gamma=args.gamma),
    )
    seconds = time.perf_counter() - start
    result = out.result
    forward = sum(step.target_seconds + step.draft_seconds for step in result.steps)
    return dict(tokens=result.num_tokens, seconds=seconds, target_calls=result.target_calls, result=result,
                forward_seconds=forward + result.prefill_seconds)


METHODS = {
    "ours/autoregressive": lambda *a: _ours("autoregressive", *a),
    "transformers/autoregressive": lambda *a: _hf(False, *a),
    "ours/token": lambda *a: _ours("token", *a),
    "ours/block": lambda *a: _ours("block", *a),
    "hf/block": _hf_custom,
    "transformers/assisted": lambda *a: _hf(True, *a),
}


def _run_all(target, draft, prompts, tokenizer, args, sampling) -> list[dict]:
    """Methods interleaved prompt by prompt, so a load change on a shared machine hits all of them alike."""
    rows = {name: dict(method=name, tokens=0, seconds=0.0, target_calls=0, forward_seconds=0.0, results=[])
            for name in METHODS}
    for i, prompt in enumerate(prompts):
        for name, run in METHODS.items():
            record = run(target, draft, prompt, args.seed + i, tokenizer, args, sampling)
            for key in ("tokens", "seconds", "target_calls", "forward_seconds"):
                rows[name][key] += record[key]
            if "result" in record:
                rows[name]["results"].append(record["result"])
    return list(rows.values())


def _overhead(rows) -> list[str]:
    """Engine overhead per step vs one target forward, from our step records."""
    lines = []
    for row in rows:
        steps = [s for r in row["results"] for s in r.steps]
        if not steps:
            continue
        overhead = statistics.median(s.overhead_seconds for s in steps)
        target = statistics.median(s.target_seconds for s in steps)
        draft = statistics.median(s.draft_seconds for s in steps)
        lines.append(f"{row['method']:<28} median per step: target forward {1e3 * target:7.2f} ms, draft "
                     f"{1e3 * draft:7.2f} ms, overhead {1e3 * overhead:6.2f} ms = {100 * overhead / target:5.1f}% "
                     "of a target forward")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=7, help="one per category of data/prompts.jsonl (<= 7)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--draft", default="v8k-4l", help="v8k-4l (shipped), truncated:N, or a checkpoint path")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared 2-core CPU)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (cuda > mps > cpu)")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 24 tokens")
    parser.add_argument("--out", type=Path, default=None, help="write the table rows as JSON lines here")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 2, 24
    torch.set_num_threads(args.threads)
    target, tokenizer = load_embedded("smollm2-135m-instruct", device=args.device)
    draft = draft_from_name(args.draft, target, tokenizer)
    prompts = _prompts(tokenizer, args.prompts)
    sampling = SamplingConfig(temperature=args.temperature)
    _print(_run_all(target, draft, prompts, tokenizer, args, sampling), args)


def _print(rows, args) -> None:
    base = rows[0]["tokens"] / rows[0]["seconds"]
    assisted = rows[-1]["tokens"] / rows[-1]["seconds"]
    print(f"\nSmolLM2-135M-Instruct target, draft = {args.draft}, gamma = {args.gamma}, "
          f"T = {args.temperature}, {args.prompts} prompts x {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| method | tokens | seconds | tokens/s | block efficiency | in forward passes | vs autoregressive "
          "| vs HF assisted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        speed = row["tokens"] / row["seconds"]
        row.update(tokens_per_second=speed, block_efficiency=row["tokens"] / max(row["target_calls"], 1))
        print(f"| {row['method']} | {row['tokens']} | {row['seconds']:.1f} | {speed:.1f} | "
              f"{row['block_efficiency']:.2f} | {100 * row['forward_seconds'] / row['seconds']:.1f}% | "
              f"{speed / base:.2f}x | {speed / assisted:.2f}x |")
    hf = rows[-1]
    print(f"\nCeiling: transformers' assisted run spent {hf['forward_seconds']:.1f} of its {hf['seconds']:.1f} s inside "
          f"the two models' forward passes; an engine with zero overhead making the same forward calls would be at "
          f"most {hf['seconds'] / hf['forward_seconds']:.3f}x its tokens/s.")
    for row in rows:
        if row["results"] and row["method"] != "ours/autoregressive":
            rates = [r.acceptance_rate for r in row["results"]]
            print(f"{row['method']}: alpha estimate {statistics.mean(rates):.3f}")
    print("\n" + "\n".join(_overhead(rows)))
    print("(block efficiency = new tokens / target forward calls that yield tokens: ours prefills all but the last "
          "prompt token without yielding; transformers' prefill yields the first token)")
    if args.out:
        with args.out.open("w") as f:
            for row in rows:
                f.write(json.dumps({k: v for k, v in row.items() if k != "results"}) + "\n")


if __name__ == "__main__":
    main()
