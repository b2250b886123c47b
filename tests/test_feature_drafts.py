"""Feature drafts (EAGLE-style) on tiny random models: the head's cached drafting equals its rollout
forward, rollback and re-feeding of true features, the engine channel (greedy equality, B > 1 with left
padding, EOS, max_new_tokens, seeds, losslessness), the target wrapper's hidden states, bad input."""

import dataclasses
import functools
import types

import pytest
import torch
from helpers import ToyChatTokenizer, feature_head

from specresearch.config import SamplingConfig
from specresearch.drafts.feature import FeatureDraft, FeatureHead, FeatureHeadConfig
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, load_prompts
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.protocols import FeatureReader
from specresearch.models.toy import ToyLM, tiny_llama

VOCAB = 48
GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 33, 7, 5, 9], [4, 8], [16, 23, 42, 3]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=3)


@pytest.fixture(scope="module")
def draft(target):
    return FeatureDraft(feature_head(target.model))


def _features(target, seq, layers):
    with torch.no_grad():
        out = target.model(input_ids=seq, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1)  # [B, L, F]


def test_cached_drafting_equals_the_rollout_forward(target, draft):
    """Drafting with the KV cache (true features, then own predictions for 1, 2 tokens) gives the logits of
    the uncached rollout passes 0, 1, 2 at the same slots (atol 1e-4, float32), outside autograd."""
    head = draft.head
    seq = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]])
    feats = _features(target, seq, head.feature_layers)
    before = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], 1)
    with torch.no_grad():
        passes = [head.logits(h) for h in head.rollout(feats, seq, torch.ones_like(seq), passes=3)]
    draft.observe(before[:, :4])
    prefilled = draft.prefill(seq[:, :4], torch.ones(1, 4, dtype=torch.long))  # the last slot's logits only
    torch.testing.assert_close(prefilled, passes[0][:, 3], atol=1e-4, rtol=0)
    draft.observe(before[:, 4:6])
    scored = draft.score(seq[:, 4:6])
    torch.testing.assert_close(scored, passes[0][:, 4:6], atol=1e-4, rtol=0)
    assert not prefilled.requires_grad and not scored.requires_grad  # drafting builds no autograd graph
    torch.testing.assert_close(draft.score(seq[:, 6:7])[:, 0], passes[1][:, 6], atol=1e-4, rtol=0)
    torch.testing.assert_close(draft.score(seq[:, 7:8])[:, 0], passes[2][:, 7], atol=1e-4, rtol=0)


