"""DFlash block drafters as a draft the engine verifies (``drafts.dflash``).

* In transformers' layout (what ``MuseGlimmerAssistantModel.save_pretrained`` writes) the drafter's blocks equal
  transformers' own forward of the drafter on the same context, at every block position, for one prompt and for a
  left-padded batch, with full attention and with a sliding window that cuts the context; a drafted slot returns the
  next position of its anchor's block.
* In z-lab's layout (``dflash_config``, ``fc`` / ``hidden_norm``) the same weights give the same blocks; a z-lab
  sliding layer is causal with ``q - k < w`` (transformers' forward run with that mask).
* In vllm-project/speculators' layout (``transformer_layer_config``, ``aux_hidden_state_layer_ids``) the same weights
  give the same blocks; with a draft vocabulary the law lives on it and its logits are its own head's.
* Through the engine: greedy chains, token chains, sampled trees and dynamic trees give the target's greedy tokens;
  T = 1 keeps the target's law (exact Bonferroni test, false-positive rate <= 1e-6); a step drafts at most
  ``block_size - 1`` tokens.
* DFlash2, a missing mask token, a wrong tensor, another hidden size, speculators' sample_from_anchor, its
  sliding layers and a key this loader does not read: refused in one line.
"""

import json

import pytest
import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.dflash import DFlashDraft, load_dflash
from specresearch.drafts.registry import DFLASH_FORMAT, draft_format, draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import tiny_dflash_pair

BLOCK = 4


def _pair(tmp_path, **config):
    """The tiny target (wrapped), transformers' drafter (``config`` set on it before its weights are drawn) and the
    directory it saved itself to."""
    target, assistant = tiny_dflash_pair(block_size=BLOCK)
    if config:
        from transformers import MuseGlimmerAssistantConfig
        from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import MuseGlimmerAssistantModel

        settings = {**assistant.config.to_dict(), **config}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            assistant = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(**settings)).eval()
    assistant.save_pretrained(tmp_path / "drafter")
    return CausalLM(target), assistant, tmp_path / "drafter"


def _theirs(target, assistant, prompt, mask=None, head=None, first=1):
    """transformers' drafter on the context of ``prompt``'s tokens before the last (the anchor) -> the target's head
    (or ``head``) on block positions ``first``..B-1, ``[B - first, V]``; ``mask``: the attention mask of each layer
    type, else its own."""
    from transformers.cache_utils import DFlashCache

    config, cache = assistant.config, DFlashCache(config=assistant.config)  # as its candidate generator calls it
    cache.set_previous_accepted_tokens(len(prompt) - 1)
    with torch.no_grad():
        hidden = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1][:, :-1] for i in config.target_layer_ids], -1)
        ids = torch.tensor([[prompt[-1]] + [config.mask_token_id] * (config.block_size - 1)])
        out = assistant(noise_embeds=target.model.get_input_embeddings()(ids), context_hidden_states=context,
                        position_ids=torch.arange(len(prompt) - 1 + config.block_size)[None],
                        attention_mask=mask, cache=cache).last_hidden_state
        return (head or target.model.get_output_embeddings())(out[:, first:])[0]


def _ours(target, draft, prompts, drafted=(7, 19)):
    """The blocks as the engine feeds the draft (``engine.generate``'s prefill for feature readers): the pending
    token's logits, then one per drafted token. -> ``[B, 1 + len(drafted), V]``."""
    from specresearch.engine.prompts import encode_prompts

    ids, mask = encode_prompts(prompts, None)
    _, features = target.prefill(ids[:, :-1], mask[:, :-1], hidden_layers=draft.feature_layers)
    before = torch.cat([torch.zeros_like(features[:, :1]), features], 1)
    before = before * torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1)[:, :, None]
    draft.observe(before[:, :-1])
    draft.prefill(ids[:, :-1], mask[:, :-1])
    draft.observe(before[:, -1:])
    rows = [draft.score(ids[:, -1:])[:, -1]]
    rows += [draft.score(torch.full((len(prompts), 1), y))[:, -1] for y in drafted]
    return torch.stack(rows, 1)


