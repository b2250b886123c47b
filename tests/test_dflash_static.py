"""DFlash block drafters in the engine's captured steps (``drafts.dflash_static.StaticDFlashDraft``).

* The re-feed of three slots of a left-padded batch runs a block at every column: each column's first drafted
  token's logits are transformers' drafter's on that column's own prefix (full attention, and a window that cuts the
  context), and drafting calls handed a column's block give its later positions, a tree's siblings the same one
  (1e-4, as ``tests/test_dflash.py``);
  the control: a column's block that sees the context past its anchor (the next column's) differs.
* DSpark (gated Markov head, sampling from the anchor, a draft vocabulary), DFlash2 (rescored candidates) and XPress
  (its refiner over the tokens drafted so far; fill-in and from the anchor) draft in the static form what their
  growing drafts draft (1e-5 of the logits' scale), the Markov bias, the selector and the refiner given the fed
  tokens.
* Through the engine (``compile="static"``): greedy chains and trees give the target's tokens; a chain and a dynamic
  tree step trace as one graph, and compiled (``aot_eager``) give the eager step's log at T = 1; at T = 1 chains and
  a traversal tree keep the target's law (exact Bonferroni test, false-positive rate <= 1e-6 each).
* Refused in one line: a gamma past the block (``auto`` then runs the growing loop, which shortens it).
"""

import pytest
import torch
from helpers import check_captured_step, refed_static_form
from test_dflash import BLOCK, PROMPTS, _dspark, _ours, _pair, _theirs
from test_dflash2 import _dflash2
from test_xpress import _xpress

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.static import static_available
from specresearch.experiments.stats import lossless_test

GREEDY = SamplingConfig(temperature=0.0)


@pytest.mark.parametrize("setting", [dict(), dict(sliding_window=3)])
def test_the_refeed_runs_every_columns_block_on_its_own_prefix(tmp_path, setting):
    target, assistant, directory = _pair(tmp_path, **setting)
    draft = draft_from_name(str(directory), target)
    static, logits, blocks = refed_static_form(target, draft, PROMPTS, 3)
    for row, prompt in enumerate(PROMPTS):
        for column in range(3):
            want = _theirs(target, assistant, prompt[: len(prompt) - 2 + column])  # positions 1..B-1
            got = [logits[row, column]] + [static.forward(torch.tensor([[7]]), inputs=blocks[row : row + 1, column :
                                                                                            column + 1], offset=i)[0][0, 0]
                                           for i in range(BLOCK - 2)]
            assert torch.allclose(torch.stack(got), want, atol=1e-4), (torch.stack(got) - want).abs().max()
            siblings, _ = static.forward(torch.tensor([[7, 9]]), inputs=blocks[row : row + 1, column : column + 1].expand(
                -1, 2, -1), offset=2)  # a tree's two nodes at depth 2: block position 3, shared
            assert torch.allclose(siblings[0], want[2:3].expand(2, -1), atol=1e-4)
    # the control: a column's block sees the context up to its own anchor only
    later = _theirs(target, assistant, PROMPTS[0][:-1])
    assert not torch.allclose(logits[0, 0], later[0], atol=1e-3)
    with pytest.raises(ValueError, match=f"drafts at most {BLOCK - 1} tokens"):
        static.forward(torch.tensor([[7], [7]]), inputs=blocks[:, :1], offset=BLOCK - 2)


def _growing_and_static(target, draft):
    """``_ours`` (the growing draft: the pending token's logits, then one per drafted token 7, 19) and the same from
    the static form."""
    want = _ours(target, draft, PROMPTS)
    static, logits, blocks = refed_static_form(target, draft, PROMPTS, 1)
    rows = [logits[:, 0]]
    for i, token in enumerate((7, 19)):  # each call hands its block on to the next (XPress: with its token written)
        out, blocks = static.forward(torch.full((2, 1), token), inputs=blocks, offset=i)
        rows.append(out[:, 0])
    return want, torch.stack(rows, 1)


