"""Dynamic draft trees (EAGLE-2's top-k tree, ``draft_law="dynamic"``, verified by the one-hot rule).

* The exact twin (``exact.dynamic``): the tree of a hand-checked draft; the loop of dynamic-tree steps is lossless
  exactly for random models and shapes, and a rule that forgets to zero a rejected child is caught.
* Torch against the twin: the engine drafts the twin's tree node for node (a ``ToyLM`` draft with distinct
  probabilities), ``greedy_tree_verify`` takes the one-hot rule's decisions on one-hot rows (random trees with
  repeated sibling tokens), and ``onehot_tree_verify``'s law on a fixed tree matches ``onehot_tree_law`` (chi-square
  at N = 20,000, level 1e-6: false-positive rate 1e-6 per case, 3 cases).
* The static tree (``draft_law="static"``, EAGLE-2's baseline) is checked the same way, beside the dynamic one.
* Through the engine: T = 0 gives the greedy autoregressive tokens for every draft kind and several tree shapes,
  with acceptances (block efficiency > 1.2); batched == alone with per-row seeds; statistical losslessness of the
  first 3 tokens on a Markov pair (N = 12,000, exact Bonferroni p > 1e-7) and with a feature head on a tiny Llama
  (N = 6,000); bad arguments are refused before any model work.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest
import torch
from helpers import close_draft, markov_toy

from specresearch import exact
from specresearch.config import SamplingConfig
from specresearch.core.draws import sample_from_weights
from specresearch.core.verify_tree import children_table, greedy_tree_verify, onehot_tree_verify
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.topk_tree import draft_dynamic_tree
from specresearch.exact import dynamic
from specresearch.exact.multi import _sequential_law
from specresearch.experiments.stats import chi_square, lossless_test
from specresearch.models.toy import ToyLM, tiny_llama

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 33, 7], [4, 8], [16, 23, 42, 3]]
F = Fraction


# ----------------------------------------------------------------------------- the exact twin

def _markov_rows(rows):
    """An exact Markov model from rows of Fractions: the next-token row depends on the last token only."""
    return lambda prefix: tuple(rows[prefix[-1]])


def test_dynamic_tree_by_hand():
    # q(. | last token): from 0 -> (0, 1/2, 1/3, 1/6); 1 -> (1/10, 0, 3/5, 3/10); 2 -> (9/10, 1/10, 0, 0); 3 uniform
    rows = [(F(0), F(1, 2), F(1, 3), F(1, 6)), (F(1, 10), F(0), F(3, 5), F(3, 10)), (F(9, 10), F(1, 10), F(0), F(0)),
            (F(1, 4),) * 4]
    draft = _markov_rows(rows)
    # from prefix (0,), K = 2. Depth 1: 1 (1/2), 2 (1/3). Depth 2: 1 -> 2 (3/10), 3 (3/20); 2 -> 0 (3/10), 1 (1/30)
    assert dynamic.dynamic_tree(draft, 2, 2, 3, (0,)) == {(): (1, 2), (1,): (2,), (2,): (), (1, 2): ()}  # tie: earlier
    assert dynamic.dynamic_tree(draft, 2, 2, 4, (0,)) == {(): (1, 2), (1,): (2,), (2,): (0,), (1, 2): (), (2, 0): ()}
    # depth 3 expands the best 2 of depth 2, (1, 2) and (2, 0), not (1, 3)
    deep = dynamic.dynamic_tree(draft, 2, 3, 100, (0,))
    assert deep[(1, 3)] == () and deep[(1, 2)] == (0, 1) and deep[(2, 0)] == (1, 2) and deep[(2,)] == (0, 1)
    assert dynamic.dynamic_tree(draft, 2, 3, 5, (0,)) == {(): (1, 2), (1,): (2,), (2,): (0,), (1, 2): (0,), (2, 0): (),
                                                          (1, 2, 0): ()}
    # static: the first 2 nodes drafted at depth 2 (1 -> 2, 1 -> 3) are expanded and the first 5 drafted are kept,
    # whatever the values
    static = dynamic.dynamic_tree(draft, 2, 3, 5, (0,), static=True)
    assert static == {(): (1, 2), (1,): (2, 3), (2,): (0,), (1, 2): (), (1, 3): (), (2, 0): ()}


@pytest.mark.parametrize("seed, vocab, num_children, depth, tree_nodes",
                         [(0, 3, 2, 2, 3), (1, 4, 2, 3, 5), (2, 4, 3, 2, 4), (3, 3, 1, 3, 2), (4, 4, 2, 2, 1)])
def test_dynamic_loop_is_exactly_lossless(seed, vocab, num_children, depth, tree_nodes):
    target = exact.random_rational_model(vocab, random.Random(seed), depth=2, zero_prob=0.2)
    draft = exact.random_rational_model(vocab, random.Random(seed + 100), depth=2, zero_prob=0.2)
    for static in (False, True):
        assert dynamic.is_lossless_dynamic(target, draft, num_children, depth, tree_nodes, 3, (1,), static)


def test_a_one_hot_rule_that_keeps_rejected_children_is_lossy():
    target = exact.random_rational_model(3, random.Random(0), depth=1, zero_prob=0.0)
    draft = exact.random_rational_model(3, random.Random(1), depth=1, zero_prob=0.0)
    tree = dynamic.dynamic_tree(draft, 2, 2, 4, (0,))
    wrong = _sequential_law(exact.as_model(target), None, (0,), lambda u: tree.get(u, ()),
                            lambda p_row, q_row, x: (p_row[x], p_row, q_row))  # p(x) not zeroed after rejection
    first = Counter()
    for seq, v in wrong.items():
        first[seq[0]] += v
    assert [first[t] for t in range(3)] != list(target((0,)))
    right = dynamic.onehot_tree_law(target, tree, (0,))
    first = Counter()
    for seq, v in right.items():
        first[seq[0]] += v
    assert [first[t] for t in range(3)] == list(target((0,)))


# ----------------------------------------------------------------------------- torch against the twin

def _toy(seed: int, vocab: int = 7) -> tuple[ToyLM, object]:
    """A Markov ToyLM with distinct probabilities in every row (no ties in the top-k), and its exact twin."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=generator, dtype=torch.float64) * 1.5
    probs = logits.softmax(-1)
    rows = [tuple(F(v) / sum(map(F, row.tolist())) for v in row.tolist()) for row in probs]
    return ToyLM(probs.log()), _markov_rows(rows)


