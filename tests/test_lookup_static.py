"""Prompt lookup in the engine's captured steps (``drafts.combined.StaticLookupOrDraft``, ``drafts.ngram.
lookup_at_slots``), on a tiny random Llama and a feature head over it.

* The device lookup is :func:`ngram_probs` / :func:`ngram_match_length` of every context: 300 random batches of 3 rows
  and 4 queries each (left padding, contexts of 1 to 24 tokens over 4 symbols, so matches of every length), equal
  within 1e-6.
* A step's logits, slot by slot, are the growing ``LookupOrDraft``'s (every slot fed, ``@every-slot``): a re-feed,
  then two drafting calls, for a row that ends in a repeated bigram (lookup) and one that does not (the head), drafted
  tokens that extend, break and make a match (1e-4: the head in calls of other widths).
* Through the engine (``compile="static"``): greedy chains give the target's tokens; a chain step traces as one graph
  and compiled (``aot_eager``) gives the eager step's log at T = 1, and a warm-up (as a CUDA graph's or inductor's
  runner makes) gives back the head's extents as well as the lookup's; T = 1 keeps the target's law (exact Bonferroni
  test, false-positive rate <= 1e-6).
* Prompt lookup alone (``NGramDraft.static_form()``): its logits slot by slot, greedy chains with the growing loop's
  accepted counts, T = 1 the target's law.
* Refused in one line: trees (a node's lookup context is its own path), a length plan below gamma (``draft_gamma``,
  decided per step on the host), prompt lookup over a draft without a static form. ``compile="auto"`` then runs the
  growing loop.
"""

import pytest
import torch
from helpers import check_captured_step, feature_head

from specresearch.config import SamplingConfig
from specresearch.drafts.combined import LookupOrDraft
from specresearch.drafts.feature import FeatureDraft
from specresearch.drafts.ngram import NGramDraft, _lookup, lookup_at_slots
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_prompts
from specresearch.engine.static import static_available
from specresearch.experiments.stats import lossless_test
from specresearch.models.toy import tiny_llama

VOCAB = 48
GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 33, 7, 5, 9], [4, 8, 16, 23]]  # row 0 ends in a repeated bigram, row 1 has no repeat


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=3)


def test_the_device_lookup_is_the_lookup_of_every_context():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        tokens, start = torch.randint(0, 4, (3, 24), generator=g), torch.randint(0, 6, (3,), generator=g)
        slots = torch.stack([torch.randint(int(s), 24, (4,), generator=g).sort().values for s in start])
        looked, matches = lookup_at_slots(tokens, start, slots, 7, 3, 0.02)
        for b in range(3):
            for j in range(4):
                q, n = _lookup(tokens[b, int(start[b]) : int(slots[b, j]) + 1], 7, 3, 0.02)
                assert n == int(matches[b, j]) and torch.allclose(q.log(), looked[b, j], atol=1e-6)


def test_a_tree_nodes_lookup_is_the_lookup_of_its_own_path():
    """``lookup_call`` on draft-tree calls: each node's context is the kept slots, then the region slots it sees in
    order; 200 random trees (kept contexts of 2 to 12 tokens over 4 symbols after left padding, calls of 3 nodes at
    region offsets 0 to 6, random ancestor sets) against ``_lookup`` of that context (1e-6)."""
    from specresearch.drafts.ngram import lookup_call
    from specresearch.models.static_cache import StaticRows

    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        rows = StaticRows(2, 32, "cpu")
        pads = torch.randint(0, 3, (2,), generator=g)
        rows.begin(torch.arange(16)[None] >= pads[:, None])
        rows.advance(torch.randint(4, 15, (2,), generator=g))
        buffer = torch.randint(0, 4, (2, 32), generator=g)
        offset, k = int(torch.randint(0, 7, (1,), generator=g)), 3
        earlier = torch.rand(2, k, offset, generator=g) < 0.5  # each node's ancestors among the region's earlier slots
        visible = torch.cat([earlier, torch.eye(k, dtype=torch.bool).expand(2, -1, -1)], 2)
        tokens = torch.randint(0, 4, (2, k), generator=g)
        expected = buffer.clone()
        expected.scatter_(1, rows.length[:, None] + offset + torch.arange(k), tokens)
        looked, matches = lookup_call(buffer, rows, tokens, offset, visible, 7, 3, 0.02)
        for b in range(2):
            kept = expected[b, int(rows.start[b]) : int(rows.length[b])]
            region = expected[b, int(rows.length[b]) : int(rows.length[b]) + offset + k]
            for i in range(k):
                q, n = _lookup(torch.cat([kept, region[visible[b, i]]]), 7, 3, 0.02)
                assert n == int(matches[b, i]) and torch.allclose(q.log(), looked[b, i], atol=1e-6)