def test_rollback_and_refeed_equal_a_fresh_draft_fed_true_features(target, draft):
    """Draft 3 tokens on own features, roll back 2 per row (ragged: 2 and 1), re-feed true features: the
    logits equal a draft that only ever saw true features. B = 2 with left padding."""
    seqs = [[3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    ids = torch.tensor([[0, 0] + seqs[0][:3], seqs[1][:5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    full = [_features(target, torch.tensor([s]), draft.feature_layers)[0] for s in seqs]
    before = [torch.cat([torch.zeros_like(f[:1]), f[:-1]]) for f in full]
    draft.observe(torch.stack([torch.cat([torch.zeros(2, full[0].shape[1]), before[0][:3]]), before[1][:5]]))
    draft.prefill(ids, mask)
    draft.observe(torch.stack([before[0][3:4], before[1][5:6]]))
    draft.score(torch.tensor([[seqs[0][3]], [seqs[1][5]]]))
    draft.score(torch.tensor([[40], [41]]))  # own-feature slots, then rolled back
    draft.score(torch.tensor([[42], [43]]))
    draft.rollback(torch.tensor([2, 3]))  # row 1 also drops its last true slot
    draft.observe(torch.stack([before[0][4:6], torch.cat([torch.zeros(1, full[1].shape[1]), before[1][5:6]])]))
    got = draft.score(torch.tensor([seqs[0][4:6], [0, seqs[1][5]]]), torch.tensor([[True, True], [False, True]]))[:, -1]
    for b, (seq, length) in enumerate(zip(seqs, (6, 6))):
        fresh = FeatureDraft(draft.head)
        fresh.observe(before[b][None, :length])
        expected = fresh.prefill(torch.tensor([seq[:length]]), torch.ones(1, length, dtype=torch.long))
        torch.testing.assert_close(got[b], expected[0], atol=1e-4, rtol=0)


def test_target_wrapper_returns_the_requested_hidden_states(target):
    seq = torch.tensor([[3, 4, 5, 6, 7, 8]])
    expected = _features(target, seq, (1, -1))
    _, prompt_hidden = target.prefill(seq[:, :4], torch.ones(1, 4, dtype=torch.long), hidden_layers=(1, -1))
    logits, block_hidden = target.score(seq[:, 4:], hidden_layers=(1, -1))
    assert logits.shape == (1, 2, VOCAB)
    torch.testing.assert_close(torch.cat([prompt_hidden, block_hidden], 1), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("verifier", ["greedy", "token", "block"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_greedy_autoregressive(target, draft, verifier, gamma):
    """B = 3 with left padding: the feature draft changes nothing at temperature 0 (and does accept some drafts)."""
    reference = autoregressive_generate(target, PROMPTS, max_new_tokens=17, sampling=GREEDY)
    out = speculative_generate(target, draft, PROMPTS, verifier=verifier, gamma=gamma, max_new_tokens=17, sampling=GREEDY)
    assert out.tokens == reference.tokens
    assert all(len(row) == 17 for row in out.tokens)


def test_a_trained_like_draft_accepts_and_stays_exact(target):
    """A head equal to the target's last layer reading its own final feature accepts often; output unchanged."""
    head = FeatureHead(target.model, FeatureHeadConfig("t", feature_layers=(-1,), init_layer=-1))
    out = speculative_generate(target, FeatureDraft(head), PROMPTS, verifier="token", gamma=3, max_new_tokens=20, sampling=GREEDY)
    assert out.tokens == autoregressive_generate(target, PROMPTS, max_new_tokens=20, sampling=GREEDY).tokens


def test_eos_and_seeds(target, draft):
    sampling = SamplingConfig(temperature=1.0)
    first = speculative_generate(target, draft, PROMPTS, gamma=3, max_new_tokens=12, sampling=sampling, seed=5)
    again = speculative_generate(target, draft, PROMPTS, gamma=3, max_new_tokens=12, sampling=sampling, seed=5)
    other = speculative_generate(target, draft, PROMPTS, gamma=3, max_new_tokens=12, sampling=sampling, seed=6)
    assert first.tokens == again.tokens != other.tokens
    per_row = speculative_generate(target, draft, PROMPTS, gamma=3, max_new_tokens=12, sampling=sampling, seed=[1, 2, 3])
    eos = per_row.tokens[0][4]  # rows that reach it leave the batch; per-row seeds keep row 0's draws its own
    cut = speculative_generate(target, draft, PROMPTS, gamma=3, max_new_tokens=12, sampling=sampling, seed=[1, 2, 3], eos_token_id=eos)
    assert cut.tokens[0] == per_row.tokens[0][: per_row.tokens[0].index(eos) + 1]
    alone = speculative_generate(target, draft, PROMPTS[1:2], gamma=3, max_new_tokens=12, sampling=sampling, seed=[2])
    assert per_row.tokens[1] == alone.tokens[0]  # per-row seeds: a row does not depend on the batch


SMALL_V = 6


@pytest.mark.parametrize("verifier, sampling", [("token", SamplingConfig()), ("block", SamplingConfig(temperature=0.8, top_k=4))])
def test_sampled_output_follows_the_target_law(verifier, sampling):
    """End-to-end losslessness with a feature draft (subset head: q = 0 off 5 of 6 tokens): chi-square over
    3-token sequences, rejected at p < 1e-6, so a correct engine fails with probability < 1e-6."""
    small = tiny_llama(SMALL_V, seed=2, init_std=0.8)
    draft = FeatureDraft(feature_head(small.model, layers=(-1,), scale=0.3, head_tokens=5))
    result = lossless_test(small, draft, verifier, [1, 4, 2], sampling=sampling, gamma=3, k=3, max_new_tokens=4,
                           num_samples=3000, seed=11, batch_size=500)
    assert result.impossible == 0 and not result.rejects(1e-6)


def test_engine_detects_a_reading_draft_and_bad_input_raises(target, draft):
    assert isinstance(draft, FeatureReader)
    with pytest.raises(ValueError, match="features must be"):
        draft.observe(torch.zeros(1, 1, 3))
    with pytest.raises(ValueError, match=r"target must return them \(a models.causal_lm.CausalLM\)"):
        speculative_generate(ToyLM.random(VOCAB), draft, PROMPTS, max_new_tokens=3)
    fresh = FeatureDraft(draft.head)
    fresh.reset(1)
    with pytest.raises(ValueError, match="needs the target's features"):
        fresh.score(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="feature_layers"):
        FeatureHeadConfig("x", feature_layers=(1, 1))


def test_training_reduces_the_loss_and_raises_alpha(tmp_path):
    """A tiny target, a cached corpus of 64 sampled continuations, 200 steps (a few seconds): the loss on a fixed
    batch falls at every depth, the measured depth-1 alpha on 16 held-out prompts rises, and the target gets no gradient.

    Sized so that the margins do not hang on float rounding: with head and batch seeds 0-11 (a stand-in for another
    CPU's rounding) alpha rises from 0.075 by 0.064-0.087 and the losses fall to 0.22-0.29 of their start. A corpus of 8
    continuations measured on 2 held-out prompts (24 positions) rose by -0.03 to +0.05 over seeds: a coin toss."""
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        collect_feature_corpus,
        load_feature_chunks,
    )
    from specresearch.training.feature_distill import (
        FeatureTrainConfig,
        _feature_batch,
        _feature_columns,
        feature_loss,
        train_feature_head,
    )
    from specresearch.training.feature_measure import measure_feature_draft

    small = tiny_llama(32, seed=4, init_std=0.8, num_layers=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 32, (int(n),), generator=g) for n in torch.randint(3, 7, (80,), generator=g)]
    corpus_config = FeatureCorpusConfig(store_layers=(1, -1), chunk_prompts=16, max_new_tokens=16, batch_size=4, teacher_top_k=8)
    assert collect_feature_corpus(small.model, prompts[:64], corpus_config, tmp_path, eos_token_ids=[1], progress=False) == 4
    corpus = load_feature_chunks(tmp_path)
    head = FeatureHead(small.model, FeatureHeadConfig("t", feature_layers=(1, -1)), seed=0)
    config = FeatureTrainConfig(steps=200, batch_size=4, lr=1e-2, warmup_steps=2, rollout=2)
    batch = _feature_batch(corpus, list(range(8)), config.seq_len, *_feature_columns(head, corpus_config.store_layers))
    measure = functools.partial(measure_feature_draft, small.model, head, prompts[64:], depths=2, max_new_tokens=12,
                                prompts_per_batch=8, progress=False)
    before_alpha = measure()
    with torch.no_grad():
        loss, before = feature_loss(head, batch, config)
        with_tv, kls = feature_loss(head, batch, dataclasses.replace(config, tv_loss_weight=1.0))
    assert kls == before and float(loss) < float(with_tv) < float(loss) + 1  # + the mean TV of the passes, in (0, 1]
    result = train_feature_head(head, corpus, corpus_config.store_layers, config, checkpoint_dir=tmp_path / "run", progress=False)
    with torch.no_grad():
        _, after = feature_loss(head, batch, config)
    after_alpha = measure()
    assert result.finished and (tmp_path / "run" / "checkpoint.pt").exists()
    # the target's embedding and full head are read, not trained: no gradient of them is taken (a [V, H] one a step)
    assert all(p.grad is None for p in small.model.parameters())
    assert all(a < 0.7 * b for a, b in zip(after, before)), (before, after)
    assert after_alpha.alpha[1.0][0] > before_alpha.alpha[1.0][0] + 0.05
    assert all(0 <= a <= 1 for a in after_alpha.alpha[1.0] + after_alpha.greedy_agreement)


def _tiny_feature_corpus(directory, max_new_tokens: int):
    """A tiny target and its cached feature corpus: 8 random prompts in 2 chunks, layers (1, -1) stored."""
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        collect_feature_corpus,
        load_feature_chunks,
    )

    small = tiny_llama(32, seed=4, init_std=0.8, num_layers=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 32, (int(n),), generator=g) for n in torch.randint(3, 7, (8,), generator=g)]
    corpus_config = FeatureCorpusConfig(store_layers=(1, -1), chunk_prompts=4, max_new_tokens=max_new_tokens, batch_size=4, teacher_top_k=8)
    collect_feature_corpus(small.model, prompts, corpus_config, directory, progress=False)
    return small, load_feature_chunks(directory), corpus_config


def test_training_stopped_by_its_budget_resumes_to_the_same_head_and_sums_its_seconds(tmp_path, monkeypatch):
    """A clock that advances one second per reading: a budget of 7 s stops training after a known number of
    steps; two more sittings finish it. The weights, losses and KLs equal those of one uninterrupted run
    exactly, and the reported seconds are the sum of the sittings' (not the last one's, not a budget)."""
    import specresearch.training.feature_distill as fd

    small, corpus, corpus_config = _tiny_feature_corpus(tmp_path / "corpus", max_new_tokens=8)
    config = fd.FeatureTrainConfig(steps=12, batch_size=4, lr=3e-3, warmup_steps=2, rollout=2, checkpoint_every=3)

    def trained(directory, budgets):
        head = FeatureHead(small.model, FeatureHeadConfig("t", feature_layers=(1, -1)), seed=0)
        results = [fd.train_feature_head(head, corpus, corpus_config.store_layers, config, checkpoint_dir=directory,
                                         max_seconds=b, progress=False) for b in budgets]
        return head, results

    whole, (one,) = trained(tmp_path / "whole", [None])
    clock = iter(range(10**6))
    monkeypatch.setattr(fd, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    resumed, sittings = trained(tmp_path / "resumed", [7, 7, 100])
    # Clock readings per sitting: one at its start, one per budget test, one per checkpoint (every 3 steps) and one
    # at its end. Sitting 1: steps 1-5 (tests at 1, 2, 3, 5, 6; checkpoint at 4), the test at 7 stops it, ends at 8.
    # Sitting 2 resumes from step 5: steps 6-9, 8 s again. Sitting 3: steps 10-12, checkpoint, end: 5 s.
    assert [r.step for r in sittings] == [5, 9, 12] and [r.finished for r in sittings] == [False, False, True]
    assert [r.seconds for r in sittings] == [8.0, 16.0, 21.0]
    assert sittings[-1].losses == one.losses and sittings[-1].kls == one.kls
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))


def test_bf16_autocast_training_reduces_the_loss_keeps_float32_state_and_resumes_older_checkpoints(tmp_path):
    """Training under bfloat16 autocast on the tiny corpus: the float32 loss on a fixed batch falls at every depth as
    in float32 training, the weights and Adam moments stay float32 and differ from float32 training's (the autocast
    is on), and the run key of a default config is the key it had before the field existed. A checkpoint written
    without the field (an older run) resumes under the default config."""
    import hashlib
    import json

    import specresearch.training.feature_distill as fd

    small, corpus, corpus_config = _tiny_feature_corpus(tmp_path / "corpus", max_new_tokens=16)
    # lr 1e-2: over head and batch seeds 0-7 the losses fall to 0.33-0.51 of their start in either mode (at 3e-3 to
    # 0.51-0.72, so a 0.7 bound failed on one CPU's rounding and passed on another's)
    config = fd.FeatureTrainConfig(steps=30, batch_size=4, lr=1e-2, warmup_steps=2, rollout=2, checkpoint_every=10)
    fast = dataclasses.replace(config, bf16_autocast=True)
    heads = {}
    for name, c in (("fp32", config), ("bf16", fast)):
        head = FeatureHead(small.model, FeatureHeadConfig("t", feature_layers=(1, -1)), seed=0)
        batch = fd._feature_batch(corpus, list(range(8)), c.seq_len, *fd._feature_columns(head, corpus_config.store_layers))
        with torch.no_grad():
            _, before = fd.feature_loss(head, batch, config)
        fd.train_feature_head(head, corpus, corpus_config.store_layers, c, checkpoint_dir=tmp_path / name, progress=False)
        with torch.no_grad():
            _, after = fd.feature_loss(head, batch, config)
        assert all(a < 0.7 * b for a, b in zip(after, before)), (name, before, after)
        heads[name] = head
    assert all(p.dtype == torch.float32 for p in heads["bf16"].parameters())
    moments = torch.load(tmp_path / "bf16" / "checkpoint.pt", weights_only=True)["optimizer"]["state"]
    assert all(v.dtype == torch.float32 for s in moments.values() for k, v in s.items() if k != "step")
    assert not all(torch.equal(a, b) for a, b in zip(heads["fp32"].parameters(), heads["bf16"].parameters()))
    head_config = FeatureHeadConfig("t", feature_layers=(1, -1))
    assert fd._run_key(head_config, config, "k", 2) != fd._run_key(head_config, fast, "k", 2)
    older = dataclasses.asdict(config)
    del older["bf16_autocast"]
    unkeyed = {k: v for k, v in older.items() if k != "tv_loss_weight"}  # the key of runs before either field existed
    older_head = {k: v for k, v in dataclasses.asdict(head_config).items() if k != "architecture"}  # nor this one
    blob = json.dumps([older_head, unkeyed, "k", 2], sort_keys=True)
    assert fd._run_key(head_config, config, "k", 2) == f"t-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
    payload = torch.load(tmp_path / "fp32" / "checkpoint.pt", weights_only=True)
    payload["config"] = older
    torch.save(payload, tmp_path / "fp32" / "checkpoint.pt")
    resumed = FeatureHead(small.model, head_config, seed=0)
    result = fd.train_feature_head(resumed, corpus, corpus_config.store_layers, config, checkpoint_dir=tmp_path / "fp32", progress=False)
    assert result.step == 30 and all(torch.equal(a, b) for a, b in zip(heads["fp32"].parameters(), resumed.parameters()))
    with pytest.raises(ValueError, match="another FeatureTrainConfig"):
        fd.train_feature_head(resumed, corpus, corpus_config.store_layers, fast, checkpoint_dir=tmp_path / "fp32", progress=False)


def test_a_corpus_longer_than_one_pass_samples_reshuffled_prompts_again(tmp_path):
    """More chunks than the prompts fill: chunks are cut from successive shuffles end to end, the first pass's
    chunks are the same whatever the total, and every prompt is sampled once per pass (with new seeds)."""
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        chunk_prompt_order,
        collect_feature_corpus,
        load_feature_chunks,
    )

    order = chunk_prompt_order(6, seed=3, count=15)
    assert order[:6] == torch.randperm(6, generator=torch.Generator().manual_seed(3)).tolist()
    assert sorted(order[6:12]) == list(range(6)) and order[6:12] != order[:6] and len(order) == 15
    small = tiny_llama(32, seed=4, init_std=0.8, num_layers=2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.arange(2, 2 + n) + 4 * i for i, n in enumerate(torch.randint(3, 6, (6,), generator=g).tolist())]
    config = FeatureCorpusConfig(seed=3, store_layers=(-1,), chunk_prompts=4, max_new_tokens=6, batch_size=4, teacher_top_k=4)
    assert collect_feature_corpus(small.model, prompts, config, tmp_path / "one", progress=False) == 2  # ceil(6 / 4)
    assert collect_feature_corpus(small.model, prompts, config, tmp_path / "three", max_chunks=3, progress=False) == 3
    one, three = load_feature_chunks(tmp_path / "one", 1), load_feature_chunks(tmp_path / "three")
    assert all(torch.equal(a, b) for a, b in zip(one.sequences, three.sequences[:4]))
    sampled = [next(i for i, p in enumerate(prompts) if torch.equal(s[:n], p)) for s, n in zip(three.sequences, three.prompt_lengths)]
    assert sampled == order[:12] and sorted(sampled) == sorted(2 * list(range(6)))
    with pytest.raises(ValueError, match="num_prompts must be an integer >= 1"):
        chunk_prompt_order(0, seed=0, count=4)  # no endless loop over an empty prompt list
    with pytest.raises(ValueError, match="max_chunks"):
        collect_feature_corpus(small.model, prompts, config, tmp_path / "bad", max_chunks=-1, progress=False)


def test_a_feature_corpus_is_the_same_data_for_a_distilled_lm(tmp_path):
    """as_distill_corpus: the cached chunks' teacher rows, cut to seq_len, are distill.teacher_targets of the same
    tokens (recomputed by distill's own collate), so both kinds of draft train on identical data."""
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        as_distill_corpus,
        collect_feature_corpus,
        load_feature_chunks,
    )
    from specresearch.training.teacher import teacher_targets

    small = tiny_llama(32, seed=4, init_std=0.8, num_layers=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 32, (int(n),), generator=g) for n in torch.randint(3, 7, (6,), generator=g)]
    config = FeatureCorpusConfig(store_layers=(-1,), chunk_prompts=3, max_new_tokens=12, batch_size=3, teacher_top_k=8)
    collect_feature_corpus(small.model, prompts, config, tmp_path, progress=False)
    chunk = load_feature_chunks(tmp_path)
    for seq_len in (64, 10):  # 10 cuts every continuation short
        corpus, teacher = as_distill_corpus(chunk, seq_len)
        again = teacher_targets(small.model, corpus, seq_len, top_k=8, progress=False)
        assert corpus.sequences == chunk.sequences and len(teacher.ids) == len(chunk.sequences) == 6
        for ids, probs, ids2, probs2 in zip(teacher.ids, teacher.probs, again.ids, again.probs):
            assert ids.shape == ids2.shape and ids.dtype == torch.long and probs.dtype == torch.float32
            assert torch.equal(ids[:, :3], ids2[:, :3])  # the likeliest tokens (no near-ties at the top here)
            torch.testing.assert_close(probs, probs2, atol=2e-3, rtol=0)  # float16 storage
        kept = sum(len(t) for t in teacher.ids)
        if seq_len == 64:
            assert kept == chunk.num_generated_tokens
        else:
            assert 0 < kept < chunk.num_generated_tokens


