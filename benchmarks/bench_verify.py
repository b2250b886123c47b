"""Time the verifiers of ``specresearch.verify`` against transformers' ``_speculative_sampling``.

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_verify.py --threads 1 --repeats 50 --clock wall
    .venv/bin/python benchmarks/bench_verify.py --threads 1 --repeats 50 --clock cpu
    .venv/bin/python benchmarks/bench_verify.py --quick

Each cell is the median time of ``--repeats`` calls after warm-up, float32 on CPU, V = 49152 (SmolLM2's
vocabulary); the candidates are timed round-robin in shuffled order so load changes hit them alike. ``--clock wall`` uses
``time.perf_counter``; ``--clock cpu`` uses this thread's CPU time, which is steadier on a shared machine.
``block`` picks its tau rule by vocabulary size; ``block pruned`` / ``block dense`` force one: the backward
scan (h_i only for candidates visited from the back until the first pass, whose weights are reused for the
sample; Python scalars at B = 1; at B >= 2 a loop over the gamma columns only, each column vectorised over its
open rows, gathered into slots of one preallocated work buffer), or h_i for every i at once (dense). Inputs: target logits ~ 3 N(0, 1), draft logits = target logits +
N(0, 1), probabilities by softmax, draft tokens sampled from the draft rows, so acceptance is realistic
(alpha ~ 0.62; ``--regime independent`` draws unrelated draft logits instead, alpha ~ 0). transformers' verifier takes logits and one row (B = 1), so it is timed
on the logits (its softmax included) and, for B > 1, in a Python loop over the rows; we report ours both
on probabilities and with the same softmax added. ``rows block/token`` counts the O(V) row pairs each
verifier must read (``residual_rows``): the work the algorithm needs in that regime, whatever the kernels.
Rows are printed as a Markdown table; nothing is asserted about time.
"""

import argparse
import random
import statistics
import time

import torch
from transformers.generation.utils import _speculative_sampling

from specresearch import verify

VOCAB = 49152
PROMPT_LENGTH = 16
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def make_inputs(batch, gamma, vocab, generator, regime="correlated"):
    """Logits and probabilities for one verification step: a dict of tensors (see module docstring).

    ``regime="correlated"``: draft logits = target logits + N(0, 1) (alpha ~ 0.62); ``"independent"``:
    independent draft logits ~ 3 N(0, 1) (alpha ~ 0: almost every token rejected).
    """
    target_logits = 3 * torch.randn(batch, gamma + 1, vocab, generator=generator)
    noise = torch.randn(batch, gamma, vocab, generator=generator)
    draft_logits = target_logits[:, :gamma] + noise if regime == "correlated" else 3 * noise
    draft_probs = draft_logits.softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=generator).view(batch, gamma)
    prompt = torch.randint(vocab, (batch, PROMPT_LENGTH), generator=generator)
    return {
        "target_logits": target_logits,
        "draft_logits": draft_logits,
        "target_probs": target_logits.softmax(-1),
        "draft_probs": draft_probs,
        "draft_tokens": draft_tokens,
        "candidate_ids": torch.cat([prompt, draft_tokens], 1),
    }


def median_seconds(candidates, repeats, clock=time.perf_counter, warmup=3):
    """Median time of each zero-argument callable over ``repeats`` calls, after ``warmup`` calls.

    The candidates are timed round-robin in a shuffled order (one call of each per repeat), so a load
    change on a shared machine hits all of them alike and the ratios stay meaningful.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in candidates}
    order = list(candidates)
    shuffler = random.Random(0)
    for _ in range(repeats):
        shuffler.shuffle(order)  # no candidate always follows the same one (allocator and cache state)
        for name in order:
            start = clock()
            candidates[name]()
            times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def transformers_verify(inputs):
    """transformers' verifier on each batch row in turn (it handles B = 1)."""
    gamma = inputs["draft_tokens"].shape[1]
    for b in range(inputs["draft_tokens"].shape[0]):
        _speculative_sampling(
            inputs["candidate_ids"][b : b + 1],
            inputs["draft_logits"][b : b + 1],
            gamma,
            inputs["target_logits"][b : b + 1],
        )


def candidates(inputs, generator):
    """name -> zero-argument callable timed by ``median_seconds``."""
    probs = (inputs["target_probs"], inputs["draft_probs"], inputs["draft_tokens"])

    def ours(name, validate=False):
        return lambda: verify.VERIFIERS[name](*probs, generator, validate=validate)

    def with_softmax(name):
        logits = (inputs["target_logits"], inputs["draft_logits"])
        return lambda: verify.VERIFIERS[name](
            logits[0].softmax(-1), logits[1].softmax(-1), inputs["draft_tokens"], generator, validate=False
        )

    return {
        "token": ours("token"),
        "block": ours("block"),
        "greedy": ours("greedy"),
        "token_validated": ours("token", validate=True),
        "block_validated": ours("block", validate=True),
        "block_pruned": lambda: _block_with("pruned", *probs, generator),
        "block_dense": lambda: _block_with("dense", *probs, generator),
        "token_softmax": with_softmax("token"),
        "block_softmax": with_softmax("block"),
        "transformers": lambda: transformers_verify(inputs),
    }


