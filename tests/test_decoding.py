"""Tests for specresearch.engine.decoding: beam search vs brute force, sampling frequencies vs logits_to_probs and
the exact twins, temperature -> greedy, contrastive decoding by hand, n-gram blocking, validation.

Statistical tests: each chi-square test uses the (1 - 1e-8) quantile of its chi-square law as threshold,
so a correct sampler fails a given check with probability 1e-8; there are fewer than 30 such checks in
this file, so a correct implementation fails the file with probability < 1e-6. Seeds are fixed.
"""

import itertools
import math
import random

import pytest
import torch
from scipy.stats import chi2

from specresearch import exact
from specresearch.config import SamplingConfig
from specresearch.core.sampling import logits_to_probs
from specresearch.engine.decoding import (
    DECODING_PRESETS,
    DecodingConfig,
    beam_search,
    block_repeated_ngrams,
    contrastive,
    contrastive_scores,
    decode,
    greedy,
    lm_logits_fn,
    sample,
    sequence_log_probs,
    truncated_context,
)
from specresearch.exact.sampling import transformed_model

FALSE_POSITIVE = 1e-8  # per chi-square check (see module docstring)


def markov2(vocab_size=4, seed=0, scale=2.0):
    """An order-2 Markov toy model: logits depend on the last two tokens. Returns a logits_fn."""
    table = torch.randn(vocab_size, vocab_size, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale

    def logits_fn(ids, mask):
        return table[ids[:, -2], ids[:, -1]]

    return logits_fn


def table_fn(table):
    """Order-1 Markov (table [V, V]) or i.i.d. (table [V]) logits_fn."""
    if table.ndim == 1:
        return lambda ids, mask: table.expand(ids.shape[0], -1)
    return lambda ids, mask: table[ids[:, -1]]


def brute_force(logits_fn, prompt, vocab_size, length, eos=None, alpha=0.0):
    """Every hypothesis (stopping at EOS or at `length`) with its log P and normalised score, best first."""
    out = []
    for seq in itertools.product(range(vocab_size), repeat=length):
        if eos is not None and eos in seq[:-1]:
            seq = seq[: seq.index(eos) + 1]
        ids = torch.tensor([prompt])
        logp = sequence_log_probs(logits_fn, ids, torch.tensor([seq])).sum().item()
        out.append((logp / len(seq) ** alpha, logp, tuple(seq)))
    out = sorted(set(out), key=lambda item: -item[0])
    return out


# --- beam search ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_beams", [16, 64])
def test_beam_search_is_exact_when_nothing_is_pruned(num_beams):
    """V = 4, length 3: with width >= V^2 every prefix survives, so the beam is the exact top list."""
    fn, prompt = markov2(seed=1), [0, 1]
    want = brute_force(fn, prompt, 4, 3)[:num_beams]
    got = beam_search(fn, torch.tensor([prompt]), num_beams, 3)
    assert [tuple(s[2:].tolist()) for s in got.sequences] == [w[2] for w in want]
    torch.testing.assert_close(got.log_probs, torch.tensor([w[1] for w in want], dtype=torch.float64))
    assert got.sequences.shape == (num_beams, 5) and (got.num_generated == 3).all()


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_with_eos_and_length_penalty_matches_brute_force(alpha):
    fn, prompt, eos = markov2(seed=2, scale=1.5), [2, 0], 3
    want = brute_force(fn, prompt, 4, 3, eos=eos, alpha=alpha)[:16]
    got = beam_search(fn, torch.tensor([prompt]), 16, 3, eos_token_id=eos, pad_token_id=eos, length_penalty=alpha)
    got_seqs = [tuple(s[2 : 2 + n].tolist()) for s, n in zip(got.sequences, got.num_generated.tolist())]
    assert got_seqs == [w[2] for w in want]
    torch.testing.assert_close(got.scores, torch.tensor([w[0] for w in want], dtype=torch.float64))
    assert any(len(s) < 3 for s in got_seqs)  # EOS hypotheses were found, padded with pad_token_id
    short = got.num_generated < 3
    assert (got.sequences[short, -1] == eos).all()


def test_beam_width_one_is_greedy_and_wider_beam_can_beat_greedy():
    # token 0 -> (1 likely, 2 less likely); after 1 everything is flat, after 2 a sure continuation
    p = torch.tensor([[0.1, 0.5, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0], [0.25] * 4])
    fn = table_fn(p.log())
    prompt = torch.tensor([[0]])
    g = greedy(fn, prompt, 2)
    b1 = beam_search(fn, prompt, 1, 2)
    assert torch.equal(b1.sequences, g.sequences)
    b2 = beam_search(fn, prompt, 2, 2)
    assert b2.sequences[0].tolist() == [0, 2, 3]
    assert math.isclose(b2.log_probs[0].item(), math.log(0.4), rel_tol=1e-6) and b2.log_probs[0] > g.log_probs[0]


def test_beam_search_early_stop_keeps_the_best():
    """A model that says EOS with prob 0.9 everywhere: the best hypothesis is [EOS] and the search stops."""
    table = torch.tensor([0.05, 0.05, 0.9]).log()
    got = beam_search(table_fn(table), torch.tensor([[0]]), 2, 50, eos_token_id=2)
    assert got.sequences[0, 1:].tolist()[:1] == [2] and got.num_generated[0] == 1
    assert got.num_generated.max() <= 2  # stopped long before 50


# --- sampling ------------------------------------------------------------------------------------


def chi_square_ok(counts, probs):
    """Pearson chi-square of counts against probs (tokens of prob 0 must have count 0)."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    assert (counts[probs == 0] == 0).all(), "a zero-probability token was sampled"
    support = probs > 0
    if support.sum() <= 1:
        return True
    expected = n * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat < chi2.isf(FALSE_POSITIVE, int(support.sum()) - 1)


SAMPLING_CONFIGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.5),
    SamplingConfig(temperature=1.5),
    SamplingConfig(top_k=3),
    SamplingConfig(top_p=0.7),
    SamplingConfig(epsilon=0.08),
    SamplingConfig(temperature=0.7, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("config", SAMPLING_CONFIGS, ids=str)
def test_sampling_frequencies_match_logits_to_probs(config):
    logits = torch.randn(8, generator=torch.Generator().manual_seed(5))
    n = 20000
    out = sample(table_fn(logits), torch.zeros(n, 1, dtype=torch.long), config, 1,
                 generator=torch.Generator().manual_seed(6))
    counts = torch.bincount(out.sequences[:, 1], minlength=8)
    assert chi_square_ok(counts, logits_to_probs(logits, config))


@pytest.mark.parametrize("config", [SamplingConfig(), SamplingConfig(top_p=0.55, temperature=0.5),
                                    SamplingConfig(top_k=2), SamplingConfig(epsilon=0.15)], ids=str)
def test_two_step_sampling_matches_the_exact_twin(config):
    """Sequences of 2 tokens from a Markov model vs the exact law of the transformed model (exact_sampling)."""
    model = exact.random_rational_model(4, random.Random(11), depth=1, zero_prob=0.2)
    table = torch.tensor([[float(x) for x in model((t,))] for t in range(4)], dtype=torch.float64).log()
    n = 20000
    out = sample(table_fn(table), torch.zeros(n, 1, dtype=torch.long), config, 2,
                 generator=torch.Generator().manual_seed(12))
    law = exact.target_distribution(transformed_model(model, config), 2, prefix=(0,))
    pairs = list(itertools.product(range(4), repeat=2))
    probs = torch.tensor([float(law.get(pair, 0)) for pair in pairs])
    codes = out.sequences[:, 1] * 4 + out.sequences[:, 2]
    assert chi_square_ok(torch.bincount(codes, minlength=16), probs)


def test_sampling_is_reproducible_from_the_generator():
    fn = markov2(6, seed=3, scale=0.5)
    prompt = torch.tensor([[0, 1], [2, 3]])
    a = sample(fn, prompt, SamplingConfig(), 10, generator=torch.Generator().manual_seed(0))
    b = sample(fn, prompt, SamplingConfig(), 10, generator=torch.Generator().manual_seed(0))
    c = sample(fn, prompt, SamplingConfig(), 10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.sequences, b.sequences) and not torch.equal(a.sequences, c.sequences)


def test_log_probs_are_the_model_log_likelihood():
    fn = markov2(5, seed=4)
    prompt = torch.tensor([[0, 1], [1, 2], [3, 3]])
    out = sample(fn, prompt, SamplingConfig(top_k=2), 6, generator=torch.Generator().manual_seed(0))
    want = sequence_log_probs(fn, prompt, out.sequences[:, 2:]).sum(-1)
    torch.testing.assert_close(out.log_probs, want)
    torch.testing.assert_close(out.scores, out.log_probs)


def test_eos_stops_a_row_and_pads():
    # after token 1 the model says EOS (= 2) surely; token 0 never leads to EOS
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]])
    out = sample(table_fn(p.log()), torch.tensor([[0], [0]]), SamplingConfig(), 30,
                 generator=torch.Generator().manual_seed(0), eos_token_id=2, pad_token_id=7)
    for row, n in zip(out.sequences.tolist(), out.num_generated.tolist()):
        generated = row[1 : 1 + n]
        assert 2 not in generated[:-1]
        if n < 30:
            assert generated[-1] == 2 and all(t == 7 for t in row[1 + n :])


def test_methods_run_in_the_engines_loop_where_finished_rows_leave():
    # token 1 is followed by EOS (= 2) surely, token 0 by token 0 or 1: rows end at different steps
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]])
    batches = []

    def fn(ids, mask):
        batches.append(ids.shape[0])
        return p.log()[ids[:, -1]]

    prompt = torch.tensor([[9, 0], [9, 0], [9, 0], [0, 0]])  # left-padded: row 3 has two prompt tokens
    mask = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 1]])
    out = sample(fn, prompt, SamplingConfig(), 12, generator=torch.Generator().manual_seed(3), attention_mask=mask,
                 eos_token_id=2, pad_token_id=7)
    assert batches[0] == 4 and min(batches) < 4 and batches == sorted(batches, reverse=True)
    ended = out.num_generated < 12
    assert ended.any()
    for row, n in zip(out.sequences.tolist(), out.num_generated.tolist()):
        assert row[2 + n - 1] == 2 or n == 12
    # the log-likelihood of each row's tokens up to its end, the EOS included
    for b in range(4):
        n = int(out.num_generated[b])
        logits_fn = lambda ids, m: p.log()[ids[:, -1]]  # noqa: E731
        want = sequence_log_probs(logits_fn, prompt[b : b + 1], out.sequences[b : b + 1, 2 : 2 + n])
        torch.testing.assert_close(out.log_probs[b], want.sum())


def test_greedy_and_contrastive_draw_nothing_from_the_global_rng():
    fn = markov2(5, seed=2)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    greedy(fn, torch.tensor([[0, 1]]), 4)
    contrastive(fn, markov2(5, seed=3), torch.tensor([[0, 1]]), 4)
    assert torch.equal(torch.get_rng_state(), state)
    sample(fn, torch.tensor([[0, 1]]), SamplingConfig(), 4)  # sampling without a generator does draw its seed
    assert not torch.equal(torch.get_rng_state(), state)


def test_bad_logits_at_a_later_step_are_refused():
    def fn(ids, mask):  # fine for the prompt, NaN once two tokens were generated
        out = torch.zeros(ids.shape[0], 4)
        out[:, 0] = float("nan") if ids.shape[1] > 3 else 0.0
        return out

    with pytest.raises(ValueError, match="contains NaN"):
        sample(fn, torch.tensor([[1, 2]]), SamplingConfig(), 5, generator=torch.Generator().manual_seed(0))


def test_a_right_padded_prompt_is_refused():
    with pytest.raises(ValueError, match="left-padded"):
        sample(markov2(4), torch.tensor([[1, 2, 0]]), SamplingConfig(), 2, attention_mask=torch.tensor([[1, 1, 0]]))


# --- temperature -> greedy -----------------------------------------------------------------------


def test_temperature_zero_is_exactly_greedy_and_small_temperature_agrees():
    fn = markov2(6, seed=7, scale=3.0)
    prompt = torch.tensor([[0, 1], [4, 2], [5, 5]])
    g = greedy(fn, prompt, 12)
    t0 = sample(fn, prompt, SamplingConfig(temperature=0.0), 12)
    assert torch.equal(g.sequences, t0.sequences)
    assert torch.equal(decode(fn, prompt, DecodingConfig.from_name("greedy", max_new_tokens=12)).sequences, g.sequences)
    # every gap between best and second-best logit in the table is > 0.02 here, so at T = 1e-3 a step
    # deviates from the argmax with probability < 5 exp(-20) ~ 1e-8: about 1e-7 over the 36 steps
    table = torch.randn(6, 6, 6, generator=torch.Generator().manual_seed(7)) * 3.0
    top2 = table.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 0.02
    cold = sample(fn, prompt, SamplingConfig(temperature=1e-3), 12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cold.sequences, g.sequences)


def test_greedy_takes_the_first_maximum():
    fn = table_fn(torch.tensor([1.0, 3.0, 3.0]))
    assert greedy(fn, torch.tensor([[0]]), 2).sequences.tolist() == [[0, 1, 1]]


# --- contrastive decoding ------------------------------------------------------------------------


def test_contrastive_scores_by_hand():
    expert = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    amateur = torch.tensor([0.6, 0.2, 0.19, 0.01]).log()
    # alpha = 0.25: head = {p >= 0.125} = {0, 1, 2}; ratios 0.5/0.6, 0.3/0.2, 0.15/0.19 -> token 1
    scores = contrastive_scores(expert, amateur, 0.25)
    want = torch.tensor([math.log(0.5 / 0.6), math.log(1.5), math.log(0.15 / 0.19), -math.inf], dtype=torch.float64)
    torch.testing.assert_close(scores, want, rtol=1e-6, atol=1e-6)
    assert scores.argmax() == 1
    # alpha = 0.05: token 3 (0.05 >= 0.025) joins the head and its ratio 5 wins
    assert contrastive_scores(expert, amateur, 0.05).argmax() == 3
    # alpha = 1: only the expert's argmax is plausible -> greedy
    assert torch.isfinite(contrastive_scores(expert, amateur, 1.0)).tolist() == [True, False, False, False]


def test_contrastive_decoding_follows_the_formula_each_step():
    expert = torch.tensor([[0.1, 0.6, 0.3], [0.45, 0.1, 0.45], [0.5, 0.4, 0.1]])
    amateur = torch.tensor([[0.1, 0.8, 0.1], [0.3, 0.1, 0.6], [0.2, 0.6, 0.2]])
    out = contrastive(table_fn(expert.log()), table_fn(amateur.log()), torch.tensor([[0]]), 3, alpha=0.45)
    # after 0: head {p >= 0.27} = {1 (0.6), 2 (0.3)}; 0.6/0.8 < 0.3/0.1 -> 2
    # after 2: head {p >= 0.225} = {0 (0.5), 1 (0.4)}; 0.5/0.2 > 0.4/0.6 -> 0 ; after 0 again -> 2
    assert out.sequences.tolist() == [[0, 2, 0, 2]]
    torch.testing.assert_close(out.log_probs, torch.tensor([math.log(0.3 * 0.5 * 0.3)], dtype=torch.float64))
    config = DecodingConfig(method="contrastive", contrastive_alpha=0.45, max_new_tokens=3)
    same = decode(table_fn(expert.log()), torch.tensor([[0]]), config, amateur_fn=table_fn(amateur.log()))
    assert torch.equal(same.sequences, out.sequences)


def test_contrastive_decoding_takes_a_plausible_token_the_amateur_rules_out():
    # after 0 the amateur gives tokens 1 and 2 probability 0: both score +inf, the first of them (1) is taken
    expert = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    amateur = torch.tensor([[1.0, 0.0, 0.0], [0.1, 0.45, 0.45], [1 / 3, 1 / 3, 1 / 3]])
    out = contrastive(table_fn(expert.log()), table_fn(amateur.log()), torch.tensor([[0], [0]]), 2, alpha=0.5)
    # after 1: head {p >= 0.3} = {0}; -> 0
    assert out.sequences.tolist() == [[0, 1, 0]] * 2


def test_contrastive_with_identical_models_is_argmax_of_head_ties():
    # expert == amateur: every plausible score is 0, argmax takes the first plausible token
    e = torch.tensor([0.2, 0.5, 0.3]).log()
    assert contrastive_scores(e, e, 0.5).argmax() == 1  # head {1, 2}; tie at 0 -> first plausible id


# --- n-gram blocking -----------------------------------------------------------------------------


def repeated_ngrams(seq, n):
    grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
    return len(grams) - len(set(grams))


def test_greedy_repeats_and_ngram_blocking_removes_it():
    # a cycle 0 -> 1 -> 2 -> 0 that is very likely, other tokens possible
    table = torch.full((8, 8), -4.0)
    for t in range(8):
        table[t, (t + 1) % 3] = 4.0
    fn = table_fn(table)
    plain = greedy(fn, torch.tensor([[0]]), 12).sequences[0].tolist()
    assert repeated_ngrams(plain, 3) > 0
    for n in (2, 3, 4):
        blocked = greedy(fn, torch.tensor([[0]]), 12, no_repeat_ngram_size=n).sequences[0].tolist()
        assert repeated_ngrams(blocked, n) == 0, (n, blocked)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ngram_blocking_never_repeats_with_sampling_and_beam(n):
    # 2 prompt + 14 new tokens <= V = 16: no (n-1)-gram can occur V + 1 times, so no row gets stuck;
    # the prompts themselves repeat no n-gram
    fn = markov2(16, seed=9, scale=1.0)
    prompt = torch.tensor([[0, 1], [3, 4], [5, 0]])
    out = sample(fn, prompt, SamplingConfig(), 14, generator=torch.Generator().manual_seed(n), no_repeat_ngram_size=n)
    for row in out.sequences.tolist():
        assert repeated_ngrams(row, n) == 0
    beams = beam_search(fn, prompt[:1], 3, 14, no_repeat_ngram_size=n)
    for row in beams.sequences.tolist():
        assert repeated_ngrams(row, n) == 0


def test_ngram_blocking_bans_exactly_the_completions():
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    out = block_repeated_ngrams(ids, torch.zeros(1, 5), 3)
    assert torch.isinf(out).nonzero()[:, 1].tolist() == [3]  # "1 2 3" seen: after "1 2" ban 3
    with pytest.raises(ValueError, match="no_repeat_ngram_size=1"):
        block_repeated_ngrams(torch.tensor([[0, 1]]), torch.zeros(1, 2), 1)


# --- adapters, presets, validation ---------------------------------------------------------------


def test_lm_logits_fn_with_toy_and_tiny_llama():
    from specresearch.models.toy import ToyLM, tiny_llama

    table = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    prompt = torch.tensor([[0, 3], [1, 1]])
    via_toy = greedy(lm_logits_fn(ToyLM(table)), prompt, 6)
    assert torch.equal(via_toy.sequences, greedy(table_fn(table), prompt, 6).sequences)

    lm = tiny_llama(32, seed=0, init_std=0.5)
    uncached = lambda ids, mask: lm.prefill(ids, mask)  # noqa: E731
    prompt = torch.tensor([[2, 5, 7]])
    a = sample(lm_logits_fn(lm), prompt, SamplingConfig(top_k=8), 8, generator=torch.Generator().manual_seed(0))
    b = sample(uncached, prompt, SamplingConfig(top_k=8), 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-4, rtol=0)


def test_a_cached_logits_function_follows_the_rows_that_stay():
    """Rows that end leave the engine's batch; ``lm_logits_fn``'s cache keeps the others instead of prefilling again,
    and the tokens equal an uncached run's."""
    from specresearch.models.toy import ToyLM

    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]])  # after token 1 comes EOS (= 2)

    class Counting(ToyLM):
        prefills = 0

        def prefill(self, input_ids, attention_mask):
            Counting.prefills += 1
            return super().prefill(input_ids, attention_mask)

    prompt = torch.tensor([[0], [1], [2], [0]])  # the row after token 1 ends at once
    for method in ("sample", "contrastive"):
        Counting.prefills = 0
        expert, amateur = lm_logits_fn(Counting(p.log())), lm_logits_fn(Counting((0.5 * p + 0.5 / 3).log()))
        if method == "sample":
            out = sample(expert, prompt, SamplingConfig(), 12, generator=torch.Generator().manual_seed(1),
                         eos_token_id=2)
            want = sample(table_fn(p.log()), prompt, SamplingConfig(), 12, generator=torch.Generator().manual_seed(1),
                          eos_token_id=2)
        else:
            out = contrastive(expert, amateur, prompt, 12, alpha=0.1, eos_token_id=2)
            want = contrastive(table_fn(p.log()), table_fn((0.5 * p + 0.5 / 3).log()), prompt, 12, alpha=0.1,
                               eos_token_id=2)
        assert torch.equal(out.sequences, want.sequences)
        assert len(set(out.num_generated.tolist())) > 1  # rows ended at different steps
        assert Counting.prefills == (1 if method == "sample" else 2), (method, Counting.prefills)