def test_feature_distillation_end_to_end_and_continued_on_later_chunks(tmp_path, monkeypatch):
    """``run_feature_distillation`` on a tiny target: corpus -> training -> measurement -> saved head and
    manifest. A second run continues that head (``init_from``) on chunks 2-3 only: chunks 0-1 are not
    read again, the token ids of its subset head are kept, it starts from the first head's loss rather
    than a new head's, and the manifest records the head it started from. A starting head of another
    configuration raises."""
    import json

    import specresearch.training.feature_distill as fd
    from specresearch.drafts.feature import feature_head_digest, load_feature_head
    from specresearch.training.feature_corpus import FeatureCorpusConfig

    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path / "cache"))
    small, tokenizer = tiny_llama(32, seed=4, init_std=0.8, num_layers=2), ToyChatTokenizer()
    g = torch.Generator().manual_seed(5)
    for name, count in (("corpus.jsonl", 16), ("heldout.jsonl", 4)):
        rows = [{"id": f"{name}-{i}", "category": "c", "turns": ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (5,), generator=g))]}
                for i in range(count)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    head_config = FeatureHeadConfig("t", feature_layers=(1, -1), head_tokens=16, train_head=True)
    corpus_config = FeatureCorpusConfig(store_layers=(1, -1), chunk_prompts=4, max_new_tokens=10, batch_size=4, teacher_top_k=8)
    train = fd.FeatureTrainConfig(steps=30, batch_size=4, lr=3e-3, warmup_steps=2, rollout=2, checkpoint_every=10)

    def run(out, **kw):
        return fd.run_feature_distillation(small, tokenizer, head_config, train, corpus_config, prompts_path=tmp_path / "corpus.jsonl",
                                           heldout_path=tmp_path / "heldout.jsonl", chunks=2, out_dir=tmp_path / out, heldout_prompts=4,
                                           measure_tokens=8, depths=2, progress=False, **kw)

    first = run("first")
    chunks = tmp_path / "cache" / "distill" / "features" / corpus_config.key(tmp_path / "corpus.jsonl")
    assert first["finished"] and sorted(p.name for p in chunks.iterdir()) == ["chunk-0000.pt", "chunk-0001.pt"]
    assert first["corpus"]["sequences"] == 8 and "init_from" not in first
    assert 0 < first["measurement"]["alpha_by_depth"]["1.0"][0] <= 1 and first["cost"]["c"] > 0
    saved = json.loads((tmp_path / "first" / "manifest.json").read_text())
    assert saved["training"]["steps"] == 30 and saved["corpus"]["first_chunk"] == 0

    second = run("second", first_chunk=2, init_from=tmp_path / "first")
    assert second["finished"] and sorted(p.name for p in chunks.iterdir())[2:] == ["chunk-0002.pt", "chunk-0003.pt"]
    assert second["corpus"]["first_chunk"] == 2 and second["corpus"]["sequences"] == 8
    assert second["init_from"]["weights_sha256"] == feature_head_digest(tmp_path / "first")
    assert second["init_from"]["training_steps"] == 30
    heads = [load_feature_head(small.model, tmp_path / d) for d in ("first", "second")]
    assert torch.equal(heads[0].subset_head.token_ids, heads[1].subset_head.token_ids)
    assert not all(torch.equal(a, b) for a, b in zip(heads[0].parameters(), heads[1].parameters()))
    fresh = fd.run_feature_distillation(small, tokenizer, head_config, dataclasses.replace(train, steps=1), corpus_config,
                                        prompts_path=tmp_path / "corpus.jsonl", heldout_path=tmp_path / "heldout.jsonl", chunks=2,
                                        first_chunk=2, out_dir=tmp_path / "fresh", heldout_prompts=1, measure_tokens=2, depths=1, progress=False)
    # the first step's loss (same batch: same seed and chunks): a continued head starts far below a new one. A head
    # that ignored init_from would start at exactly the new one's loss (ratio 1); continued heads measured 0.87 on an
    # AVX-512 EPYC (MKL's rounding changes the sampled corpus, so the ratio moves by machine)
    assert second["training"]["loss_curve"][0] < 0.9 * fresh["training"]["loss_curve"][0]
    assert len(list((tmp_path / "cache" / "distill" / "feature_runs").iterdir())) == 3  # three run keys, three checkpoints
    with pytest.raises(ValueError, match="is not the preset's"):
        fd.run_feature_distillation(small, tokenizer, dataclasses.replace(head_config, num_layers=2), train, corpus_config,
                                    prompts_path=tmp_path / "corpus.jsonl", heldout_path=tmp_path / "heldout.jsonl", chunks=2,
                                    first_chunk=2, init_from=tmp_path / "first", out_dir=tmp_path / "bad", progress=False)


