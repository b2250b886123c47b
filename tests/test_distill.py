"""Tests of specresearch.training.distill on tiny random-weight Llama models (fast), plus one slow test of the
shipped SmolLM2 draft. All runs are deterministic (fixed seeds, one thread), so no test here is
statistical: the thresholds are margins over deterministic values, stated where they are used."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from specresearch.drafts.distilled import SubsetHead, load_draft, load_trained_draft
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.models.toy import tiny_llama
from specresearch.training import distill as D
from specresearch.training.corpus import (
    generate_corpus,
    head_token_ids,
    load_corpus,
    sample_continuations,
    save_corpus,
)
from specresearch.training.loop import TrainConfig
from specresearch.training.measure import measure_draft
from specresearch.training.teacher import (
    _collate,
    _masked_logits,
    corpus_kl,
    distill_kl,
    sparse_distill_kl,
    sparse_tv,
    teacher_targets,
)

VOCAB = 61
EOS = 1


@pytest.fixture(scope="module")
def target():
    """A tiny random Llama with peaked, context-dependent next-token distributions (init_std 0.5)."""
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=0, init_std=0.5, tie_word_embeddings=True).model


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (int(n),), generator=generator) for n in torch.randint(3, 9, (8,), generator=generator)]


@pytest.fixture(scope="module")
def train_config():
    return TrainConfig(steps=40, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=2, corpus_max_new_tokens=20,
                         corpus_samples_per_prompt=2, corpus_batch_size=5, checkpoint_every=2)


@pytest.fixture(scope="module")
def corpus(target, prompts, train_config):
    return generate_corpus(target, prompts, train_config, eos_token_ids=[EOS], progress=False)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in D.trainable_state(model).items()}


def test_training_reduces_kl(target, corpus, train_config):
    """40 AdamW steps on a 1-layer random draft: corpus KL(p || q) falls by more than 30 % (observed ~45 %)."""
    draft = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=0)
    before = corpus_kl(target, draft, corpus)
    result = D.train_draft(target, draft, corpus, train_config, progress=False)
    after = corpus_kl(target, draft, corpus)
    assert result.finished and result.step == train_config.steps and len(result.losses) == train_config.steps
    assert after < 0.7 * before, (before, after)


def test_only_layers_and_norm_are_trained(target, corpus, train_config):
    draft = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=0)
    embedding = target.get_input_embeddings().weight
    D.train_draft(target, draft, corpus, dataclasses.replace(train_config, steps=3), progress=False)
    assert torch.equal(draft.get_input_embeddings().weight, embedding)
    assert torch.equal(draft.get_output_embeddings().weight, target.get_output_embeddings().weight)
    assert all(name.startswith(("model.layers.", "model.norm.")) for name in D.trainable_state(draft))


def test_resume_gives_the_same_weights(target, corpus, train_config, tmp_path):
    config = dataclasses.replace(train_config, steps=6)
    whole = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=3)
    uninterrupted = D.train_draft(target, whole, corpus, config, progress=False)

    first = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=3)
    stopped = D.train_draft(target, first, corpus, config, checkpoint_dir=tmp_path, stop_at=3, progress=False)
    assert stopped.step == 3 and not stopped.finished
    second = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=3)  # a fresh process would do this
    resumed = D.train_draft(target, second, corpus, config, checkpoint_dir=tmp_path, progress=False)

    assert resumed.finished and resumed.losses == uninterrupted.losses
    expected, actual = _weights(whole), _weights(second)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        D.train_draft(target, second, corpus, dataclasses.replace(config, lr=1e-4), checkpoint_dir=tmp_path, progress=False)


def test_max_seconds_zero_stops_before_any_step(target, corpus, train_config, tmp_path):
    """A run stopped by max_seconds=0 does no step and leaves a checkpoint at step 0."""
    draft = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=0)
    before = _weights(draft)
    result = D.train_draft(target, draft, corpus, train_config, checkpoint_dir=tmp_path, max_seconds=0.0, progress=False)
    assert result.step == 0 and not result.finished
    assert all(torch.equal(before[k], v) for k, v in _weights(draft).items())


def test_saved_draft_rebuilds_with_identical_logits(target, corpus, train_config, tmp_path):
    config = D.DraftConfig("t", num_layers=2, init_layers=(1, 0))
    draft = D.build_draft(target, config, seed=0)
    D.train_draft(target, draft, corpus, dataclasses.replace(train_config, steps=3), progress=False)
    D.save_draft(draft, target, config, tmp_path / "t", {"seed": 0})

    stored = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert stored["seed"] == 0 and stored["draft_config"]["num_layers"] == 2
    loaded = load_trained_draft(target, "t", root=tmp_path)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(draft(input_ids=ids).logits, loaded(input_ids=ids).logits)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "t" / "draft.safetensors"))) == set(D.trainable_state(draft))


def test_packed_weights_load_the_same_draft_with_the_same_digest(target, tmp_path, monkeypatch):
    """How drafts ship: xz-packed weights load to the same logits and keep the digest of the plain files."""
    from specresearch.drafts.store import draft_digest, pack_weights, weights_path

    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path / "cache"))
    config = D.DraftConfig("p", num_layers=1, storage_dtype="bfloat16")
    draft = D.build_draft(target, config, seed=0)
    D.save_draft(draft, target, config, tmp_path / "p")
    plain = load_draft(target, tmp_path / "p")
    digest = draft_digest(tmp_path / "p")
    packed = pack_weights(tmp_path / "p", "draft.safetensors")
    assert packed.name == "draft.safetensors.xz" and not (tmp_path / "p" / "draft.safetensors").exists()
    assert draft_digest(tmp_path / "p") == digest
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, load_draft(target, tmp_path / "p")(input_ids=ids).logits)
    assert weights_path(tmp_path / "p", "draft.safetensors").is_relative_to(tmp_path / "cache")  # decompressed once
    with pytest.raises(FileNotFoundError, match="no weights file"):
        weights_path(tmp_path, "draft.safetensors")


def test_bfloat16_storage_rounds_the_stored_weights(target, tmp_path):
    config = D.DraftConfig("b", num_layers=1, storage_dtype="bfloat16")
    draft = D.build_draft(target, config, seed=0)
    D.save_draft(draft, target, config, tmp_path / "b")
    loaded = load_draft(target, tmp_path / "b")
    for name, weight in D.trainable_state(loaded).items():
        assert torch.equal(weight, D.trainable_state(draft)[name].to(torch.bfloat16).float())


def test_loading_against_another_target_raises(target, tmp_path):
    config = D.DraftConfig("t", num_layers=1)
    D.save_draft(D.build_draft(target, config), target, config, tmp_path / "t")
    other = tiny_llama(VOCAB, seed=1, init_std=0.5, tie_word_embeddings=True).model
    with pytest.raises(ValueError, match="target"):
        load_draft(other, tmp_path / "t")
    with pytest.raises(ValueError, match="name 'missing'"):
        load_trained_draft(target, "missing", root=tmp_path)


def test_copy_of_all_target_layers_reproduces_the_target(target, prompts):
    """A 'draft' made of all the target's layers is the target: alpha = 1 and greedy agreement = 1."""
    layers = target.config.num_hidden_layers
    draft = D.build_draft(target, D.DraftConfig("copy", num_layers=layers, init_layers=tuple(range(layers))))
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(draft(input_ids=ids).logits, target(input_ids=ids).logits)
    measured = measure_draft(target, draft, prompts[:3], max_new_tokens=8, progress=False)
    assert measured.greedy_agreement == 1.0
    assert all(math.isclose(a, 1.0, abs_tol=1e-5) for a in measured.alpha.values()), measured.alpha
    assert all(n == 3 * 8 for n in measured.positions.values())


