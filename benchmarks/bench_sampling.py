"""What one sampling step costs on a full-vocabulary row: ``sampling.sample_tokens`` against ``torch.multinomial``,
and ``sampling.check_logits`` against the three full passes (NaN, +inf, all -inf) it replaced.

Autoregressive decoding samples one token per target call, speculative decoding one per drafted token, so
each millisecond here is paid per token by both; the engine draws through ``sample_tokens``. Rows of
V = 49,152 (the embedded target's vocabulary) from random logits, B in ``--batches``, one thread, medians
of ``--repeats`` timings of ``--inner`` calls each, the two sides interleaved. A benchmark: nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sampling.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specresearch.core.sampling import check_logits, sample_tokens


def three_passes(logits: torch.Tensor) -> bool:
    """The checks as three full passes (what ``check_logits`` did before its one-pass fast path)."""
    return bool(torch.isnan(logits).any() or torch.isposinf(logits).any() or not torch.isfinite(logits).any(-1).all())


def timed(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"V = {args.vocab}, {args.threads} thread(s), medians of {args.repeats} x {args.inner} calls, ms per call")
    print(f"{'B':>3} {'multinomial':>12} {'sample_tokens':>14} {'ratio':>6} {'3 passes':>9} {'check_logits':>13} {'ratio':>6}")
    for batch in args.batches:
        logits = 3 * torch.randn(batch, args.vocab, generator=generator)
        probs = torch.softmax(logits, -1)
        sides = {
            "multinomial": lambda: torch.multinomial(probs, 1, generator=generator),
            "sample_tokens": lambda: sample_tokens(probs, generator),
            "three_passes": lambda: three_passes(logits),
            "check_logits": lambda: check_logits(logits),
        }
        times = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, fn in sides.items():
                times[name].append(timed(fn, args.inner))
        m = {name: statistics.median(t) for name, t in times.items()}
        print(f"{batch:>3} {m['multinomial']:>12.3f} {m['sample_tokens']:>14.3f} {m['sample_tokens'] / m['multinomial']:>6.3f} "
              f"{m['three_passes']:>9.3f} {m['check_logits']:>13.3f} {m['check_logits'] / m['three_passes']:>6.3f}")


if __name__ == "__main__":
    main()
