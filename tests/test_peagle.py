"""P-EAGLE heads in vllm-project/speculators' layout as a draft the engine verifies (``drafts.peagle``).

* The d-th drafted token's logits are the format's definition written out uncached: EAGLE-3's layer over the prompt's
  slots followed by d mask slots (``embed(mask_token_id)``, ``fc(mask_hidden)``); they do not move with the tokens
  drafted before them; left-padded batches give each row's numbers alone.
* Through the engine: greedy chains and trees give the target's tokens; T = 1 keeps the target's law (exact
  Bonferroni test, false-positive rate <= 1e-6); a chain drafts at most the depths trained, a deeper tree is refused.
* Refused in one line: a config without ``mask_token_id`` or the depths trained, a mask token outside the vocabulary,
  a checkpoint without ``mask_hidden``, feeding true features over drafted slots not rolled back; the captured steps
  name the draft as one they do not run.

speculators' own ``PEagleDraftModel`` against the loader: ``benchmarks/speculators_heads.py``.
"""

import json

import pytest
import torch
from test_published_drafts import (
    LAYERS,
    H,
    _exact_and_lossless,
    _reference,
    _speculators_checkpoint,
    _target,
)

from specresearch.config import SamplingConfig
from specresearch.drafts.peagle import PEagleDraft, load_peagle
from specresearch.drafts.registry import PEAGLE_FORMAT, draft_format, draft_from_name
from specresearch.engine.generate import speculative_generate
from specresearch.engine.static import static_available

VOCAB, DEPTHS, MASK = 64, 4, 63


def _peagle(directory, *, depths=DEPTHS, drop=None, **changes):
    """A random P-EAGLE head as speculators saves it: a speculators EAGLE-3 head (``norm_before_residual``) with its
    type, ``mask_token_id`` and depths in the config, ``mask_hidden`` and ``embed_tokens`` beside its tensors.
    -> (tensors under the repository's names, draft token ids)."""
    from safetensors.torch import load_file, save_file

    tensors, token_ids = _speculators_checkpoint(directory)
    g = torch.Generator().manual_seed(5)
    extra = {"mask_hidden": torch.randn(1, 1, 3 * H, generator=g), "embed_tokens.weight": torch.randn(VOCAB, H, generator=g)}
    saved = load_file(directory / "model.safetensors") | extra
    save_file({k: v for k, v in saved.items() if k != drop}, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config |= {"speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"], "mask_token_id": MASK,
               "embed_requires_grad": True, "speculators_config": {"algorithm": "peagle", "proposal_methods": [
                   {"proposal_type": "greedy", "speculative_tokens": depths}]}}
    (directory / "config.json").write_text(json.dumps({k: v for k, v in (config | changes).items() if v is not None}))
    return tensors | extra, token_ids


