"""Tests of the batched multi-draft verifiers and samplers in ``specresearch.core.verify_multi``.

* K = 1 reductions, bit for bit: with the same generator, ``rrs``, ``rrs_without_replacement`` and
  ``kseq`` return ``verify.token_verify``'s output and ``gbv`` and ``traversal`` ``verify.block_verify``'s
  (both of block verification's tau rules: V <= 4096 and above), float32 and float64.
* Sampler vs exact twin (``exact_multi``): for a fixed instance (exact rational models, fixed paths) the
  torch verifier runs on TRIALS = 200_000 copies in one batched call; the emitted sequences (accepted
  tokens, then the next token) are compared with ``verify_multi_exact``: outcomes of exact probability 0
  must never occur (hard assertion), and a Pearson chi-square test (cells with expected count < 5 pooled)
  must not reject at level ALPHA = 1e-8. Whole steps (paths drawn by ``sample_draft_paths``) are compared
  with ``step_distribution_multi`` the same way, and the sampler alone with ``draft_paths_law``.
* False-positive budget: K_STAT = 27 level-ALPHA tests a correct implementation should pass (18 fixed
  instances, 7 whole steps, 2 sampler laws), so the family-wise false-positive rate is below
  K_STAT * ALPHA = 2.7e-7 < 1e-6. Seeds are fixed, so a run is deterministic.
* Power: the same test rejects RRS's output against the traversal twin on one instance, so it can fail.
"""

from __future__ import annotations

import random
from collections import Counter
from itertools import combinations, product

import pytest
import torch

from specresearch.core.draft_paths import (
    draw_multi_uniforms,
    path_target_probs,
    sample_draft_paths,
)
from specresearch.core.verify import VERIFIERS
from specresearch.core.verify_multi import (
    MULTI_VERIFIERS,
    MultiVerifyResult,
    kseq_verify,
    rrs_verify,
    traversal_verify,
)
from specresearch.exact import multi as exact_multi
from specresearch.exact.multi import step_distribution_multi, verify_multi_exact
from specresearch.exact.paths import draft_paths_law
from specresearch.exact.single import random_rational_model
from specresearch.experiments import stats

ALPHA = 1e-8
K_STAT = 27
TRIALS = 200_000
assert K_STAT * ALPHA < 1e-6

SINGLE_TWIN = {"rrs": "token", "rrs_without_replacement": "token", "kseq": "token", "gbv": "block", "traversal": "block"}


# ----------------------------------------------------------------------------- helpers


def _goodness_of_fit(counts: Counter, law: dict) -> tuple[float, int]:
    """(chi-square p-value, draws on outcomes of exact probability 0); cells with expected count < 5 pooled."""
    trials = sum(counts.values())
    impossible = sum(c for key, c in counts.items() if key not in law)
    cells = sorted((float(prob), counts.get(key, 0)) for key, prob in law.items())
    small = [cell for cell in cells if trials * cell[0] < 5]
    cells = cells[len(small) :]
    if small:
        pooled = (sum(p for p, _ in small), sum(c for _, c in small))
        if trials * pooled[0] < 5:  # still too small: merge into the smallest large cell
            pooled, cells = (pooled[0] + cells[0][0], pooled[1] + cells[0][1]), cells[1:]
        cells.append(pooled)
    if len(cells) < 2:
        return 1.0, impossible
    total = sum(p for p, _ in cells)
    _, _, p_value, _ = stats.chi_square([c for _, c in cells], [p / total for p, _ in cells])
    return p_value, impossible


