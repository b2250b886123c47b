"""Targets with DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5's ``glm_moe_dsa``): an indexer scores every earlier
key, each query attends to its top ``index_topk`` (``models.attention.INDEXED_FAMILIES``).

* Tiny random models keeping 4 keys a query out of up to 15, on eager and sdpa: ``CausalLM``'s probe passes (a tree
  and dead slots against uncached forwards), greedy decoding gives the tokens of uncached forwards one step at a time
  for each prompt alone (left-padded in the batch), and greedy speculative decoding (chains, sampled and dynamic trees)
  gives those tokens. Control: the same weights keeping every key decode other tokens, so the selection is in play.
* sdpa stays transformers' own: the indexer's selection is a mask only there and under eager (another attention
  function is handed indices it does not read; the wrapper's CPU sdpa dropped the selection without an error).
* Rows rolled back unevenly, packed, selected and repeated keep their indexer keys; so does the static form (the
  captured steps' cache), whose every probe row is the uncached forward's and whose captured steps decode greedily.
* T = 1: a DeepSeek-V3.2 target with a Llama draft keeps the target's law (chains and K = 2 traversal trees; exact
  Bonferroni test, false-positive rate <= 1e-6 each).
"""

import pytest
import torch
from helpers import check_captured_step

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.static import static_available
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import SPARSE_FAMILIES, tiny_sparse_model
from specresearch.models.probe import static_form_calls
from specresearch.models.toy import tiny_llama

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 3, 17, 22, 8, 30, 11, 4], [7, 2, 11]]
NEW = 6


def _uncached_greedy(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(SPARSE_FAMILIES))
def test_a_sparse_attention_target_decodes_as_uncached_forwards_in_chains_and_trees(family, kernel):
    model = tiny_sparse_model(family, kernel)
    target = CausalLM(model)  # the probe runs here
    assert model.config._attn_implementation == kernel  # sdpa left as transformers' (module docstring)
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=NEW, sampling=GREEDY).tokens
    assert [list(row) for row in want] == [_uncached_greedy(model, p, NEW) for p in PROMPTS]
    dense = CausalLM(tiny_sparse_model(family, kernel, index_topk=64))
    assert autoregressive_generate(dense, PROMPTS, max_new_tokens=NEW, sampling=GREEDY).tokens != want  # control
    draft = draft_from_name("ngram", target)
    for options in (dict(gamma=3), dict(gamma=1), dict(num_drafts=2, gamma=3, verifier="traversal"),
                    dict(num_drafts=2, gamma=3, verifier="onehot", draft_law="dynamic")):
        got = speculative_generate(target, tiny_llama(64, seed=1, init_std=0.5) if "num_drafts" in options else draft,
                                   PROMPTS, max_new_tokens=NEW, sampling=GREEDY, **options).tokens
        assert got == want, options


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(SPARSE_FAMILIES))
def test_the_static_form_keeps_the_indexer_keys_and_scores_as_uncached_forwards(family, kernel):
    """The captured steps' cache (``models.static_cache``: the indexer's keys in a buffer of their own, written at the
    call's slots and copied with a kept path): every logit row of ``models.probe.static_form_calls`` (two left-padded
    rows, a chain, a tree of two branches, paths kept to 3 and 2 nodes, a token after) is the uncached forward's
    (1e-4); greedy chains and trees in captured steps give the uncached tokens; a step traces as one graph."""
    model = tiny_sparse_model(family, kernel)
    target = CausalLM(model)
    assert static_available(target) is None
    for logits, sequence in static_form_calls(target.static_form()):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([sequence])).logits[0, -1]
        assert torch.allclose(logits, want, atol=1e-4), (sequence, float((logits - want).abs().max()))
    want = [_uncached_greedy(model, p, NEW) for p in PROMPTS]
    draft = tiny_llama(64, seed=1, init_std=0.5)
    for options in (dict(gamma=3), dict(num_drafts=2, gamma=3, verifier="traversal"),
                    dict(num_drafts=2, gamma=3, verifier="onehot", draft_law="dynamic")):
        got = speculative_generate(target, draft, PROMPTS, max_new_tokens=NEW, sampling=GREEDY, compile="static",
                                   **options).tokens
        assert [list(row) for row in got] == want, options
    check_captured_step(target, draft, PROMPTS, dict(gamma=3))


def test_rows_keep_their_indexer_keys():
    model = tiny_sparse_model("deepseek_v32")
    lm = CausalLM(model)
    prompts = [[5, 9, 3, 17, 40, 41], [0, 0, 7, 2, 12, 13], [0, 11, 4, 8, 50, 51]]
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    lm.prefill(torch.tensor(prompts), mask)
    histories = [[t for t, m in zip(p, row) if m] for p, row in zip(prompts, mask.tolist())]
    new = [30, 31, 32, 33, 34, 35]
    lm.score(torch.tensor([new] * 3))
    lm.rollback([0, 5, 4])
    histories = [h + new[: 6 - n] for h, n in zip(histories, [0, 5, 4])]
    lm.select_rows(torch.tensor([2, 1]))  # 7 and 5 valid slots of 12: the cache is packed to 7
    assert lm.cache_length == 7 and all(layer.indexer_keys.shape[1] == 7 for layer in lm._cache.layers)
    lm.repeat_rows(2)  # rows 2, 2, 1, 1
    rows = [histories[2], histories[2], histories[1], histories[1]]
    after = lm.score(torch.tensor([[40], [41], [42], [43]]))[:, 0]
    for i, (row, token) in enumerate(zip(rows, [40, 41, 42, 43])):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([row + [token]])).logits[0, -1]
        assert torch.allclose(after[i], alone, atol=1e-4), i


def test_a_sparse_attention_target_keeps_its_law_at_t1():
    target = CausalLM(tiny_sparse_model("deepseek_v32"))
    draft = tiny_llama(64, seed=1, init_std=0.5)
    for rule, trees in (("block", 1), ("traversal", 2)):
        result = lossless_test(target, draft, rule, [5, 9, 3, 17, 22, 8], sampling=SamplingConfig(), gamma=3, k=3,
                               max_new_tokens=4, num_samples=4_000, seed=0, batch_size=2_000, num_drafts=trees)
        assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, (rule, result.p_value)
