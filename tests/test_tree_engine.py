"""Draft trees in the engine (``speculative_generate(num_drafts=K, draft_law=...)``, ``engine.tree``).

* Tree scoring: a tree scored in one cached call (4-D mask, positions = prefix + depth) gives each node the logits of
  an uncached forward of its path, and after ``end_tree`` (keep the accepted path, crop, pack) the cache goes on
  exactly as the compacted sequence: float32, atol 1e-4, left-padded batch of two.
* Temperature 0: every multi-draft rule under both draft laws returns the greedy autoregressive tokens, with a draft
  close enough to the target that acceptances happen (block efficiency > 1.2, so the check has teeth).
* Statistical losslessness through the engine (``experiments.stats.lossless_test``) on a Markov pair of ``ToyLM`` s,
  first 3 tokens after a fixed prompt, N = 12,000: each rule under a law it is lossless for must pass at the exact,
  conservative Bonferroni level 1e-7; so must trees drafted by a feature head and by lookup + feature head on a tiny
  Llama (N = 6,000; 10 such tests: family-wise false-positive rate <= 1e-6); a wrong tree rule (RRS that resamples p
  instead of the residual after rejecting every root candidate) is rejected at N = 12,000.
"""

from __future__ import annotations

import pytest
import torch
from helpers import close_draft, markov_toy, tree_path, visible_from_parents

from specresearch.config import SamplingConfig
from specresearch.core.draws import sample_from_weights
from specresearch.core.verify_multi import MultiVerifyResult, rrs_verify
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.tree import _tree
from specresearch.experiments.stats import lossless_test
from specresearch.models.toy import tiny_llama

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 33, 7], [4, 8], [16, 23, 42, 3]]