def _rows(model, prefixes, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor([[float(v) for v in model(tuple(prefix))] for prefix in prefixes], dtype=dtype)


def _instance_tensors(target, draft, paths, dtype=torch.float64):
    """target_probs [K, L+1, V], draft_probs [K, L, V], draft_tokens [K, L] along fixed ``paths``."""
    length = len(paths[0])
    target_probs = torch.stack([_rows(target, [path[:i] for i in range(length + 1)], dtype) for path in paths])
    draft_probs = torch.stack([_rows(draft, [path[:i] for i in range(length)], dtype) for path in paths])
    return target_probs, draft_probs, torch.tensor(paths, dtype=torch.int64)


def _emitted(draft_tokens, result: MultiVerifyResult) -> Counter:
    """Counter of emitted sequences: draft_tokens[b, path_index, :num_accepted] then next_token."""
    batch, _, length = draft_tokens.shape
    vocab_mark = int(draft_tokens.max()) + 10 ** 6  # "empty" marker
    chosen = draft_tokens[torch.arange(batch), result.path_index]  # [B, L]
    padded = torch.cat([chosen, torch.full((batch, 1), vocab_mark)], 1)
    padded[torch.arange(batch), result.num_accepted] = result.next_token
    padded[torch.arange(length + 1)[None, :] > result.num_accepted[:, None]] = vocab_mark
    rows, counts = padded.unique(dim=0, return_counts=True)
    return Counter({tuple(t for t in row if t != vocab_mark): int(c) for row, c in zip(rows.tolist(), counts.tolist())})


def _run_fixed(method, target, draft, paths, seed) -> Counter:
    target_probs, draft_probs, tokens = _instance_tensors(target, draft, paths)
    shape = (TRIALS,) + tuple(tokens.shape)
    expanded = (target_probs.expand(TRIALS, *target_probs.shape), draft_probs.expand(TRIALS, *draft_probs.shape))
    result = MULTI_VERIFIERS[method](*expanded, tokens.expand(shape), torch.Generator().manual_seed(seed))
    return _emitted(tokens.expand(shape), result)


def _table_fn(model, vocab, max_length):
    """A torch ``probs_fn(prefix_tokens [N, t]) -> [N, V]`` reading an exact model through lookup tables."""
    tables = [_rows(model, product(range(vocab), repeat=t)) for t in range(max_length + 1)]

    def probs_fn(prefixes):
        t = prefixes.shape[1]
        if t == 0:
            return tables[0][torch.zeros(len(prefixes), dtype=torch.int64)]
        return tables[t][(prefixes * vocab ** torch.arange(t - 1, -1, -1)).sum(1)]

    return probs_fn


def _models(seed, vocab):
    rng = random.Random(seed)
    return random_rational_model(vocab, rng, zero_prob=0.3), random_rational_model(vocab, rng, zero_prob=0.3)


def _fixed_instance(seed, vocab, num_drafts, length, draft_law):
    """Random models and one draft (K paths) of positive probability under ``draft_law``."""
    target, draft = _models(seed, vocab)
    law = draft_paths_law(draft, num_drafts, length, draft_law)
    options = sorted(law)
    paths = random.Random(seed).choices(options, weights=[float(law[o]) for o in options])[0]
    return target, draft, paths


# ----------------------------------------------------------------------------- K = 1 reductions


def _random_single(batch, length, vocab, seed, dtype):
    """Context-dependent random rows with exact zeros; tokens drawn from the draft rows ([B, L] shapes)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, 2 * length + 1, vocab, generator=generator, dtype=torch.float64)
    zeros = torch.rand(logits.shape, generator=generator, dtype=torch.float64) < 0.3
    zeros[..., 0] = False
    probs = logits.masked_fill(zeros, float("-inf")).softmax(-1)
    target_probs, draft_probs = probs[:, : length + 1].to(dtype), probs[:, length + 1 :].to(dtype)
    tokens = torch.multinomial(draft_probs.double().reshape(-1, vocab), 1, generator=generator).view(batch, length)
    return target_probs.contiguous(), draft_probs.contiguous(), tokens


@pytest.mark.parametrize("method", sorted(SINGLE_TWIN))  # onehot has no single-draft twin: it never reads q
@pytest.mark.parametrize("vocab", [5, 5000])  # block_verify's dense and backward tau rules
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_path_is_the_single_draft_verifier_bit_for_bit(method, vocab, dtype):
    batch = 200 if vocab < 100 else 48
    for length in [1] if method == "kseq" else [1, 3]:
        target_probs, draft_probs, tokens = _random_single(batch, length, vocab, seed=vocab + length, dtype=dtype)
        single = VERIFIERS[SINGLE_TWIN[method]](target_probs, draft_probs, tokens, torch.Generator().manual_seed(3))
        multi = MULTI_VERIFIERS[method](
            target_probs[:, None], draft_probs[:, None], tokens[:, None], torch.Generator().manual_seed(3)
        )
        assert torch.equal(multi.num_accepted, single.num_accepted), (method, length)
        assert torch.equal(multi.next_token, single.next_token), (method, length)
        assert torch.equal(multi.path_index, torch.zeros_like(multi.path_index))
        assert 0 < int((single.num_accepted > 0).sum()) < batch  # both outcomes occur: the check has teeth


@pytest.mark.parametrize("vocab", [5, 5000])
def test_gbv_reads_only_the_rows_it_computes_in_full(vocab):
    """gbv_verify sorts only the q^G rows block verification reads in full (``gbv_needed``); with the same
    uniforms it must equal block verification of X* with every row q^G computed in full, bit for bit."""
    from specresearch.core.multi_weights import gbv_draft_rows, gbv_select
    from specresearch.core.verify import block_verify

    batch, num_drafts, length = 64, 3, 3
    target, draft, tokens = _random_single(batch * num_drafts, length, vocab, seed=vocab, dtype=torch.float32)
    paths = (target.view(batch, num_drafts, length + 1, vocab), draft.view(batch, num_drafts, length, vocab),
             tokens.view(batch, num_drafts, length))
    uniforms = draw_multi_uniforms(batch, num_drafts, length, torch.Generator().manual_seed(5))
    pruned = MULTI_VERIFIERS["gbv"](*paths, uniforms=uniforms)
    rows = torch.arange(batch)
    chosen = gbv_select(*paths)
    selected = [t[rows, chosen] for t in paths]
    full = gbv_draft_rows(selected[0], selected[1], selected[2], num_drafts)
    assert torch.allclose(full.sum(-1), torch.ones(batch, length), atol=1e-5)  # q^G rows are distributions
    reference = block_verify(selected[0], full, selected[2], uniforms=uniforms[:, :, 0])
    assert torch.equal(pruned.num_accepted, reference.num_accepted)
    assert torch.equal(pruned.next_token, reference.next_token)
    assert len(set(reference.num_accepted.tolist())) == length + 1  # every tau occurs: the rows were read


@pytest.mark.parametrize("seed", range(3))
def test_gbv_draft_rows_match_the_exact_twin_for_many_drafts(seed):
    """q^G = [(A + y + z)^K - (A + y)^K] / [(A + Q)^K - A^K] cancels badly in floating point when the path ranks
    high (A near 1) and K is large; the reference code released with GBV advises against K > 4 for that reason.
    The torch rows (``multi_weights.gbv_draft_rows``, a power sum in float64) equal the exact twin's on every
    drafted path of random rational models (V = 4, L = 3) up to K = 64: within 1e-12 from float64 rows (measured
    1.4e-14 at K = 64) and 1e-5 from float32 rows (1.9e-6)."""
    from specresearch.core.multi_weights import gbv_draft_rows

    rng = random.Random(seed)
    target, draft = random_rational_model(4, rng, zero_prob=0.2), random_rational_model(4, rng, zero_prob=0.2)
    length = 3
    paths = [path for path in product(range(4), repeat=length)
             if all(draft(path[:i])[path[i]] > 0 for i in range(length))]
    target_probs, draft_probs, tokens = _instance_tensors(target, draft, paths)
    for num_drafts in (1, 2, 4, 8, 16, 32, 64):
        want = torch.tensor([exact_multi.gbv_draft_rows(target, draft, path, num_drafts) for path in paths],
                            dtype=torch.float64)
        wide = gbv_draft_rows(target_probs, draft_probs, tokens, num_drafts)
        narrow = gbv_draft_rows(target_probs.float(), draft_probs.float(), tokens, num_drafts)
        assert (wide - want).abs().max() < 1e-12, num_drafts
        assert (narrow.double() - want).abs().max() < 1e-5, num_drafts


def test_multi_uniforms_with_one_path_are_the_single_draft_stream():
    from specresearch.core.draws import draw_uniforms

    multi = draw_multi_uniforms(7, 1, 3, torch.Generator().manual_seed(1))
    assert torch.equal(multi[:, :, 0], draw_uniforms(7, 3, torch.Generator().manual_seed(1)))


# ----------------------------------------------------------------------------- fixed instances vs the exact twin

# (seed, V, K, L, draft law of the paths); seeds chosen (by scanning) so that every law has >= 4 outcomes and
# the mix covers duplicated first tokens and branching below a shared prefix (i.i.d. paths), distinct first
# tokens (without replacement), L = 1 and L = 2.
FIXED = {
    "rrs": [(16, 3, 3, 2, "iid"), (9, 4, 2, 2, "iid"), (7, 3, 3, 1, "iid")],
    "rrs_without_replacement": [
        (1, 4, 3, 2, "without_replacement"),
        (26, 3, 2, 2, "without_replacement"),
        (25, 4, 3, 1, "without_replacement"),
    ],
    "kseq": [(1, 4, 3, 1, "iid"), (7, 3, 3, 1, "iid"), (3, 4, 2, 1, "iid")],
    "gbv": [(16, 3, 3, 2, "iid"), (16, 4, 2, 2, "iid"), (16, 3, 2, 1, "iid")],
    "traversal": [(16, 3, 3, 2, "iid"), (3, 4, 3, 2, "without_replacement"), (3, 3, 2, 2, "iid")],
    "onehot": [(16, 3, 2, 2, "topk"), (5, 4, 3, 1, "topk"), (3, 3, 2, 2, "iid")],
}
FIXED_CASES = [(method, case) for method, cases in FIXED.items() for case in cases]


@pytest.mark.parametrize("method, case", FIXED_CASES, ids=[f"{m}-{c[0]}" for m, c in FIXED_CASES])
def test_verifier_matches_exact_twin(method, case):
    seed, vocab, num_drafts, length, draft_law = case
    target, draft, paths = _fixed_instance(seed, vocab, num_drafts, length, draft_law)
    law = verify_multi_exact(target, draft, paths, method, draft_law=draft_law)
    counts = _run_fixed(method, target, draft, paths, seed)
    p_value, impossible = _goodness_of_fit(counts, law)
    assert impossible == 0, f"{method} on {paths}: impossible outcomes; counts {counts} vs law {law}"
    assert p_value > ALPHA, f"{method} on {paths}: p = {p_value:.3g}; counts {counts}, law {law}"


def test_fixed_instances_are_informative():
    """Guard the fixtures: every law has >= 4 outcomes; duplicated first tokens and branching occur."""
    duplicated = branching = 0
    for method, case in FIXED_CASES:
        seed, vocab, num_drafts, length, draft_law = case
        target, draft, paths = _fixed_instance(seed, vocab, num_drafts, length, draft_law)
        assert len(verify_multi_exact(target, draft, paths, method)) >= 4, (method, case)
        firsts = [path[0] for path in paths]
        duplicated += len(set(firsts)) < len(firsts)
        branching += any(a[0] == b[0] and a != b for a in paths for b in paths)
    assert duplicated >= 6 and branching >= 4


def test_chi_square_rejects_the_wrong_twin():
    """Power: RRS's output against the traversal twin on an instance where the two laws differ."""
    target, draft, paths = _fixed_instance(16, 3, 3, 2, "iid")
    rrs_law = verify_multi_exact(target, draft, paths, "rrs")
    traversal_law = verify_multi_exact(target, draft, paths, "traversal")
    assert rrs_law != traversal_law
    p_value, impossible = _goodness_of_fit(_run_fixed("rrs", target, draft, paths, seed=0), traversal_law)
    assert impossible > 0 or p_value < ALPHA


# ----------------------------------------------------------------------------- whole steps and the sampler

# (method, draft law, seed, V, K, L)
STEPS = [
    ("rrs", "iid", 21, 3, 2, 2),
    ("rrs_without_replacement", "without_replacement", 22, 3, 3, 2),
    ("kseq", "iid", 23, 4, 3, 1),
    ("gbv", "iid", 24, 3, 2, 2),
    ("traversal", "without_replacement", 25, 3, 2, 2),
    ("traversal", "iid", 26, 3, 2, 2),
    ("onehot", "iid", 27, 3, 2, 2),
]


@pytest.mark.parametrize("method, draft_law, seed, vocab, num_drafts, length", STEPS)
def test_whole_step_matches_step_distribution(method, draft_law, seed, vocab, num_drafts, length):
    target, draft = _models(seed, vocab)
    generator = torch.Generator().manual_seed(seed)
    draft_fn = _table_fn(draft, vocab, length)
    tokens, draft_probs = sample_draft_paths(draft_fn, TRIALS, num_drafts, length, draft_law, generator)
    target_probs = path_target_probs(_table_fn(target, vocab, length), tokens)
    result = MULTI_VERIFIERS[method](target_probs, draft_probs, tokens, generator)
    law = step_distribution_multi(target, draft, num_drafts, length, method, draft_law=draft_law)
    p_value, impossible = _goodness_of_fit(_emitted(tokens, result), law)
    assert impossible == 0 and p_value > ALPHA, (method, draft_law, p_value, impossible)


@pytest.mark.parametrize("draft_law", ["iid", "without_replacement"])
def test_sampler_matches_draft_paths_law(draft_law):
    """Seed 33 gives a context-dependent draft whose root row has 2 tokens of positive mass, so K = 3
    without replacement exercises the copies of the exact twin's convention."""
    vocab, num_drafts, length = 4, 3, 2
    _, draft = _models(33, vocab)
    assert sum(1 for v in draft(()) if v) == 2
    generator = torch.Generator().manual_seed(32)
    tokens, _ = sample_draft_paths(_table_fn(draft, vocab, length), TRIALS, num_drafts, length, draft_law, generator)
    rows, counts = tokens.reshape(TRIALS, -1).unique(dim=0, return_counts=True)
    observed = Counter({tuple(tuple(row[k * length : (k + 1) * length]) for k in range(num_drafts)): int(c)
                        for row, c in zip(rows.tolist(), counts.tolist())})
    p_value, impossible = _goodness_of_fit(observed, draft_paths_law(draft, num_drafts, length, draft_law))
    assert impossible == 0 and p_value > ALPHA, (draft_law, p_value, impossible)


def test_sampler_returns_the_rows_each_token_was_drawn_from():
    vocab, length = 3, 2
    target, draft = _models(40, vocab)
    generator = torch.Generator().manual_seed(0)
    tokens, draft_probs = sample_draft_paths(_table_fn(draft, vocab, length), 4, 2, length, "iid", generator)
    target_probs = path_target_probs(_table_fn(target, vocab, length), tokens)
    for b, k in product(range(4), range(2)):
        path = tuple(tokens[b, k].tolist())
        assert torch.equal(draft_probs[b, k], _rows(draft, [path[:i] for i in range(length)]))
        assert torch.equal(target_probs[b, k], _rows(target, [path[:i] for i in range(length + 1)]))
        assert all(draft(path[:i])[path[i]] > 0 for i in range(length))


# ----------------------------------------------------------------------------- hand-made cases


def test_path_index_is_the_lowest_path_with_the_accepted_prefix():
    """p = q everywhere: every token is accepted, so RRS accepts path 0's first token and descends; paths 0
    and 2 share the first token, and the emitted prefix names path 0 even when the second token is path 2's."""
    row = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    tokens = torch.tensor([[[0, 1], [2, 2], [0, 2]]])  # [1, 3, 2]
    target_probs, draft_probs = row.expand(1, 3, 3, 3), row.expand(1, 3, 2, 3)
    for method in ["rrs", "traversal"]:
        result = MULTI_VERIFIERS[method](target_probs, draft_probs, tokens, torch.Generator().manual_seed(0))
        assert int(result.num_accepted) == 2, method
        accepted = tuple(tokens[0, int(result.path_index)].tolist())
        assert int(result.path_index) == [(0, 1), (2, 2), (0, 2)].index(accepted)
    # traversal visits the first leaf (path 0's) first and accepts it: w = 1 there
    assert int(traversal_verify(target_probs, draft_probs, tokens, torch.Generator().manual_seed(0)).path_index) == 0
    # GBV selects X* = (2, 2) (ratios all 1: ties by token id) and reports path 1 whatever it accepts, except
    # when it accepts nothing (path 0, the lowest path with the empty prefix)
    for seed in range(20):
        result = MULTI_VERIFIERS["gbv"](target_probs, draft_probs, tokens, torch.Generator().manual_seed(seed))
        assert int(result.path_index) == (1 if int(result.num_accepted) > 0 else 0)


def test_traversal_visits_the_papers_figure_1_tree_in_its_order():
    """Traversal verification's Figure 1 (arXiv 2505.12398): root children X1, X2; X1's children X3, X4; X2's child
    X5; visited X3, X4, X1, X5, X2 (depth-first post-order, a parent after all its children). For each pair a
    before b, uniforms 0 at a and b (accepted if visited with weight > 0) and 1 - 1e-12 elsewhere (rejected at
    weight < 1) must accept a. A pre-order walk (X1 before X3) fails the pair (X3, X1). Rows chosen so every
    weight stays in (0, 1) along the walk."""
    p_rows = {"": [0.35, 0.16, 0.19, 0.17, 0.08, 0.05], "X1": [0.01, 0.16, 0.57, 0.06, 0.07, 0.13],
              "X2": [0.06, 0.6, 0.01, 0.2, 0.01, 0.12], "leaf": [1 / 6] * 6}
    q_rows = {"": [0.06, 0.34, 0.04, 0.16, 0.12, 0.28], "X1": [0.07, 0.31, 0.11, 0.07, 0.03, 0.41],
              "X2": [0.12, 0.03, 0.07, 0.01, 0.32, 0.45]}

    def rows(table, names):
        return torch.tensor([[table[n] for n in path] for path in names], dtype=torch.float64)[None]

    tokens = torch.tensor([[[1, 3], [1, 4], [2, 5]]])  # paths (X1, X3), (X1, X4), (X2, X5)
    target_probs = rows(p_rows, [["", "X1", "leaf"], ["", "X1", "leaf"], ["", "X2", "leaf"]])
    draft_probs = rows(q_rows, [["", "X1"], ["", "X1"], ["", "X2"]])
    slot = {"X1": (0, 0), "X3": (1, 0), "X4": (1, 1), "X2": (0, 2), "X5": (1, 2)}  # (depth - 1, first path)
    accepted = {"X1": (1, 0), "X3": (2, 0), "X4": (2, 1), "X2": (1, 2), "X5": (2, 2)}  # (tau, lowest path)
    order = ["X3", "X4", "X1", "X5", "X2"]
    for a, b in combinations(order, 2):
        uniforms = torch.full((1, 3, 3), 1 - 1e-12, dtype=torch.float64)
        for node in (a, b):
            uniforms[(0, *slot[node])] = 0.0
        result = traversal_verify(target_probs, draft_probs, tokens, uniforms=uniforms)
        assert (int(result.num_accepted), int(result.path_index)) == accepted[a], (a, b)


def test_zero_probability_drafts_are_never_accepted():
    """A drafted token with p = 0 (path 0) or q = 0 (path 1) is rejected by every verifier that reads q,
    whatever the uniforms; onehot, which never reads q, rejects the p = 0 token and accepts the other."""
    target = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    draft = torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64)
    tokens = torch.tensor([[[0], [1]]])
    uniforms = torch.zeros(1, 2, 2, dtype=torch.float64)
    for method, verifier in MULTI_VERIFIERS.items():
        result = verifier(target.expand(1, 2, 2, 3), draft.expand(1, 2, 1, 3), tokens, uniforms=uniforms)
        assert int(result.num_accepted) == (method == "onehot"), method
        assert int(result.next_token) != 0, method  # p(0) = 0: never emitted
        if method == "onehot":
            assert int(result.path_index) == 1


