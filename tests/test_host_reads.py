"""Host reads per step: every value the host reads back from a tensor (``.tolist()``, ``.item()``, ``bool()``,
``int()``, ``.nonzero()``, ...) waits for a GPU. Counted on the CPU with a ``TorchFunctionMode`` hook
(``engine.timing.HostReads``), as the difference between a long and a short run (so the prompt's one-off checks
cancel). docs/engine_and_models.md states the counts."""

import pytest
import torch
from helpers import reads_per_step

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import truncated_draft
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.timing import HostReads
from specresearch.models.toy import tiny_llama

PROMPTS = [[5, 9, 2, 33, 7], [4, 8, 1], [16, 23, 42, 3], [7, 7]]


def _per_step(run) -> dict[str, float]:
    return reads_per_step(run)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(48, seed=0, init_std=0.6, num_layers=3)


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_a_chain_step_reads_the_host_once(target, verifier):
    """One read per step (accepted counts, next token, drafts and the deferred logits checks together); at B = 1
    the rollbacks crop with host counts and never compact."""
    draft = truncated_draft(target, 1)
    per_step = _per_step(lambda n: speculative_generate(target, draft, PROMPTS[:1], gamma=3, max_new_tokens=n,
                                                         verifier=verifier, sampling=SamplingConfig(temperature=1.0)))
    assert per_step["specresearch"] == 1.0, per_step


def test_a_batched_chain_step_reads_little_more(target):
    """B = 4: plus, for each model whose rows dropped different counts, the check whether to pack dead slots."""
    draft = truncated_draft(target, 1)
    per_step = _per_step(lambda n: speculative_generate(target, draft, PROMPTS, gamma=3, max_new_tokens=n,
                                                         sampling=SamplingConfig(temperature=1.0)))
    assert 1.0 < per_step["specresearch"] <= 3.0, per_step


def test_an_autoregressive_step_reads_the_host_once(target):
    per_step = _per_step(lambda n: autoregressive_generate(target, PROMPTS[:1], max_new_tokens=n,
                                                           sampling=SamplingConfig(temperature=1.0)))
    assert per_step["specresearch"] == 1.0, per_step


def test_per_step_timing_is_on_where_free_and_off_on_request(target):
    """On the CPU each step's draft / target split is timed by default; ``step_timing=False`` (the CUDA default: no
    sync per reading) keeps the call's total and leaves the split NaN."""
    import math

    draft = truncated_draft(target, 1)
    timed = speculative_generate(target, draft, PROMPTS[:2], gamma=3, max_new_tokens=8, seed=0)
    untimed = speculative_generate(target, draft, PROMPTS[:2], gamma=3, max_new_tokens=8, seed=0, step_timing=False)
    assert untimed.tokens == timed.tokens
    assert all(s.target_seconds >= 0 and s.draft_seconds >= 0 for s in timed.steps)
    assert all(math.isnan(s.target_seconds) and math.isnan(s.draft_seconds) for s in untimed.steps)
    assert untimed.seconds > 0 and all(s.seconds >= 0 for s in untimed.steps)


def test_the_counter_also_counts_every_torch_call():
    """``calls``: each torch function called from Python (a kernel launch, or several, on a GPU), reads or not."""
    import torch

    x = torch.arange(6.0)
    with HostReads() as reads:
        y = torch.exp(x) + 1
        y.sum().item()
    assert (reads.count, reads.calls) == (1, 4)  # exp, add, sum, item; only item reads the host


@pytest.mark.parametrize("static", [False, True])
def test_a_dynamic_tree_step_reads_its_layout_and_its_result_once_each(target, static):
    """EAGLE-2's trees: the drafted tree's layout in one read (with the drafting's logits checks), the result in one
    (with the target's); what remains is the cache's bookkeeping (tree end, packing checks: causal_lm) and
    transformers' own mask code ("other"): 7-7.2 a step here (16 when each drafted depth and the result were read on
    their own). The captured steps over static caches read once (tests/test_static.py)."""
    draft = truncated_draft(target, 1)
    per_step = _per_step(lambda n: speculative_generate(
        target, draft, PROMPTS[:1], max_new_tokens=n, sampling=SamplingConfig(temperature=1.0), verifier="onehot",
        num_drafts=3, gamma=3, draft_law="static" if static else "dynamic"))
    assert per_step["specresearch"] <= 8.0, per_step


def test_a_sampled_tree_step_reads_no_more_than_its_tree_and_bookkeeping(target):
    """Traversal over 3 paths of 3: the paths' equal prefixes merged into a tree on the host and the cache's bookkeeping
    (16.8 a step here); the multi-draft rule itself reads none (it was ~27 while it visited nodes by host-read
    index)."""
    from specresearch.core import verify_multi

    draft = truncated_draft(target, 1)
    per_step = _per_step(lambda n: speculative_generate(
        target, draft, PROMPTS[:1], max_new_tokens=n, sampling=SamplingConfig(temperature=1.0), verifier="traversal",
        num_drafts=3, gamma=3))
    assert per_step["specresearch"] <= 18.0, per_step
    import torch

    p = torch.softmax(torch.randn(1, 3, 4, 48), -1)
    q = torch.softmax(torch.randn(1, 3, 3, 48), -1)
    with HostReads() as reads:
        verify_multi.traversal_verify(p, q, torch.randint(0, 48, (1, 3, 3)), uniforms=torch.rand(1, 4, 3),
                                      validate=False)
    assert reads.count == 0


def test_kernels_counts_the_operators_that_launch_work_and_not_the_views():
    """``engine.timing.Kernels``: a linear layer is one ``mm`` (a bias-free one; ``addmm`` with a bias), pointwise
    operators one each, a copy made contiguous one ``clone``; views, transposes and expands none."""
    from specresearch.engine.timing import Kernels

    x, weight = torch.randn(4, 8), torch.randn(16, 8)
    with Kernels() as kernels:
        y = torch.nn.functional.linear(x, weight)
        (y * 2 + 1).t().contiguous()
        y.view(-1)
        x.expand(2, 4, 8)
        x[:, None]
    assert dict(kernels.by_op) == {"mm": 1, "mul": 1, "add": 1, "clone": 1}
    assert kernels.count == 4 and kernels.views >= 5


def test_an_inductor_wrappers_launches_are_read_from_its_code():
    """``bench_step_ops.wrapper_launches`` on the code inductor generates here for a matrix product followed by
    pointwise work and a reduction: one library ``mm``, and the generated kernels fuse the rest (fewer than the
    eager operators; at least one)."""
    import importlib.util
    from pathlib import Path

    from torch._inductor.codecache import PyCodeCache

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_step_ops", root / "benchmarks" / "bench_step_ops.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def f(x, w):
        return (torch.relu(x @ w) * 3 + 1).sum(-1)

    torch._dynamo.reset()
    PyCodeCache.cache_clear()
    torch.compile(f, fullgraph=True, dynamic=False)(torch.randn(8, 32), torch.randn(32, 16))
    graphs = [g for g in (script.wrapper_launches(Path(m.__file__).read_text()) for m in script._loaded(PyCodeCache)) if g]
    assert len(graphs) == 1, graphs
    (launches,) = graphs
    assert launches["extern_kernels.mm"] == 1 and 1 <= launches["generated"] < 4, launches
    assert script.wrapper_launches("x = 1\n") == {}
