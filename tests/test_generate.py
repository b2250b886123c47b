"""The generation engine on tiny models: lengths, EOS, greedy equality, seeds, q handed to the verifier,
end-to-end losslessness of the sampled output, bad inputs."""

import pytest
import torch
from scipy.stats import chi2

from specresearch.config import SamplingConfig
from specresearch.core.sampling import logits_to_probs
from specresearch.core.verify import token_verify
from specresearch.drafts.ngram import NGramDraft
from specresearch.drafts.registry import truncated_draft
from specresearch.engine import generate as gen
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_prompts
from specresearch.models.toy import ToyLM, tiny_llama

VOCAB = 48
GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 33, 7, 5, 9], [4, 8], [16, 23, 42, 3]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=3)


def _drafts(target):
    return {
        "truncated": truncated_draft(target, 1),
        "other_llama": tiny_llama(VOCAB, seed=1, init_std=0.6),
        "ngram": NGramDraft(VOCAB, max_ngram=2),
    }


@pytest.mark.parametrize("verifier", ["greedy", "token", "block"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculative_equals_greedy_autoregressive(target, verifier, batch):
    prompts = PROMPTS[:batch]
    reference = autoregressive_generate(target, prompts, max_new_tokens=24, sampling=GREEDY)
    for p, row in zip(prompts, reference.tokens):  # batching with left padding changes nothing
        assert autoregressive_generate(target, [p], max_new_tokens=24, sampling=GREEDY).tokens[0] == row
    ragged = False
    for name, draft in _drafts(target).items():
        out = speculative_generate(target, draft, prompts, verifier=verifier, gamma=3, max_new_tokens=24,
                                   sampling=GREEDY, seed=1)
        assert out.tokens == reference.tokens, name
        ragged |= any(len(set(s.num_accepted)) > 1 for s in out.steps)
    assert batch == 1 or ragged  # rows really did accept different numbers of drafts somewhere


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9, 13])
def test_exactly_max_new_tokens_even_when_the_last_block_overshoots(target, max_new_tokens):
    # a 3-of-3-layer truncation IS the target: every block is accepted and gamma + 1 = 5 tokens overshoot
    out = speculative_generate(target, truncated_draft(target, 3), PROMPTS, gamma=4, max_new_tokens=max_new_tokens,
                               seed=3)
    assert [len(r) for r in out.tokens] == [max_new_tokens] * 3


def _chain_table(vocab, successor):
    """Markov logits: token t goes to successor[t] with probability ~1 (logit 20 vs 0)."""
    table = torch.zeros(vocab, vocab)
    for t, s in successor.items():
        table[t, s] = 20.0
    return table


def test_eos_inside_an_accepted_block_ends_that_row_only():
    vocab, eos = 10, 1
    table = _chain_table(vocab, {2: 3, 3: 4, 4: eos, eos: 5, 5: 6, 6: 7, 7: 8, 8: 9, 9: 6, 0: 0})
    toy = ToyLM(table)
    out = speculative_generate(toy, ToyLM(table), [[2], [6]], verifier="block", gamma=4, max_new_tokens=7,
                               sampling=GREEDY, eos_token_id=eos)
    assert out.steps[0].num_accepted == (4, 4)  # the whole block [3, 4, EOS, 5] + bonus was accepted ...
    assert out.tokens == ((3, 4, eos), (7, 8, 9, 6, 7, 8, 9))  # ... but row 0 stops at EOS, row 1 goes on
    ar = autoregressive_generate(toy, [[2], [6]], max_new_tokens=7, sampling=GREEDY, eos_token_id=eos)
    assert ar.tokens == out.tokens


def test_same_seed_same_tokens_other_seed_other_tokens(target):
    def run(seed):
        return speculative_generate(target, truncated_draft(target, 1), PROMPTS, verifier="token", gamma=3,
                                    max_new_tokens=20, seed=seed).tokens

    assert run(7) == run(7)
    # 60 tokens from distributions far from one-hot: equal outputs across seeds are (far) below 1e-6 likely
    assert run(7) != run(8)