def _block_with(rule, target_probs, draft_probs, draft_tokens, generator):
    """Block verification forcing one tau rule: "pruned" (``verify._block_backward``: backward scan, w_tau
    reused for the sample) or "dense" (``verify._block_tau_dense``: every h_i, then a fresh residual sample)."""
    eta = verify.draw_uniforms(*draft_tokens.shape, generator).to(target_probs.dtype)
    p_x, q_x = verify._drafted_probs(target_probs, draft_probs, draft_tokens)
    scale = verify._block_scales(p_x, q_x)
    if rule == "pruned":
        return verify._block_backward(target_probs, draft_probs, scale, eta[:, :-1], eta[:, -1])[1]
    tau = verify._block_tau_dense(target_probs, draft_probs, scale, eta[:, :-1])
    return verify._sample_residual(target_probs, draft_probs, tau, verify._scale_at(scale, tau), eta[:, -1])


def residual_rows(inputs, generator, draws=50):
    """Mean (p, q) row pairs one call reads, block / token, over ``draws`` draws of the uniforms.

    Token verification reads one pair per batch row (the residual at its first rejection, or the bonus p row).
    Block verification's backward scan visits every candidate (eta_i < p_i) from gamma - 1 down to tau, each a
    pair, plus the pair at X^0 when tau = 0; the bonus row (tau = gamma) is one p row, counted as half a pair.
    Both counts follow from tau alone, so this measures the work the algorithm needs, whatever the kernels.
    """
    probs = (inputs["target_probs"], inputs["draft_probs"], inputs["draft_tokens"])
    batch, gamma = inputs["draft_tokens"].shape
    scale = verify._block_scales(*verify._drafted_probs(*probs))  # [B, gamma]: p_1..p_gamma
    pairs = 0.0
    for _ in range(draws):
        uniforms = verify.draw_uniforms(batch, gamma, generator).to(scale.dtype)
        tau = verify.block_verify(*probs, uniforms=uniforms, validate=False).num_accepted  # [B]
        position = torch.arange(1, gamma, device=tau.device)  # candidates i = 1..gamma-1
        visited = (uniforms[:, : gamma - 1] < scale[:, : gamma - 1]) & (position >= tau[:, None]) & (tau[:, None] < gamma)
        pairs += float(visited.sum() + (tau == 0).sum() + 0.5 * (tau == gamma).sum())
    return pairs / (draws * batch)


def run(batches, gammas, repeats, clock, regime="correlated"):
    """One record per (B, gamma): median microseconds of each candidate."""
    generator = torch.Generator().manual_seed(0)
    records = []
    for batch in batches:
        for gamma in gammas:
            inputs = make_inputs(batch, gamma, VOCAB, generator, regime)
            medians = median_seconds(candidates(inputs, generator), repeats, clock)
            timings = {name: 1e6 * seconds for name, seconds in medians.items()}
            records.append({"B": batch, "gamma": gamma, **timings, "rows": residual_rows(inputs, generator)})
    return records


def markdown(records):
    """Markdown table of the records with the ratios side by side."""
    header = (
        "| B | gamma | token | block | greedy | token val. | block val. | block pruned | block dense | transformers "
        "| block/token | rows block/token | token/tf | token+softmax/tf | block+softmax/tf |"
    )
    lines = [header, "|" + "---|" * 15]
    for r in records:
        lines.append(
            f"| {r['B']} | {r['gamma']} | {r['token']:.0f} | {r['block']:.0f} | {r['greedy']:.0f} "
            f"| {r['token_validated']:.0f} | {r['block_validated']:.0f} | {r['block_pruned']:.0f} | {r['block_dense']:.0f} "
            f"| {r['transformers']:.0f} | {r['block'] / r['token']:.2f} | {r['rows']:.2f} | {r['token'] / r['transformers']:.2f} "
            f"| {r['token_softmax'] / r['transformers']:.2f} | {r['block_softmax'] / r['transformers']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per cell (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall = time.perf_counter; cpu = time.thread_time (this thread's CPU time: robust on a loaded machine, "
        "meaningful with --threads 1 only)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="batch sizes B")
    parser.add_argument("--gammas", type=int, nargs="+", default=[4, 8], help="block lengths gamma")
    parser.add_argument(
        "--regime",
        choices=["correlated", "independent"],
        default="correlated",
        help="correlated: draft logits = target logits + noise (realistic acceptance); independent: alpha ~ 0",
    )
    parser.add_argument("--quick", action="store_true", help="B = 1 only, gamma = 4 only, 5 repeats")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches, gammas, repeats = ([1], [4], 5) if args.quick else (args.batches, args.gammas, args.repeats)
    records = run(batches, gammas, repeats, CLOCKS[args.clock], args.regime)
    print(
        f"Median {args.clock}-clock microseconds per call; float32, CPU, V = {VOCAB}, "
        f"threads = {args.threads}, repeats = {repeats}, {args.regime} draft."
    )
    print("'val.' = validate=True; 'tf' = transformers._speculative_sampling (softmax included, loop over B); "
          "'rows block/token' = (p, q) row pairs block verification must read per pair token reads "
          "(``residual_rows``).\n")
    print(markdown(records))


if __name__ == "__main__":
    main()