def _as_dict(tree, b: int) -> dict:
    """The node form of row b as {node path: children tokens in order}."""
    tokens = tree.node_tokens[b].tolist()
    paths = {0: ()}
    out = {(): ()}
    for i, parent in enumerate(tree.parents[b], start=1):
        paths[i] = paths[parent] + (tokens[i - 1],)
        out[paths[i]] = ()
        out[paths[parent]] += (tokens[i - 1],)
    return out


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("num_drafts, gamma, tree_nodes", [(2, 3, 5), (3, 3, 9), (3, 1, 2), (2, 4, 100)])
def test_the_engine_drafts_the_twins_tree(num_drafts, gamma, tree_nodes, static):
    draft, twin = _toy(0)
    prompts = [[1, 3], [4, 6]]
    ids = torch.tensor(prompts)
    draft.prefill(ids[:, :-1], torch.ones_like(ids[:, :-1]))
    tree = draft_dynamic_tree(draft, ids[:, -1:], None, num_drafts, gamma, tree_nodes, "cpu", static)
    for b, prompt in enumerate(prompts):
        want = dynamic.dynamic_tree(twin, num_drafts, gamma, tree_nodes, tuple(prompt), static)
        assert _as_dict(tree, b) == want
    depth_one = (tree.depth == 1) & (tree.node_tokens >= 0)
    assert bool(tree.visible[:, :, 0].all()) and int(depth_one[0].sum()) >= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_onehot_tree_verify_has_the_twins_law(seed):
    target, target_twin = _toy(seed + 10)
    _, draft_twin = _toy(seed + 20)
    prefix = (2,)
    tree = dynamic.dynamic_tree(draft_twin, 2, 3, 6, prefix)
    nodes = [u for u in tree if u]  # parents before children (dict order is drafting order)
    index = {(): 0, **{u: i + 1 for i, u in enumerate(nodes)}}
    call_tokens = torch.tensor([[prefix[-1]] + [u[-1] for u in nodes]])
    children = children_table([[index[u[:-1]] for u in nodes]])
    probs = torch.stack([target.table[(prefix + u)[-1]] for u in [()] + nodes]).softmax(-1)[None]
    samples = 20_000
    batch = probs.expand(samples, -1, -1).contiguous()
    result = onehot_tree_verify(batch, call_tokens.expand(samples, -1), children.expand(samples, -1, -1), 3,
                                torch.Generator().manual_seed(seed))
    emitted = Counter()
    path = call_tokens[0][result.path_nodes]  # [N, L]
    for row, n, t in zip(path.tolist(), result.num_accepted.tolist(), result.next_token.tolist()):
        emitted[tuple(row[:n]) + (t,)] += 1
    law = dynamic.onehot_tree_law(target_twin, tree, prefix)
    assert set(emitted) <= set(law)
    cells = sorted(law)
    _, _, p_value, _ = chi_square([emitted[c] for c in cells], [float(law[c]) for c in cells])
    assert p_value > 1e-6


