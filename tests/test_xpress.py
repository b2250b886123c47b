"""XPress drafters in vllm-project/speculators' layout as a draft the engine verifies (``drafts.dflash``,
``drafts.xpress``).

* A drafted position's logits are transformers' DFlash block's (same weights) plus the refiner's bias, written here
  as its definition with loops over positions: the tokens before each position's predicted one are the token before
  the anchor, the anchor and the drafted tokens (fill-in layout), or the anchor and the drafted tokens (sampling
  from the anchor); on the full vocabulary and on a draft vocabulary. The law at the second drafted token depends on
  the first drafted token (the mixer carries it along the block).
* Left-padded batches give each row's numbers alone; the token before a row's first slot is the anchor itself.
* Through the engine: greedy chains and trees give the target's tokens; T = 1 keeps the target's law (exact
  Bonferroni test, false-positive rate <= 1e-6).
* A config with a rank or MLP ratio that is not a positive integer: refused in one line.

speculators' own ``XPressDraftModel`` against the loader: ``benchmarks/speculators_heads.py``.
"""

import pytest
import torch
from test_dflash import BLOCK, PROMPTS, _ours, _pair, _speculators, _theirs, exact_and_lossless, refused_with_config

from specresearch.drafts.registry import DFLASH_FORMAT, draft_format, draft_from_name
from specresearch.drafts.xpress import tokens_before

H, VOCAB, LAYERS, RANK = 32, 64, 2, 4


def _xpress(directory, source, *, anchor=False, ratio=2, draft_ids=None, **options):
    """The drafter of transformers' layout in ``source`` as speculators saves an XPress drafter, its refiner random
    (the mixer too: speculators starts it at zero). -> (directory, tensors)."""
    from safetensors.torch import save_file

    spec = dict(speculators_model_type="xpress", architectures=["XPressSpeculator"], sample_from_anchor=anchor,
                xpress_rank=RANK, xpress_mlp_ratio=ratio, num_jacobi_passes=6, **options)
    directory, tensors = _speculators(directory, source, draft_ids=draft_ids, **spec)
    draft = VOCAB if draft_ids is None else len(draft_ids)
    g = torch.Generator().manual_seed(11)
    shapes = {"token_embed.weight": (VOCAB, RANK), "down_h.weight": (RANK, H), "down_g.weight": (RANK, H),
              "in_proj.weight": (RANK, 3 * RANK), "mix_l": (RANK, BLOCK, BLOCK), "mlp_gate.weight": (RANK * ratio, RANK),
              "mlp_up.weight": (RANK * ratio, RANK), "mlp_down.weight": (RANK, RANK * ratio),
              "readout.weight": (draft, RANK)}
    tensors |= {"refiner_head." + k: 2 * torch.randn(s, generator=g) / s[-1] ** 0.5 for k, s in shapes.items()}
    save_file(tensors, directory / "model.safetensors")
    return directory, tensors


def _bias(tensors, hidden, previous, k):
    """The refiner's bias at block position ``k`` by its definition (``hidden [B, H]`` every block position's output,
    ``previous [B]`` the token before each position's predicted one)."""
    t = {name.removeprefix("refiner_head."): v for name, v in tensors.items() if name.startswith("refiner_head.")}
    mean = hidden.mean(0)
    a = [t["in_proj.weight"] @ torch.cat([t["down_h.weight"] @ hidden[j], t["down_g.weight"] @ mean,
                                          t["token_embed.weight"][previous[j]]]) for j in range(k + 1)]
    c = a[k].clone()
    for channel in range(RANK):
        for j in range(k + 1):
            c[channel] += t["mix_l"][channel, k, j] * a[j][channel]
    gate, up = t["mlp_gate.weight"] @ c, t["mlp_up.weight"] @ c
    return t["readout.weight"] @ (c + t["mlp_down.weight"] @ (torch.nn.functional.silu(gate) * up))


