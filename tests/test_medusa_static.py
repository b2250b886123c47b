"""Medusa heads in the engine's captured steps (``drafts.medusa.StaticMedusaDraft``), on the random heads of
``tests/test_published_drafts.py`` (3 heads, one ResBlock repeated twice) over its tiny Llama.

* The re-feed of three slots gives head 0 on each slot's feature, and a drafting call at depth d head d on the
  gathered feature (a chain's call at ``offset = d - 1``, a tree's K nodes at ``(d - 1) K``), by the format's
  definition (1e-5); past the last head, refused in one line.
* Through the engine (``compile="static"``): greedy chains and trees give the target's tokens; a chain and a dynamic
  tree step trace as one graph and compiled (``aot_eager``) give the eager step's log at T = 1; at T = 1 a block chain
  and a traversal tree keep the target's law (exact Bonferroni test, false-positive rate <= 1e-6 each); a gamma past
  the heads is refused for captured steps (the growing loop plans it down).
"""

import pytest
import torch
from helpers import check_captured_step
from test_published_drafts import MEDUSA_HEADS, _medusa_checkpoint, _medusa_reference, _target

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.static import static_available
from specresearch.experiments.stats import lossless_test

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("medusa") / "heads"
    tensors = _medusa_checkpoint(directory)
    target = _target()
    return target, draft_from_name(str(directory), target), tensors


def test_the_refeed_gives_head_0_and_a_drafting_call_at_depth_d_head_d(pair):
    target, draft, tensors = pair
    ids = torch.tensor([[5, 9, 3, 17, 22, 8, 41]])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    static = draft.static_form()
    static.allocate(1, 64)
    static.prefill(ids, torch.ones_like(ids), leave=3)
    logits, carried = static.refeed(ids[:, -3:], inputs=static.fuse(features[:, -4:-1]))  # each slot: the one before
    for column in range(3):
        want = _medusa_reference(tensors, 0, features[0, column - 4])
        assert torch.allclose(logits[0, column].log_softmax(-1), want, atol=1e-5)
    anchor = carried[:, -1:]
    for depth in range(1, MEDUSA_HEADS):
        want = _medusa_reference(tensors, depth, features[0, -2])
        chain, _ = static.forward(torch.tensor([[30]]), inputs=anchor, offset=depth - 1)
        tree, _ = static.forward(torch.tensor([[30, 31]]), inputs=anchor.expand(-1, 2, -1), offset=2 * (depth - 1))
        assert torch.allclose(chain[0, 0].log_softmax(-1), want, atol=1e-5)
        assert torch.allclose(tree[0].log_softmax(-1), want.expand(2, -1), atol=1e-5)
    with pytest.raises(ValueError, match=f"Medusa has {MEDUSA_HEADS} heads"):
        static.forward(torch.tensor([[30]]), inputs=anchor, offset=MEDUSA_HEADS - 1)


RUNS = [dict(gamma=3), dict(gamma=2, num_drafts=2, verifier="traversal"),
        dict(gamma=3, num_drafts=2, verifier="onehot", draft_law="dynamic", tree_nodes=5)]


def test_in_the_captured_steps_greedy_runs_give_the_targets_tokens(pair):
    target, draft, _ = pair
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY).tokens
    for options in RUNS:
        out = speculative_generate(target, draft, PROMPTS, max_new_tokens=10, sampling=GREEDY, compile="static",
                                   **options)
        assert out.tokens == want and all(r.target_seconds != r.target_seconds for r in out.steps), options


@pytest.mark.parametrize("options", [RUNS[0], RUNS[2]], ids=["chain", "dynamic tree"])
def test_a_captured_step_traces_as_one_graph_and_compiled_computes_the_eager_step(pair, options):
    target, draft, _ = pair
    check_captured_step(target, draft, PROMPTS, options)


@pytest.mark.parametrize("rule, trees", [("block", 1), ("traversal", 2)])
def test_in_the_captured_steps_at_temperature_one_it_keeps_the_targets_law(pair, rule, trees):
    target, draft, _ = pair
    result = lossless_test(target, draft, rule, [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=0, batch_size=3_000, num_drafts=trees,
                           compile="static")
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def test_a_gamma_past_the_heads_is_refused_for_captured_steps(pair):
    target, draft, _ = pair
    assert static_available(target, draft, gamma=MEDUSA_HEADS) is None
    assert f"drafts at most {MEDUSA_HEADS} tokens" in static_available(target, draft, gamma=MEDUSA_HEADS + 1)
    with pytest.raises(ValueError, match=f"use gamma <= {MEDUSA_HEADS}"):
        speculative_generate(target, draft, PROMPTS, max_new_tokens=4, sampling=GREEDY, compile="static",
                             gamma=MEDUSA_HEADS + 1)