def test_truncated_context_sees_only_the_window():
    seen = []
    short = truncated_context(lambda ids, mask: seen.append(ids.shape[1]) or torch.zeros(ids.shape[0], 3), 2)
    short(torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5))
    assert seen == [2]


def test_presets_all_run():
    fn, amateur = markov2(6, seed=10), truncated_context(markov2(6, seed=11), 2)
    prompt = torch.tensor([[0, 1]])
    for name in DECODING_PRESETS:
        out = decode(fn, prompt, DecodingConfig.from_name(name, max_new_tokens=4), amateur_fn=amateur,
                     generator=torch.Generator().manual_seed(0))
        assert out.sequences.shape[1] == 6 and out.sequences.shape[0] in (1, 4)
        assert out.scores.shape == out.log_probs.shape == (out.sequences.shape[0],)


def test_decode_beam_loops_over_prompts():
    fn = markov2(4, seed=1)
    out = decode(fn, torch.tensor([[0, 1], [2, 3]]), DecodingConfig(method="beam", num_beams=3, max_new_tokens=3))
    assert out.sequences.shape == (6, 5)
    first = beam_search(fn, torch.tensor([[0, 1]]), 3, 3)
    assert torch.equal(out.sequences[:3], first.sequences)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"method": "nucleus"}, "method"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"num_beams": 0}, "num_beams"),
        ({"length_penalty": -1.0}, "length_penalty"),
        ({"no_repeat_ngram_size": 0}, "no_repeat_ngram_size"),
        ({"contrastive_alpha": 0.0}, "contrastive_alpha"),
        ({"contrastive_alpha": 1.5}, "contrastive_alpha"),
        ({"sampling": {"top_p": 0.9}}, "sampling"),
    ],
)
def test_decoding_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DecodingConfig(**kwargs)


