"""P-EAGLE heads in the engine's captured steps (``drafts.peagle.StaticPEagleDraft``), on the random head of
``tests/test_peagle.py`` (4 depths) over the tiny Llama of ``tests/test_published_drafts.py``.

* The re-feed of three slots of a left-padded batch runs every column's mask slots: each column's drafted depths
  (depth 1 from the re-feed, depths 2..4 from drafting calls handed that column's mask slots, a chain's and a tree's)
  follow the format's definition on that column's own prefix (1e-4, as ``tests/test_peagle.py``); the control: a
  column's mask slots seeing the next column's slot move them.
* Through the engine (``compile="static"``): greedy chains and trees give the target's tokens; a chain and a dynamic
  tree step trace as one graph and compiled (``aot_eager``) give the eager step's log at T = 1; at T = 1 a block chain
  and a traversal tree keep the target's law (exact Bonferroni test, false-positive rate <= 1e-6 each); a gamma past
  the depths is refused there.
"""

import pytest
import torch
from helpers import check_captured_step, refed_static_form
from test_peagle import DEPTHS, _definition, _peagle
from test_published_drafts import _target

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.static import static_available
from specresearch.experiments.stats import lossless_test

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 3, 17, 22, 8, 41], [7, 2, 11, 4, 6]]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    directory = tmp_path_factory.mktemp("peagle") / "head"
    tensors, token_ids = _peagle(directory)
    target = _target()
    return target, draft_from_name(str(directory), target), tensors, token_ids


def test_the_refeed_runs_every_columns_mask_slots_on_its_own_prefix(head):
    target, draft, tensors, token_ids = head
    static, logits, masks = refed_static_form(target, draft, PROMPTS, 3)
    for row, prompt in enumerate(PROMPTS):
        for column in range(3):
            prefix = prompt[: len(prompt) - 2 + column]
            carried = masks[row : row + 1, column : column + 1]
            got = [logits[row, column]]
            for d in range(1, DEPTHS):
                chain, _ = static.forward(torch.tensor([[30]]), inputs=carried, offset=d - 1)
                tree, _ = static.forward(torch.tensor([[30, 31]]), inputs=carried.expand(-1, 2, -1), offset=2 * (d - 1))
                assert torch.equal(chain[0, 0], tree[0, 0]) and torch.equal(tree[0, 0], tree[0, 1])
                got.append(chain[0, 0])
            for depth, row_logits in enumerate(got, start=1):
                want = _definition(tensors, target, prefix, depth, token_ids)
                finite = want.isfinite()
                assert torch.allclose(row_logits.log_softmax(-1)[finite], want[finite], atol=1e-4), (row, column, depth)
    later = _definition(tensors, target, PROMPTS[0][:-1], 2, token_ids)  # the control: the next column's prefix
    finite = later.isfinite()
    first, _ = static.forward(torch.tensor([[30]]), inputs=masks[:1, :1], offset=0)
    assert not torch.allclose(first[0, 0].log_softmax(-1)[finite], later[finite], atol=1e-2)
    with pytest.raises(ValueError, match=f"drafts at most {DEPTHS} tokens"):
        static.forward(torch.tensor([[30]]), inputs=masks[:1, :1], offset=DEPTHS - 1)


RUNS = [dict(gamma=3), dict(gamma=2, num_drafts=2, verifier="traversal"),
        dict(gamma=3, num_drafts=2, verifier="onehot", draft_law="dynamic", tree_nodes=5)]


def test_in_the_captured_steps_greedy_runs_give_the_targets_tokens(head):
    target, draft, _, _ = head
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY).tokens
    for options in RUNS:
        out = speculative_generate(target, draft, PROMPTS, max_new_tokens=10, sampling=GREEDY, compile="static",
                                   **options)
        assert out.tokens == want and all(r.target_seconds != r.target_seconds for r in out.steps), options
    assert f"drafts at most {DEPTHS} tokens" in static_available(target, draft, gamma=DEPTHS + 1)


@pytest.mark.parametrize("options", [RUNS[0], RUNS[2]], ids=["chain", "dynamic tree"])
def test_a_captured_step_traces_as_one_graph_and_compiled_computes_the_eager_step(head, options):
    target, draft, _, _ = head
    check_captured_step(target, draft, PROMPTS, options)


@pytest.mark.parametrize("rule, trees", [("block", 1), ("traversal", 2)])
def test_in_the_captured_steps_at_temperature_one_it_keeps_the_targets_law(head, rule, trees):
    target, draft, _, _ = head
    result = lossless_test(target, draft, rule, [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=0, batch_size=3_000, num_drafts=trees,
                           compile="static")
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value
