"""The timing half of ``scripts/gpu_check.sh``: verifiers at B = 32, the engine's overhead and host reads per step,
the device's cost curve r_n with chains against sampled and dynamic trees (what a tree step costs there), and a
masked call's attention as transformers computes it against ``CausalLM``'s on CUDA (``packed_sdpa_attention``), on a model
with SmolLM2-135M's configuration and random weights (``data/configs/smollm2-135m-instruct.json``: no
shipped weights needed, so a GPU machine gets it with the code). Writes ``OUT/gpu_bench.json``; nothing is asserted.

    python scripts/gpu_bench.py --out RESULTS_DIR                    # on a CUDA machine
    python scripts/gpu_bench.py --out /tmp/x --device cpu --quick     # the same code on a CPU, small (the tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specresearch.config import SamplingConfig  # noqa: E402
from specresearch.core.draft_paths import draw_multi_uniforms  # noqa: E402
from specresearch.core.verify import VERIFIERS, draw_uniforms  # noqa: E402
from specresearch.core.verify_multi import MULTI_VERIFIERS  # noqa: E402
from specresearch.drafts.ngram import NGramDraft  # noqa: E402
from specresearch.drafts.registry import truncated_draft  # noqa: E402
from specresearch.engine.generate import autoregressive_generate, speculative_generate  # noqa: E402
from specresearch.engine.timing import HostReads, TimedCall, interleaved_medians  # noqa: E402
from specresearch.models.causal_lm import CausalLM  # noqa: E402


def verifier_timings(device, batch: int, vocab: int, repeats: int) -> dict:
    """Median ms of each verifier on [B, gamma = 4] blocks and of each multi-draft rule on K = 4 paths of L = 4."""
    g = torch.Generator(device=device).manual_seed(0)
    target = torch.softmax(3 * torch.randn(batch, 5, vocab, generator=g, device=device), -1)
    draft = torch.softmax(torch.log(target[:, :4]) + torch.randn(batch, 4, vocab, generator=g, device=device), -1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).view(batch, 4)
    calls = {}
    for name, verify in VERIFIERS.items():
        u = draw_uniforms(batch, 4, g)
        calls[name] = TimedCall(lambda verify=verify, u=u: verify(target, draft, tokens, uniforms=u, validate=False))
    paths_target = target[:, None].expand(batch, 4, 5, vocab).contiguous()
    paths_draft = draft[:, None].expand(batch, 4, 4, vocab).contiguous()
    paths = torch.stack([torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).view(batch, 4) for _ in range(4)], 1)
    for name in ("rrs", "rrs_without_replacement", "traversal", "gbv", "onehot"):
        u = draw_multi_uniforms(batch, 4, 4, g)
        calls[f"{name} K4 L4"] = TimedCall(lambda name=name, u=u: MULTI_VERIFIERS[name](paths_target, paths_draft, paths,
                                                                                       uniforms=u, validate=False))
    medians = interleaved_medians(list(calls.values()), repeats=repeats, warmup=3, device=device)
    return {name: 1e3 * seconds for name, seconds in zip(calls, medians)}


def engine(device, target, quick: bool) -> list[dict]:
    """Per configuration: tokens/s against autoregressive decoding (steps timed, and untimed as is CUDA's default),
    mean overhead per step (timed steps), and host reads and torch calls per step (a counted run of its own)."""
    rows = []
    prompts = [[1, 504, 1458, 28, 253, 1156, 30, 2] * 4]
    new = 8 if quick else 64
    for batch in (1, 2) if quick else (1, 8):
        for name, make in (("truncated:4", lambda: truncated_draft(target, 4)), ("ngram", lambda: NGramDraft(target.vocab_size, device=device))):
            for temperature in (1.0,) if quick else (0.0, 1.0):
                sampling = SamplingConfig(temperature=temperature)
                batch_prompts = prompts * batch
                base = autoregressive_generate(target, batch_prompts, max_new_tokens=new, sampling=sampling, seed=0)
                timed = speculative_generate(target, make(), batch_prompts, gamma=4, max_new_tokens=new,
                                             sampling=sampling, seed=0, step_timing=True)
                untimed = speculative_generate(target, make(), batch_prompts, gamma=4, max_new_tokens=new,
                                               sampling=sampling, seed=0, step_timing=False)
                with HostReads() as reads:  # a run of its own: the counter sees every torch call, which slows it
                    counted = speculative_generate(target, make(), batch_prompts, gamma=4, max_new_tokens=new,
                                                   sampling=sampling, seed=0, step_timing=False)
                rows.append({"batch": batch, "draft": name, "temperature": temperature,
                             "speedup_timed": timed.speedup_over(base), "speedup_untimed": untimed.speedup_over(base),
                             "tau": timed.block_efficiency,
                             "overhead_ms_per_step": 1e3 * statistics.mean(s.overhead_seconds for s in timed.steps),
                             "host_reads_per_step": reads.count / len(counted.steps),
                             "torch_calls_per_step": reads.calls / len(counted.steps)})
                print(rows[-1], flush=True)
    return rows


TREES = {"chain g1": dict(verifier="block", gamma=1), "chain g3": dict(verifier="block", gamma=3),
         "traversal K2 g2": dict(verifier="traversal", num_drafts=2, gamma=2),
         "dynamic K4 g4 n10": dict(verifier="onehot", num_drafts=4, gamma=4, draft_law="dynamic", tree_nodes=10)}


def trees(device, target, quick: bool) -> dict:
    """The machine's cost curve (``engine.cost``: r_n, c and o with a 4-layer truncated draft) and, per chain or tree
    configuration, the mean seconds of a step and of its target call, the tokens/s against autoregressive decoding
    and, from an untimed run, torch calls and host reads per step (random weights: tau means little, the costs are
    what a tree run on this device pays)."""
    from specresearch.engine.cost import measure_cost_curve

    curve = measure_cost_curve(target, truncated_draft(target, 4), max_tokens=4 if quick else 12,
                               repeats=3 if quick else 9, rounds=1)  # one round, as the H200 run that sized its limit
    prompts = [[1, 504, 1458, 28, 253, 1156, 30, 2] * 4]
    new, sampling = (8 if quick else 64), SamplingConfig(temperature=1.0)
    base = autoregressive_generate(target, prompts, max_new_tokens=new, sampling=sampling, seed=0)
    runs = {}
    for name, options in TREES.items():
        out = speculative_generate(target, truncated_draft(target, 4), prompts, max_new_tokens=new, sampling=sampling,
                                   seed=0, step_timing=True, **options)
        with HostReads() as reads:  # untimed: torch calls (each launches kernels on a GPU) and host reads per step
            counted = speculative_generate(target, truncated_draft(target, 4), prompts, max_new_tokens=new,
                                           sampling=sampling, seed=0, step_timing=False, **options)
        runs[name] = {"speedup": out.speedup_over(base), "tau": out.block_efficiency,
                      "torch_calls_per_step": reads.calls / len(counted.steps),
                      "host_reads_per_step": reads.count / len(counted.steps),
                      "step_ms": 1e3 * statistics.mean(s.seconds for s in out.steps),
                      "target_ms": 1e3 * statistics.mean(s.target_seconds for s in out.steps),
                      "scored_per_step": statistics.mean(s.scored[0] for s in out.steps)}
        print(name, runs[name], flush=True)
    return {"r": list(curve.ratios), "c": curve.draft_ratio, "o": curve.overhead_ratio,
            "target_ms": 1e3 * curve.target_seconds, "runs": runs}


def attention(device, target, quick: bool) -> list[dict]:
    """Per tokens scored k: milliseconds of a masked call (a cached 256-token context, each call rolled back) with
    transformers' ``"sdpa"`` attention, which copies K and V per query group under a mask, against
    ``models.attention.packed_sdpa_attention`` (what ``CausalLM`` chooses on CUDA), interleaved; and each call's torch calls."""
    from specresearch.models.attention import PACKED_SDPA, use_packed_sdpa

    model, before = target.model, target.model.config._attn_implementation
    use_packed_sdpa(model)  # registers it (the model is switched back and forth below)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(3, model.config.vocab_size, (1, 32 if quick else 256), generator=generator)
    target.prefill(context, torch.ones_like(context))
    rows = []
    for k in (2, 8) if quick else (2, 8, 32):
        tokens = torch.randint(3, model.config.vocab_size, (1, k), generator=generator)
        names = ("sdpa", PACKED_SDPA)
        calls = [TimedCall(call=lambda: target.score(tokens), setup=lambda name=name: model.set_attn_implementation(name),
                           reset=lambda: target.rollback(k)) for name in names]
        medians = interleaved_medians(calls, repeats=5 if quick else 20, warmup=3, device=device)  # ~7 s on a GPU
        counts = []
        for name in names:
            model.set_attn_implementation(name)
            with HostReads() as reads:
                target.score(tokens)
            target.rollback(k)
            counts.append(reads.calls)
        rows.append({"tokens": k, "sdpa_ms": 1e3 * medians[0], "packed_ms": 1e3 * medians[1],
                     "packed_over_sdpa": medians[1] / medians[0], "sdpa_torch_calls": counts[0],
                     "packed_torch_calls": counts[1]})
        print(rows[-1], flush=True)
    model.set_attn_implementation(before)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU check of this script)")
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_json_file(str(ROOT / "data" / "configs" / "smollm2-135m-instruct.json"))
    if args.quick:
        config.num_hidden_layers, config.vocab_size = 4, 2048
    torch.manual_seed(0)
    target = CausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32), device=device, skinny_linear=False)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": f"random weights, SmolLM2-135M configuration ({config.num_hidden_layers} layers, V = {config.vocab_size})",
        "verifiers_ms_B32": verifier_timings(device, 4 if args.quick else 32, config.vocab_size, 5 if args.quick else 50),
        "engine": engine(device, target, args.quick),
        "trees": trees(device, target, args.quick),
        "attention": attention(device, target, args.quick),
    }
    result["seconds"] = time.perf_counter() - started
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["verifiers_ms_B32"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