PROMPTS = [[5, 9, 3, 17, 22, 8, 41, 30, 12, 2, 33], [7, 2, 11, 4]]


@pytest.mark.parametrize("setting", [dict(), dict(layer_types=["full_attention"]), dict(sliding_window=3)])
def test_dflash_blocks_equal_transformers_drafter(tmp_path, setting):
    target, assistant, directory = _pair(tmp_path, **setting)
    draft = draft_from_name(str(directory), target)
    assert isinstance(draft, DFlashDraft) and draft_format(directory) == DFLASH_FORMAT
    assert draft.feature_layers == (1, 2) and draft.plan_length(8) == BLOCK - 1
    got = _ours(target, draft, PROMPTS)  # a left-padded batch: each row against its own run
    for row, prompt in enumerate(PROMPTS):
        want = _theirs(target, assistant, prompt)
        assert torch.allclose(got[row], want, atol=1e-4), (got[row] - want).abs().max()
    with pytest.raises(ValueError, match=f"drafts at most {BLOCK - 1} tokens"):
        draft.score(torch.tensor([[1], [1]]))
    if "sliding_window" in setting:  # the window cut the context: without it the first row's block differs
        full = _theirs(target, assistant, PROMPTS[0], mask={"sliding_attention": None, "full_attention": None})
        assert not torch.allclose(got[0], full, atol=1e-2)


def _zlab(directory, source, **dflash):
    """The drafter of transformers' layout in ``source`` rewritten in z-lab's (``dflash_config``, ``fc``,
    ``hidden_norm``)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    layer_ids, mask_id = config.pop("target_layer_ids"), config.pop("mask_token_id")
    config.update(model_type="qwen3", architectures=["DFlashDraftModel"],
                  dflash_config={"target_layer_ids": layer_ids, "mask_token_id": mask_id, **dflash})
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    names = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    save_file({names.get(k, k): v for k, v in load_file(source / "model.safetensors").items()},
              directory / "model.safetensors")
    return directory


def test_zlab_layout_reads_the_same_weights_and_its_sliding_layers_are_causal(tmp_path):
    target, assistant, directory = _pair(tmp_path, layer_types=["full_attention"])
    zlab = draft_from_name(str(_zlab(tmp_path / "zlab", directory)), target)
    assert draft_format(tmp_path / "zlab") == DFLASH_FORMAT
    assert torch.equal(_ours(target, zlab, PROMPTS), _ours(target, draft_from_name(str(directory), target), PROMPTS))
    target, assistant, directory = _pair(tmp_path / "w", sliding_window=3)
    zlab = load_dflash(target, _zlab(tmp_path / "zlab-sliding", directory))
    got = _ours(target, zlab, [PROMPTS[0]])[0]
    # z-lab's sliding mask (dflash/model.py, _attention_mask): over [context; block], key j visible to query i iff
    # j <= i and i - j < w
    n, size = len(PROMPTS[0]) - 1, BLOCK
    q, k = torch.arange(n, n + size)[:, None], torch.arange(n + size)[None]
    mask = ((k <= q) & (q - k < 3))[None, None]
    assert torch.allclose(got, _theirs(target, assistant, PROMPTS[0], mask={"sliding_attention": mask}), atol=1e-4)


def _speculators(directory, source, draft_ids=None, **options):
    """The drafter of transformers' layout in ``source`` rewritten as vllm-project/speculators saves a DFlash drafter:
    the layer's config under ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (z-lab's ids + 1), z-lab's
    tensor names; with ``draft_ids``, a draft vocabulary: its own random ``lm_head`` and ``d2t`` / ``t2d``."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings",
                                    "vocab_size", "rope_parameters", "layer_types")} | {"model_type": "qwen3"}
    vocab = config["vocab_size"]
    spec = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
            "transformer_layer_config": layer, "block_size": config["block_size"], "mask_token_id": config["mask_token_id"],
            "aux_hidden_state_layer_ids": [i + 1 for i in config["target_layer_ids"]], "target_hidden_size": None,
            "draft_vocab_size": vocab if draft_ids is None else len(draft_ids), "sample_from_anchor": False,
            "sliding_window_non_causal": False, **options}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(spec))
    names = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    tensors = {names.get(k, k): v for k, v in load_file(source / "model.safetensors").items()}
    if draft_ids is not None:
        g = torch.Generator().manual_seed(3)
        tensors |= {"lm_head.weight": torch.randn(len(draft_ids), layer["hidden_size"], generator=g),
                    "d2t": draft_ids - torch.arange(len(draft_ids)),
                    "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True)}
    save_file(tensors, directory / "model.safetensors")
    return directory, tensors


def test_speculators_layout_reads_aux_ids_and_its_draft_vocabulary(tmp_path):
    """speculators' DFlash layout: the full-vocabulary drafter gives the blocks of the same weights in transformers'
    layout; with a draft vocabulary of 40 tokens the block's law lives on them, its logits its own head's (d2t-mapped);
    sliding layers and an unknown key are refused."""
    target, assistant, directory = _pair(tmp_path, layer_types=["full_attention"])
    full, _ = _speculators(tmp_path / "full", directory)
    assert draft_format(full) == DFLASH_FORMAT
    same = _ours(target, draft_from_name(str(directory), target), PROMPTS)
    assert torch.equal(_ours(target, draft_from_name(str(full), target), PROMPTS), same)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40].sort().values
    subset, tensors = _speculators(tmp_path / "subset", directory, draft_ids=ids, draft_vocab_size=40)
    got = _ours(target, draft_from_name(str(subset), target), [PROMPTS[0]])[0]
    off = torch.ones(64, dtype=torch.bool).index_fill_(0, ids, False)
    assert torch.all(got.softmax(-1)[:, off] == 0)  # no mass off the draft vocabulary
    head = lambda h: h @ tensors["lm_head.weight"].T  # noqa: E731
    assert torch.allclose(got[:, ids], _theirs(target, assistant, PROMPTS[0], head=head), atol=1e-4)
    refused = {"key": (dict(dspark_markov_rank=4), r"keys \['dspark_markov_rank'\]"),
               "sliding": (dict(transformer_layer_config={"model_type": "qwen3", "layer_types": ["sliding_attention"]}),
                           "sliding-window")}
    for name, (options, message) in refused.items():
        _speculators(tmp_path / name, directory, **options)
        with pytest.raises(ValueError, match=message):
            load_dflash(target, tmp_path / name)


