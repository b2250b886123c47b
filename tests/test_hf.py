"""specresearch.engine.hf: the engine inside transformers' ``generate(custom_generate=...)``.

Tiny random-weight Llamas (``models.tiny_llama``; ``.model`` is the raw transformers model whose
``generate`` is called) and the embedded SmolLM2 pair: greedy output equals ``generate(do_sample=False)``
for every verifier and B in {1, 3} (left-padded), with and without prefix logits processors; sampled
output follows the target law (chi-square / exact Bonferroni, fixed seeds, false-positive rate stated per
test) and the same test rejects a wrong verifier; EOS inside an accepted block, max_new_tokens, streamer,
return_dict metrics, seeds, the ``custom_generate/`` directory, and clear ``ValueError`` s.
"""

import itertools
from pathlib import Path

import pytest
import torch
from helpers import feature_head
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
from transformers.generation.streamers import BaseStreamer

from specresearch.config import SamplingConfig
from specresearch.core.sampling import logits_to_probs
from specresearch.engine import hf
from specresearch.engine.generate import speculative_generate
from specresearch.experiments.stats import (
    chi_square,
    sequence_law,
    wrong_residual_verify,
)
from specresearch.models.causal_lm import CausalLM
from specresearch.models.toy import tiny_llama

REPO = Path(__file__).resolve().parent.parent
LEVEL = 1e-7
# Left-padded batch of 3 (pad id 1 = the tiny config's pad/eos) and its single first row.
IDS = torch.tensor([[1, 1, 5, 6, 7], [2, 3, 4, 5, 9], [1, 1, 1, 9, 8]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
BATCHES = {1: (IDS[1:2], MASK[1:2]), 3: (IDS, MASK)}


@pytest.fixture(scope="module")
def models():
    """(target, draft) raw transformers models: peaked, context-dependent, same vocabulary (64)."""
    return tiny_llama(seed=0, init_std=0.5).model, tiny_llama(seed=1, init_std=0.5, num_layers=1).model


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("verifier", ["token", "block", "greedy"])
def test_greedy_equals_transformers_greedy(models, verifier, batch):
    target, draft = models
    ids, mask = BATCHES[batch]
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14,
                          custom_generate=hf.speculative(draft, verifier=verifier, gamma=3))
    assert torch.equal(out, reference)


def test_the_callers_models_are_left_as_transformers_built_them():
    """``generate`` wraps the caller's models to decode, and leaves them as they were: the same parameter objects
    (an optimizer built on them still holds them), the same module classes (no fused projections), the same mode."""
    from specresearch.models.families import tiny_family_model

    target = tiny_family_model("llama", "sdpa", seed=0, init_std=0.5)
    draft = tiny_family_model("llama", "sdpa", seed=1, init_std=0.5)
    target.train()
    before = {model: (list(model.parameters()), [type(m) for m in model.modules()]) for model in (target, draft)}
    reference = target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=8)
    out = target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=8,
                          custom_generate=hf.speculative(draft, gamma=3))
    assert torch.equal(out, reference)
    for model, (parameters, classes) in before.items():
        assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))
        assert [type(m) for m in model.modules()] == classes
    assert target.training and not draft.training


def _mended_state(model) -> list:
    """What a mend leaves on a model: hooks, forwards set on instances, attributes the toolkit names."""
    return [(name, kind) for name, module in model.named_modules()
            for kind in ("hooks", "forward", "marks")
            if (kind == "hooks" and (module._forward_hooks or module._forward_pre_hooks))
            or (kind == "forward" and "forward" in vars(module))
            or (kind == "marks" and any(key.startswith("specresearch") for key in vars(module)))]


