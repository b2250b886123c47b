"""Torch calls, kernels and host reads per step of chains and dynamic trees on the embedded pair: what bounds a step
on a GPU.

On an H200 the 135M target's call costs about the same from 1 to 64 tokens (record ``trees_head_h200``): the host
issuing its ~1,850 torch calls sets the time, about 12-15 µs a call, so a step costs roughly its calls. This counts
them here, deterministically, on the path a GPU runs (the target without the CPU's skinny kernels), with
``engine.timing.HostReads``: every torch operation called from Python (attribute reads excluded) and every host read;
and with ``engine.timing.Kernels`` the operators among them that launch work (views and aliases left out).
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
included, as for the growing loop. ``--compile inductor`` counts the kernels of each step as inductor compiles it on
this machine (``fused_kernels_per_step``: its generated kernels, library calls and fallbacks, read from the code it
generated; the step alone, one prompt): how much of a step its fusion takes away, the form ``reduce-overhead``
captures on a GPU (whose Triton code fuses alike but not identically: a prediction, not the GPU's count).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_ops.py --prompts 1 --max-new-tokens 12 --compile inductor \
        --out benchmarks/records/step_ops_inductor_amd.json

``--fuse`` counts the target and the draft with their projections fused (``models.fused``), as they run on CUDA now;
without it neither is fused, as in the records above and the H200's run (commit eebeadf):

    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_ops.py --prompts 4 --max-new-tokens 32 --compile static \
        --fuse --out benchmarks/records/step_ops_static_fused_amd.json
    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_ops.py --prompts 1 --max-new-tokens 12 --compile inductor \
        --fuse --out benchmarks/records/step_ops_inductor_fused_amd.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
from pathlib import Path

import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair
from specresearch.engine.cost import tree_options
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.engine.timing import HostReads, Kernels
from specresearch.experiments.records import record_header
from specresearch.models.attention import use_packed_sdpa
from specresearch.models.fused import fuse_projections, unfuse_projections
from specresearch.models.kernels import SkinnyLinear
from specresearch.paths import data_dir, repo_root

RUNS = {"autoregressive": None, "chain block g1": {"gamma": 1}, "chain block g2": {"gamma": 2},
        "chain block g3": {"gamma": 3}, "dynamic K4 g4 n10": tree_options((4, 4, 10)),
        "dynamic K8 g6 n32": tree_options((8, 6, 32)), "dynamic K10 g6 n60": tree_options((10, 6, 60))}


def as_on_cuda(target, draft, fuse: bool = False) -> None:
    """Make the CPU models issue the torch calls they issue on CUDA, in place: the target (loaded without skinny
    linears) gets the attention ``CausalLM`` chooses there (``models.attention.packed_sdpa_attention``); the draft's
    ``SkinnyLinear`` layers, which drafts choose on CPU only, become plain ``nn.Linear`` where their weights are
    float32 and take ``F.linear`` for every row count where they are float16 (the half path runs on CUDA too). With
    ``fuse``, both models' projections are fused as ``CausalLM`` and ``FeatureDraft`` fuse them there
    (``models.fused``); without, neither model's are (``CausalLM`` fuses its own by default on every device)."""
    use_packed_sdpa(target.model)
    modules = [target.model, *_modules(draft)]
    for module in modules:
        unfuse_projections(module)
    for module in modules[1:]:
        for layer in module.modules():
            if type(layer) is SkinnyLinear and layer.weight.dtype == torch.float32:
                layer.__class__ = torch.nn.Linear
            elif hasattr(layer, "skinny_rows"):
                layer.skinny_rows = ()
    target.fuses = fuse
    if fuse:
        for module in modules:
            fuse_projections(module)


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
    """Per run: torch calls, kernels (``engine.timing.Kernels``) and host reads per step, summed over the prompts,
    and tokens per step."""
    rows = []
    for label, options in RUNS.items():
        calls = kernels = reads = steps = tokens = 0
        for i, ids in enumerate(prompts):
            with HostReads() as counter, Kernels() as launched:
                out = _generate(target, draft, ids, options, temperature, max_new_tokens, 1000 + i, compile)
            calls, kernels, reads = calls + counter.calls, kernels + launched.count, reads + counter.count
            steps, tokens = steps + len(out.steps), tokens + out.num_tokens
        rows.append({"temperature": temperature, "run": label, "compile": compile,
                     "torch_calls_per_step": calls / steps, "kernels_per_step": kernels / steps,
                     "host_reads_per_step": reads / steps, "tokens_per_step": tokens / steps})
        print(rows[-1], flush=True)
    return rows