# ----------------------------------------------------------------------------- through the engine


@pytest.mark.parametrize("draft_law", ["dynamic", "static"])
@pytest.mark.parametrize("num_drafts, gamma, tree_nodes", [(2, 3, None), (3, 4, 6), (1, 3, None), (4, 2, 3)])
def test_greedy_dynamic_trees_are_greedy_decoding(num_drafts, gamma, tree_nodes, draft_law, monkeypatch):
    """At T = 0 the engine's tree steps decide with greedy_tree_verify (the one-hot walk is never called) and give
    greedy decoding's tokens, with acceptances."""
    import specresearch.engine.topk_tree as topk_tree

    monkeypatch.setattr(topk_tree, "onehot_tree_verify", lambda *a, **k: pytest.fail("a T = 0 step walked the tree"))
    target, draft = tiny_llama(48, seed=0, init_std=0.6), close_draft()
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=24, sampling=GREEDY).tokens
    out = speculative_generate(target, draft, PROMPTS, verifier="onehot", num_drafts=num_drafts, gamma=gamma,
                               draft_law=draft_law, tree_nodes=tree_nodes, max_new_tokens=24, sampling=GREEDY)
    assert out.tokens == want
    assert out.block_efficiency > 1.2


@pytest.mark.parametrize("kind", ["ngram", "feature", "lookup+feature"])
def test_every_draft_kind_drafts_dynamic_trees(kind):
    from helpers import feature_head

    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.feature import FeatureDraft
    from specresearch.drafts.ngram import NGramDraft

    target = tiny_llama(16, seed=0, init_std=0.8, num_layers=2)
    head = FeatureDraft(feature_head(target.model, seed=2, scale=0.1))
    draft = {"ngram": lambda: NGramDraft(16, max_ngram=2), "feature": lambda: head,
             "lookup+feature": lambda: LookupOrDraft(head, min_match=1, max_ngram=2)}[kind]()
    prompts = [[3, 5, 3, 5, 3], [7, 1]]
    want = autoregressive_generate(target, prompts, max_new_tokens=16, sampling=GREEDY).tokens
    out = speculative_generate(target, draft, prompts, verifier="onehot", num_drafts=2, gamma=3, draft_law="dynamic",
                               max_new_tokens=16, sampling=GREEDY)
    assert out.tokens == want


def test_dynamic_trees_batched_equal_alone():
    target, draft = tiny_llama(48, seed=0, init_std=0.6), close_draft(0.3)
    kwargs = dict(verifier="onehot", num_drafts=2, gamma=3, draft_law="dynamic", max_new_tokens=16,
                  sampling=SamplingConfig(temperature=1.0))
    batched = speculative_generate(target, draft, PROMPTS, seed=[3, 4, 5], **kwargs).tokens
    alone = [speculative_generate(target, draft, [p], seed=[s], **kwargs).tokens[0] for p, s in zip(PROMPTS, [3, 4, 5])]
    assert list(batched) == alone


VOCAB, PROMPT, LEVEL, SAMPLES = 6, [2, 5], 1e-7, 12_000


@pytest.mark.parametrize("num_drafts, gamma, tree_nodes, draft_law", [(2, 2, None, "dynamic"), (3, 3, 4, "dynamic"),
                                                                      (2, 3, 4, "static")])
