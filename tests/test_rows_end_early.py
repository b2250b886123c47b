"""Rows that end early leave the batch: no model is fed past a row's end, the context bound prompt + max_new_tokens +
gamma holds for every row, each row's output is the one it gives alone, and a model with absolute position
embeddings runs a batch whose rows end at different steps."""

import pytest
import torch
from helpers import feature_head

from specresearch.config import SamplingConfig
from specresearch.drafts.combined import LookupOrDraft
from specresearch.drafts.dial import DialDraft
from specresearch.drafts.feature import FeatureDraft
from specresearch.drafts.ngram import NGramDraft
from specresearch.drafts.registry import truncated_draft
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.models.causal_lm import CausalLM
from specresearch.models.toy import ToyLM, tiny_llama

VOCAB = 48
GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 33, 7, 5, 9], [4, 8], [16, 23, 42, 3]]


class _Counting(ToyLM):
    """A Markov table that records the most valid slots any row's context reached and the batch sizes it saw."""

    def __init__(self, table):
        super().__init__(table)
        self.longest, self.batch_sizes = 0, []

    def score(self, tokens, valid=None):
        logits = super().score(tokens, valid)
        self.longest = max(self.longest, int(self._slots.counts().max()))
        self.batch_sizes.append(tokens.shape[0])
        return logits


def _table(successor: dict[int, int]) -> torch.Tensor:
    """Greedy Markov logits: token x is followed by ``successor[x]`` (else by x + 1)."""
    table = torch.zeros(VOCAB, VOCAB)
    for x in range(VOCAB):
        table[x, successor.get(x, min(x + 1, VOCAB - 1))] = 10.0
    return table


def test_a_row_that_ended_is_no_longer_fed_and_the_context_bound_holds():
    """Row 0 accepts every draft and reaches EOS (token 1) after 4 tokens; row 1's draft is always rejected, so it
    needs 20 steps. Riding along, row 0 would be fed 5 tokens a step to ~100 positions; the bound is 2 + 20 + 4."""
    cycle = {10: 11, 11: 12, 12: 1, 1: 10}  # row 0: 10 -> 11 -> 12 -> EOS -> 10 ...
    target, draft = _Counting(_table(cycle)), _Counting(_table({**cycle, **{x: min(x + 2, VOCAB - 1) for x in range(20, 46)}}))
    out = speculative_generate(target, draft, [[9, 10], [3, 20]], gamma=4, max_new_tokens=20, sampling=GREEDY,
                               eos_token_id=1)
    assert out.tokens == ((11, 12, 1), tuple(range(21, 41)))
    assert len(out.steps) == 20 and out.steps[1].active == (False, True)
    bound = 2 + 20 + 4
    assert target.longest <= bound and draft.longest <= bound, (target.longest, draft.longest)
    assert target.batch_sizes[0] == 2 and set(target.batch_sizes[1:]) == {1}  # row 0 left after the first step
    assert [s.num_accepted for s in out.steps[:2]] == [(4, 0), (0, 0)]  # records stay one entry per prompt


def _drafts(target):
    """Every draft kind the engine drives, fresh (no state shared between runs)."""
    head = feature_head(target.model, seed=2, scale=0.1)
    return {
        "truncated": lambda: truncated_draft(target, 1),
        "ngram": lambda: NGramDraft(VOCAB, max_ngram=2),
        "feature": lambda: FeatureDraft(head),
        "lookup+feature": lambda: LookupOrDraft(FeatureDraft(head), min_match=1),
        "dial": lambda: DialDraft(CausalLM(target.model, device="cpu"), "uniform", 0.7),
    }


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=3)


KINDS = ["truncated", "ngram", "feature", "lookup+feature", "dial"]
TREE_KINDS = KINDS  # every draft kind draws trees


