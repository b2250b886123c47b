"""Time the verifiers of ``specresearch.core.verify`` against transformers' ``_speculative_sampling``.

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_verify.py --threads 1 --repeats 50 --clock wall
    .venv/bin/python benchmarks/bench_verify.py --threads 1 --repeats 50 --clock cpu
    .venv/bin/python benchmarks/bench_verify.py --quick
    .venv/bin/python benchmarks/bench_verify.py --threads 1 --repeats 20 --clock cpu --multi-only

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

Multi-draft table (``specresearch.core.verify_multi``; skip it with ``--no-multi``, or run it alone with
``--multi-only``): per B in ``--multi-batches`` (default 32), K = ``--num-drafts`` (4) i.i.d. paths of length
L = ``--multi-length`` (4) drawn by ``draft_paths.sample_draft_paths`` from a draft whose logits at every
(row, prefix) are the target's + N(0, 1) (target logits ~ 3 N(0, 1), one fresh draw per distinct prefix,
so paths sharing a prefix share its rows), V = 49152. Timed round-robin with ``token`` and ``block`` on path
0 alone (the single-draft baseline of the same step); K-SEQ (L = 1 only) is timed on the paths' first
tokens beside ``token`` and ``rrs`` at L = 1. ``tokens/step`` = 1 + mean accepted tokens over 200 draws
of the uniforms on the same inputs (one input draw: a rough figure, not an estimate of E[tau]).
"""

import argparse
import random
import statistics
import time

import torch
from transformers.generation.utils import _speculative_sampling

from specresearch.core import draft_paths, draws, verify, verify_multi

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
    eta = draws.draw_uniforms(*draft_tokens.shape, generator).to(target_probs.dtype)
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
        uniforms = draws.draw_uniforms(batch, gamma, generator).to(scale.dtype)
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


# ---------------------------------------------------------------------------------------------------
# Multi-draft verifiers


