"""Torch calls and host reads per step of chains and dynamic trees on the embedded pair: what bounds a step on a GPU.

On an H200 the 135M target's call costs about the same from 1 to 64 tokens (record ``trees_head_h200``): the host
issuing its ~1,850 torch calls sets the time, about 12-15 µs a call, so a step costs roughly its calls. This counts
them here, deterministically, on the path a GPU runs (the target without the CPU's skinny kernels), with
``engine.timing.HostReads``: every torch operation called from Python (attribute reads excluded) and every host read.
The models issue the calls they would on CUDA (:func:`as_on_cuda`: the target's attention ``CausalLM`` chooses there,
the draft's float32 layers plain ``nn.Linear``). The shipped head drafts; held-out chat prompts; T = 0 and 1. Nothing
is timed and nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_ops.py --prompts 4 --max-new-tokens 32
    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_ops.py --prompts 4 --max-new-tokens 32 --draft fp16:eagle3-v8k \
        --out benchmarks/records/step_ops_fp16_amd.json
    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_ops.py --prompts 4 --max-new-tokens 32 --compile static \
        --out benchmarks/records/step_ops_static_amd.json

``--compile static`` counts the captured steps' calls (run eagerly: the calls a CUDA graph of the step holds, each one
kernel or more, which a replay launches without the host); per step, the prompt's prefill and the run's set-up
included, as for the growing loop.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair
from specresearch.engine.cost import tree_options
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.engine.timing import HostReads
from specresearch.experiments.records import record_header
from specresearch.models.attention import use_packed_sdpa
from specresearch.models.kernels import SkinnyLinear
from specresearch.paths import data_dir, repo_root

RUNS = {"autoregressive": None, "chain block g1": {"gamma": 1}, "chain block g2": {"gamma": 2},
        "dynamic K4 g4 n10": tree_options((4, 4, 10)), "dynamic K8 g6 n32": tree_options((8, 6, 32))}


def as_on_cuda(target, draft) -> None:
    """Make the CPU models issue the torch calls they issue on CUDA, in place: the target (loaded without skinny
    linears) gets the attention ``CausalLM`` chooses there (``models.attention.packed_sdpa_attention``); the draft's
    ``SkinnyLinear`` layers, which drafts choose on CPU only, become plain ``nn.Linear`` where their weights are
    float32 and take ``F.linear`` for every row count where they are float16 (the half path runs on CUDA too)."""
    use_packed_sdpa(target.model)
    for module in _modules(draft):
        for layer in module.modules():
            if type(layer) is SkinnyLinear and layer.weight.dtype == torch.float32:
                layer.__class__ = torch.nn.Linear
            elif hasattr(layer, "skinny_rows"):
                layer.skinny_rows = ()


def _modules(draft, depth: int = 3) -> list[torch.nn.Module]:
    """The ``nn.Module`` attributes of a draft and of the drafts it wraps (a lookup's trained draft)."""
    found = []
    for value in vars(draft).values():
        if isinstance(value, torch.nn.Module):
            found.append(value)
        elif depth and hasattr(value, "__dict__") and not isinstance(value, (type, torch.Tensor)):
            found.extend(_modules(value, depth - 1))
    return found


def count(target, draft, prompts, temperature: float, max_new_tokens: int, compile: str = "off") -> list[dict]:
    """Per run: torch calls and host reads per step, summed over the prompts, and tokens per step."""
    rows = []
    for label, options in RUNS.items():
        calls = reads = steps = tokens = 0
        for i, ids in enumerate(prompts):
            sampling = SamplingConfig(temperature=temperature)
            common = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=1000 + i, compile=compile)
            with HostReads() as counter:
                out = (autoregressive_generate(target, [ids], **common) if options is None
                       else speculative_generate(target, draft, [ids], **options, **common))
            calls, reads = calls + counter.calls, reads + counter.count
            steps, tokens = steps + len(out.steps), tokens + out.num_tokens
        rows.append({"temperature": temperature, "run": label, "compile": compile,
                     "torch_calls_per_step": calls / steps, "host_reads_per_step": reads / steps,
                     "tokens_per_step": tokens / steps})
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft", default="eagle3-v8k", help="default: the float32 head, as scripts/gpu_check.sh runs")
    parser.add_argument("--compile", choices=["off", "static"], default="off",
                        help="off: the growing loop; static: the captured steps run eagerly (the calls a CUDA graph of "
                             "the step holds: each launches one kernel or more, replayed without the host)")
    parser.add_argument("--out", default=str(repo_root() / "benchmarks" / "records" / "step_ops_amd.json"))
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error(f"--prompts and --max-new-tokens must be >= 1, got {args.prompts} and {args.max_new_tokens}")
    target, draft, tokenizer = load_pair(draft=args.draft, skinny_linear=False)  # the GPU's path: plain linear layers
    as_on_cuda(target, draft)
    chosen = evenly_spaced(load_prompts(data_dir() / "prompts.jsonl"), args.prompts)
    prompts = [row.tolist() for row in encode_chat(chosen, tokenizer)]
    rows = [row for t in (0.0, 1.0) for row in count(target, draft, prompts, t, args.max_new_tokens, args.compile)]
    record = record_header("benchmarks/bench_step_ops.py", sys.argv[1:], draft=args.draft, rows=rows)
    with open(args.out, "w") as file:
        file.write(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