def test_decode_argument_errors():
    fn = markov2(4)
    with pytest.raises(ValueError, match="amateur_fn"):
        decode(fn, torch.tensor([[0, 1]]), DecodingConfig(method="contrastive"))
    with pytest.raises(ValueError, match="input_ids"):
        decode(fn, torch.tensor([[0.0, 1.0]]), DecodingConfig())
    with pytest.raises(ValueError, match="input_ids"):
        decode(fn, torch.tensor([0, 1]), DecodingConfig())
    with pytest.raises(ValueError, match="one prompt"):
        beam_search(fn, torch.tensor([[0, 1], [1, 2]]), 2, 2)
    with pytest.raises(ValueError, match="name"):
        DecodingConfig.from_name("nope")
    with pytest.raises(ValueError, match="same shape"):
        contrastive_scores(torch.zeros(3), torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="NaN"):
        greedy(lambda ids, mask: torch.full((1, 3), float("nan")), torch.tensor([[0]]), 1)


def test_repeated_ngrams_and_phrase_repetition():
    from specresearch.engine.decoding import (
        phrase_repetition_log_probs,
        repeated_ngrams,
    )

    assert repeated_ngrams([1, 2, 3, 1, 2, 3, 1], 3) == 2 and repeated_ngrams([1, 2, 3], 1) == 0
    # order-2 model: after (a, b) the phrase's next token; check against sequence_log_probs by hand
    fn = markov2(5, seed=3)
    prefix, phrase = torch.tensor([[0, 1]]), torch.tensor([2, 3, 4])
    got = phrase_repetition_log_probs(fn, prefix, phrase, 3)
    full = sequence_log_probs(fn, prefix, phrase.repeat(3)[None])[0]
    torch.testing.assert_close(got, full.reshape(3, 3).sum(-1))
    # a Markov chain of order 2 sees the same context from the 2nd repetition on
    torch.testing.assert_close(got[1], got[2])