@pytest.mark.parametrize("anchor,vocabulary", [(False, False), (True, False), (False, True)])
def test_xpress_adds_the_refiners_bias_of_the_tokens_before(tmp_path, anchor, vocabulary):
    target, assistant, directory = _pair(tmp_path, layer_types=["full_attention"] * LAYERS, num_hidden_layers=LAYERS)
    ids = torch.tensor([0, 3, 5, 7, 8, 9, 12, 17, 19, 22, 30, 41, 50, 63]) if vocabulary else None
    xpress, tensors = _xpress(tmp_path / "xpress", directory, anchor=anchor, draft_ids=ids)
    draft = draft_from_name(str(xpress), target)
    assert draft_format(xpress) == DFLASH_FORMAT and draft.plan_length(8) == (BLOCK if anchor else BLOCK - 1)
    prompt, drafted = PROMPTS[0], (7, 19)
    got = _ours(target, draft, [prompt], drafted)[0]
    first = 0 if anchor else 1
    hidden = _theirs(target, assistant, prompt, head=lambda h: h, first=0).detach()  # [B, H]: every block position
    head = target.model.get_output_embeddings().weight.detach() if ids is None else tensors["lm_head.weight"]
    columns = torch.arange(VOCAB) if ids is None else ids
    previous = torch.tensor(([] if anchor else [prompt[-2]]) + [prompt[-1], *drafted])
    for d in range(1 + len(drafted)):
        k = first + d
        want = hidden[k] @ head.T + _bias(tensors, hidden, previous, k)
        error = float((got[d, columns] - want).abs().max())
        assert error <= 1e-4 + 1e-5 * float(want.abs().max()), (d, error)  # float32's rounding at the logits' scale
        assert not torch.allclose(want, hidden[k] @ head.T, atol=1e-2)  # the refiner matters
    other = _ours(target, draft, [prompt], (8, 19))[0]  # another first drafted token
    assert torch.allclose(other[0], got[0]) and not torch.allclose(other[1], got[1], atol=1e-3)
    assert not torch.allclose(other[2], got[2], atol=1e-3)  # the third token's law reads it too, through the mixer


def test_xpress_rows_of_a_padded_batch_are_their_own(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"] * LAYERS, num_hidden_layers=LAYERS)
    xpress, _ = _xpress(tmp_path / "xpress", directory)
    draft = draft_from_name(str(xpress), target)
    prompts = [*PROMPTS, [7, 2]]  # the last: the token before the anchor is the row's first
    batch = _ours(target, draft, prompts)
    for i, prompt in enumerate(prompts):
        alone = _ours(target, draft, [prompt])[0]
        assert float((batch[i] - alone).abs().max()) <= 1e-5 * float(alone.abs().max()), i
    mask = torch.tensor([[False, True, True, False, True], [False, False, True, True, True]])
    tokens = torch.tensor([[9, 1, 2, 9, 3], [9, 9, 4, 5, 6]])
    assert tokens_before(mask, tokens, torch.tensor([[4, 1], [2, 4]])).tolist() == [[2, -1], [-1, 5]]


def test_xpress_runs_chains_and_trees_exactly_and_keeps_the_targets_law(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"] * LAYERS, num_hidden_layers=LAYERS)
    xpress, _ = _xpress(tmp_path / "xpress", directory)
    exact_and_lossless(target, draft_from_name(str(xpress), target), BLOCK - 1)


def test_xpress_configs_it_does_not_read_are_refused_in_one_line(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"] * LAYERS, num_hidden_layers=LAYERS)
    cases = {"rank": (dict(xpress_rank=0), "xpress_rank"), "ratio": (dict(xpress_mlp_ratio="2"), "xpress_mlp_ratio"),
             "unknown": (dict(xpress_topc=512), r"config keys \['xpress_topc'\]")}
    refused_with_config(target, lambda name: _xpress(tmp_path / name, directory), cases)
