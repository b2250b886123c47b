"""DFlash2 drafters in vllm-project/speculators' layout as a draft the engine verifies (``drafts.dflash``,
``drafts.dflash2``).

* The grouped convolution equals its definition written as a loop over rows, taps and channels.
* With the convolutions at identity, a drafted position's logits are transformers' DFlash block's (same weights)
  with its top ``selector_top_k`` tokens rescored by the bilinear selector of the token before (the anchor, then the
  drafted ones), by hand, and no mass elsewhere; random convolutions change the block.
* Through the engine: greedy chains and trees give the target's tokens; T = 1 keeps the target's law with the
  draft's law on 3 candidates a position (exact Bonferroni test, false-positive rate <= 1e-6).
* A config without a DFlash2 key, with a draft vocabulary or a group size that does not divide the width: refused in
  one line.

speculators' own ``DFlash2DraftModel`` against the loader: ``benchmarks/speculators_heads.py``.
"""

import pytest
import torch
from test_dflash import BLOCK, PROMPTS, _ours, _pair, _speculators, _theirs, exact_and_lossless, refused_with_config

from specresearch.drafts.dflash2 import GroupedConv
from specresearch.drafts.registry import DFLASH_FORMAT, draft_format, draft_from_name

H, VOCAB, LAYERS = 32, 64, 2


def _dflash2(directory, source, *, anchor=False, top_k=5, rank=4, taps=2, group=8, identity=True, **options):
    """The drafter of transformers' layout in ``source`` as speculators saves a DFlash2 drafter: random selector
    codebooks, convolutions at identity (speculators' initialisation) or random. -> (directory, tensors)."""
    from safetensors.torch import save_file

    spec = dict(speculators_model_type="dflash2", architectures=["DFlash2DraftModel"], sample_from_anchor=anchor,
                conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=top_k, **options)
    directory, tensors = _speculators(directory, source, **spec)
    g = torch.Generator().manual_seed(7)
    tensors |= {"candidate_selector.predecessor_codebook": torch.randn(VOCAB, rank, generator=g),
                "candidate_selector.successor_codebook": torch.randn(VOCAB, rank, generator=g),
                "candidate_selector.hidden_projection.weight": torch.randn(rank, H, generator=g)}
    for i in range(LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, taps, H).index_fill_(1, torch.tensor([0]), 1.0)
            projection = torch.zeros(2 * taps * H // group, H)
            if not identity:
                base, projection = base + 0.3 * torch.randn(base.shape, generator=g), 0.3 * torch.randn(
                    projection.shape, generator=g)
            tensors |= {f"layers.{i}.{conv}.base_kernel": base,
                        f"layers.{i}.{conv}.kernel_projection.weight": projection}
    save_file(tensors, directory / "model.safetensors")
    return directory, tensors


def test_the_grouped_convolution_is_its_definition():
    """Side s, row i, channel c: sum over taps t <= i of (base[s, t, c] + offset[i, s, t, group of c]) x[i - t, c]."""
    torch.manual_seed(0)
    conv = GroupedConv(12, taps=3, group=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 5, 12)
    got, offsets = conv.prepare(x)
    every = conv.kernel_projection(x).view(2, 5, 2, 3, 3)
    want = torch.zeros_like(x)
    for n in range(2):
        for i in range(5):
            for t in range(min(3, i + 1)):
                for c in range(12):
                    want[n, i, c] += (conv.base_kernel[0, t, c] + every[n, i, 0, t, c // 4]) * x[n, i - t, c]
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(offsets, every[:, :, 1])


@pytest.mark.parametrize("anchor", [False, True])
def test_dflash2_rescores_the_blocks_candidates_given_the_previous_token(tmp_path, anchor):
    target, assistant, directory = _pair(tmp_path, layer_types=["full_attention"] * LAYERS, num_hidden_layers=LAYERS)
    dflash2, tensors = _dflash2(tmp_path / "dflash2", directory, anchor=anchor)
    draft = draft_from_name(str(dflash2), target)
    assert draft_format(dflash2) == DFLASH_FORMAT and draft.plan_length(8) == (BLOCK if anchor else BLOCK - 1)
    prompt, drafted = PROMPTS[0], (7, 19)
    got = _ours(target, draft, [prompt], drafted)[0]
    first = 0 if anchor else 1
    base = _theirs(target, assistant, prompt, first=first)[: 1 + len(drafted)]
    hidden = _theirs(target, assistant, prompt, head=lambda h: h, first=first)[: 1 + len(drafted)]
    previous = torch.tensor([prompt[-1], *drafted])
    unary, candidates = base.topk(5, -1)
    context = tensors["candidate_selector.predecessor_codebook"][previous] * (
        hidden @ tensors["candidate_selector.hidden_projection.weight"].T)
    want = unary + torch.einsum("pr,pkr->pk", context, tensors["candidate_selector.successor_codebook"][candidates])
    assert torch.allclose(got.gather(-1, candidates), want, atol=1e-4), (got.gather(-1, candidates) - want).abs().max()
    off = torch.ones_like(got, dtype=torch.bool).scatter_(-1, candidates, False)
    assert torch.all(got.softmax(-1)[off] == 0)  # the law lives on the candidates
    assert not torch.allclose(want.softmax(-1), unary.softmax(-1), atol=1e-2)  # the selector matters
    rough, _ = _dflash2(tmp_path / "rough", directory, anchor=anchor, identity=False)
    changed = _ours(target, draft_from_name(str(rough), target), [prompt], drafted)[0]
    assert not torch.allclose(changed.softmax(-1), got.softmax(-1), atol=1e-2)  # the convolutions matter


def test_dflash2_runs_chains_and_trees_exactly_and_keeps_the_targets_law(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"] * LAYERS, num_hidden_layers=LAYERS)
    dflash2, _ = _dflash2(tmp_path / "dflash2", directory, top_k=3, identity=False)
    exact_and_lossless(target, draft_from_name(str(dflash2), target), BLOCK - 1)


def test_dflash2_configs_it_does_not_read_are_refused_in_one_line(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"] * LAYERS, num_hidden_layers=LAYERS)
    cases = {"no_rank": (dict(selector_rank=None), r"no integer \['selector_rank'\]"),
             "vocabulary": (dict(draft_vocab_size=40), "a draft vocabulary of 40 tokens"),
             "group": (dict(conv_group_size=5), "conv_group_size 5"),
             "taps": (dict(conv_kernel_size=BLOCK + 1), f"conv_kernel_size {BLOCK + 1}"),
             "top_k": (dict(selector_top_k=VOCAB + 1), f"selector_top_k {VOCAB + 1}")}
    refused_with_config(target, lambda name: _dflash2(tmp_path / name, directory), cases)