def test_a_steps_logits_are_the_growing_drafts_slot_by_slot(target):
    head = FeatureDraft(feature_head(target.model))
    growing = LookupOrDraft(head, min_match=2, lazy=False)
    ids, mask = encode_prompts(PROMPTS)
    _, features = target.prefill(ids, mask, hidden_layers=head.feature_layers)
    previous = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1)  # a slot reads the one before (zeros: none)
    before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1) * previous[:, :, None]
    growing.observe(before)
    want = [growing.prefill(ids, mask)]
    drafted = [torch.tensor([[2], [4]]), torch.tensor([[30], [8]])]  # row 0 extends its match, then breaks it; row 1
    # makes one: 4 8 repeats its first two tokens (a second drafted token written elsewhere would not)
    want += [growing.score(token)[:, 0] for token in drafted]
    static = growing.static_form()
    static.allocate(2, 64)
    static.prefill(ids, mask, leave=1, inputs=static.fuse(before[:, :-1]))
    logits, carry = static.forward(ids[:, -1:], inputs=static.fuse(before[:, -1:]))
    static.commit(torch.ones(2, dtype=torch.long))  # the re-fed next token kept: the drafted tokens follow it
    got = [logits[:, 0]]
    for i, token in enumerate(drafted):
        logits, carry = static.forward(token, inputs=carry[:, -1:], offset=i)
        got.append(logits[:, 0])
    for w, s in zip(want, got):
        torch.testing.assert_close(s, w, rtol=1e-4, atol=1e-4)  # the head: float rounding of other row counts
    lookup = NGramDraft(VOCAB)  # the control: row 0 drafts by lookup there, row 1 by the head
    torch.testing.assert_close(got[0][0], lookup.prefill(ids[:1], mask[:1])[0])
    assert not torch.allclose(got[0][1], lookup.prefill(ids[1:, 3:], mask[1:, 3:])[0], atol=1e-2)


def test_in_the_captured_steps_greedy_chains_give_the_targets_tokens_and_keep_the_law(target):
    draft = LookupOrDraft(FeatureDraft(feature_head(target.model)), min_match=2, draft_gamma=None)
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=15, sampling=GREEDY).tokens
    for gamma in (1, 4):
        out = speculative_generate(target, draft, PROMPTS, verifier="block", gamma=gamma, max_new_tokens=15,
                                   sampling=GREEDY, compile="static")
        assert out.tokens == want and all(r.target_seconds != r.target_seconds for r in out.steps)
    result = lossless_test(target, draft, "block", [5, 9, 5, 9], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=0, batch_size=3_000, compile="static")
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def test_a_captured_chain_step_traces_as_one_graph_and_compiled_computes_the_eager_step(target):
    draft = LookupOrDraft(FeatureDraft(feature_head(target.model)), min_match=2, draft_gamma=None)
    check_captured_step(target, draft, PROMPTS, dict(gamma=3))  # a warm-up gives back the head's extents too


class _HostDraft:
    """A draft with no static form (what a dial draft is)."""

    vocab_size, device = VOCAB, torch.device("cpu")


def test_prompt_lookup_alone_in_the_captured_steps_is_the_growing_lookup(target):
    """``NGramDraft``'s static form: a re-feed and two drafting calls give its logits slot by slot (exactly: the same
    counts), greedy chains the target's tokens with the growing loop's accepted counts (but the last block), T = 1
    the target's law."""
    ids, mask = encode_prompts(PROMPTS)
    growing = NGramDraft(VOCAB)
    want = [growing.prefill(ids, mask)] + [growing.score(t)[:, 0] for t in (torch.tensor([[2], [4]]),
                                                                            torch.tensor([[30], [8]]))]
    static = growing.static_form()
    static.allocate(2, 64)
    static.prefill(ids, mask, leave=1)
    got = [static.forward(ids[:, -1:])[0][:, 0]]
    static.commit(torch.ones(2, dtype=torch.long))
    got += [static.forward(t, offset=i)[0][:, 0] for i, t in enumerate((torch.tensor([[2], [4]]),
                                                                        torch.tensor([[30], [8]])))]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)
    prompts = [[5, 9, 2, 5, 9, 2, 5, 9], [4, 8, 4, 8, 16]]
    out = speculative_generate(target, NGramDraft(VOCAB), prompts, gamma=3, max_new_tokens=24, sampling=GREEDY,
                               compile="static")
    grown = speculative_generate(target, NGramDraft(VOCAB), prompts, gamma=3, max_new_tokens=24, sampling=GREEDY)
    assert out.tokens == grown.tokens == autoregressive_generate(target, prompts, max_new_tokens=24,
                                                                 sampling=GREEDY).tokens
    assert [s.num_accepted for s in out.steps][:-1] == [s.num_accepted for s in grown.steps][: len(out.steps) - 1]
    result = lossless_test(target, NGramDraft(VOCAB), "block", [5, 9, 5, 9], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=0, batch_size=3_000, compile="static")
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def test_a_length_plan_and_a_draft_without_a_static_form_are_refused(target):
    head = FeatureDraft(feature_head(target.model))
    chains = LookupOrDraft(head, draft_gamma=None)
    assert static_available(target, chains, gamma=4) is None
    assert static_available(target, chains, verifier="traversal", num_drafts=2, gamma=2) is None
    planned = LookupOrDraft(head, draft_gamma=1)
    assert static_available(target, planned, gamma=1) is None  # one token a step: the plan changes nothing
    assert "plans each step's length on the host" in static_available(target, planned, gamma=4)
    with pytest.raises(ValueError, match="plans each step's length"):
        speculative_generate(target, planned, PROMPTS, gamma=4, max_new_tokens=4, sampling=GREEDY, compile="static")
    assert "which has no static form" in static_available(target, LookupOrDraft(_HostDraft()), gamma=1)
    assert static_available(target, NGramDraft(VOCAB), verifier="traversal", num_drafts=2, gamma=2) is None
    out = speculative_generate(target, planned, PROMPTS, gamma=4, max_new_tokens=8, sampling=GREEDY)  # auto: the loop
    assert out.tokens == autoregressive_generate(target, PROMPTS, max_new_tokens=8, sampling=GREEDY).tokens
