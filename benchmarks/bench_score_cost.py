"""What verification costs on this machine: one cached target call scoring k tokens against one scoring 1.

A speculative step with gamma drafted tokens scores gamma + 1 tokens in one target call; autoregressive
decoding scores one per call. Leviathan et al.'s speed-up E / (1 + gamma c) takes the two calls to cost
the same (a forward bound by reading the weights, as on a GPU at small batch). This times r_k =
T(k) / T(1) for the embedded target (``bench.score_seconds``: B = 1, contexts of ``--contexts`` tokens, the ks
timed in turn, medians) at each ``--threads``, and the same for the target's output layer alone
(49,152 x 576, the largest single matrix), so the two can be told apart; each in four variants in the
same run: what ``CausalLM`` uses on CPU (linear layers as ``models.kernels.SkinnyLinear``, attention
``models.attention.cpu_sdpa_attention``), the same linear layers with transformers' ``"sdpa"`` attention,
``strided``: the same products returned as the transposed (column-major) ``(W @ x^T)^T`` with ``"sdpa"``
(what ``SkinnyLinear`` returned before it made its outputs row-major; a strided query sends the CPU
attention kernel down its unfused path), and the peer, plain ``nn.Linear`` with ``"sdpa"``. Contexts
``--contexts``. Every row names the machine (``machine_info``). A benchmark: nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_score_cost.py --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specresearch.experiments import bench
from specresearch.experiments.records import machine_info
from specresearch.models.attention import CPU_SDPA
from specresearch.models.embedded import load_embedded
from specresearch.models.kernels import SkinnyLinear


class StridedSkinnyLinear(SkinnyLinear):
    """``SkinnyLinear``'s product with its output left column-major (1-8 rows on CPU), as it was returned before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows not in self.SKINNY_ROWS:
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])
        y = torch.mm(self.weight, (flat.expand(2, -1) if rows == 1 else flat).contiguous().t()).t()[:rows]
        return (y if self.bias is None else y + self.bias).reshape(*x.shape[:-1], -1)


VARIANTS = {"skinny": (SkinnyLinear, CPU_SDPA), "skinny, sdpa": (SkinnyLinear, "sdpa"), "strided": (StridedSkinnyLinear, "sdpa"),
            "plain": (torch.nn.Linear, "sdpa")}


def _switch(model: torch.nn.Module, cls) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module) in (SkinnyLinear, StridedSkinnyLinear, torch.nn.Linear):
            module.__class__ = cls


def head_seconds(head: torch.nn.Module, hidden_size: int, ks, repeats: int = 20, warmup: int = 3) -> dict[int, float]:
    """Median time of the output layer alone on k hidden states, ks in turn within each repeat."""
    xs = {k: torch.randn(1, k, hidden_size, generator=torch.Generator().manual_seed(k)) for k in ks}
    times = {k: [] for k in ks}
    with torch.no_grad():
        for _ in range(warmup + repeats):
            for k in ks:
                start = time.perf_counter()
                head(xs[k])
                times[k].append(time.perf_counter() - start)
    return {k: statistics.median(t[warmup:]) for k, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8, 10])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--contexts", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="reports/bench_score_cost.jsonl")
    args = parser.parse_args()
    if 1 not in args.ks or any(k < 1 for k in args.ks):
        parser.error("--ks must include 1 and be >= 1")
    lm, _ = load_embedded(device="cpu", skinny_linear=True)  # the variants below switch every layer themselves
    head, hidden = lm.model.get_output_embeddings(), lm.model.config.hidden_size
    rows, machine = [], {k: v for k, v in machine_info().items() if k != "torch_threads"}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for context in args.contexts:
            for variant, (cls, attention) in VARIANTS.items():
                _switch(lm.model, cls)
                lm.model.set_attn_implementation(attention)
                full = bench.score_seconds(lm, args.ks, context_length=context, repeats=args.repeats)
                alone = head_seconds(head, hidden, args.ks, repeats=args.repeats)
                for k in args.ks:
                    rows.append({"threads": threads, "context": context, "linear": variant.split(",")[0], "attention": attention, "k": k,
                                 "score_ms": 1e3 * full[k], "r_k": full[k] / full[1], "head_ms": 1e3 * alone[k], "head_r_k": alone[k] / alone[1],
                                 "machine": machine})
    _switch(lm.model, SkinnyLinear)
    lm.model.set_attn_implementation(CPU_SDPA)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("| threads | context | linear layers | attention | k | target call ms | r_k | output layer ms | its r_k |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['context']} | {r['linear']} | {r['attention']} | {r['k']} | {r['score_ms']:.1f} | {r['r_k']:.2f} | "
              f"{r['head_ms']:.1f} | {r['head_r_k']:.2f} |")
    print(f"\nB = 1, medians of {args.repeats}; {machine['cpu']}, {machine['cpu_count']} cores; rows in {args.out}")


if __name__ == "__main__":
    main()