class _PrefixRows:
    """Correlated (target, draft) logits per (batch row, prefix): one fresh draw per distinct prefix, so
    paths that share a prefix read the same rows (the merged tree's contract)."""

    def __init__(self, num_drafts, vocab, generator):
        self.num_drafts, self.vocab, self.generator, self.rows = num_drafts, vocab, generator, {}

    def _row(self, key):
        if key not in self.rows:
            target = 3 * torch.randn(self.vocab, generator=self.generator)
            self.rows[key] = (target.softmax(-1), (target + torch.randn(self.vocab, generator=self.generator)).softmax(-1))
        return self.rows[key]

    def probs_fn(self, which):
        def fn(prefixes):  # [N, t] -> [N, V], row n belongs to batch row n // K
            keys = [(n // self.num_drafts, tuple(prefix)) for n, prefix in enumerate(prefixes.tolist())]
            return torch.stack([self._row(key)[which] for key in keys])

        return fn


def make_multi_inputs(batch, num_drafts, length, vocab, generator):
    """``(target_probs [B, K, L+1, V], draft_probs [B, K, L, V], draft_tokens [B, K, L])``, i.i.d. paths."""
    rows = _PrefixRows(num_drafts, vocab, generator)
    tokens, draft_probs = draft_paths.sample_draft_paths(rows.probs_fn(1), batch, num_drafts, length, "iid", generator)
    return draft_paths.path_target_probs(rows.probs_fn(0), tokens), draft_probs, tokens


def multi_candidates(inputs, generator):
    """name -> (zero-argument callable, verifier, its inputs) for the multi-draft table."""
    target_probs, draft_probs, tokens = inputs
    paths = (target_probs, draft_probs, tokens)
    first = (target_probs[:, :, :2].contiguous(), draft_probs[:, :, :1].contiguous(), tokens[:, :, :1].contiguous())
    single = (target_probs[:, 0].contiguous(), draft_probs[:, 0].contiguous(), tokens[:, 0].contiguous())
    single_first = tuple(t[:, 0].contiguous() for t in first)
    table = {
        "token": (verify.token_verify, single),
        "block": (verify.block_verify, single),
        "rrs": (verify_multi.rrs_verify, paths),
        "rrs_without_replacement": (verify_multi.rrs_without_replacement_verify, paths),
        "gbv": (verify_multi.gbv_verify, paths),
        "traversal": (verify_multi.traversal_verify, paths),
        "token L=1": (verify.token_verify, single_first),
        "rrs L=1": (verify_multi.rrs_verify, first),
        "kseq L=1": (verify_multi.kseq_verify, first),
    }
    return {name: (lambda fn=fn, args=args: fn(*args, generator, validate=False), fn, args) for name, (fn, args) in table.items()}


def mean_accepted(fn, args, generator, draws=200):
    """1 + mean num_accepted over ``draws`` calls (fresh uniforms each) on one input: tokens per step."""
    return 1 + sum(float(fn(*args, generator, validate=False).num_accepted.double().mean()) for _ in range(draws)) / draws


def run_multi(batches, num_drafts, length, repeats, clock):
    """One record per (B, verifier): median microseconds and tokens per step."""
    generator = torch.Generator().manual_seed(0)
    records = []
    for batch in batches:
        inputs = make_multi_inputs(batch, num_drafts, length, VOCAB, generator)
        table = multi_candidates(inputs, generator)
        medians = median_seconds({name: entry[0] for name, entry in table.items()}, repeats, clock)
        for name, (_, fn, args) in table.items():
            records.append({"B": batch, "verifier": name, "us": 1e6 * medians[name],
                            "tokens": mean_accepted(fn, args, generator)})
    return records


def multi_markdown(records, num_drafts, length):
    """Markdown table of the multi-draft records, times relative to block (L rows) or token (L = 1 rows)."""
    lines = ["| B | verifier | K | L | us | / block (same B, L) | / token (same B, L) | tokens/step |", "|" + "---|" * 8]
    for r in records:
        same = [x for x in records if x["B"] == r["B"]]
        suffix = " L=1" if r["verifier"].endswith("L=1") else ""
        block = next((x["us"] for x in same if x["verifier"] == "block"), None)
        token = next(x["us"] for x in same if x["verifier"] == "token" + suffix)
        single = r["verifier"] in ("token", "block", "token L=1")
        block_ratio = f"{r['us'] / block:.2f}" if block and not suffix else "--"
        lines.append(
            f"| {r['B']} | {r['verifier']} | {1 if single else num_drafts} | {1 if suffix else length} | {r['us']:.0f} "
            f"| {block_ratio} | {r['us'] / token:.2f} | {r['tokens']:.2f} |"
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
    parser.add_argument("--multi-batches", type=int, nargs="+", default=[32], help="batch sizes B of the multi-draft table")
    parser.add_argument("--num-drafts", type=int, default=4, help="K draft paths per row (multi-draft table)")
    parser.add_argument("--multi-length", type=int, default=4, help="path length L (multi-draft table)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-multi", action="store_true", help="skip the multi-draft table")
    which.add_argument("--multi-only", action="store_true", help="only the multi-draft table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches, gammas, repeats = ([1], [4], 5) if args.quick else (args.batches, args.gammas, args.repeats)
    if not args.multi_only:
        records = run(batches, gammas, repeats, CLOCKS[args.clock], args.regime)
        print(
            f"Median {args.clock}-clock microseconds per call; float32, CPU, V = {VOCAB}, "
            f"threads = {args.threads}, repeats = {repeats}, {args.regime} draft."
        )
        print("'val.' = validate=True; 'tf' = transformers._speculative_sampling (softmax included, loop over B); "
              "'rows block/token' = (p, q) row pairs block verification must read per pair token reads "
              "(``residual_rows``).\n")
        print(markdown(records))
    if not args.no_multi:
        multi_batches = [2] if args.quick else args.multi_batches
        records = run_multi(multi_batches, args.num_drafts, args.multi_length, repeats, CLOCKS[args.clock])
        print(
            f"\nMulti-draft: median {args.clock}-clock microseconds per call; float32, CPU, V = {VOCAB}, "
            f"threads = {args.threads}, repeats = {repeats}; K = {args.num_drafts} i.i.d. paths of length "
            f"L = {args.multi_length}, correlated draft; token / block verify path 0 alone.\n"
        )
        print(multi_markdown(records, args.num_drafts, args.multi_length))


if __name__ == "__main__":
    main()