def test_kseq_rho_matches_the_exact_root():
    """The float rho* (regula falsi, 16 steps) against exact_multi.kseq_rho on 40 random rows (K = 2..5):
    within 1e-12 in float64, 1e-5 in float32."""
    from specresearch.core.multi_weights import kseq_rho as torch_kseq_rho
    from specresearch.exact.multi import kseq_rho

    for seed in range(40):
        rng = random.Random(seed)
        vocab, num_drafts = rng.randint(2, 6), rng.randint(2, 5)
        p, q = (random_rational_model(vocab, rng, zero_prob=0.3, denominator=97)(()) for _ in range(2))
        exact_root = float(kseq_rho(p, q, num_drafts))
        got = torch_kseq_rho(_rows(lambda _: p, [()]), _rows(lambda _: q, [()]), num_drafts)
        assert abs(float(got[0]) - exact_root) < 1e-12, (seed, p, q, num_drafts)
        single = torch_kseq_rho(_rows(lambda _: p, [()], torch.float32), _rows(lambda _: q, [()], torch.float32), num_drafts)
        assert single.dtype == torch.float32 and abs(float(single[0]) - exact_root) < 1e-5, (seed, float(single[0]))


# ----------------------------------------------------------------------------- bad input


def _valid(batch=2, num_drafts=2, length=2, vocab=3):
    target = torch.full((batch, num_drafts, length + 1, vocab), 1 / vocab, dtype=torch.float64)
    draft = torch.full((batch, num_drafts, length, vocab), 1 / vocab, dtype=torch.float64)
    return target, draft, torch.zeros(batch, num_drafts, length, dtype=torch.int64)


