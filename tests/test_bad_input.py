"""Bad input to the engine, the sampling config and the verifiers: a ValueError that says what to change,
never a silent token 0, a NaN, or an IndexError from deep inside torch."""

import math

import pytest
import torch

from specresearch.config import SamplingConfig
from specresearch.core.draws import draw_uniforms
from specresearch.core.sampling import logits_to_probs
from specresearch.core.verify import VERIFIERS
from specresearch.drafts.ngram import NGramDraft
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.models.toy import ToyLM, tiny_llama

VOCAB = 8


def _toy(seed: int = 0, vocab: int = VOCAB) -> ToyLM:
    return ToyLM(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))


def _poisoned(value: float, row: int = 3) -> ToyLM:
    """A model whose logits after token ``row`` contain ``value`` (NaN or +inf)."""
    table = _toy().table.clone()
    table[row, 2] = value
    return ToyLM(table)


@pytest.mark.parametrize("value, word", [(math.nan, "NaN"), (math.inf, r"\+inf")])
def test_bad_target_logits_name_the_target_and_the_step(value, word):
    with pytest.raises(ValueError, match=rf"target model logits \(scoring the drafts\).*{word}"):
        speculative_generate(_poisoned(value), _toy(1), [[3]], gamma=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=rf"target model logits \(autoregressive step\).*{word}"):
        autoregressive_generate(_poisoned(value), [[3]], max_new_tokens=4)


@pytest.mark.parametrize("value, word", [(math.nan, "NaN"), (math.inf, r"\+inf")])
def test_bad_draft_logits_name_the_draft_and_the_step(value, word):
    with pytest.raises(ValueError, match=rf"draft model logits \(drafting token 1\).*{word}"):
        speculative_generate(_toy(1), _poisoned(value), [[3]], gamma=2, max_new_tokens=4)


def test_nan_even_under_greedy_sampling_is_an_error_not_token_0():
    # argmax of a NaN row would silently be the NaN position; the check runs before any transform
    with pytest.raises(ValueError, match="NaN"):
        speculative_generate(_poisoned(math.nan), _toy(1), [[3]], gamma=2, max_new_tokens=4,
                             sampling=SamplingConfig(temperature=0))


def test_all_masked_row_is_an_error():
    with pytest.raises(ValueError, match="every entry is -inf"):
        logits_to_probs(torch.full((2, VOCAB), -math.inf), SamplingConfig())


def test_a_transformers_model_or_other_object_is_named_not_an_attribute_error():
    """A transformers model handed to the engine as it is (it raised AttributeError: no 'prefill') is told to be wrapped;
    another object is named by what it lacks."""
    hf = tiny_llama(VOCAB).model  # the transformers LlamaForCausalLM inside the wrapper
    wrap = r"got LlamaForCausalLM: wrap a transformers model in models.causal_lm.CausalLM\(model\)"
    with pytest.raises(TypeError, match=r"^target must be a language model the engine drives \(prefill, score, "
                                        r"rollback missing.*" + wrap):
        speculative_generate(hf, _toy(), [[1, 2]])
    with pytest.raises(TypeError, match="^draft must be a language model.*" + wrap):
        speculative_generate(_toy(), hf, [[1, 2]])
    with pytest.raises(TypeError, match=r"^target must be .*\(prefill, score missing.*" + wrap):
        autoregressive_generate(hf, [[1, 2]])
    with pytest.raises(TypeError, match=r"draft must be .*\(prefill, score, rollback missing.*\), got str$"):
        speculative_generate(_toy(), "v8k-4l", [[1, 2]])


def test_mismatched_vocab_sizes():
    with pytest.raises(ValueError, match=r"draft vocab_size 9 != target vocab_size 8.*same tokenizer"):
        speculative_generate(_toy(), _toy(1, vocab=9), [[1, 2]])
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(_toy(), NGramDraft(VOCAB + 1), [[1, 2]])
    with pytest.raises(ValueError, match="vocabulary size"):  # at the verifier boundary too
        VERIFIERS["token"](torch.full((1, 2, 4), 0.25), torch.full((1, 1, 5), 0.2), torch.zeros(1, 1, dtype=torch.long))


class _BigTokenizer:
    """A tokenizer with more ids than the model has logits (ids up to 2 * VOCAB)."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 * VOCAB - 1, 1]}

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_tokenizer_larger_than_the_logits():
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, vocab_size=8\).*this model's tokenizer"):
        speculative_generate(_toy(), _toy(1), ["hello"], tokenizer=_BigTokenizer())
    with pytest.raises(ValueError, match="prompt token ids"):
        autoregressive_generate(_toy(), [[1, -2]])


def test_different_tokenizer_of_the_same_size_is_allowed_and_still_lossless():
    """No error is possible (ids are just ids) and none is needed: verification is over the target's ids, so a
    draft speaking another vocabulary of the same size only lowers acceptance. Greedy output = target's."""
    target = _toy()
    permuted = ToyLM(target.table[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))])
    greedy = SamplingConfig(temperature=0)
    spec = speculative_generate(target, permuted, [[1, 2]], gamma=3, max_new_tokens=12, sampling=greedy)
    assert spec.tokens == autoregressive_generate(target, [[1, 2]], max_new_tokens=12, sampling=greedy).tokens


def test_empty_prompts():
    with pytest.raises(ValueError, match="must not be empty"):
        speculative_generate(_toy(), _toy(1), [[]])
    with pytest.raises(ValueError, match="must not be empty"):
        autoregressive_generate(_toy(), [[1], []])
    with pytest.raises(ValueError, match="at least one prompt"):
        speculative_generate(_toy(), _toy(1), [])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_new_tokens_must_be_a_positive_integer(bad):
    """The engine's choice for max_new_tokens = 0: a ValueError (not an empty result)."""
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        speculative_generate(_toy(), _toy(1), [[1]], max_new_tokens=bad)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        autoregressive_generate(_toy(), [[1]], max_new_tokens=bad)