def _generate(target, draft, ids, options, temperature, max_new_tokens, seed, compile):
    common = dict(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=temperature), seed=seed,
                  compile=compile)
    return (autoregressive_generate(target, [ids], **common) if options is None
            else speculative_generate(target, draft, [ids], **options, **common))


# a statement of an inductor wrapper's ``call`` that launches work: its own kernels (C++ on the CPU, Triton on CUDA),
# a library kernel (``extern_kernels.mm``) or an ATen fallback it could not generate (``torch.ops.aten.sort``)
LAUNCH = re.compile(r"^(?:\w+ = )?(?P<kind>cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(")


def wrapper_launches(source: str) -> collections.Counter:
    """The kernels one call of an inductor-compiled graph launches, read from its generated wrapper's ``call``
    function (``source``: the module's code): by kind (its own generated kernels as ``"generated"``)."""
    if "def call(" not in source:
        return collections.Counter()
    body = source.split("def call(", 1)[1]
    found = collections.Counter()
    for line in body.splitlines()[1:]:
        if line and not line.startswith((" ", "\t")):  # the function has ended
            break
        match = LAUNCH.match(line.strip())
        if match:
            kind = match["kind"]
            found["generated" if kind.startswith(("cpp_fused_", "triton_")) else kind] += 1
    return found


def count_fused(target, draft, prompts, temperature: float, max_new_tokens: int) -> list[dict]:
    """Per run: the kernels of its step compiled by inductor (``compile="inductor"``, this machine's code: C++ and
    library calls on the CPU), read from the code inductor generated for it; one compile a run (dynamo reset
    first, the code cache emptied, so that the step's module is the one loaded)."""
    from torch._inductor.codecache import PyCodeCache

    rows = []
    for label, options in RUNS.items():
        torch._dynamo.reset()
        PyCodeCache.cache_clear()
        out = _generate(target, draft, prompts[0], options, temperature, max_new_tokens, 1000, "inductor")
        graphs = [wrapper_launches(Path(module.__file__).read_text()) for module in _loaded(PyCodeCache)]
        graphs = [g for g in graphs if g]
        if len(graphs) != 1:
            raise RuntimeError(f"{label}: expected one compiled step, inductor loaded {len(graphs)} graphs")
        (launches,) = graphs
        rows.append({"temperature": temperature, "run": label, "compile": "inductor",
                     "fused_kernels_per_step": sum(launches.values()), "fused_kernels_by_kind": dict(launches),
                     "tokens_per_step": out.num_tokens / len(out.steps)})
        print(rows[-1], flush=True)
    return rows


def _loaded(cache) -> list:
    modules = cache.modules
    return list(modules.values() if isinstance(modules, dict) else modules)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft", default="eagle3-v8k", help="default: the float32 head, as scripts/gpu_check.sh runs")
    parser.add_argument("--compile", choices=["off", "static", "inductor"], default="off",
                        help="off: the growing loop; static: the captured steps run eagerly (the calls a CUDA graph of "
                             "the step holds: each launches one kernel or more, replayed without the host); inductor: "
                             "the kernels of each step as inductor compiles it here")
    parser.add_argument("--fuse", action="store_true",
                        help="the target's and the draft's q / k / v and gate / up projections fused, as they run on "
                             "CUDA (models.fused); without it, unfused as the H200's run (commit eebeadf) ran them")
    parser.add_argument("--out", default=str(repo_root() / "benchmarks" / "records" / "step_ops_amd.json"))
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error(f"--prompts and --max-new-tokens must be >= 1, got {args.prompts} and {args.max_new_tokens}")
    target, draft, tokenizer = load_pair(draft=args.draft, skinny_linear=False)  # the GPU's path: plain linear layers
    as_on_cuda(target, draft, fuse=args.fuse)
    chosen = evenly_spaced(load_prompts(data_dir() / "prompts.jsonl"), args.prompts)
    prompts = [row.tolist() for row in encode_chat(chosen, tokenizer)]
    counter = count_fused if args.compile == "inductor" else functools.partial(count, compile=args.compile)
    rows = [row for t in (0.0, 1.0) for row in counter(target, draft, prompts, t, args.max_new_tokens)]
    record = record_header("benchmarks/bench_step_ops.py", sys.argv[1:], draft=args.draft, rows=rows)
    with open(args.out, "w") as file:
        file.write(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