def test_draft_probs_handed_to_verifier_are_the_sampling_distribution(monkeypatch):
    vocab = 12
    g = torch.Generator().manual_seed(0)
    target_table, draft_table = torch.randn(vocab, vocab, generator=g), torch.randn(vocab, vocab, generator=g)
    sampling = SamplingConfig(temperature=0.7, top_k=4)
    calls = []

    def spy(target_probs, draft_probs, draft_tokens, generator=None, **kwargs):
        result = token_verify(target_probs, draft_probs, draft_tokens, generator, **kwargs)
        calls.append((target_probs, draft_probs, draft_tokens, result))
        return result

    monkeypatch.setitem(gen.VERIFIERS, "spy", spy)
    out = speculative_generate(ToyLM(target_table), ToyLM(draft_table), [[3], [4, 5]], verifier="spy", gamma=3,
                               max_new_tokens=30, sampling=sampling, seed=0)
    assert len(calls) == len(out.steps) > 1
    last = torch.tensor([[3], [5]])  # Markov tables: the distribution depends on the last token only
    for (target_probs, draft_probs, draft_tokens, result), step in zip(calls, out.steps):
        rows = torch.tensor(step.active).nonzero()[:, 0]  # a finished row has left the batch
        prev = torch.cat([last[rows], draft_tokens], 1)  # [B, gamma+1]
        torch.testing.assert_close(draft_probs, logits_to_probs(draft_table[prev[:, :-1]], sampling))
        torch.testing.assert_close(target_probs, logits_to_probs(target_table[prev], sampling))
        assert bool((draft_probs.gather(-1, draft_tokens[..., None]) > 0).all())  # drawn inside the top-k support
        last[rows] = result.next_token[:, None]


def _exact_law(lm, prompt, n_tokens, sampling):
    """Exact law of the first n_tokens of the sampling-transformed target, by enumeration. -> {seq: prob}."""
    law = {(): 1.0}
    for _ in range(n_tokens):
        longer = {}
        for seq, prob in law.items():
            with torch.no_grad():
                logits = lm.model(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1]
            probs = logits_to_probs(logits.double(), sampling).tolist()
            longer.update({seq + (t,): prob * p for t, p in enumerate(probs)})
        law = longer
    return law


def _chi_square(samples, law):
    """Pearson statistic and its 1e-6 critical value; cells expected < 5 times are pooled into one."""
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    big = [s for s, p in law.items() if p * n >= 5]
    observed = [counts.get(s, 0) for s in big] + [n - sum(counts.get(s, 0) for s in big)]
    expected = [law[s] * n for s in big] + [n * (1 - sum(law[s] for s in big))]
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, chi2.isf(1e-6, len(cells) - 1)


SMALL_V = 6


@pytest.fixture(scope="module")
def small_pair():
    return tiny_llama(SMALL_V, seed=2, init_std=0.8), tiny_llama(SMALL_V, seed=3, init_std=0.8)


@pytest.mark.parametrize(
    "verifier, sampling",
    [("token", SamplingConfig()), ("block", SamplingConfig()), ("block", SamplingConfig(temperature=0.8, top_k=4))],
)
def test_sampled_output_follows_the_target_law(small_pair, verifier, sampling):
    """End-to-end losslessness (Leviathan et al. Thm 1; Sun et al. Thm 1) through the whole engine, with
    3000 batch rows that accept different numbers of drafts (per-row rollback, masked slots).
    Pearson chi-square at the 1e-6 critical value: a correct engine fails with probability < 1e-6."""
    target, draft = small_pair
    prompt, rows = [1, 4, 2], 3000
    out = speculative_generate(target, draft, [prompt] * rows, verifier=verifier, gamma=2, max_new_tokens=3,
                               sampling=sampling, seed=11)
    stat, critical = _chi_square(list(out.tokens), _exact_law(target, prompt, 3, sampling))
    assert stat < critical


def test_the_law_test_has_power(small_pair, monkeypatch):
    """A verifier that accepts every draft (not lossless) must fail the same test."""
    target, draft = small_pair

    def accept_all(target_probs, draft_probs, draft_tokens, generator=None, **kwargs):
        b, gamma = draft_tokens.shape
        nxt = torch.multinomial(target_probs[:, -1], 1, generator=generator)[:, 0]
        return gen.VERIFIERS["greedy"](target_probs, draft_probs, draft_tokens, generator).__class__(
            torch.full((b,), gamma), nxt)

    monkeypatch.setitem(gen.VERIFIERS, "accept_all", accept_all)
    prompt = [1, 4, 2]
    out = speculative_generate(target, draft, [prompt] * 3000, verifier="accept_all", gamma=2, max_new_tokens=3,
                               seed=11)
    stat, critical = _chi_square(list(out.tokens), _exact_law(target, prompt, 3, SamplingConfig()))
    assert stat > critical