def test_stored_corpus_tokens_rebuild_the_sampled_chunks_without_sampling(tmp_path, monkeypatch):
    """save_corpus_tokens keeps the sampled ids (uint16) and the corpus key; collect_feature_corpus rebuilds
    the chunks they hold by the teacher-forced pass alone, equal to the sampled chunks (ids, features,
    teacher, sampling seconds), and samples the chunks they do not hold; another corpus' file, or tokens
    whose prompts are not this chunk's, raise; stored_chunk_count counts a committed file's chunks."""
    import numpy as np

    from specresearch.training import feature_corpus
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        collect_feature_corpus,
        load_corpus_tokens,
        save_corpus_tokens,
    )

    small = tiny_llama(32, seed=4, init_std=0.8, num_layers=2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 32, (int(n),), generator=g) for n in torch.randint(3, 7, (9,), generator=g)]
    config = FeatureCorpusConfig(store_layers=(1, -1), chunk_prompts=3, max_new_tokens=10, batch_size=3, teacher_top_k=8)
    assert collect_feature_corpus(small.model, prompts, config, tmp_path / "sampled", progress=False) == 3
    assert save_corpus_tokens(tmp_path / "sampled", tmp_path / "t.npz", "key", count=2) == 2
    with np.load(tmp_path / "t.npz") as data:
        assert data["tokens"].dtype == np.uint16 and data["chunk_sizes"].tolist() == [3, 3]
    stored = load_corpus_tokens(tmp_path / "t.npz", "key")
    sampled_chunks, collect = [], feature_corpus._collect_chunk
    monkeypatch.setattr(feature_corpus, "_collect_chunk", lambda *a: sampled_chunks.append(a[3]) or collect(*a))
    assert collect_feature_corpus(small.model, prompts, config, tmp_path / "rebuilt", stored=stored, progress=False) == 3
    assert sampled_chunks == [2]
    for i in range(3):
        want, got = (torch.load(tmp_path / d / f"chunk-{i:04d}.pt", weights_only=True) for d in ("sampled", "rebuilt"))
        assert got["prompt_lengths"] == want["prompt_lengths"] and (got["seconds"] == want["seconds"]) == (i < 2)
        for name in ("sequences", "features", "teacher_ids", "teacher_probs"):
            assert all(torch.equal(a, b) for a, b in zip(got[name], want[name], strict=True)), name
    for i in (0, 1):  # the stored chunks need not be cached: the file grows by the chunks sampled after them
        (tmp_path / "sampled" / f"chunk-{i:04d}.pt").unlink()
    assert save_corpus_tokens(tmp_path / "sampled", tmp_path / "t3.npz", "key", stored=stored) == 3
    grown = load_corpus_tokens(tmp_path / "t3.npz", "key")
    assert [c["seconds"] for c in grown[:2]] == [c["seconds"] for c in stored]
    assert all(torch.equal(a, b) for a, b in zip(grown[2]["sequences"], torch.load(tmp_path / "rebuilt" / "chunk-0002.pt")["sequences"], strict=True))
    with pytest.raises(ValueError, match="hold 1 consecutive chunks, 4 needed"):
        save_corpus_tokens(tmp_path / "sampled", tmp_path / "t4.npz", "key", count=4, stored=stored[:1])
    with pytest.raises(ValueError, match="holds the tokens of corpus 'key'"):
        load_corpus_tokens(tmp_path / "t.npz", "another")
    with pytest.raises(ValueError, match="do not start with the prompts"):
        collect_feature_corpus(small.model, prompts[::-1], config, tmp_path / "other", stored=stored, progress=False)
    monkeypatch.setattr(feature_corpus, "corpora_dir", lambda: tmp_path)  # the count the CLI checks reads the sizes alone
    (tmp_path / "t3.npz").rename(tmp_path / "key.npz")
    assert feature_corpus.stored_chunk_count("key") == 3 and feature_corpus.stored_chunk_count("absent") == 0
    (tmp_path / "key.npz").rename(tmp_path / "other.npz")
    with pytest.raises(ValueError, match="holds the tokens of corpus 'key'"):
        feature_corpus.stored_chunk_count("other")