def _uncached(lm, ids):
    with torch.no_grad():
        return lm.model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_tree_scoring_equals_each_path_uncached_and_the_cache_goes_on():
    lm = tiny_llama(48, seed=0, init_std=0.6)
    prompts = [[5, 9, 2, 33, 7], [4, 8, 11]]
    ids = torch.tensor([[5, 9, 2, 33, 7], [0, 0, 4, 8, 11]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    lm.prefill(ids[:, :-1], mask[:, :-1])
    histories = [list(p[:-1]) for p in prompts]
    pending = [p[-1] for p in prompts]
    for step in range(6):  # several trees: dead slots accumulate and the cache is packed on the way
        # call nodes: 0 pending; 1 a, 2 b (child of 1), 3 c, 4 d (child of 3), 5 e (child of 2)
        parents = [-1, 0, 1, 0, 3, 2]
        tokens = torch.tensor([[pending[b], 10 + step, 20, 30 - step, 40, 12] for b in range(2)])
        depth = torch.tensor([[0, 1, 2, 1, 2, 3]] * 2)
        lm.begin_tree()
        logits = lm.score_tree(tokens, depth, visible_from_parents(parents).expand(2, -1, -1))
        for b in range(2):
            for i in range(6):
                want = _uncached(lm, histories[b] + tree_path(tokens[b], parents, i))
                assert torch.allclose(logits[b, i], want, atol=1e-4), (step, b, i)
        kept = torch.tensor([[True, True, True, False, False, True], [True, False, False, True, True, False]])
        lm.end_tree(kept)
        histories[0] += [pending[0], 10 + step, 20, 12]
        histories[1] += [pending[1], 30 - step, 40]
        pending = [7, 9]
        assert lm.cache_length <= max(len(h) for h in histories) + 8
    out = lm.score(torch.tensor([[pending[0]], [pending[1]]]))
    for b in range(2):
        assert torch.allclose(out[b, -1], _uncached(lm, histories[b] + [pending[b]]), atol=1e-4)


def test_tree_merges_equal_prefixes():
    node_tokens, depth, visible, path_nodes = _tree(torch.tensor([[[3, 4], [3, 5], [6, 4]]]))
    assert node_tokens.tolist() == [[3, 4, 5, 6, 4]] and depth.tolist() == [[1, 2, 2, 1, 2]]
    assert path_nodes.tolist() == [[[1, 2], [1, 3], [4, 5]]]
    assert visible[0, 3].tolist() == [True, True, False, True, False, False]  # node 5 sees the root, 3 and itself


@pytest.mark.parametrize("verifier", ["rrs", "rrs_without_replacement", "gbv", "traversal", "onehot", "kseq"])
@pytest.mark.parametrize("draft_law", ["iid", "without_replacement"])
def test_greedy_trees_are_greedy_decoding(verifier, draft_law):
    target, draft = tiny_llama(48, seed=0, init_std=0.6), close_draft()
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=24, sampling=GREEDY).tokens
    gamma = 1 if verifier == "kseq" else 3
    out = speculative_generate(target, draft, PROMPTS, verifier=verifier, num_drafts=3, gamma=gamma, draft_law=draft_law,
                               max_new_tokens=24, sampling=GREEDY)
    assert out.tokens == want
    assert out.block_efficiency > 1.2


def test_tree_arguments_are_checked():
    target, draft = tiny_llama(48, seed=0), tiny_llama(48, seed=1)
    with pytest.raises(ValueError, match="multi-draft rule"):
        speculative_generate(target, draft, PROMPTS, verifier="block", num_drafts=2)
    with pytest.raises(ValueError, match="draft_law must be one of"):
        speculative_generate(target, draft, PROMPTS, verifier="rrs", num_drafts=2, draft_law="topk")
    with pytest.raises(ValueError, match="single-step"):
        speculative_generate(target, draft, PROMPTS, verifier="kseq", num_drafts=2, gamma=3)
    with pytest.raises(ValueError, match="num_drafts"):
        speculative_generate(target, draft, PROMPTS, verifier="rrs", num_drafts=0)


# ----------------------------------------------------------------------------- through the engine, statistically

VOCAB, PROMPT, LEVEL, SAMPLES = 6, [2, 5], 1e-7, 12_000


LOSSLESS = [("rrs", "iid", 2), ("rrs_without_replacement", "without_replacement", 2), ("kseq", "iid", 1), ("gbv", "iid", 2),
            ("traversal", "iid", 2), ("traversal", "without_replacement", 2), ("onehot", "iid", 2), ("onehot", "without_replacement", 2)]


@pytest.mark.parametrize("verifier, draft_law, gamma", LOSSLESS)
def test_tree_rules_are_lossless_through_the_engine(verifier, draft_law, gamma):
    result = lossless_test(markov_toy(3), markov_toy(4), verifier, PROMPT, sampling=SamplingConfig(), gamma=gamma, k=3,
                           max_new_tokens=4, num_samples=SAMPLES, seed=7, batch_size=SAMPLES // 2, num_drafts=3,
                           draft_law=draft_law)
    assert result.impossible == 0 and result.bonferroni_p_value > LEVEL, result.p_value


@pytest.mark.parametrize("kind", ["feature", "lookup+feature"])
def test_feature_head_trees_are_lossless_through_the_engine(kind):
    """The head drafts each path on its own features and is re-fed the target's along the accepted one."""
    from helpers import feature_head

    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.feature import FeatureDraft

    target = tiny_llama(16, seed=0, init_std=0.8, num_layers=2)
    head = FeatureDraft(feature_head(target.model, seed=2, scale=0.1))
    draft = head if kind == "feature" else LookupOrDraft(head, min_match=1, max_ngram=2)
    result = lossless_test(target, draft, "traversal", [3, 5, 3], sampling=SamplingConfig(), gamma=2, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=7, batch_size=3_000, num_drafts=2)
    assert result.impossible == 0 and result.bonferroni_p_value > LEVEL, result.p_value


def _resample_root(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """WRONG: RRS, except that a row rejecting every root candidate emits a fresh sample of p, not the residual."""
    result = rrs_verify(target_probs, draft_probs, draft_tokens, generator, uniforms=uniforms, validate=validate)
    u = torch.rand(len(draft_tokens), generator=generator, dtype=target_probs.dtype)
    fresh = sample_from_weights(target_probs[:, 0, 0], u)
    next_token = torch.where(result.num_accepted == 0, fresh, result.next_token)
    return MultiVerifyResult(result.num_accepted, result.path_index, next_token)


def test_a_wrong_tree_rule_is_rejected_through_the_engine():
    result = lossless_test(markov_toy(3), markov_toy(4), _resample_root, PROMPT, sampling=SamplingConfig(), gamma=2, k=3,
                           max_new_tokens=4, num_samples=SAMPLES, seed=7, batch_size=SAMPLES // 2, num_drafts=3)
    assert result.p_value < LEVEL and result.bonferroni_p_value < LEVEL


def test_bench_runs_tree_rules_by_name(tmp_path):
    from specresearch.engine.tree import parse_verifier
    from specresearch.experiments.bench import BenchConfig, BenchPrompt, run_bench
    from specresearch.experiments.records import read_records

    assert parse_verifier("traversal:4") == ("traversal", 4, "iid", None) and parse_verifier("block") == ("block", 1, "iid", None)
    assert parse_verifier("onehot:2:without_replacement") == ("onehot", 2, "without_replacement", None)
    for bad in ("block:2", "traversal:x", "rrs:2:topk", "nope"):
        with pytest.raises(ValueError, match="multi-draft rule"):
            parse_verifier(bad)
    target, draft = tiny_llama(48, seed=0, init_std=0.6), close_draft()
    config = BenchConfig(verifiers=("block", "traversal:3", "onehot:2:dynamic:4"), temperatures=(0.0, 1.0), gammas=(2,), max_new_tokens=12)
    run_bench(target, draft, [BenchPrompt("p", "chat", (5, 9, 2, 33, 7))], config, tmp_path / "r.csv", progress=False)
    rows = read_records(tmp_path / "r.csv")
    assert set(rows.verifier) == {"autoregressive", "block", "traversal:3", "onehot:2:dynamic:4"}
    greedy = rows[rows.temperature == 0]
    for tree in ("traversal:3", "onehot:2:dynamic:4"):
        assert greedy[greedy.verifier == "block"].output_hash.iloc[0] == greedy[greedy.verifier == tree].output_hash.iloc[0]