@pytest.mark.parametrize("bad", [0, -2, 2.0])
def test_gamma_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"gamma must be an integer >= 1 \(draft tokens per step\)"):
        speculative_generate(_toy(), _toy(1), [[1]], gamma=bad)
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="gamma must be >= 1"):
            draw_uniforms(2, bad)


def test_unknown_verifier():
    with pytest.raises(ValueError, match=r"verifier must be one of \['block', 'greedy', 'token'\]"):
        speculative_generate(_toy(), _toy(1), [[1]], verifier="Block")


@pytest.mark.parametrize("field, bad, message", [
    ("temperature", -0.1, "temperature must be a finite number >= 0"),
    ("temperature", math.inf, "temperature must be a finite number >= 0"),
    ("temperature", math.nan, "temperature must be a real number"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_p", -0.2, r"top_p must be in \(0, 1\]"),
    ("top_k", 0, "top_k must be an integer >= 1"),
    ("top_k", -3, "top_k must be an integer >= 1"),
    ("top_k", 2.5, "top_k must be an integer >= 1"),
    ("epsilon", 1.0, r"epsilon must be in \[0, 1\)"),
])
def test_sampling_config_rejects_out_of_range_values(field, bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**{field: bad})


def test_prompt_longer_than_the_model_context():
    lm = tiny_llama(VOCAB, max_position_embeddings=16)
    assert lm.max_context == 16
    long_prompt = [[1] * 20]
    with pytest.raises(ValueError, match=r"needs 24 positions but the model's context is 16: shorten the prompt"):
        autoregressive_generate(lm, long_prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="model's context is 16"):
        speculative_generate(lm, NGramDraft(VOCAB), [[1] * 10], gamma=4, max_new_tokens=4)  # 10 + 4 + 4 > 16
    out = speculative_generate(lm, NGramDraft(VOCAB), [[1] * 8], gamma=4, max_new_tokens=4)  # 16 fits
    assert len(out.tokens[0]) == 4


def test_per_prompt_seeds_must_match_the_prompts():
    with pytest.raises(ValueError, match="one int per prompt"):
        speculative_generate(_toy(), _toy(1), [[1], [2]], seed=[1, 2, 3])
    with pytest.raises(ValueError, match="one int per prompt"):
        autoregressive_generate(_toy(), [[1], [2]], seed=[1, 2.0])


class _VocabTokenizer:
    def __init__(self, vocab):
        self._vocab = dict(vocab)

    def get_vocab(self):
        return dict(self._vocab)


def test_different_tokenizers_are_rejected_where_both_are_known():
    from specresearch.models.protocols import check_same_tokenizer

    same = {"a": 0, "b": 1, "c": 2}
    check_same_tokenizer(_VocabTokenizer(same), _VocabTokenizer(same))  # no error
    with pytest.raises(ValueError, match=r"draft tokenizer differs.*'a' is id 1 in the draft and 0 in the target"):
        check_same_tokenizer(_VocabTokenizer(same), _VocabTokenizer({"a": 1, "b": 0, "c": 2}))
    with pytest.raises(ValueError, match=r"draft tokenizer differs from the target.s \(2 vs 3 tokens"):
        check_same_tokenizer(_VocabTokenizer(same), _VocabTokenizer({"a": 0, "b": 1}))


def test_draft_checkpoint_with_another_tokenizer_is_rejected(tmp_path):
    """A draft checkpoint whose saved tokenizer differs from the target's: clear error before any generation."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specresearch.drafts.registry import draft_from_name

    def tokenizer(vocab):
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))

    target = tiny_llama(vocab_size=VOCAB, seed=0)
    draft_dir = tmp_path / "draft"
    tiny_llama(vocab_size=VOCAB, seed=1).model.save_pretrained(draft_dir)
    tokenizer({"<unk>": 0, "x": 1, "y": 2}).save_pretrained(draft_dir)
    with pytest.raises(ValueError, match="draft tokenizer differs"):
        draft_from_name(str(draft_dir), target, tokenizer=tokenizer({"<unk>": 0, "y": 1, "x": 2}))
    draft = draft_from_name(str(draft_dir), target, tokenizer=tokenizer({"<unk>": 0, "x": 1, "y": 2}))
    assert draft.vocab_size == target.vocab_size


def test_check_int_accepts_integers_only():
    """checks.check_int: bools, floats and strings are refused with the field's name; numpy integers pass."""
    import numpy as np

    from specresearch.checks import check_int

    check_int("n", 1)
    check_int("n", np.int64(3), minimum=2)
    for bad in (True, 2.0, "3", 0, None):
        with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got "):
            check_int("n", bad)
    with pytest.raises(ValueError, match=r"^gamma must be an integer >= 2 \(draft tokens\), got 1$"):
        check_int("gamma", 1, minimum=2, meaning="draft tokens")


def test_load_pair_refuses_an_unknown_draft_before_loading(tmp_path):
    """Neither shipped, nor a directory, nor a draft description: one clear error, before the target loads."""
    from specresearch.drafts.registry import load_pair

    for name in ("v9-nope", str(tmp_path / "missing")):
        with pytest.raises(ValueError, match=r"draft must be a shipped draft \[.*v8k-4l.*\], a trained draft's directory"):
            load_pair(draft=name, device="cpu")