def test_trained_draft_directories_load_by_path(target, tmp_path):
    """draft_from_name takes the directory ``feature-distill --out`` / ``distill --out`` wrote, as generate's --draft does."""
    from specresearch.drafts.distilled import DraftConfig, build_draft, save_draft
    from specresearch.drafts.feature import round_head_to_storage, save_feature_head
    from specresearch.drafts.registry import draft_from_name

    head = feature_head(target.model, head_tokens=40)
    round_head_to_storage(head)
    save_feature_head(head, target.model, tmp_path / "head")
    config = DraftConfig("t", num_layers=1, init_layers=(0,))
    save_draft(build_draft(target.model, config, seed=0), target.model, config, tmp_path / "small")
    loaded = draft_from_name(str(tmp_path / "head"), target)
    small = draft_from_name(str(tmp_path / "small"), target)
    assert isinstance(loaded, FeatureDraft) and torch.equal(loaded.head.subset_head.token_ids, head.subset_head.token_ids)
    assert isinstance(small, CausalLM) and small.model.config.num_hidden_layers == 1
    for saved in ("head", "small"):  # the same sizes here: the embedding's moments tell the targets apart
        with pytest.raises(ValueError, match=r"trained for another target \(same sizes, other embedding weights\): .*"
                                             r"prompt lookup \('ngram'\)"):
            draft_from_name(str(tmp_path / saved), tiny_llama(VOCAB, seed=9, init_std=0.6, num_layers=3))