class _Planned:
    """Delegates to ``draft`` and plans each step's length from the past only (``models.protocols.PlansLength``):
    1 draft token in odd steps, 2 in even ones."""

    def __init__(self, draft, plan=None):
        self.draft, self.vocab_size, self.device = draft, draft.vocab_size, draft.device
        self.plan = plan or (lambda gamma: min(gamma, 1 + len(self.plans) % 2))
        self.plans = []

    def prefill(self, input_ids, attention_mask):
        return self.draft.prefill(input_ids, attention_mask)

    def reset(self, batch_size):
        self.draft.reset(batch_size)

    def score(self, tokens, valid=None):
        return self.draft.score(tokens, valid)

    def rollback(self, n):
        self.draft.rollback(n)

    def plan_length(self, gamma):
        self.plans.append(self.plan(gamma))
        return self.plans[-1]


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_a_draft_that_plans_its_length_stays_lossless(small_pair, verifier):
    """Step lengths chosen by the draft from the context (1 or 2 here) leave the output law the target's:
    same chi-square at the 1e-6 critical value as above (false-positive rate < 1e-6), 3000 rows."""
    target, draft = small_pair
    planned = _Planned(draft)
    prompt = [1, 4, 2]
    out = speculative_generate(target, planned, [prompt] * 3000, verifier=verifier, gamma=2, max_new_tokens=4, seed=11)
    assert [s.gamma for s in out.steps] == planned.plans and planned.plans[:2] == [1, 2]  # the first step shortened
    assert out.draft_calls == sum(planned.plans)
    stat, critical = _chi_square([row[:3] for row in out.tokens], _exact_law(target, prompt, 3, SamplingConfig()))
    assert stat < critical


def test_planned_lengths_keep_greedy_equality_and_per_row_seeds_follow_the_plan_for_one_row_only(target):
    reference = autoregressive_generate(target, PROMPTS, max_new_tokens=20, sampling=GREEDY)
    planned = _Planned(truncated_draft(target, 1))
    out = speculative_generate(target, planned, PROMPTS, gamma=3, max_new_tokens=20, sampling=GREEDY)
    assert out.tokens == reference.tokens and [s.gamma for s in out.steps] == planned.plans
    assert {1, 2} <= set(planned.plans)
    planned = _Planned(truncated_draft(target, 1))
    out = speculative_generate(target, planned, PROMPTS, gamma=3, max_new_tokens=20, seed=[1, 2, 3])
    assert planned.plans == [] and {s.gamma for s in out.steps} == {3}  # per-row seeds: batch-independent rows
    out = speculative_generate(target, planned, PROMPTS[:1], gamma=3, max_new_tokens=20, seed=[1])
    assert [s.gamma for s in out.steps] == planned.plans != []  # ... and a batch of one follows the plan
    for bad in (0, 4, 2.0):
        with pytest.raises(ValueError, match=r"plan_length\(3\) must return an integer in 1..3"):
            speculative_generate(target, _Planned(truncated_draft(target, 1), lambda gamma: bad), PROMPTS, gamma=3)


def test_result_statistics(target):
    out = speculative_generate(target, truncated_draft(target, 1), PROMPTS, verifier="token", gamma=3,
                               max_new_tokens=20, seed=0)
    active_steps = [(n, a) for s in out.steps for n, a in zip(s.num_accepted, s.active) if a]
    assert out.block_efficiency == pytest.approx(sum(n + 1 for n, _ in active_steps) / len(active_steps))
    assert 0 <= out.acceptance_rate <= 1
    assert out.target_calls == len(out.steps) and out.draft_calls == sum(s.gamma for s in out.steps)
    ar = autoregressive_generate(target, PROMPTS, max_new_tokens=20)
    assert ar.target_calls == 20 and ar.num_tokens == 60
    assert out.speedup_over(ar) == pytest.approx(out.tokens_per_second / ar.tokens_per_second)