@pytest.mark.parametrize("kind", ["dspark", "dflash2", "xpress", "xpress from the anchor"])
def test_dspark_dflash2_and_xpress_draft_in_the_static_form_what_they_draft_growing(tmp_path, kind):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"] * 2, num_hidden_layers=2)
    if kind == "dspark":
        path, _ = _dspark(tmp_path / kind, directory, anchor=True, gated=True, draft_ids=torch.arange(0, 64, 2))
    elif kind == "dflash2":
        path, _ = _dflash2(tmp_path / kind, directory, top_k=3, identity=False)
    else:
        path, _ = _xpress(tmp_path / "xpress", directory, anchor=kind != "xpress")
    want, got = _growing_and_static(target, draft_from_name(str(path), target))
    scale = max(1.0, float(want.abs().max()))  # XPress's random refiner: logits ~1e3
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * scale), (got - want).abs().max() / scale


def _drafts(tmp_path):
    target, _, directory = _pair(tmp_path, layer_types=["full_attention"] * 2, num_hidden_layers=2)
    dspark, _ = _dspark(tmp_path / "dspark", directory, anchor=True, gated=True)
    dflash2, _ = _dflash2(tmp_path / "dflash2", directory, top_k=3, identity=False)
    xpress, _ = _xpress(tmp_path / "xpress", directory)
    return target, {name: draft_from_name(str(path), target) for name, path in
                    (("dflash", directory), ("dspark", dspark), ("dflash2", dflash2), ("xpress", xpress))}


RUNS = [dict(gamma=3), dict(gamma=2, num_drafts=2, verifier="traversal"),
        dict(gamma=3, num_drafts=2, verifier="onehot", draft_law="dynamic", tree_nodes=5)]


def test_in_the_captured_steps_greedy_runs_give_the_targets_tokens(tmp_path):
    target, drafts = _drafts(tmp_path)
    prompts = [[5, 9, 3, 17, 22, 8], [7, 2, 11]]
    want = autoregressive_generate(target, prompts, max_new_tokens=10, sampling=GREEDY).tokens
    for name, draft in drafts.items():
        for options in RUNS + ([dict(gamma=BLOCK)] if name == "dspark" else []):  # DSpark's block drafts B
            out = speculative_generate(target, draft, prompts, max_new_tokens=10, sampling=GREEDY, compile="static",
                                       **options)
            assert out.tokens == want, (name, options)
            assert all(record.target_seconds != record.target_seconds for record in out.steps)  # captured: NaN


@pytest.mark.parametrize("name, options", [("dflash", RUNS[0]), ("dspark", RUNS[2]), ("dflash2", RUNS[1]),
                                           ("xpress", RUNS[2])])
def test_a_captured_step_traces_as_one_graph_and_compiled_computes_the_eager_step(tmp_path, name, options):
    target, drafts = _drafts(tmp_path)
    check_captured_step(target, drafts[name], [[5, 9, 3, 17, 22, 8], [7, 2, 11]], options)


@pytest.mark.parametrize("name, rule, trees", [("dflash", "block", 1), ("dspark", "token", 1),
                                               ("dflash2", "traversal", 2), ("xpress", "traversal", 2)])
def test_in_the_captured_steps_at_temperature_one_it_keeps_the_targets_law(tmp_path, name, rule, trees):
    target, drafts = _drafts(tmp_path)
    result = lossless_test(target, drafts[name], rule, [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=0, batch_size=3_000, num_drafts=trees,
                           compile="static")
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def test_a_gamma_past_the_block_is_refused_in_one_line(tmp_path):
    target, drafts = _drafts(tmp_path)
    assert static_available(target, drafts["dflash"], gamma=BLOCK - 1) is None
    assert f"drafts at most {BLOCK - 1} tokens" in static_available(target, drafts["dflash"], gamma=BLOCK)
    with pytest.raises(ValueError, match=f"use gamma <= {BLOCK - 1}"):
        speculative_generate(target, drafts["dflash"], [[5, 9, 3]], max_new_tokens=4, sampling=GREEDY,
                             compile="static", gamma=BLOCK)
    out = speculative_generate(target, drafts["dflash"], [[5, 9, 3]], max_new_tokens=6, sampling=GREEDY, gamma=BLOCK)
    assert max(step.gamma for step in out.steps) == BLOCK - 1  # the growing loop shortens it