@pytest.mark.parametrize("kind, tree", [(k, False) for k in KINDS] + [(k, True) for k in TREE_KINDS])
def test_rows_ending_at_different_steps_give_what_each_gives_alone(target, kind, tree):
    """Greedy with an EOS that ends rows at different steps, and sampled with per-row seeds: batched == alone."""
    make = _drafts(target)[kind]
    options = dict(verifier="traversal", num_drafts=2) if tree else dict(verifier="block")
    greedy = autoregressive_generate(target, PROMPTS, max_new_tokens=16, sampling=GREEDY)
    eos = greedy.tokens[1][2]  # row 1 ends after 3 tokens; the others run on (or end elsewhere)
    batched = speculative_generate(target, make(), PROMPTS, gamma=3, max_new_tokens=16, sampling=GREEDY,
                                   eos_token_id=eos, **options)
    lengths = {len(row) for row in batched.tokens}
    assert len(lengths) > 1 and len(batched.tokens[1]) == 3  # rows did end at different steps
    sampling = SamplingConfig(temperature=1.0)
    seeds = [11, 12, 13]
    sampled = speculative_generate(target, make(), PROMPTS, gamma=3, max_new_tokens=16, sampling=sampling,
                                   seed=seeds, eos_token_id=eos, **options)
    for b, prompt in enumerate(PROMPTS):
        alone = speculative_generate(target, make(), [prompt], gamma=3, max_new_tokens=16, sampling=GREEDY,
                                     eos_token_id=eos, **options)
        assert batched.tokens[b] == alone.tokens[0] == greedy.tokens[b][: len(alone.tokens[0])]
        alone = speculative_generate(target, make(), [prompt], gamma=3, max_new_tokens=16, sampling=sampling,
                                     seed=[seeds[b]], eos_token_id=eos, **options)
        assert sampled.tokens[b] == alone.tokens[0], b


def test_absolute_position_embeddings_with_rows_ending_early():
    """GPT-2 embeds positions from a table of n_positions rows: a row fed past its end would index out of range.
    n_positions is exactly the bound of the longest prompt (5 + 20 + 4)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    def gpt2(seed):
        config = GPT2Config(vocab_size=VOCAB, n_positions=29, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                            eos_token_id=1, initializer_range=0.6)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return CausalLM(AutoModelForCausalLM.from_config(config), device="cpu")

    target, draft = gpt2(0), gpt2(1)
    prompts = [[5, 9, 2, 33, 7], [4, 8], [16, 23, 42, 3]]
    reference = autoregressive_generate(target, prompts, max_new_tokens=20, sampling=GREEDY)
    eos = reference.tokens[0][2]
    out = speculative_generate(target, draft, prompts, gamma=4, max_new_tokens=20, sampling=GREEDY, eos_token_id=eos)
    assert len(out.tokens[0]) == 3 and max(len(r) for r in out.tokens) == 20
    for row, full in zip(out.tokens, reference.tokens):
        assert row == full[: len(row)] and (len(row) == 20 or row[-1] == eos)
    sampled = speculative_generate(target, draft, prompts, gamma=4, max_new_tokens=20, seed=[1, 2, 3], eos_token_id=eos,
                                   sampling=SamplingConfig(temperature=1.0))
    assert all(len(r) <= 20 for r in sampled.tokens)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("keep", [[2, 1], [1]])
def test_select_rows_then_score_equals_the_rows_scored_alone(target, kind, keep):
    """Every draft kind: row 1 drops 5 of 6 slots (dead slots; selected alone they are packed away), then after
    ``select_rows(keep)`` the rows kept score as they do alone."""
    make = _drafts(target)[kind]
    ids = torch.tensor([[0, 0, 5, 9, 2], [4, 8, 3, 3, 1], [0, 16, 23, 42, 3]])
    mask = (torch.arange(5)[None] >= torch.tensor([[2], [0], [1]])).long()
    block = torch.tensor([[7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24]])
    drop = torch.tensor([0, 5, 0])

    def start(rows):
        model = make()
        reading = hasattr(model, "feature_layers")
        feed = (lambda k: model.observe(torch.zeros(len(rows), k, model.feature_size))) if reading else (lambda k: None)
        if reading:
            model.observe(target.prefill(ids[rows], mask[rows], hidden_layers=model.feature_layers)[1])
        model.prefill(ids[rows], mask[rows])
        feed(6)
        model.score(block[rows])
        model.rollback(drop[rows])
        return model, feed

    model, feed = start([0, 1, 2])
    model.select_rows(torch.tensor(keep))
    feed_kept = (lambda: model.observe(torch.zeros(len(keep), 1, model.feature_size))) if hasattr(model, "feature_layers") else (lambda: None)
    feed_kept()
    batched = model.score(torch.full((len(keep), 1), 6))
    for i, b in enumerate(keep):
        alone, feed = start([b])
        feed(1)
        torch.testing.assert_close(batched[i], alone.score(torch.tensor([[6]]))[0], atol=1e-4, rtol=0)