def test_bad_inputs_raise_clear_errors(target):
    draft = NGramDraft(VOCAB)
    with pytest.raises(ValueError, match="must not be empty"):
        speculative_generate(target, draft, [[]])
    with pytest.raises(ValueError, match="at least one prompt"):
        speculative_generate(target, draft, [])
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens"):
            speculative_generate(target, draft, [[1, 2]], max_new_tokens=bad)
        with pytest.raises(ValueError, match="max_new_tokens"):
            autoregressive_generate(target, [[1, 2]], max_new_tokens=bad)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(target, draft, [[1, 2]], gamma=0)
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, NGramDraft(VOCAB + 1), [[1, 2]])
    with pytest.raises(ValueError, match="verifier"):
        speculative_generate(target, draft, [[1, 2]], verifier="typo")
    with pytest.raises(ValueError, match="tokenizer"):
        speculative_generate(target, draft, ["a string prompt"])


def test_encode_prompts_left_pads():
    ids, mask = encode_prompts([[1, 2, 3], [4]])
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert encode_prompts([7, 8])[0].tolist() == [[7, 8]]  # one prompt given as a flat list


def test_ngram_draft_distribution():
    from specresearch.drafts.ngram import ngram_probs

    q = ngram_probs(torch.tensor([5, 6, 7, 5, 6, 8, 5, 6]), 10, max_ngram=2, floor=0.1)
    # suffix (5, 6) was followed by 7 and by 8: each gets 0.9 / 2 + 0.1 / 10
    torch.testing.assert_close(q[[7, 8]], torch.tensor([0.46, 0.46]))
    assert q.sum().item() == pytest.approx(1.0) and bool((q > 0).all())
    assert ngram_probs(torch.tensor([3]), 4, floor=0.2).tolist() == pytest.approx([0.05, 0.05, 0.05, 0.85])


def test_probs_handed_to_verifier_equal_uncached_forwards_of_the_emitted_context(target, monkeypatch):
    """Cache bookkeeping of both models (pending blocks, per-row rollback, masked x_gamma slots): every
    target/draft row the verifier sees equals a plain forward of prompt + tokens emitted so far + drafts."""
    draft = truncated_draft(target, 2)  # close to the target: some rows accept all drafts, others do not
    calls = []

    def spy(target_probs, draft_probs, draft_tokens, generator=None, **kwargs):
        result = gen.VERIFIERS["block"](target_probs, draft_probs, draft_tokens, generator, **kwargs)
        calls.append((target_probs, draft_probs, draft_tokens, result))
        return result

    monkeypatch.setitem(gen.VERIFIERS, "spy", spy)
    out = speculative_generate(target, draft, PROMPTS, verifier="spy", gamma=2, max_new_tokens=24, seed=5)
    contexts = [list(p) for p in PROMPTS]
    for (target_probs, draft_probs, draft_tokens, result), step in zip(calls, out.steps):
        live = [c for c, active in zip(contexts, step.active) if active]  # a finished row has left the batch
        for b, context in enumerate(live):
            drafts = draft_tokens[b].tolist()
            with torch.no_grad():
                p = target.model(input_ids=torch.tensor([context + drafts])).logits[0, len(context) - 1 :]
                q = draft.model(input_ids=torch.tensor([context + drafts[:-1]])).logits[0, len(context) - 1 :]
            torch.testing.assert_close(target_probs[b], p.softmax(-1), atol=1e-4, rtol=0)
            torch.testing.assert_close(draft_probs[b], q.softmax(-1), atol=1e-4, rtol=0)
            n = int(result.num_accepted[b])
            context.extend(drafts[:n] + [int(result.next_token[b])])
    # the masked x_gamma slot was exercised: a step where one row accepted all drafts and another did not
    assert any(int(r.num_accepted.max()) == 2 and int(r.num_accepted.min()) < 2 for *_, r in calls)


def test_cli_generate_parses_into_a_command():
    from specresearch.cli import build_parser

    args = build_parser().parse_args(["generate", "hello", "--verifier", "token", "--gamma", "3", "--top-k", "5",
                                      "--draft", "truncated:4", "--temperature", "0"])
    assert args.func.__name__ == "_run_generate" and (args.gamma, args.top_k, args.draft) == (3, 5, "truncated:4")
    assert build_parser().parse_args(["report"]).command == "report"  # the existing command is intact