@pytest.mark.parametrize("method", sorted(MULTI_VERIFIERS))
def test_bad_input_raises_value_error_naming_the_argument(method):
    length = 1 if method == "kseq" else 2
    verifier = MULTI_VERIFIERS[method]
    target, draft, tokens = _valid(length=length)
    with pytest.raises(ValueError, match="target_probs must be 4-D"):
        verifier(target[:, 0], draft, tokens)
    with pytest.raises(ValueError, match="draft_probs must be"):
        verifier(target, draft[:, :1], tokens)
    with pytest.raises(ValueError, match="target_probs must be"):
        verifier(target[:, :, :-1], draft, tokens)
    with pytest.raises(ValueError, match="draft_tokens must be token ids"):
        verifier(target, draft, tokens + 3)
    with pytest.raises(ValueError, match="target_probs rows must sum to 1"):
        verifier(target * 2, draft, tokens)
    with pytest.raises(ValueError, match="NaN"):
        verifier(target.clone().fill_(float("nan")), draft, tokens)
    with pytest.raises(ValueError, match="uniforms must be"):
        verifier(target, draft, tokens, uniforms=torch.zeros(2, length + 1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="either generator or uniforms"):
        verifier(target, draft, tokens, torch.Generator(), uniforms=torch.zeros(2, length + 1, 2, dtype=torch.float64))


def test_kseq_needs_one_token_per_path_and_samplers_check_their_arguments():
    with pytest.raises(ValueError, match=r"L = 1"):
        kseq_verify(*_valid(length=2))
    fn = _table_fn(_models(0, 3)[1], 3, 1)
    with pytest.raises(ValueError, match="draft_law must be one of"):
        sample_draft_paths(fn, 2, 2, 1, "beam")
    with pytest.raises(ValueError, match="num_drafts must be an integer >= 1"):
        sample_draft_paths(fn, 2, 0, 1)
    with pytest.raises(ValueError, match="must return a \\[N, V\\] tensor"):
        sample_draft_paths(lambda prefixes: torch.ones(3), 2, 2, 1)
    assert rrs_verify(*_valid(), validate=False).num_accepted.shape == (2,)