def test_cli_generate_accepts_every_decoding_method():
    from specresearch.cli import build_parser
    from specresearch.engine.decoding import METHODS

    for method in METHODS:
        args = build_parser().parse_args(["generate", "hi", "--method", method, "--num-beams", "2",
                                          "--no-repeat-ngram", "3", "--epsilon", "0.01"])
        assert args.method == method and args.num_beams == 2 and args.no_repeat_ngram == 3


def test_several_eos_ids_end_hypotheses_and_rows():
    """A chat turn may end at one of several ids (the tokenizer's EOS and the generation config's, as Gemma's
    ``<end_of_turn>``): beam search finishes a hypothesis at any of them (its list equals every hypothesis enumerated,
    best first), and sampling ends a row at any of them, padded after it."""
    fn, prompt, ends = markov2(seed=2, scale=1.5), [2, 0], (3, 1)
    hypotheses = set()
    for seq in itertools.product(range(4), repeat=3):
        cut = next((i for i, t in enumerate(seq[:-1]) if t in ends), None)
        seq = seq if cut is None else seq[: cut + 1]
        hypotheses.add((sequence_log_probs(fn, torch.tensor([prompt]), torch.tensor([seq])).sum().item(), seq))
    want = [seq for _, seq in sorted(hypotheses, key=lambda item: -item[0])[:16]]
    got = beam_search(fn, torch.tensor([prompt]), 16, 3, eos_token_id=list(ends))
    got_seqs = [tuple(s[2 : 2 + n].tolist()) for s, n in zip(got.sequences, got.num_generated.tolist())]
    assert got_seqs == want
    assert {s[-1] for s in got_seqs if len(s) < 3} == set(ends)  # hypotheses ended at each id
    p = torch.tensor([[0.5, 0.25, 0.25], [1 / 3] * 3, [1 / 3] * 3])  # from 0: go on, or end at 1 or at 2
    out = sample(table_fn(p.log()), torch.tensor([[0]] * 8), SamplingConfig(), 30,
                 generator=torch.Generator().manual_seed(0), eos_token_id=[1, 2], pad_token_id=7)
    last = set()
    for row, n in zip(out.sequences.tolist(), out.num_generated.tolist()):
        generated = row[1 : 1 + n]
        assert not {1, 2} & set(generated[:-1]) and n < 30 and all(t == 7 for t in row[1 + n :])
        last.add(generated[-1])
    assert last == {1, 2}