def test_a_chat_ends_where_transformers_generate_ends_it():
    """With a tokenizer the engine stops where transformers' ``generate`` stops: at the tokenizer's EOS and at every id
    of the target's generation config (Gemma's ``<end_of_turn>``, Phi-3's ``<|end|>``, which end a chat turn while the
    tokenizer's EOS is another token); chains, captured steps and plain decoding alike. An explicit ``eos_token_id``
    is taken as it is."""
    from types import SimpleNamespace

    from specresearch.experiments.families import reference_tokens
    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.families import perturbed_copy, tiny_family_model

    model = tiny_family_model("llama")
    prompt = [5, 9, 3]
    tokenizer = SimpleNamespace(eos_token_id=1, decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    reference = reference_tokens(model, [prompt], 12)[0]
    stop = reference[4]
    assert 1 not in reference and reference.index(stop) < 11
    model.generation_config.eos_token_id = [1, stop]
    ended = reference[: reference.index(stop) + 1]
    generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=1)
    assert generated[0, len(prompt):].tolist() == ended
    target, draft = CausalLM(model, device="cpu"), CausalLM(perturbed_copy(model), device="cpu")
    runs = {"chain": speculative_generate(target, draft, [prompt], gamma=3, tokenizer=tokenizer, max_new_tokens=12,
                                          sampling=GREEDY),
            "captured": speculative_generate(target, draft, [prompt], gamma=3, tokenizer=tokenizer, max_new_tokens=12,
                                             sampling=GREEDY, compile="static"),
            "plain": autoregressive_generate(target, [prompt], tokenizer=tokenizer, max_new_tokens=12, sampling=GREEDY)}
    for name, out in runs.items():
        assert list(out.tokens[0]) == ended, name
    given = speculative_generate(target, draft, [prompt], gamma=3, tokenizer=tokenizer, eos_token_id=1,
                                 max_new_tokens=12, sampling=GREEDY)
    assert list(given.tokens[0]) == reference


@pytest.mark.parametrize("width", [60, 70])
def test_a_draft_with_another_number_of_output_rows_runs_fitted_to_the_target(width, tmp_path):
    """A draft that shares the target's tokenizer but not its number of output rows (Qwen2.5-0.5B's 151,936 against
    the 7B's 152,064): refused as it is, with the fix in the message; as ``CausalLM(model, vocab_size=target's)``
    its logits are cut or padded with -inf, greedy speculative decoding gives the target's tokens (chains, trees,
    captured steps), and at T = 1 the first 3 tokens follow the target's law (exact Bonferroni chi-square over
    10,000 samples: a lossless engine is rejected with probability <= 1e-6). A checkpoint draft whose tokenizer is the
    target's is fitted by ``drafts.registry``."""
    from specresearch.experiments.stats import lossless_test
    from specresearch.models.causal_lm import CausalLM

    target = tiny_llama(64, seed=0, init_std=0.6)
    other = tiny_llama(width, seed=1, init_std=0.6).model
    with pytest.raises(ValueError, match=r"CausalLM\(model, vocab_size=64\)"):
        speculative_generate(target, CausalLM(other, device="cpu"), PROMPTS, max_new_tokens=4)
    draft = CausalLM(other, device="cpu", vocab_size=64)
    assert (draft.vocab_size, draft.own_vocab_size) == (64, width)
    logits = draft.prefill(torch.tensor([[5, 9, 2]]), torch.ones(1, 3, dtype=torch.long))
    assert logits.shape == (1, 64) and (torch.isinf(logits[0, width:]).all() if width < 64 else True)
    reference = autoregressive_generate(target, PROMPTS, max_new_tokens=16, sampling=GREEDY)
    for options in (dict(gamma=3), dict(gamma=3, compile="static"), dict(verifier="traversal", num_drafts=3, gamma=2)):
        out = speculative_generate(target, draft, PROMPTS, max_new_tokens=16, sampling=GREEDY, **options)
        assert out.tokens == reference.tokens, options
    result = lossless_test(target, draft, "block", [5, 9, 2, 33], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=10_000, seed=3, batch_size=5_000)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specresearch.drafts.registry import draft_from_name

    vocab = {"<unk>": 0, "x": 1, "y": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    other.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = draft_from_name(str(tmp_path), target, tokenizer=tokenizer)
    assert (loaded.vocab_size, loaded.own_vocab_size) == (64, width)