@pytest.mark.parametrize("family", ["bloom", "gpt-neo", "zamba2", "recurrent_gemma"])
def test_a_target_the_wrapper_mends_is_handed_back_as_transformers_built_it(family):
    """A family whose cached calls the wrapper mends in place (ALiBi from masks, GPT-Neo's windows, a Mamba-2 mixer's
    bounded time step, RecurrentGemma's states in the cache: ``models.mends``): ``generate`` gives the engine's greedy
    tokens and leaves no hook, replaced forward or mark on the caller's model; its forward is as before."""
    from specresearch.models.families import RECURRENT_FAMILIES, tiny_family_model, tiny_recurrent_model
    from specresearch.models.mends import undo_mends

    build = (lambda: tiny_recurrent_model(family)) if family in RECURRENT_FAMILIES else (
        lambda: tiny_family_model(family, "eager", seed=0))
    target, ids = build(), torch.tensor([[5, 9, 3, 17, 22, 8, 4, 7]])
    with torch.no_grad():
        before = target(input_ids=ids).logits
    assert _mended_state(target) == []
    want = speculative_generate(CausalLM(build()), tiny_llama(64, seed=1), [ids[0].tolist()], max_new_tokens=8,
                                sampling=SamplingConfig(temperature=0.0), gamma=3).tokens[0]
    out = target.generate(ids, do_sample=False, max_new_tokens=8, custom_generate=hf.speculative(tiny_llama(64, seed=1),
                                                                                                 gamma=3))
    assert out[0, ids.shape[1]:].tolist() == list(want)
    assert _mended_state(target) == [] and undo_mends(target) == 0
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids).logits, before)
    CausalLM(target)  # mended again after the undo: its marks were undone too
    assert _mended_state(target) != []


@pytest.mark.parametrize("options", [dict(verifier="traversal", num_drafts=2),
                                     dict(verifier="onehot", num_drafts=3, draft_law="dynamic", tree_nodes=5)])
def test_greedy_trees_equal_transformers_greedy(models, options):
    """Draft trees through ``custom_generate``: sampled paths and EAGLE-2's dynamic tree, a left-padded batch."""
    target, draft = models
    reference = target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=14)
    out = target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=14,
                          custom_generate=hf.speculative(draft, gamma=3, **options))
    assert torch.equal(out, reference)


@pytest.mark.parametrize("options", [dict(verifier="token"), dict(verifier="block"),
                                     dict(verifier="traversal", num_drafts=2),
                                     dict(verifier="onehot", num_drafts=3, draft_law="dynamic", tree_nodes=5)])
def test_greedy_with_prefix_processors_equals_transformers(models, options):
    """Repetition penalty (per-row prompt padding), no-repeat n-grams, bad words, min new tokens and a
    prefix-constrained function (batch index) applied at every scored position with its own prefix; in a
    draft tree, every node with its own path as prefix."""
    target, draft = models
    settings = dict(do_sample=False, max_new_tokens=14, repetition_penalty=1.5, no_repeat_ngram_size=2,
                    bad_words_ids=[[20], [30, 31]], min_new_tokens=5,
                    prefix_allowed_tokens_fn=lambda b, ids: list(range(b, 64, 2)) if len(ids) % 3 else list(range(64)))
    reference = target.generate(IDS, attention_mask=MASK, **settings)
    out = target.generate(IDS, attention_mask=MASK, custom_generate=hf.speculative(draft, gamma=3, **options),
                          **settings)
    assert torch.equal(out, reference)
    assert not torch.equal(reference, target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=14))


@pytest.mark.parametrize("combined", [False, True])
def test_feature_draft_with_prefix_processors_equals_transformers(models, combined):
    """A draft that reads the target's hidden states keeps its feature channel through the logits
    processors (the target returns features, only logits are processed), and the combined draft keeps its
    length plan: greedy output equals generate's for B = 3; no row finds a lookup match here, so the
    combined draft drafts one token per step where, without its plan, it would draft gamma."""
    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.feature import FeatureDraft

    target, _ = models
    head = feature_head(target)
    draft = LookupOrDraft(FeatureDraft(head), draft_gamma=1) if combined else FeatureDraft(head)
    settings = dict(do_sample=False, max_new_tokens=14, repetition_penalty=1.5, no_repeat_ngram_size=2,
                    return_dict_in_generate=True)
    reference = target.generate(IDS, attention_mask=MASK, **settings).sequences
    out = target.generate(IDS, attention_mask=MASK, custom_generate=hf.speculative(draft, gamma=3), **settings)
    assert torch.equal(out.sequences, reference)
    assert set(out.gamma[:-3].tolist()) == ({1} if combined else {3})  # the last steps stop at max_new_tokens