def test_measure_draft_matches_a_direct_computation(target, prompts):
    """alpha at T = 1 equals the mean over positions of sum_x min(p, q), recomputed by hand on the same sample."""
    draft = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=5)
    measured = measure_draft(target, draft, prompts[:1], temperatures=(1.0,), max_new_tokens=6, seed=7, progress=False)
    generator = torch.Generator().manual_seed(7)
    continuations = sample_continuations(target, [prompts[0]] * 2, [0.0, 1.0], 6, generator)
    sampled = torch.cat([prompts[0], continuations[1]])[None]
    with torch.no_grad():
        p = target(input_ids=sampled).logits[0, len(prompts[0]) - 1 : -1].softmax(-1)
        q = draft(input_ids=sampled).logits[0, len(prompts[0]) - 1 : -1].softmax(-1)
    assert measured.alpha[1.0] == pytest.approx(float(torch.minimum(p, q).sum(-1).mean()), abs=1e-5)
    assert 0.0 < measured.alpha[1.0] < 1.0


def test_left_padded_batch_sampling_matches_single_rows(target, prompts):
    """Greedy rows are deterministic: batching prompts of different lengths (left padding) changes nothing."""
    generator = torch.Generator().manual_seed(0)
    batched = sample_continuations(target, prompts[:4], [0.0] * 4, 10, generator)
    for prompt, row in zip(prompts[:4], batched):
        (single,) = sample_continuations(target, [prompt], [0.0], 10, generator)
        assert torch.equal(row, single)