# the logits' relative error (norm) each storage may give: float16's is ~1e-3 here, int8's ~0.016 / 0.029 (head / LM;
# a layer's rounding is ~0.4 % of its product, tests/test_models.py, which the tiny random models amplify)
@pytest.mark.parametrize("prefix, dtype, tolerance", [("fp16:", torch.float16, 1e-2), ("int8:", torch.int8, 0.05)])
def test_half_and_int8_weight_drafts_stay_exact_and_leave_the_target_alone(target, tmp_path, prefix, dtype, tolerance):
    """fp16:<draft> / int8:<draft>: the feature head and a distilled draft get float16 / int8 weights (the target keeps
    float32), their logits are the float32 ones up to the rounding, greedy speculative decoding still equals greedy
    autoregressive decoding, and drafts without weights are refused."""
    from specresearch.drafts.distilled import (
        DraftConfig,
        SubsetHead,
        build_draft,
        save_draft,
    )
    from specresearch.drafts.feature import round_head_to_storage, save_feature_head
    from specresearch.drafts.registry import draft_from_name

    head = feature_head(target.model, head_tokens=40)
    round_head_to_storage(head)
    save_feature_head(head, target.model, tmp_path / "head")
    config = DraftConfig("t", num_layers=1, init_layers=(0,), head_tokens=40)
    save_draft(build_draft(target.model, config, seed=0, head_token_ids=torch.arange(40)), target.model, config, tmp_path / "small")
    for name in ("head", "small"):
        full, half = draft_from_name(str(tmp_path / name), target), draft_from_name(f"{prefix}{tmp_path / name}", target)
        module = half.head if name == "head" else half.model
        inputs = [m for m in (half.head.fuse, half.head.fc) if m is not None] if name == "head" else []
        assert inputs or name == "small"  # int8: a feature head's input layers read the raw features: float16
        assert {m.weight.dtype for m in inputs} <= {torch.float16}
        assert {m.weight.dtype for m in module.modules()
                if isinstance(m, (torch.nn.Linear, SubsetHead)) and all(m is not i for i in inputs)} == {dtype}
        assert (half.head.subset_head if name == "head" else half.model.lm_head).weight.dtype == dtype
        assert all(p.dtype == torch.float32 for p in target.model.parameters())
        out = speculative_generate(target, half, PROMPTS, gamma=3, max_new_tokens=12, sampling=GREEDY)
        assert out.tokens == autoregressive_generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens
        ids, mask = torch.tensor([[5, 9, 2, 33]]), torch.ones(1, 4, dtype=torch.long)
        logits = []
        for draft in (full, half):
            if name == "head":
                _, features = target.prefill(ids, mask, hidden_layers=draft.feature_layers)
                draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
            logits.append(draft.prefill(ids, mask)[:, :40])
        assert 0 < float((logits[1] - logits[0]).norm() / logits[0].norm()) < tolerance
    with pytest.raises(ValueError, match="trained draft"):
        draft_from_name(f"{prefix}ngram", target)


def test_feature_draft_computes_the_row_counts_chosen_for_its_own_layers(target, monkeypatch):
    """choose_skinny_rows times the vocabulary-subset head beside the linear layers; FeatureDraft on CPU gives
    both the row counts it picks, every row count when asked, none when refused; the drafted logits are the
    same up to float rounding whichever path each row count takes."""
    from specresearch.drafts.distilled import DraftConfig, SubsetHead, build_draft
    from specresearch.models import kernels
    from specresearch.models.kernels import SkinnyLinear, choose_skinny_rows

    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "auto")
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 0)  # the tiny head stands in for a large one
    head = feature_head(target.model, head_tokens=40)
    layers = [m.weight.shape[0] for m in head.modules() if isinstance(m, (torch.nn.Linear, SubsetHead))]
    swept = []
    choose_skinny_rows(head, repeats=1, timer=lambda fn, path, rows: swept.append([y.shape[-1] for y in fn()]) or 1.0)
    assert 40 in layers and swept == [layers] * (8 * 2)  # every sweep multiplies the subset head's weight too

    built = {}
    for setting, pinned in ((None, "2,3"), (True, "none"), (False, "all")):
        monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", pinned)  # only skinny_linear=None follows the pin
        built[setting] = FeatureDraft(feature_head(target.model, head_tokens=40), skinny_linear=setting)
    rows = {s: {tuple(m.skinny_rows) for m in d.head.modules() if hasattr(m, "skinny_rows")} for s, d in built.items()}
    assert rows == {None: {(2, 3)}, True: {tuple(range(1, 9))}, False: {()}}
    assert [m.skinny_rows for m in built[None].head.modules() if isinstance(m, SubsetHead)] == [(2, 3)]
    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "none")  # a distilled draft's subset head follows its CausalLM
    config = DraftConfig("t", num_layers=1, init_layers=(0,), head_tokens=40, train_head=True)
    small = CausalLM(build_draft(target.model, config, seed=0, head_token_ids=torch.arange(40)), device="cpu")
    assert [m.skinny_rows for m in small.model.modules() if isinstance(m, SubsetHead)] == [()]
    assert not any(type(m) is SkinnyLinear for m in small.model.modules())  # nn.Linear, or fused (the default):
    assert all(tuple(m.skinny_rows) == () for m in small.model.modules() if isinstance(m, SkinnyLinear))  # F.linear's
    for length in (2, 3, 4):
        seq = torch.tensor([[3, 4, 5, 6][:length]])
        feats = _features(target, seq, built[None].feature_layers)
        with torch.no_grad():
            want, *others = (d.head.logits(d.head.rollout(feats, seq, torch.ones_like(seq), 2)[1]) for d in built.values())
        for got in others:
            # float32 sums in another order (seen: 2e-5 on an AMD EPYC's kernels, below 1e-5 on a Xeon's)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_save_and_load_round_trip(target, tmp_path):
    """The shipped format: trained tensors in the storage dtype + manifest; the loaded head gives the rounded head's
    logits, and a head saved against another target is refused."""
    from specresearch.drafts.feature import (
        is_feature_draft_dir,
        load_feature_head,
        round_head_to_storage,
        save_feature_head,
    )

    head = feature_head(target.model, head_tokens=40)
    round_head_to_storage(head)
    save_feature_head(head, target.model, tmp_path / "h", {"note": "test"})
    assert is_feature_draft_dir(tmp_path / "h") and not is_feature_draft_dir(tmp_path)
    loaded = load_feature_head(target.model, tmp_path / "h")
    seq = torch.tensor([[3, 4, 5, 6, 7]])
    feats = _features(target, seq, head.feature_layers)
    with torch.no_grad():
        expected = head.logits(head.rollout(feats, seq, torch.ones_like(seq), 2)[1])
        got = loaded.logits(loaded.rollout(feats, seq, torch.ones_like(seq), 2)[1])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="was trained for another target"):
        load_feature_head(tiny_llama(VOCAB, seed=9, init_std=0.6, num_layers=3).model, tmp_path / "h")


def _shipped_feature_heads():
    from specresearch.drafts.feature import is_feature_draft_dir
    from specresearch.drafts.store import drafts_dir, shipped_drafts

    return [n for n in shipped_drafts() if is_feature_draft_dir(drafts_dir() / n)]