@pytest.mark.slow
def test_embedded_pair_greedy_equals_transformers_greedy():
    """SmolLM2-135M-Instruct with the shipped v8k-4l draft (a LanguageModel) and as a raw transformers model."""
    from specresearch.drafts.registry import load_pair

    target, draft, tokenizer = load_pair(device="cpu")
    batch = tokenizer(["The capital of France is", "def add(a, b):", "Once"], return_tensors="pt", padding=True)
    reference = target.model.generate(**batch, do_sample=False, max_new_tokens=16)
    for candidate in (draft, draft.model):
        out = target.model.generate(**batch, do_sample=False, max_new_tokens=16,
                                    custom_generate=hf.speculative(candidate, verifier="block", gamma=4))
        assert torch.equal(out, reference)


@pytest.mark.slow
def test_embedded_stop_strings_as_a_stopping_criterion():
    """transformers 5.23 drops generate's tokenizer= for a custom_generate callable (so stop_strings= raises its
    own error); a StopStringCriteria passed as stopping_criteria stops where generate(stop_strings=...) does, and
    the custom_generate/ directory builds it from stop_strings= and tokenizer=."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    from specresearch.drafts.registry import load_pair

    target, draft, tokenizer = load_pair(device="cpu")
    batch = tokenizer(["The capital of France is"], return_tensors="pt")
    reference = target.model.generate(**batch, do_sample=False, max_new_tokens=20, stop_strings=[" answer"],
                                      tokenizer=tokenizer)
    out = target.model.generate(**batch, do_sample=False, max_new_tokens=20,
                                stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, [" answer"])]),
                                custom_generate=hf.speculative(draft, gamma=4))
    assert torch.equal(out, reference) and tokenizer.decode(out[0]).endswith(" answer")
    assert out.shape[1] < batch["input_ids"].shape[1] + 20
    directory = target.model.generate(**batch, do_sample=False, max_new_tokens=20, stop_strings=[" answer"],
                                      tokenizer=tokenizer, custom_generate=str(REPO), trust_remote_code=True,
                                      assistant_model=draft.model)
    assert torch.equal(directory, reference)


SMALL_V, PROMPT, SAMPLES = 6, [1, 4, 2], 3000


@pytest.fixture(scope="module")
def small_pair():
    return tiny_llama(SMALL_V, seed=2, init_std=0.8), tiny_llama(SMALL_V, seed=3, init_std=0.8)


def _hf_sequences(target, draft, verifier, n, seed, num_drafts=1, **settings) -> list[tuple[int, ...]]:
    ids = torch.tensor([PROMPT] * n)  # token 1 is the pad id: without a mask generate would treat it as padding
    decode = hf.speculative(draft.model, verifier=verifier, gamma=3 if num_drafts == 1 else 2, num_drafts=num_drafts)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, eos_token_id=None,
                                seed=seed, custom_generate=decode, **settings)
    return [tuple(row) for row in out[:, len(PROMPT): len(PROMPT) + 3].tolist()]


def _law_test(law, sequences):
    counts = [0] * len(law.cells)
    for sequence in sequences:
        index = law.index(sequence)
        assert index is not None, f"impossible sequence {sequence}"
        counts[index] += 1
    return chi_square(counts, law.probs)


@pytest.mark.parametrize("verifier, settings", [
    ("token", dict(do_sample=True)),
    ("block", dict(do_sample=True)),
    ("block", dict(do_sample=True, temperature=0.8, top_k=4)),
])
def test_sampled_output_follows_the_target_law(small_pair, verifier, settings):
    """Losslessness through generate (Leviathan et al. Thm 1; Sun et al. Thm 1): 3000 rows of one prompt in one
    batch, first 3 of 4 tokens, against stats.sequence_law. FPR <= 1e-7 (exact Bonferroni p-value; the
    chi-square p-value is also checked at 1e-7)."""
    target, draft = small_pair
    sampling = SamplingConfig(temperature=settings.get("temperature", 1.0), top_k=settings.get("top_k"))
    law = sequence_law(target, PROMPT, sampling=sampling, k=3, num_samples=SAMPLES)
    _, dof, p_value, bonferroni = _law_test(law, _hf_sequences(target, draft, verifier, SAMPLES, 11, **settings))
    assert dof >= 5 and p_value > LEVEL and bonferroni > LEVEL


def test_the_law_test_rejects_a_wrong_verifier(small_pair):
    """Power: the same test, same N, rejects resampling from p instead of norm(max(p - q, 0))."""
    target, draft = small_pair
    law = sequence_law(target, PROMPT, sampling=SamplingConfig(), k=3, num_samples=SAMPLES)
    _, _, p_value, bonferroni = _law_test(law, _hf_sequences(target, draft, wrong_residual_verify, SAMPLES, 11,
                                                             do_sample=True))
    assert p_value < LEVEL and bonferroni < LEVEL


def _penalised_law(target: CausalLM, penalty: float, k: int) -> dict[tuple[int, ...], float]:
    """Exact law of k tokens of sampling (T = 1) with transformers' repetition penalty over prompt + prefix."""
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    law = {}
    for sequence in itertools.product(range(SMALL_V), repeat=k):
        prob = 1.0
        for i in range(k):
            ids = torch.tensor([PROMPT + list(sequence[:i])])
            logits = target.model(ids).logits[:, -1].float()
            prob *= float(logits_to_probs(processor(ids, logits), SamplingConfig())[0, sequence[i]])
        law[sequence] = prob
    return law