GREEDY_PROMPTS = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12], [20, 21]]


def greedy_runs_give_the_targets_tokens(target, draft, runs, cap: int) -> None:
    """Greedy chains and trees (``runs``: ``speculative_generate``'s options) with ``draft`` give the target's own
    greedy tokens, each step drafting at most ``cap`` tokens."""
    greedy = SamplingConfig(temperature=0.0)
    want = autoregressive_generate(target, GREEDY_PROMPTS, max_new_tokens=12, sampling=greedy).tokens
    for options in runs:
        result = speculative_generate(target, draft, GREEDY_PROMPTS, max_new_tokens=12, sampling=greedy, **options)
        assert result.tokens == want, options
        assert max(step.gamma for step in result.steps) <= cap, options


def exact_and_lossless(target, draft, cap: int, *, gamma: int = 3, rule: str = "block") -> None:
    """Greedy block, traversal and dynamic one-hot runs give the target's tokens, each step drafting at most ``cap``
    tokens; T = 1 keeps the target's law under ``rule`` (exact Bonferroni test, false-positive rate <= 1e-6)."""
    greedy_runs_give_the_targets_tokens(target, draft, (
        dict(verifier="block", gamma=gamma), dict(verifier="traversal", num_drafts=2, gamma=3),
        dict(verifier="onehot", num_drafts=2, gamma=gamma, draft_law="dynamic")), cap)
    result = lossless_test(target, draft, rule, [5, 9, 3, 17], sampling=SamplingConfig(), gamma=gamma, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=0, batch_size=3_000)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def refused_with_config(target, write, cases: dict) -> None:
    """For each ``cases[name] = (config changes, message)``, the drafter ``write(name)`` saves (-> ``(directory,
    tensors)``) with its config changed is refused by ``load_dflash`` with ``message``."""
    for name, (changes, message) in cases.items():
        directory, _ = write(name)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ValueError, match=message):
            load_dflash(target, directory)