def test_dynamic_trees_are_lossless_through_the_engine(num_drafts, gamma, tree_nodes, draft_law):
    result = lossless_test(markov_toy(3), markov_toy(4), "onehot", PROMPT, sampling=SamplingConfig(), gamma=gamma, k=3,
                           max_new_tokens=4, num_samples=SAMPLES, seed=7, batch_size=SAMPLES // 2,
                           num_drafts=num_drafts, draft_law=draft_law, tree_nodes=tree_nodes)
    assert result.impossible == 0 and result.bonferroni_p_value > LEVEL, result.p_value


def test_feature_head_dynamic_trees_are_lossless_through_the_engine():
    from helpers import feature_head

    from specresearch.drafts.feature import FeatureDraft

    target = tiny_llama(16, seed=0, init_std=0.8, num_layers=2)
    head = FeatureDraft(feature_head(target.model, seed=2, scale=0.1))
    result = lossless_test(target, head, "onehot", [3, 5, 3], sampling=SamplingConfig(), gamma=2, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=7, batch_size=3_000, num_drafts=2,
                           draft_law="dynamic")
    assert result.impossible == 0 and result.bonferroni_p_value > LEVEL, result.p_value


def test_dynamic_tree_arguments_are_checked():
    from specresearch.engine.tree import parse_verifier

    target, draft = tiny_llama(48, seed=0), tiny_llama(48, seed=1)
    refused = [(dict(verifier="traversal", num_drafts=2, draft_law="dynamic"), "verified by 'onehot'"),
               (dict(verifier="rrs", num_drafts=2, draft_law="static"), "verified by 'onehot'"),
               (dict(verifier="traversal", num_drafts=2, tree_nodes=4), "tree_nodes is for draft_law 'dynamic'"),
               (dict(verifier="block", tree_nodes=4), "tree_nodes is for draft_law 'dynamic'"),
               (dict(verifier="onehot", num_drafts=2, draft_law="dynamic", tree_nodes=0), "tree_nodes"),
               (dict(num_drafts=2, draft_law="dynamic"), "a top-k tree's: verifier='onehot'")]  # block, the default
    for options, message in refused:
        with pytest.raises(ValueError, match=message):
            speculative_generate(target, draft, PROMPTS, **options)
    assert parse_verifier("onehot:4:dynamic:16") == ("onehot", 4, "dynamic", 16)
    assert parse_verifier("onehot:4:dynamic") == ("onehot", 4, "dynamic", None)
    assert parse_verifier("onehot:2:static:5") == ("onehot", 2, "static", 5)
    for bad in ("traversal:2:dynamic", "onehot:2:iid:8", "onehot:2:dynamic:0", "onehot:2:dynamic:x"):
        with pytest.raises(ValueError, match="multi-draft rule"):
            parse_verifier(bad)


def test_steps_record_the_tokens_the_target_scored():
    target, draft = tiny_llama(48, seed=0, init_std=0.6), close_draft()
    common = dict(max_new_tokens=12, sampling=GREEDY)
    chain = speculative_generate(target, draft, PROMPTS[:1], verifier="block", gamma=3, **common)
    assert all(s.scored == (s.gamma + 1,) for s in chain.steps)
    dynamic_run = speculative_generate(target, draft, PROMPTS[:1], verifier="onehot", num_drafts=3, gamma=3,
                                       draft_law="dynamic", tree_nodes=5, **common)
    assert {s.scored for s in dynamic_run.steps[:-1]} == {(6,)}  # the pending token and 5 nodes
    paths = speculative_generate(target, draft, PROMPTS[:1], verifier="traversal", num_drafts=3, gamma=2, **common)
    assert all(s.scored == (3,) for s in paths.steps)  # greedy: the 3 paths are one chain of 2 nodes
    emitted = sum(n + 1 for s in dynamic_run.steps for n in s.num_accepted)
    assert dynamic_run.tokens_per_scored == emitted / sum(s.scored[0] for s in dynamic_run.steps)