def test_sampling_stops_after_eos(target, prompts):
    generator = torch.Generator().manual_seed(0)
    (greedy,) = sample_continuations(target, prompts[:1], [0.0], 10, generator)
    eos = int(greedy[2])  # declare the third greedy token an end-of-sequence token
    (cut,) = sample_continuations(target, prompts[:1], [0.0], 10, generator, eos_token_ids=[eos])
    assert torch.equal(cut, greedy[: int((greedy == eos).nonzero()[0]) + 1])


def test_corpus_is_reproducible_and_round_trips(target, prompts, train_config, corpus, tmp_path):
    again = generate_corpus(target, prompts, train_config, eos_token_ids=[EOS], progress=False)
    assert again.prompt_lengths == corpus.prompt_lengths
    assert all(torch.equal(a, b) for a, b in zip(again.sequences, corpus.sequences))
    assert len(corpus.sequences) == len(prompts) * train_config.corpus_samples_per_prompt
    save_corpus(corpus, tmp_path / "c.pt")
    loaded = load_corpus(tmp_path / "c.pt")
    assert all(torch.equal(a, b) for a, b in zip(loaded.sequences, corpus.sequences))


def test_distill_kl_is_the_forward_kl():
    generator = torch.Generator().manual_seed(0)
    target_logits, draft_logits = torch.randn(5, 7, generator=generator), torch.randn(5, 7, generator=generator)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    torch.testing.assert_close(distill_kl(target_logits, draft_logits), expected)
    assert float(distill_kl(target_logits, target_logits)) == pytest.approx(0.0, abs=1e-6)


def test_sparse_kl_with_all_tokens_is_the_exact_kl(target, corpus, train_config):
    """k >= V and a full head: the top-k teacher loss equals distill_kl on the full distributions."""
    draft = D.build_draft(target, D.DraftConfig("t", num_layers=1), seed=0)
    teacher = teacher_targets(target, corpus, train_config.seq_len, top_k=VOCAB, progress=False)
    indices = [0, 3, 5]
    batch = _collate(corpus, indices, train_config.seq_len)
    with torch.no_grad():
        exact = distill_kl(_masked_logits(target, *batch), _masked_logits(draft, *batch))
        sparse = sparse_distill_kl(draft, batch, *teacher.batch(indices))
    assert float(sparse) == pytest.approx(float(exact), rel=1e-5)