@pytest.mark.parametrize("name", _shipped_feature_heads())
def test_shipped_feature_head_loads_offline_and_reproduces_its_manifest(name):
    """The shipped head, rebuilt against the embedded target in one call, reproduces the manifest's seeded
    check measurement (3 held-out prompts x 16 tokens, alpha per depth and greedy agreement) within 2e-3
    (float rounding of batched forwards only: the measurement is deterministic), and drafts losslessly
    at temperature 0."""
    import json
    from pathlib import Path

    from specresearch.drafts.registry import load_pair
    from specresearch.training import distill as D
    from specresearch.training.feature_measure import measure_feature_draft

    lm, draft, tokenizer = load_pair("smollm2-135m-instruct", name, device="cpu")
    assert isinstance(draft, FeatureDraft)
    manifest = json.loads((D.drafts_dir() / name / "manifest.json").read_text())
    check = manifest["check_measurement"]
    heldout = {p["id"]: p for p in load_prompts(Path(D.drafts_dir()).parent / "prompts.jsonl")}
    ids = encode_chat([heldout[i] for i in check["prompt_ids"]], tokenizer)
    depths = len(check["greedy_agreement_by_depth"])
    measured = measure_feature_draft(lm.model, draft.head, ids, depths=depths, max_new_tokens=check["max_new_tokens"],
                                     seed=check["seed"], eos_token_ids=[tokenizer.eos_token_id], progress=False)
    for t, alphas in check["alpha_by_depth"].items():
        assert measured.alpha[float(t)] == pytest.approx(alphas, abs=2e-3)
    assert measured.greedy_agreement == pytest.approx(check["greedy_agreement_by_depth"], abs=2e-3)
    prompt = [ids[0].tolist()]
    fast = speculative_generate(lm, draft, prompt, gamma=3, max_new_tokens=12, sampling=GREEDY)
    assert fast.tokens == autoregressive_generate(lm, prompt, max_new_tokens=12, sampling=GREEDY).tokens


def test_lookup_or_draft_uses_lookup_where_the_context_matches_and_stays_exact(target, draft):
    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.ngram import NGramDraft

    combined = LookupOrDraft(draft, min_match=2)
    assert isinstance(combined, FeatureReader)  # the feature channel is forwarded
    prompts = [[5, 9, 2, 33, 7, 5, 9], [4, 8, 16, 23]]  # row 0 ends in a repeated bigram, row 1 has no repeat
    reference = autoregressive_generate(target, prompts, max_new_tokens=15, sampling=GREEDY)
    for gamma in (1, 4):
        out = speculative_generate(target, combined, prompts, verifier="token", gamma=gamma, max_new_tokens=15, sampling=GREEDY)
        assert out.tokens == reference.tokens
    lookup = NGramDraft(VOCAB)
    ids, mask = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]]), torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    feats = torch.stack([_features(target, torch.tensor([p]), draft.feature_layers)[0] for p in prompts[:1]] +
                        [torch.cat([torch.zeros(3, draft.feature_size), _features(target, torch.tensor([prompts[1]]), draft.feature_layers)[0]])])
    combined.observe(torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], 1))
    got = combined.prefill(ids, mask)
    draft.observe(torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], 1))
    torch.testing.assert_close(got[0], lookup.prefill(ids, mask)[0])
    torch.testing.assert_close(got[1], draft.prefill(ids, mask)[1])


@pytest.mark.parametrize("min_match, plan_match, draft_gamma", [(1, None, None), (2, None, 1), (2, 1, 1)])
def test_lookup_or_feature_draft_is_lossless(min_match, plan_match, draft_gamma):
    """Chi-square at p < 1e-6 (false-positive rate < 1e-6) over 3-token sequences of a prompt with repeats;
    with ``draft_gamma`` the steps without a match (of ``plan_match`` tokens) draft one token."""
    from specresearch.drafts.combined import LookupOrDraft

    small = tiny_llama(SMALL_V, seed=2, init_std=0.8)
    combined = LookupOrDraft(FeatureDraft(feature_head(small.model, layers=(-1,), scale=0.3)), min_match=min_match,
                             draft_gamma=draft_gamma, plan_match=plan_match)
    result = lossless_test(small, combined, "block", [1, 4, 2, 1], sampling=SamplingConfig(), gamma=3, k=3, max_new_tokens=4,
                           num_samples=2000, seed=13, batch_size=500)
    assert result.impossible == 0 and not result.rejects(1e-6)


@pytest.mark.parametrize("plan_match", [None, 1, 3])
def test_lookup_or_draft_plans_full_steps_where_lookup_matches_and_short_ones_elsewhere(target, draft, plan_match):
    """``draft_gamma=1``: a step drafts gamma tokens when the context before it ends in a match of
    ``plan_match`` tokens (default ``min_match``; ``ngram_match_length``), else one; greedy output unchanged."""
    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.ngram import ngram_match_length

    prompt, gamma, max_new = [5, 9, 2, 33, 7, 5, 9, 2, 33, 7, 5, 9], 4, 30
    reference = autoregressive_generate(target, [prompt], max_new_tokens=max_new, sampling=GREEDY)
    combined = LookupOrDraft(draft, min_match=2, draft_gamma=1, plan_match=plan_match)
    out = speculative_generate(target, combined, [prompt], gamma=gamma, max_new_tokens=max_new, sampling=GREEDY)
    assert out.tokens == reference.tokens
    context, emitted = list(prompt), 0
    for step in out.steps:
        cap = min(gamma, max(1, max_new - emitted - 1))
        matched = ngram_match_length(torch.tensor(context), 3) >= (plan_match or 2)
        assert step.gamma == (cap if matched else 1), (context, step)
        n = step.num_accepted[0] + 1
        context += list(out.tokens[0][emitted : emitted + n])
        emitted += n
    assert {s.gamma for s in out.steps} >= {1, gamma}  # both kinds of step occurred
    with pytest.raises(ValueError, match="draft_gamma"):
        LookupOrDraft(draft, draft_gamma=0)
    for bad in (0, 4, 1.0):
        with pytest.raises(ValueError, match="plan_match must be an integer in 1..max_ngram=3"):
            LookupOrDraft(draft, plan_match=bad)


def test_combined_draft_names_and_their_options(target):
    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.registry import draft_from_name

    def settings(name):
        d = draft_from_name(name, target)
        assert isinstance(d, LookupOrDraft) and d.draft.model.config.num_hidden_layers == 1
        return d.draft_gamma, d.lazy, d.min_match, d.plan_match

    assert settings("ngram+truncated:1") == (1, True, 2, 2)  # the default: one token where lookup has no match
    assert settings("ngram+truncated:1@draft-gamma=3") == (3, True, 2, 2)
    assert settings("ngram+truncated:1@draft-gamma=none@every-slot") == (None, False, 2, 2)
    assert settings("ngram+truncated:1@plan-match=1") == (1, True, 2, 1)
    assert settings("ngram+truncated:1@min-match=1@plan-match=3") == (1, True, 1, 3)
    with pytest.raises(ValueError, match="min_match must be an integer in 1..max_ngram=3, got 4"):
        draft_from_name("ngram+truncated:1@min-match=4", target)
    for bad in ("@draft-gamma=0", "@draft-gamma=x", "@plan-match=", "@min-match=-1", "@fast", "@"):
        with pytest.raises(ValueError, match=f"unknown option {bad}"):
            draft_from_name("ngram+truncated:1" + bad, target)