@pytest.mark.parametrize("verifier, num_drafts", [("block", 1), ("traversal", 2)])
def test_sampled_output_with_a_prefix_processor_follows_its_law(small_pair, verifier, num_drafts):
    """Repetition penalty 2.0 applied per position to target and draft (in a tree, per node on its own path): the
    output follows the penalised target law (exact, enumerated 6^3 sequences; cells with expected count < 5
    pooled). FPR <= 1e-7 per case (exact Bonferroni p-value)."""
    target, draft = small_pair
    with torch.no_grad():
        law = _penalised_law(target, 2.0, 3)
    seen = _hf_sequences(target, draft, verifier, SAMPLES, 5, num_drafts, do_sample=True, repetition_penalty=2.0)
    big = [s for s, p in law.items() if SAMPLES * p >= 5]
    counts = [sum(1 for s in seen if s == cell) for cell in big]
    probs = [law[s] for s in big]
    counts.append(SAMPLES - sum(counts))
    probs.append(1.0 - sum(probs))
    _, dof, p_value, bonferroni = chi_square(counts, probs)
    assert dof > 10 and p_value > LEVEL and bonferroni > LEVEL
    plain = sequence_law(target, PROMPT, sampling=SamplingConfig(), k=3, num_samples=SAMPLES)
    assert _law_test(plain, seen)[2] < LEVEL  # and it is NOT the unpenalised law: the processor was applied


def _greedy_eos_case(target, length=5):
    """A greedy continuation of row 0 and an EOS token = its 3rd token (not among the first two)."""
    ids = IDS[:1, 2:]
    tokens = target.generate(ids, do_sample=False, max_new_tokens=length, eos_token_id=None)[0, ids.shape[1]:]
    assert int(tokens[2]) not in tokens[:2].tolist()
    return ids, int(tokens[2])


def test_eos_inside_an_accepted_block_stops_the_row(models):
    """Draft = target, so the first step accepts all 4 drafts; the row ends at the EOS inside that block."""
    target, _ = models
    ids, eos = _greedy_eos_case(target)
    out = target.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=eos, return_dict_in_generate=True,
                          custom_generate=hf.speculative(target, verifier="block", gamma=4))
    assert out.num_accepted[0, 0] == 4 and out.sequences.shape[1] == ids.shape[1] + 3
    assert int(out.sequences[0, -1]) == eos
    reference = target.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=eos)
    assert torch.equal(out.sequences, reference)