def test_sparse_tv_is_one_minus_the_overlap_of_the_renormalised_teacher():
    """sparse_tv = 1 - sum_x min(p~, q): p~ the teacher's top k renormalised over the support (entries off it, -1,
    dropped), computed densely here; a row with no teacher mass on the support is skipped; q = p~ gives 0."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g, requires_grad=True)
    index = torch.tensor([[0, 2, -1], [5, 1, 3], [-1, -1, -1]])
    probs = torch.tensor([[0.5, 0.2, 0.3], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]])
    tv = sparse_tv(logits, index, probs)
    q = logits.detach().softmax(-1)
    dense = []
    for row in range(2):
        p = torch.zeros(6)
        for i, w in zip(index[row].tolist(), probs[row].tolist()):
            if i >= 0:
                p[i] += w
        dense.append(1 - torch.minimum(p / p.sum(), q[row]).sum())
    assert float(tv.detach()) == pytest.approx(float(torch.stack(dense).mean()), abs=1e-6)
    tv.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    same = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert float(sparse_tv(same, torch.tensor([[0, 1, 2]]), torch.tensor([[0.5, 0.3, 0.2]]))) == pytest.approx(0.0, abs=1e-6)


def test_subset_head_puts_zero_mass_off_its_tokens(target):
    ids = torch.tensor([1, 4, 9, 30])
    head = SubsetHead(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), ids, VOCAB)
    hidden = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    q = head(hidden).softmax(-1)  # [3, V]
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[ids] = False
    assert torch.all(q[:, off] == 0) and torch.allclose(q[:, ids], head.subset_logits(hidden).softmax(-1))
    assert torch.equal(head.index_of[ids], torch.arange(4)) and int(head.index_of[0]) == -1
    with pytest.raises(ValueError, match="token_ids"):
        SubsetHead(torch.randn(2, 8), torch.tensor([3, 3]), VOCAB)
    with pytest.raises(ValueError, match="token_ids"):
        SubsetHead(torch.randn(2, 8), torch.tensor([3, VOCAB]), VOCAB)


def test_head_token_ids_takes_the_most_teacher_mass(target, corpus, train_config):
    teacher = teacher_targets(target, corpus, train_config.seq_len, top_k=8, progress=False)
    mass = torch.zeros(VOCAB, dtype=torch.float64)
    mass.index_add_(0, torch.cat(teacher.ids).flatten(), torch.cat(teacher.probs).flatten().double())
    chosen = head_token_ids(teacher.ids, teacher.probs, VOCAB, 10, required=[EOS])
    assert len(chosen) == 10 and EOS in chosen.tolist() and torch.equal(chosen, chosen.sort().values)
    others = [i for i in range(VOCAB) if i not in chosen.tolist()]
    assert float(mass[[i for i in chosen.tolist() if i != EOS]].min()) >= float(mass[others].max())
    # stored as a feature corpus stores them (int32 ids, float16 probabilities): the same ids as from the
    # float16-rounded probabilities widened first
    stored = head_token_ids([t.int() for t in teacher.ids], [t.half() for t in teacher.probs], VOCAB, 10, required=[EOS])
    widened = head_token_ids(teacher.ids, [t.half().float() for t in teacher.probs], VOCAB, 10, required=[EOS])
    assert torch.equal(stored, widened)


def test_subset_head_draft_trains_ships_and_reloads(target, corpus, train_config, tmp_path):
    """A 20-token trained head: its KL falls, only layers/norm/head train, and the shipped copy (bfloat16,
    token ids stored) rebuilds with the logits of the rounded in-memory draft."""
    config = D.DraftConfig("s", num_layers=1, head_tokens=20, train_head=True, storage_dtype="bfloat16")
    teacher = teacher_targets(target, corpus, train_config.seq_len, top_k=train_config.teacher_top_k, progress=False)
    ids = head_token_ids(teacher.ids, teacher.probs, VOCAB, 20, required=[EOS])
    draft = D.build_draft(target, config, seed=0, head_token_ids=ids)
    assert torch.equal(draft.get_output_embeddings().weight, target.get_output_embeddings().weight[ids])
    indices = list(range(len(corpus.sequences)))
    batch = _collate(corpus, indices, train_config.seq_len)
    with torch.no_grad():
        before = float(sparse_distill_kl(draft, batch, *teacher.batch(indices)))
    result = D.train_draft(target, draft, corpus, train_config, teacher=teacher, progress=False)
    with torch.no_grad():
        after = float(sparse_distill_kl(draft, batch, *teacher.batch(indices)))
    assert result.finished and after < 0.7 * before, (before, after)
    assert set(D.trainable_state(draft)) >= {"lm_head.weight"}
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)

    D.round_to_storage(draft, config)
    D.save_draft(draft, target, config, tmp_path / "s")
    loaded = load_draft(target, tmp_path / "s")
    probe = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(draft(input_ids=probe).logits, loaded(input_ids=probe).logits)
    from specresearch.models.causal_lm import CausalLM

    assert CausalLM(loaded, device="cpu").vocab_size == VOCAB  # the logits' size, not the head's 20 rows
    with pytest.raises(ValueError, match="head_token_ids"):
        D.build_draft(target, config, seed=0)
    with pytest.raises(ValueError, match="teacher"):
        D.train_draft(target, draft, corpus, dataclasses.replace(train_config, seq_len=32), teacher=teacher, progress=False)


@pytest.mark.parametrize("field, kwargs", [
    ("num_layers", {"num_layers": 0}),
    ("intermediate_size", {"intermediate_size": 0}),
    ("init_layers", {"num_layers": 2, "init_layers": (0,)}),
    ("init_layers", {"init_layers": (-1,)}),
    ("storage_dtype", {"storage_dtype": "int8"}),
    ("name", {"name": "a/b"}),
])
def test_bad_draft_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        D.DraftConfig(**{"name": "x", **kwargs})


@pytest.mark.parametrize("field, value", [
    ("steps", 0), ("batch_size", 0), ("seq_len", 1), ("lr", 0.0), ("lr", float("nan")), ("warmup_steps", -1),
    ("grad_clip", 0.0), ("corpus_temperature", 0.0), ("corpus_max_new_tokens", 0), ("corpus_samples_per_prompt", 0),
    ("seed", -1), ("checkpoint_every", 0), ("corpus_batch_size", 0), ("weight_decay", -0.1),
])
def test_bad_train_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_presets_and_boundary_errors(target, corpus, train_config):
    assert D.DraftConfig.from_name("tiny-1l").num_layers == 1
    with pytest.raises(ValueError, match="name"):
        D.DraftConfig.from_name("huge-99l")
    with pytest.raises(ValueError, match="init_layers"):
        D.build_draft(target, D.DraftConfig("t", num_layers=1, init_layers=(7,)))
    draft = D.build_draft(target, D.DraftConfig("t", num_layers=1))
    with pytest.raises(ValueError, match="seq_len"):
        D.train_draft(target, draft, corpus, dataclasses.replace(train_config, seq_len=2), progress=False)
    with pytest.raises(ValueError, match="temperatures"):
        measure_draft(target, draft, [torch.tensor([3, 4])], temperatures=(0.0,), progress=False)


SHIPPED = D.drafts_dir() / "v8k-4l"


@pytest.mark.slow
def test_shipped_draft_loads_offline_and_matches_its_manifest():
    """The shipped draft rebuilds against the embedded target (offline) and its re-measured alpha on the
    manifest's 3-prompt check slice matches the recorded one within 2e-3: the measurement is deterministic
    (seeded), so only float rounding across machines/thread counts can move it."""
    from specresearch.drafts.registry import load_pair

    lm, draft_lm, tokenizer = load_pair("smollm2-135m-instruct", SHIPPED.name, device="cpu")
    draft = draft_lm.model
    manifest = json.loads((SHIPPED / "manifest.json").read_text())
    check = manifest["check_measurement"]
    heldout = {p["id"]: p for p in load_prompts(Path(D.drafts_dir()).parent / "prompts.jsonl")}
    ids = encode_chat([heldout[i] for i in check["prompt_ids"]], tokenizer)
    measured = measure_draft(lm.model, draft, ids, max_new_tokens=check["max_new_tokens"], seed=check["seed"],
                               eos_token_ids=[tokenizer.eos_token_id], progress=False)
    for t, alpha in check["alpha"].items():
        assert measured.alpha[float(t)] == pytest.approx(alpha, abs=2e-3)
    assert measured.greedy_agreement == pytest.approx(check["greedy_agreement"], abs=2e-3)


class _CharTokenizer:
    """Stands in for a chat tokenizer: one token per character of the first 12 characters."""

    eos_token_id = EOS

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [2 + ord(c) % (VOCAB - 2) for c in messages[0]["content"][:12]]


def test_run_distillation_resumes_then_ships(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "c", "turns": [f"prompt number {i}"]}) + "\n" for i in range(4)))
    config = TrainConfig(steps=4, batch_size=2, seq_len=64, corpus_max_new_tokens=6, corpus_samples_per_prompt=1)
    kwargs = dict(prompts_path=prompts, heldout_path=prompts, out_dir=tmp_path / "out", heldout_prompts=2, measure_tokens=4, progress=False)

    first = D.run_distillation(target, _CharTokenizer(), D.DraftConfig("t"), config, max_seconds=0.0, **kwargs)
    assert not first["finished"] and first["training"]["steps"] == 0 and not (tmp_path / "out").exists()
    second = D.run_distillation(target, _CharTokenizer(), D.DraftConfig("t"), config, command="test", **kwargs)
    assert second["finished"] and second["training"]["steps"] == 4 and len(second["training"]["kl_curve"]) == 4
    assert second["corpus"]["sequences"] == 4 and set(second["measurement"]["alpha"]) == {"0.2", "0.6", "1.0"}
    assert 0 < second["cost"]["c"]
    shipped = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert shipped["command"] == "test" and shipped["measurement"] == second["measurement"]
    load_draft(target, tmp_path / "out")


def test_evenly_spaced_prompts_spread_over_the_file_and_keep_all_when_asked_for_more():
    rows = [{"id": str(i)} for i in range(10)]
    assert [r["id"] for r in evenly_spaced(rows, 4)] == ["0", "2", "5", "8"]  # round(i * 10 / 4)
    assert evenly_spaced(rows, 10) == rows and evenly_spaced(rows, 12) == rows