def _onehot_child_by_child(target_probs, call_tokens, children, length, eta):
    """The one-hot rule read literally, one row, one child at a time (the oracle of the vectorised verifier)."""
    out = []
    for b in range(target_probs.shape[0]):
        node, path = 0, []
        for d in range(length + 1):
            residual = target_probs[b, node].clone()
            chosen = None
            for c, child in enumerate(children[b, node].tolist()):
                if child < 0:
                    break
                x = int(call_tokens[b, child])
                if float(eta[b, min(d, length), c]) * float(residual.sum()) < float(residual[x]):
                    chosen = child
                    break
                residual[x] = 0.0
            if chosen is None:  # all rejected, or a leaf: the next token comes from what is left
                break
            node = chosen
            path.append(chosen)
        out.append((len(path), path, residual))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_vectorised_one_hot_rule_takes_the_literal_rules_decisions(seed):
    """Same uniforms, same decisions as trying each child in turn, on random trees with up to 8 children a node,
    padding and repeated sibling tokens (a repeat of a rejected token has p = 0)."""
    g = torch.Generator().manual_seed(seed)
    batch, nodes, vocab, length = 64, 12, 6, 4
    parents = [[int(torch.randint(0, i + 1, (1,), generator=g)) if i < nodes - 3 or b % 2 else -1 for i in range(nodes)]
               for b in range(batch)]
    children = children_table(parents)
    depth = torch.zeros(batch, nodes + 1, dtype=torch.long)
    for b, row in enumerate(parents):
        for i, parent in enumerate(row, start=1):
            depth[b, i] = depth[b, parent] + 1 if parent >= 0 else 0
    length = int(depth.max())
    call_tokens = torch.randint(0, vocab, (batch, nodes + 1), generator=g)
    probs = torch.softmax(2 * torch.randn(batch, nodes + 1, vocab, generator=g), -1)
    uniforms = torch.rand(batch, length + 1, children.shape[2], generator=g, dtype=torch.float64)
    result = onehot_tree_verify(probs, call_tokens, children, length, uniforms=uniforms)
    eta = uniforms.to(probs.dtype).clamp(max=1.0 - torch.finfo(probs.dtype).eps / 2)
    for b, (accepted, path, residual) in enumerate(_onehot_child_by_child(probs, call_tokens, children, length, eta)):
        assert int(result.num_accepted[b]) == accepted and result.path_nodes[b, :accepted].tolist() == path, b
        assert int(result.next_token[b]) == int(sample_from_weights(residual[None], eta[b, length, :1])), b
    assert children.shape[2] >= 4 and bool((result.num_accepted > 0).any()) and bool((result.num_accepted == 0).any())


@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_tree_rule_is_the_one_hot_rule_on_one_hot_rows(seed):
    """At T = 0 the engine verifies with greedy_tree_verify (argmax tokens, no walk by depth): on random trees with
    padding, up to 8 children a node and a 3-token vocabulary (so siblings repeat tokens and paths run deep), its
    result is onehot_tree_verify's on the one-hot rows, for any uniforms."""
    g = torch.Generator().manual_seed(100 + seed)
    batch, nodes, vocab = 128, 12, 3
    parents = [[int(torch.randint(0, i + 1, (1,), generator=g)) if i < nodes - 3 or b % 2 else -1 for i in range(nodes)]
               for b in range(batch)]
    children = children_table(parents)
    depth = [0] * (nodes + 1)
    length = 1
    for row in parents:
        for i, parent in enumerate(row, start=1):
            depth[i] = depth[parent] + 1 if parent >= 0 else 0
        length = max(length, *depth)
    call_tokens = torch.randint(0, vocab, (batch, nodes + 1), generator=g)
    target_tokens = torch.randint(0, vocab, (batch, nodes + 1), generator=g)
    one_hot = torch.nn.functional.one_hot(target_tokens, vocab).double()
    uniforms = torch.rand(batch, length + 1, children.shape[2], generator=g, dtype=torch.float64)
    expected = onehot_tree_verify(one_hot, call_tokens, children, length, uniforms=uniforms)
    got = greedy_tree_verify(target_tokens, call_tokens, children, length)
    assert torch.equal(got.num_accepted, expected.num_accepted)
    assert torch.equal(got.path_nodes, expected.path_nodes)
    assert torch.equal(got.next_token, expected.next_token)
    assert int(expected.num_accepted.max()) >= 3 and bool((expected.num_accepted == 0).any())


def test_the_greedy_tree_rule_refuses_bad_trees():
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="after its parent"):
        greedy_tree_verify(tokens, tokens, torch.tensor([[[2], [-1], [1]]]), 2)  # node 1 a child of node 2
    with pytest.raises(ValueError, match="length"):
        greedy_tree_verify(tokens, tokens, children_table([[0, 1]]), 0)
    with pytest.raises(ValueError, match=r"\[B, 1\+n\]"):
        greedy_tree_verify(tokens[:, :2], tokens, children_table([[0, 1]]), 2)
