"""``core.tree_expectations``: each multi-draft rule's E[accepted | drafted tree] (and the single-draft baselines on
the first path), against the rational twins' laws (``exact.multi.verify_multi_exact``, ``exact.verify_exact``) on
random trees, and through the engine (``expectations=`` on tree steps, fixed seed 0), where its mean over many steps
must match the realised mean (a z-test at |z| < 5: false-positive rate below 1e-6 per case, 6 cases)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import markov_toy

from specresearch import exact
from specresearch.config import SamplingConfig
from specresearch.core.tree_expectations import TREE_EXPECTATIONS, expected_accepted_tree
from specresearch.engine.generate import speculative_generate
from specresearch.exact.multi import verify_multi_exact


def _rows(model, prefix, paths, depth):
    return torch.tensor([[[float(v) for v in model(prefix + path[:d])] for d in range(depth)] for path in paths],
                        dtype=torch.float64)


@pytest.mark.parametrize("method", [m for m in TREE_EXPECTATIONS if m not in ("token", "block")])  # below: one path
@pytest.mark.parametrize("seed", range(12))
def test_tree_expectations_equal_the_twins(method, seed):
    rng = random.Random(seed)
    vocab, num_drafts, length, prefix = 4, rng.choice([2, 3]), 1 if method == "kseq" else rng.choice([1, 2, 3]), (1,)
    target = exact.random_rational_model(vocab, rng, depth=2, zero_prob=0.2)
    draft = exact.random_rational_model(vocab, rng, depth=2, zero_prob=0.2)
    paths = []
    for _ in range(num_drafts):  # paths of positive draft probability; shared prefixes on purpose
        path = tuple(paths[0][:rng.randrange(length)]) if paths and rng.random() < 0.5 else ()
        while len(path) < length:
            row = draft(prefix + path)
            path += (rng.choices(range(vocab), weights=[float(v) for v in row])[0],)
        paths.append(path)
    law = verify_multi_exact(target, draft, paths, method, prefix)
    want = float(sum(p * (len(seq) - 1) for seq, p in law.items()))
    got = expected_accepted_tree(_rows(target, prefix, paths, length + 1)[None], _rows(draft, prefix, paths, length)[None],
                                 torch.tensor([paths]), method)
    assert got.item() == pytest.approx(want, abs=1e-9 if method == "kseq" else 1e-12)  # K-SEQ: a float rho*


@pytest.mark.parametrize("verifier, draft_law", [("rrs", "iid"), ("rrs_without_replacement", "without_replacement"),
                                                 ("onehot", "iid"), ("traversal", "iid"), ("gbv", "iid"), ("kseq", "iid")])
def test_the_engine_records_tree_expectations_that_match_what_it_accepts(verifier, draft_law):
    gamma = 1 if verifier == "kseq" else 2
    rules = tuple(m for m in TREE_EXPECTATIONS if m != "kseq" or gamma == 1)
    out = speculative_generate(markov_toy(3), markov_toy(4), [[2, 5]] * 400, verifier=verifier, num_drafts=3, gamma=gamma,
                               draft_law=draft_law, max_new_tokens=12, sampling=SamplingConfig(), seed=0,
                               expectations=rules)
    pairs = [(n, e) for s in out.steps for n, e, a in zip(s.num_accepted, s.expected[verifier], s.active) if a]
    assert all(set(s.expected) == set(rules) for s in out.steps)
    realised = torch.tensor([float(n) for n, _ in pairs])
    expected = torch.tensor([e for _, e in pairs])
    z = (realised - expected).mean() / ((realised - expected).std() / len(pairs) ** 0.5)
    assert abs(float(z)) < 5, float(z)
    assert all(0 <= e <= gamma for e in expected.tolist())


def test_tree_expectations_are_refused_where_they_do_not_apply():
    target, draft = markov_toy(3), markov_toy(4)
    with pytest.raises(ValueError, match="expectations"):
        speculative_generate(target, draft, [[2]], verifier="traversal", num_drafts=2, expectations=("greedy",))
    with pytest.raises(ValueError, match="single-step"):
        speculative_generate(target, draft, [[2]], verifier="traversal", num_drafts=2, gamma=2, expectations=("kseq",))
    with pytest.raises(ValueError, match="expectations"):
        speculative_generate(target, draft, [[2]], verifier="onehot", num_drafts=2, draft_law="dynamic",
                             expectations=("onehot",))


def test_the_single_draft_baselines_read_the_first_path_alone():
    """On a tree, "token" and "block" are what one-draft verification of the first path would accept, whatever the
    other paths hold (paths drawn from the draft, so every drafted token has q > 0)."""
    differ = 0
    for seed in range(6):
        rng = random.Random(seed)
        target = exact.random_rational_model(4, rng, depth=2, zero_prob=0.2)
        draft = exact.random_rational_model(4, rng, depth=2, zero_prob=0.2)
        prefix, paths = (1,), []
        for _ in range(2):
            path = ()
            while len(path) < 3:
                path += (rng.choices(range(4), weights=[float(v) for v in draft(prefix + path)])[0],)
            paths.append(path)
        got = {}
        for method in ("token", "block"):
            law = exact.verify_exact([target(prefix + paths[0][:d]) for d in range(4)],
                                     [draft(prefix + paths[0][:d]) for d in range(3)], paths[0], method)
            want = float(sum(p * n for (n, _), p in law.items()))
            got[method] = expected_accepted_tree(_rows(target, prefix, paths, 4)[None], _rows(draft, prefix, paths, 3)[None],
                                                 torch.tensor([paths]), method).item()
            assert got[method] == pytest.approx(want, abs=1e-12)
        differ += got["token"] != pytest.approx(got["block"])
    assert differ > 0  # the instances tell the two rules apart