def test_dflash_runs_chains_and_trees_exactly_and_keeps_the_targets_law(tmp_path):
    target, _, directory = _pair(tmp_path)
    draft = draft_from_name(str(directory), target)
    greedy_runs_give_the_targets_tokens(target, draft, (
        dict(verifier="block", gamma=3), dict(verifier="token", gamma=6),
        dict(verifier="traversal", num_drafts=2, gamma=3),
        dict(verifier="onehot", num_drafts=2, gamma=3, draft_law="dynamic")), BLOCK - 1)  # the plan caps a chain
    result = lossless_test(target, draft, "block", [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=0, batch_size=3_000)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value
    with pytest.raises(ValueError, match="drafts at most 3 tokens"):
        speculative_generate(target, draft, GREEDY_PROMPTS, max_new_tokens=8, sampling=SamplingConfig(temperature=0.0),
                             verifier="traversal", num_drafts=2, gamma=5)


def test_dflash_layouts_it_does_not_read_are_refused_in_one_line(tmp_path):
    target, _, directory = _pair(tmp_path)
    cases = {
        "dflash2": (dict(architectures=["DFlash2DraftModel"], conv_kernel_size=3), "not DFlash2"),
        "no_mask": (dict(mask_token_id=None), r"without \['mask_token_id'\]"),
        "layers": (dict(target_layer_ids=[0, 7]), "outside the target's 2 layers"),
        "width": (dict(hidden_size=48), "hidden size 48"),
        "mask": (dict(mask_token_id=64), "mask_token_id 64 is not a token"),
    }
    for name, (change, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {**json.loads((directory / "config.json").read_text()), **change}))
        (tmp_path / name / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=message):
            load_dflash(target, tmp_path / name)
    from safetensors.torch import load_file, save_file

    (tmp_path / "tensor").mkdir()
    (tmp_path / "tensor" / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    tensors["layers.0.self_attn.q_norm.weight"] = tensors["layers.0.self_attn.q_norm.weight"][:-1].clone()
    save_file(tensors, tmp_path / "tensor" / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor layers.0.self_attn.q_norm.weight has shape \(7,\), expected \(8,\)"):
        load_dflash(target, tmp_path / "tensor")


def _dspark(directory, source, *, anchor=True, rank=4, gated=False, draft_ids=None, **options):
    """The drafter of transformers' layout in ``source`` as vllm-project/speculators saves a DSpark drafter
    (``speculators_model_type: dspark``): ``sample_from_anchor``, a Markov head of ``rank`` (``gated``) and a
    confidence head, their weights random. -> (directory, tensors)."""
    from safetensors.torch import save_file

    H, vocab = 32, 64
    spec = dict(speculators_model_type="dspark", sample_from_anchor=anchor, markov_rank=rank,
                markov_head_type="gated" if gated else "vanilla", enable_confidence_head=True,
                confidence_head_with_markov=True, **options)
    directory, tensors = _speculators(directory, source, draft_ids=draft_ids, **spec)
    g = torch.Generator().manual_seed(5)
    draft_vocab = vocab if draft_ids is None else len(draft_ids)
    tensors |= {"markov_head.markov_w1.weight": torch.randn(vocab, rank, generator=g),
                "markov_head.markov_w2.weight": torch.randn(draft_vocab, rank, generator=g),
                "confidence_head.proj.weight": torch.randn(1, H + rank, generator=g),
                "confidence_head.proj.bias": torch.randn(1, generator=g)}
    if gated:
        tensors |= {"markov_head.gate_proj.weight": torch.randn(rank, H + rank, generator=g),
                    "markov_head.gate_proj.bias": torch.randn(rank, generator=g)}
    save_file(tensors, directory / "model.safetensors")
    return directory, tensors


def _markov(tensors, previous, hidden):
    """speculators' Markov bias by hand: ``w2 @ e``, ``e = w1[previous]``, gated by ``sigmoid(W [hidden; e] + b)``."""
    e = tensors["markov_head.markov_w1.weight"][previous]
    if "markov_head.gate_proj.weight" in tensors:
        z = torch.cat([hidden, e], -1) @ tensors["markov_head.gate_proj.weight"].T + tensors["markov_head.gate_proj.bias"]
        e = torch.sigmoid(z) * e
    return e @ tensors["markov_head.markov_w2.weight"].T


@pytest.mark.parametrize("anchor, gated, vocabulary", [(True, False, False), (False, True, True), (True, True, False)])
def test_dspark_adds_the_markov_bias_of_the_previous_token_to_the_block(tmp_path, anchor, gated, vocabulary):
    """speculators' DSpark layout: drafted position j's logits are the block's (position j with sample_from_anchor,
    j + 1 without) plus the Markov bias of the token before it (the anchor, then the drafted tokens), on the draft
    vocabulary's columns; without the bias the logits differ."""
    target, assistant, directory = _pair(tmp_path, layer_types=["full_attention"])
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40].sort().values if vocabulary else None
    dspark, tensors = _dspark(tmp_path / "dspark", directory, anchor=anchor, gated=gated, draft_ids=ids)
    draft = draft_from_name(str(dspark), target)
    assert draft_format(dspark) == DFLASH_FORMAT and draft.plan_length(8) == (BLOCK if anchor else BLOCK - 1)
    prompt, drafted = PROMPTS[0], (7, 19)
    got = _ours(target, draft, [prompt], drafted)[0]
    columns = ids if vocabulary else torch.arange(64)
    head = (lambda h: h @ tensors["lm_head.weight"].T) if vocabulary else None  # noqa: E731
    first = 0 if anchor else 1
    base = _theirs(target, assistant, prompt, head=head, first=first)[: 1 + len(drafted)]
    hidden = _theirs(target, assistant, prompt, head=lambda h: h, first=first)[: 1 + len(drafted)]
    want = base + _markov(tensors, torch.tensor([prompt[-1], *drafted]), hidden)
    assert torch.allclose(got[:, columns], want, atol=1e-4), (got[:, columns] - want).abs().max()
    assert not torch.allclose(got[:, columns], base, atol=1e-2)  # the bias matters
    if vocabulary:
        off = torch.ones(64, dtype=torch.bool).index_fill_(0, ids, False)
        assert torch.all(got.softmax(-1)[:, off] == 0)


def test_dspark_runs_chains_and_trees_exactly_and_keeps_the_targets_law(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"])
    dspark, _ = _dspark(tmp_path / "dspark", directory, anchor=True, gated=True)
    exact_and_lossless(target, draft_from_name(str(dspark), target), BLOCK, gamma=4, rule="token")  # B from the anchor


def test_dspark_layouts_it_does_not_read_are_refused_in_one_line(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"])
    cases = {"no_anchor_key": (dict(), "no sample_from_anchor"), "rnn": (dict(markov_head_type="rnn"), "'rnn'"),
             "null_rank": (dict(markov_rank=None), "markov_rank None")}
    for name, (options, message) in cases.items():
        dspark, _ = _dspark(tmp_path / name, directory)
        config = json.loads((dspark / "config.json").read_text())
        if name == "no_anchor_key":
            del config["sample_from_anchor"]
        (dspark / "config.json").write_text(json.dumps({**config, **options}))
        with pytest.raises(ValueError, match=message):
            load_dflash(target, dspark)
    deepseek = _zlab(tmp_path / "deepseek", directory, markov_rank=4)
    with pytest.raises(ValueError, match="DSpark drafter outside speculators' layout"):
        load_dflash(target, deepseek)