def test_ngram_draft_match_lengths_are_those_of_its_contexts():
    """The match lengths NGramDraft keeps from its logits' scan equal ``ngram_match_length`` of each row's
    context, also after per-row rollbacks and with masked slots; its logits equal ``ngram_probs``."""
    from specresearch.drafts.ngram import NGramDraft, ngram_match_length, ngram_probs

    lookup = NGramDraft(VOCAB)
    ids, mask = torch.tensor([[0, 0, 3, 4, 3], [7, 1, 7, 1, 2]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    contexts = [[3, 4, 3], [7, 1, 7, 1, 2]]

    def check(logits):
        for b, context in enumerate(contexts):
            assert int(lookup.match_lengths()[b]) == ngram_match_length(torch.tensor(context), 3)
            torch.testing.assert_close(logits[b], ngram_probs(torch.tensor(context), VOCAB).log())

    check(lookup.prefill(ids, mask))
    logits = lookup.score(torch.tensor([[4, 7], [7, 1]]), torch.tensor([[1, 1], [1, 0]]))
    contexts = [[3, 4, 3, 4, 7], [7, 1, 7, 1, 2, 7]]
    check(logits[:, -1])
    lookup.rollback(torch.tensor([1, 2]))  # row 1 drops its masked slot too
    assert lookup.match_lengths().tolist() == [2, 0]  # [3, 4, 3, 4] and [7, 1, 7, 1, 2], rescanned
    contexts = [[3, 4, 3, 4, 3], [7, 1, 7, 1, 2, 1]]
    check(lookup.score(torch.tensor([[3], [1]]))[:, -1])


class _Recorded:
    """Records the logits every ``score`` of a combined draft returned (the engine's view of the draft)."""

    def __init__(self, combined):
        self.calls = []
        original = combined.score

        def score(tokens, valid=None):
            out = original(tokens, valid)
            self.calls.append(out.clone())
            return out

        combined.score = score


@pytest.mark.parametrize("inner", ["feature", "lm"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lazy_lookup_or_draft_returns_what_feeding_every_slot_returns(target, inner, temperature):
    """The wrapped draft fed only when its logits are needed (backlog, ragged rollbacks, own-feature slots)
    returns the same logits at every engine call as feeding it every slot and computes fewer slots. B = 3, left
    padding, gamma 3. Tolerance: float32 rounding of a wider call, which the random head's own-feature chain
    amplifies ~10x per drafted token (differences 1e-5 at a flushed slot, up to 7e-4 two own slots later, on
    logits of size ~10): atol 2e-3; a wrong slot, position or feature would differ by O(1)."""
    from specresearch.drafts.combined import LookupOrDraft

    prompts = [[5, 9, 2, 33, 7, 5, 9, 2], [4, 8, 4, 8], [16, 23, 42, 3, 16]]
    runs = {}
    for lazy in (True, False):
        wrapped = FeatureDraft(feature_head(target.model)) if inner == "feature" else tiny_llama(VOCAB, seed=7, init_std=0.6)
        combined = LookupOrDraft(wrapped, min_match=1, lazy=lazy)
        recorded = _Recorded(combined)
        out = speculative_generate(target, combined, prompts, gamma=3, max_new_tokens=20,
                                   sampling=SamplingConfig(temperature=temperature), seed=3)
        runs[lazy] = out, recorded.calls, combined.draft_slots_fed
    (lazy_out, lazy_calls, lazy_fed), (eager_out, eager_calls, eager_fed) = runs[True], runs[False]
    assert lazy_out.tokens == eager_out.tokens
    assert len(lazy_calls) == len(eager_calls)
    for got, want in zip(lazy_calls, eager_calls):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert lazy_fed < eager_fed


def test_subset_coverage_reads_the_head_as_drafting_does(target):
    """``benchmarks/subset_coverage.py`` predicts each continuation token from the slot before it, as drafting does:
    position by position, its alpha at T = 1 is sum_x min(p, q) with the drafting path's q (``FeatureDraft.score`` fed
    the target's true features) to 1e-5, its T = 0 agreement whether the two top tokens match, its off-subset marks
    whether the target's top token is outside the head's 40 ids (and, for the in-context mark, occurred before). With
    no off-subset token in the context, the context-rows readout is the head's own."""
    import importlib.util

    from specresearch.paths import repo_root

    spec = importlib.util.spec_from_file_location("subset_coverage", repo_root() / "benchmarks" / "subset_coverage.py")
    coverage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(coverage)
    head = feature_head(target.model, head_tokens=40, scale=0.02).eval()
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[head.subset_head.token_ids] = True
    prompt, continuation = [44, 9, 2, 3, 7], [11, 4, 30, 2, 41, 8, 19, 6, 44, 1, 13, 45]
    sequence = torch.tensor([prompt + continuation])
    with torch.no_grad():
        _, features = target.prefill(sequence, torch.ones_like(sequence), hidden_layers=head.feature_layers)
        draft = FeatureDraft(head, skinny_linear=False)
        draft.reset(1)
        draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
        q_logits = draft.score(sequence)[0, len(prompt) - 1:-1]
        p_logits = target.model(sequence).logits[0, len(prompt) - 1:-1]
    top = p_logits.argmax(-1)
    alpha = torch.minimum(p_logits.softmax(-1), q_logits.softmax(-1)).sum(-1).double()
    sampled = coverage.positions(target, head, prompt, continuation, 1.0, inside, {})
    assert torch.allclose(sampled["agree"], alpha, atol=1e-5) and alpha.std() > 0.01  # positions differ: no shift hides
    assert torch.allclose(sampled["mass_outside"], p_logits.softmax(-1)[:, 40:].sum(-1).double(), atol=1e-6)
    greedy = coverage.positions(target, head, prompt, continuation, 0.0, inside, {VOCAB: torch.ones(VOCAB, dtype=torch.bool)})
    assert torch.equal(greedy["agree"], (q_logits.argmax(-1) == top).double())
    assert torch.equal(greedy["top_outside"], (top >= 40).double()) and greedy["top_outside"].any()  # the subset: 0-39
    assert torch.equal(greedy["mass_outside"], greedy["top_outside"]) and not greedy[f"top_outside_{VOCAB}"].any()
    seen = [int(t) >= 40 and int(t) in (prompt + continuation)[:len(prompt) + i] for i, t in enumerate(top)]
    assert torch.equal(greedy["top_outside_in_context"], torch.tensor(seen, dtype=torch.float64)) and any(seen)
    own = coverage.positions(target, head, [t % 40 for t in prompt], [t % 40 for t in continuation], 0.0, inside, {})
    assert torch.equal(own["agree_context_rows"], own["agree"]) and not own["top_outside_in_context"].any()