def _definition(t, target, prompt, depth, token_ids):
    """The law of the ``depth``-th drafted token after ``prompt`` by the format's definition (uncached): slots
    ``x_1..x_n`` reading the features of the slots before, then ``depth - 1`` mask slots. -> log-probabilities [V]."""
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=(2, LAYERS // 2, LAYERS - 3))
    inputs = torch.cat([features[0, :-1], t["mask_hidden"][0].expand(depth - 1, -1)]) @ t["fc.weight"].T + t["fc.bias"]
    tokens = torch.tensor(prompt[1:] + [MASK] * (depth - 1))
    return _reference(t, tokens, inputs, t["embed_tokens.weight"], token_ids, norm_before_residual=True)[1][-1]


def _drafted(draft, target, prompts, tokens):
    """Each drafted depth's logits after the left-padded ``prompts``, the drafting calls fed ``tokens [B, K - 1]``.
    -> ``[B, K, V]`` log-probabilities (depth 1 from the feeding call)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    _, features = target.prefill(ids, mask, hidden_layers=draft.feature_layers)
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    rows = [draft.prefill(ids, mask)]
    rows += [draft.score(tokens[:, d : d + 1])[:, 0] for d in range(tokens.shape[1])]
    return torch.stack(rows, 1).log_softmax(-1)


def test_peagle_drafts_follow_the_formats_definition_and_ignore_the_drafted_tokens(tmp_path):
    target = _target()
    tensors, token_ids = _peagle(tmp_path / "head")
    assert draft_format(tmp_path / "head") == PEAGLE_FORMAT
    draft = draft_from_name(str(tmp_path / "head"), target)
    assert isinstance(draft, PEagleDraft) and draft.format == "P-EAGLE" and draft.plan_length(9) == DEPTHS
    prompts = [[5, 9, 3, 17, 22, 8, 41], [7, 2, 11, 4]]
    got = _drafted(draft, target, prompts, torch.tensor([[30, 31, 32], [40, 41, 42]]))
    for row, prompt in enumerate(prompts):
        for depth in range(1, DEPTHS + 1):
            want = _definition(tensors, target, prompt, depth, token_ids)
            finite = want.isfinite()
            assert torch.equal(got[row, depth - 1].exp() > 0, finite)
            assert torch.allclose(got[row, depth - 1][finite], want[finite], atol=1e-4), (row, depth)
    other = _drafted(draft, target, prompts, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.allclose(other, got, atol=1e-6)  # the drafted tokens are never read
    alone = _drafted(draft, target, prompts[1:], torch.tensor([[40, 41, 42]]))
    assert torch.allclose(alone[0], got[1], atol=1e-4)
    assert not torch.allclose(got[:, 1], got[:, 2], atol=1e-2)  # depths differ: the mask slots see each other
    # a step later, as the engine goes on: the drafted slots rolled back, two accepted tokens fed with true features
    _drafted(draft, target, prompts[:1], torch.tensor([[30, 31, 32]]))
    draft.rollback(DEPTHS - 1)
    longer = prompts[0] + [30, 31]
    ids = torch.tensor([longer])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    draft.observe(features[:, -3:-1])
    rows = [draft.score(ids[:, -2:])[:, -1]] + [draft.score(torch.tensor([[7]]))[:, 0] for _ in range(DEPTHS - 1)]
    for depth, row in enumerate(rows, start=1):
        want = _definition(tensors, target, longer, depth, token_ids)
        finite = want.isfinite()
        assert torch.allclose(row.log_softmax(-1)[0][finite], want[finite], atol=1e-4), depth


def test_peagle_runs_chains_and_trees_exactly_keeps_the_targets_law_and_drafts_at_most_its_depths(tmp_path):
    target = _target()
    _peagle(tmp_path / "head")
    draft = draft_from_name(str(tmp_path / "head"), target)
    _exact_and_lossless(target, draft, chain_gamma=DEPTHS + 2, tree_gamma=3, k=3, seed=0)
    greedy = SamplingConfig(temperature=0.0)
    result = speculative_generate(target, draft, [[5, 9, 3]], max_new_tokens=12, sampling=greedy, gamma=DEPTHS + 2)
    assert max(step.gamma for step in result.steps) == DEPTHS
    with pytest.raises(ValueError, match=f"drafts at most {DEPTHS} tokens"):
        speculative_generate(target, draft, [[5, 9, 3]], max_new_tokens=8, sampling=greedy, verifier="traversal",
                             num_drafts=2, gamma=DEPTHS + 1)
    assert static_available(target, draft, gamma=DEPTHS) is None  # its static form: tests/test_peagle_static.py


def test_peagle_configs_and_checkpoints_it_cannot_read_and_misuse_are_refused_in_one_line(tmp_path):
    target = _target()
    cases = {"no_mask": (dict(mask_token_id=None), "without mask_token_id"),
             "no_depths": (dict(speculators_config={"algorithm": "peagle"}), "speculative_tokens"),
             "outside": (dict(mask_token_id=VOCAB), "not a token id of the target's vocabulary"),
             "sliding": (dict(transformer_layer_config={"model_type": "llama", "use_sliding_window": True}),
                         "sliding-window")}
    for name, (changes, message) in cases.items():
        _peagle(tmp_path / name, **changes)
        with pytest.raises(ValueError, match=message):
            load_peagle(target, tmp_path / name)
    _peagle(tmp_path / "no_hidden", drop="mask_hidden")
    with pytest.raises(ValueError, match=r"missing \['mask_hidden'\]"):
        load_peagle(target, tmp_path / "no_hidden")
    _peagle(tmp_path / "head")
    draft = load_peagle(target, tmp_path / "head")
    _drafted(draft, target, [[5, 9, 3]], torch.tensor([[30]]))
    draft.observe(torch.zeros(1, 1, draft.feature_size))
    with pytest.raises(ValueError, match="roll them back"):
        draft.score(torch.tensor([[30]]))