def test_eos_in_a_batch_pads_the_finished_row_like_transformers(models):
    target, draft = models
    _, eos = _greedy_eos_case(target)
    settings = dict(do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    reference = target.generate(IDS, attention_mask=MASK, **settings)
    out = target.generate(IDS, attention_mask=MASK, custom_generate=hf.speculative(draft, gamma=4), **settings)
    assert torch.equal(out, reference) and (out[0, IDS.shape[1] + 3:] == 0).all()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_exactly_max_new_tokens(models, max_new_tokens):
    target, _ = models
    out = target.generate(IDS, attention_mask=MASK, do_sample=True, max_new_tokens=max_new_tokens, eos_token_id=None,
                          custom_generate=hf.speculative(target, gamma=4), seed=0)  # drafts all accepted: overshoot
    assert out.shape == (3, IDS.shape[1] + max_new_tokens) and torch.equal(out[:, : IDS.shape[1]], IDS)


def test_stopping_criterion_inside_a_block(models):
    """A criterion of the prefix (vouched for with allow=) ends the row after the token that fires it."""
    target, _ = models
    ids, stop_token = _greedy_eos_case(target)

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_token

    settings = dict(do_sample=False, max_new_tokens=10, eos_token_id=None,
                    stopping_criteria=StoppingCriteriaList([StopAt()]))
    out = target.generate(ids, custom_generate=hf.speculative(target, gamma=4, allow=(StopAt,)), **settings)
    assert torch.equal(out, target.generate(ids, **settings)) and int(out[0, -1]) == stop_token
    with pytest.raises(ValueError, match="StopAt"):
        target.generate(ids, custom_generate=hf.speculative(target, gamma=4), **settings)


def test_streamer_receives_the_prompt_then_exactly_the_output_tokens(models):
    target, _ = models
    ids = IDS[1:2]
    streamer = _Recorder()
    out = target.generate(ids, do_sample=True, max_new_tokens=9, eos_token_id=None, seed=3,
                          custom_generate=hf.speculative(target, gamma=3, streamer=streamer))
    assert streamer.puts[0] == ids.tolist() and streamer.ends == 1
    assert sum(streamer.puts[1:], []) == out[0, ids.shape[1]:].tolist()
    assert [len(p) for p in streamer.puts[1:]] == [4, 4, 1]  # draft = target: whole blocks, cut at max_new_tokens


def test_return_dict_has_sequences_and_step_metrics(models):
    target, draft = models
    out = target.generate(IDS, attention_mask=MASK, do_sample=True, max_new_tokens=10, eos_token_id=None, seed=0,
                          return_dict_in_generate=True, custom_generate=hf.speculative(draft, gamma=3))
    steps = out.result.steps
    assert out.sequences.shape == (3, IDS.shape[1] + 10)
    assert out.num_accepted.shape == out.active.shape == (len(steps), 3) and out.gamma.shape == (len(steps),)
    assert ((out.num_accepted >= 0) & (out.num_accepted <= out.gamma[:, None])).all()
    assert out.target_calls == len(steps) and out.draft_calls == int(out.gamma.sum())
    efficiency = float((out.num_accepted + 1)[out.active].float().mean())
    assert out.block_efficiency == pytest.approx(efficiency) and out.block_efficiency >= 1.0


def test_same_seed_same_tokens_as_the_engine(models):
    """generate(custom_generate=speculative(...)) is the engine: same seed, same sampled tokens as
    speculative_generate on the unpadded prompts (top-k 20 -> SamplingConfig(top_k=20))."""
    target, draft = models
    out = target.generate(IDS, attention_mask=MASK, do_sample=True, top_k=20, max_new_tokens=9, eos_token_id=None,
                          seed=6, custom_generate=hf.speculative(draft, verifier="block", gamma=3))
    prompts = [row[m.bool()].tolist() for row, m in zip(IDS, MASK)]
    engine = speculative_generate(CausalLM(target), CausalLM(draft), prompts, verifier="block", gamma=3,
                                  max_new_tokens=9, sampling=SamplingConfig(top_k=20), seed=6)
    assert out[:, IDS.shape[1]:].tolist() == [list(row) for row in engine.tokens]


def test_seed_and_generator_reproduce(models):
    target, draft = models
    decode = hf.speculative(draft, gamma=3)

    def run(**randomness):
        return target.generate(IDS, attention_mask=MASK, do_sample=True, max_new_tokens=12, eos_token_id=None,
                               custom_generate=decode, **randomness)

    assert torch.equal(run(seed=4), run(seed=4)) and not torch.equal(run(seed=4), run(seed=5))
    assert torch.equal(run(generator=torch.Generator().manual_seed(9)), run(generator=torch.Generator().manual_seed(9)))
    torch.manual_seed(1)
    first = run()
    torch.manual_seed(1)
    assert torch.equal(first, run())
    per_row = run(seed=[7, 8, 9])
    assert torch.equal(per_row[2], target.generate(IDS[2:], attention_mask=MASK[2:], do_sample=True, max_new_tokens=12,
                                                   eos_token_id=None, custom_generate=decode, seed=[9])[0])


def test_custom_generate_directory(models):
    """custom_generate=<repository root> runs custom_generate/generate.py (trust_remote_code), the draft as
    assistant_model, the streamer as generate's own argument."""
    target, draft = models
    ids = IDS[1:2]
    streamer = _Recorder()
    reference = target.generate(ids, do_sample=False, max_new_tokens=10)
    out = target.generate(ids, do_sample=False, max_new_tokens=10, custom_generate=str(REPO), trust_remote_code=True,
                          assistant_model=draft, verifier="token", gamma=2, streamer=streamer)
    assert torch.equal(out, reference)
    assert streamer.puts[0] == ids.tolist() and sum(streamer.puts[1:], []) == out[0, ids.shape[1]:].tolist()
    with pytest.raises(ValueError, match="assistant_model"):
        target.generate(ids, max_new_tokens=3, custom_generate=str(REPO), trust_remote_code=True)


class _Shift(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1.0


def test_bad_configurations_raise_clear_errors(models):
    target, draft = models
    decode = hf.speculative(draft)

    def run(ids=IDS, mask=MASK, decode=decode, **settings):
        return target.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate=decode, **settings)

    with pytest.raises(ValueError, match="vocab_size"):
        run(decode=hf.speculative(tiny_llama(48, seed=1).model))
    with pytest.raises(ValueError, match="num_beams"):
        run(num_beams=2)
    with pytest.raises(ValueError, match="MinPLogitsWarper"):
        run(do_sample=True, min_p=0.1)
    with pytest.raises(ValueError, match="_Shift.*allow"):
        run(logits_processor=LogitsProcessorList([_Shift()]))
    vouched = run(logits_processor=LogitsProcessorList([_Shift()]), decode=hf.speculative(draft, allow=(_Shift,)))
    assert vouched.shape == (3, IDS.shape[1] + 4)
    with pytest.raises(ValueError, match="left"):
        run(mask=MASK.flip(1))
    with pytest.raises(ValueError, match="streamer"):
        run(decode=hf.speculative(draft, streamer=_Recorder()))
    with pytest.raises(ValueError, match="output_scores"):
        run(return_dict_in_generate=True, output_scores=True)
    with pytest.raises(ValueError, match="gamma"):
        hf.speculative(draft, gamma=0)
    with pytest.raises(ValueError, match="verifier"):
        hf.speculative(draft, verifier="beam")
    with pytest.raises(ValueError, match="draft"):
        hf.speculative("not a model")
    with pytest.raises(ValueError, match="seed or generator"):
        run(seed=1, generator=torch.Generator())
