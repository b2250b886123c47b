"""Wrapper parity: cached, block-scored and rolled-back logits equal a plain uncached forward.

Tolerance: atol 1e-4 in float32 (the same arithmetic in a different order: cache concatenation,
masked slots and left padding change summation order only).
"""

import json

import pytest
import torch

from specresearch.models.attention import (
    CPU_SDPA,
    PACKED_SDPA,
    cpu_sdpa_attention,
    packed_sdpa_attention,
    use_packed_sdpa,
)
from specresearch.models.causal_lm import CausalLM
from specresearch.models.toy import ToyLM, tiny_llama

ATOL = 1e-4
VOCAB = 64


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(VOCAB, seed=0, init_std=0.5)


def _reference(lm, sequence):
    """Plain uncached forward of one unpadded sequence. [L] -> [L, V]."""
    with torch.no_grad():
        return lm.model(input_ids=torch.tensor([sequence])).logits[0].float()


def _left_pad(rows):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_random_model_is_not_degenerate(lm):
    """Guard: parity on a model whose logits ignore the context would prove nothing."""
    ref = _reference(lm, [3, 4, 5, 6])
    assert (ref[1:] - ref[:-1]).abs().max() > 0.1


def test_single_row_prefill_score_rollback_match_uncached(lm):
    prompt, block = [5, 9, 2, 33, 7], [11, 12, 13]
    logits = lm.prefill(torch.tensor([prompt]), torch.ones(1, 5, dtype=torch.long))
    ref = _reference(lm, prompt + block)
    torch.testing.assert_close(logits[0], ref[4], atol=ATOL, rtol=0)
    scored = lm.score(torch.tensor([block]))
    torch.testing.assert_close(scored[0], ref[5:8], atol=ATOL, rtol=0)
    assert lm.cache_length == 8
    lm.rollback(2)  # keep prompt + [11]
    assert lm.cache_length == 6
    scored = lm.score(torch.tensor([[40, 41]]))
    torch.testing.assert_close(scored[0], _reference(lm, prompt + [11, 40, 41])[6:8], atol=ATOL, rtol=0)


def test_batch_left_padding_per_row_rollback_and_masked_slots_match_uncached(lm):
    rows = [[7], [4, 8, 15], [16, 23, 42, 3, 9]]
    ids, mask = _left_pad(rows)
    first = lm.prefill(ids, mask)
    for b, row in enumerate(rows):
        torch.testing.assert_close(first[b], _reference(lm, row)[-1], atol=ATOL, rtol=0)
    block = torch.tensor([[20, 21, 22], [30, 31, 32], [50, 51, 52]])
    lm.score(block)
    lm.rollback(torch.tensor([1, 3, 2]))  # rows keep 2, 0 and 1 of the block
    kept = [rows[0] + [20, 21], rows[1], rows[2] + [50]]
    assert lm.cache_length == 5 + 3 - 1
    assert lm.valid_lengths.tolist() == [len(k) for k in kept]
    nxt = torch.tensor([[60, 61], [62, 63], [10, 11]])
    valid = torch.tensor([[True, True], [False, True], [True, True]])  # row 1: a masked slot (never seen)
    out = lm.score(nxt, valid)
    appended = [[60, 61], [63], [10, 11]]
    for b in range(3):
        ref = _reference(lm, kept[b] + appended[b])
        torch.testing.assert_close(out[b, -1], ref[-1], atol=ATOL, rtol=0)
        if valid[b, 0]:
            torch.testing.assert_close(out[b, 0], ref[-2], atol=ATOL, rtol=0)


def test_fully_padded_row_is_an_empty_context(lm):
    """A row of only padding at prefill (a 1-token prompt in a batch, as the engine prefills all but the
    last token) must not poison the cache with NaN: later tokens see an empty context."""
    ids, mask = _left_pad([[9, 10, 11], []])
    lm.prefill(ids, mask)
    out = lm.score(torch.tensor([[12, 13], [14, 15]]))
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out[0], _reference(lm, [9, 10, 11, 12, 13])[-2:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], _reference(lm, [14, 15]), atol=ATOL, rtol=0)


def test_rollback_out_of_range_raises(lm):
    lm.prefill(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="n must be between 0 and cache_length"):
        lm.rollback(4)
    with pytest.raises(ValueError, match="n must be between"):
        lm.rollback(-1)


def test_prefill_rejects_right_padding_and_empty_prompt(lm):
    with pytest.raises(ValueError, match="left-padded"):
        lm.prefill(torch.tensor([[1, 2, 0]]), torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="L >= 1"):
        lm.prefill(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long))


def test_reset_then_score_matches_uncached(lm):
    lm.reset(1)
    out = lm.score(torch.tensor([[3, 4, 5]]))
    torch.testing.assert_close(out[0], _reference(lm, [3, 4, 5]), atol=ATOL, rtol=0)


def test_device_map_auto_loads_from_path_and_matches(lm, tmp_path):
    """device_map="auto" goes to from_pretrained (accelerate); on this CPU-only machine every layer lands on cpu."""
    lm.model.save_pretrained(tmp_path)
    sharded = CausalLM(str(tmp_path), device_map="auto")
    assert {p.device.type for p in sharded.model.parameters()} == {"cpu"}
    ids, mask = torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long)
    torch.testing.assert_close(sharded.prefill(ids, mask), lm.prefill(ids, mask), atol=ATOL, rtol=0)


def test_device_map_with_an_instance_is_rejected(lm):
    with pytest.raises(ValueError, match="device_map"):
        CausalLM(lm.model, device_map="auto")


def test_toy_markov_and_iid_tables():
    table = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    markov = ToyLM(table)
    first = markov.prefill(torch.tensor([[0, 3], [2, 4]]), torch.tensor([[0, 1], [1, 1]]))
    torch.testing.assert_close(first, table[[3, 4]])
    torch.testing.assert_close(markov.score(torch.tensor([[1, 2], [0, 0]])), table[torch.tensor([[1, 2], [0, 0]])])
    markov.rollback(torch.tensor([1, 2]))
    assert markov.cache_length == 3
    iid = ToyLM(table[0])
    torch.testing.assert_close(iid.prefill(torch.tensor([[4]]), torch.ones(1, 1)), table[0][None])
    with pytest.raises(ValueError, match="table must be"):
        ToyLM(torch.zeros(3, 4))


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_is_nn_linear_up_to_rounding(bias):
    """SkinnyLinear: 1-8 rows through (W @ x^T)^T, every other row count through nn.Linear itself (bit for bit);
    same parameters, same state dict, gradients flow; a column-major input (a transposed output) gives the same."""
    from specresearch.models.kernels import SkinnyLinear, use_skinny_linears

    g = torch.Generator().manual_seed(0)
    plain = torch.nn.Linear(48, 96, bias=bias)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96, bias=bias))
    model[0].load_state_dict(plain.state_dict())
    assert use_skinny_linears(model) == 1 and type(model[0]) is SkinnyLinear and isinstance(model[0], torch.nn.Linear)
    assert model.state_dict().keys() == {f"0.{k}" for k in plain.state_dict()}
    assert SkinnyLinear.SKINNY_ROWS == range(1, 9)
    for shape in [(1, 48), (2, 48), (3, 48), (1, 2, 48), (1, 3, 48), (3, 1, 48), (4, 48), (8, 48), (9, 48), (2, 5, 48), (1, 1, 48)]:
        x = torch.randn(shape, generator=g)
        got, want = model(x), plain(x)
        assert got.shape == want.shape
        rows = x.numel() // 48
        if rows in SkinnyLinear.SKINNY_ROWS:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(got, want)
    column_major = torch.randn(48, 3, generator=g).t()[None]  # [1, 3, 48], strides (1, 1, 3)
    assert not column_major.is_contiguous()
    torch.testing.assert_close(model(column_major), plain(column_major), atol=1e-5, rtol=1e-5)
    model(torch.randn(2, 48, generator=g)).sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_weights_multiply_the_rounded_weights_and_untie(dtype):
    """use_half_weights: every linear layer gets a new half weight (a tied head is untied from the embedding,
    which stays float32); outputs are float32 and equal the float32 product with the rounded weights up to
    the half rounding of the 1-4 row path (more rows: float32 against the upcast weights, up to float rounding)."""
    from specresearch.models.kernels import HALF_ROWS, SkinnyLinear, use_half_weights

    g = torch.Generator().manual_seed(0)
    embedding = torch.nn.Embedding(96, 48)
    head = torch.nn.Linear(48, 96, bias=False)
    head.weight = embedding.weight  # tied, as SmolLM2's head
    model = torch.nn.Sequential(embedding, torch.nn.Linear(48, 48, bias=True), head)
    reference = [model[1].weight.detach().clone(), model[1].bias.detach().clone(), embedding.weight.detach().clone()]
    assert use_half_weights(model, dtype=dtype) == 2
    assert type(model[1]) is SkinnyLinear and type(model[2]) is SkinnyLinear
    assert model[1].weight.dtype == model[2].weight.dtype == dtype and not model[2].weight.requires_grad
    assert embedding.weight.dtype == torch.float32 and torch.equal(embedding.weight, reference[2])
    assert model[1].bias.dtype == torch.float32
    rounded = reference[0].to(dtype).float()
    tolerance = 1e-2 if dtype == torch.float16 else 6e-2
    for rows in (1, 2, HALF_ROWS, HALF_ROWS + 1, 9):
        x = torch.randn(rows, 48, generator=g)
        got, want = model[1](x), x @ rounded.t() + reference[1]
        assert got.dtype == torch.float32
        if rows <= HALF_ROWS:
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="dtype"):
        use_half_weights(model, dtype=torch.float64)


def test_half_products_of_huge_inputs_do_not_overflow_and_small_ones_are_unchanged():
    """A row past the layer's limit (an attention sink's features reach 22,000 in SmolLM2) is scaled by a power of
    two: finite and close to the float32 product; rows under the limit compute bit for bit the unscaled product."""
    from specresearch.models.kernels import half_input_limit, use_half_weights

    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False))
    with torch.no_grad():
        layer[0].weight.copy_(torch.rand(64, 256, generator=g) * 0.5)  # positive: products add up, the worst case
    use_half_weights(layer)
    weight = layer[0].weight
    limit = layer[0].half_limit
    assert limit == half_input_limit(weight) and 65504 / 2 / 256 / 0.5 <= limit
    small = torch.rand(3, 256, generator=g) * limit
    assert torch.equal(layer(small), torch.nn.functional.linear(small.half(), weight).float())
    huge = small.clone()
    huge[1] *= 30_000 / limit
    assert not torch.isfinite(torch.nn.functional.linear(huge.half(), weight).float()).all()  # what it gave before
    got = layer(huge)
    assert torch.isfinite(got).all() and torch.equal(got[[0, 2]], layer(small)[[0, 2]])
    torch.testing.assert_close(got, huge @ weight.float().t(), rtol=2e-3, atol=0)


def test_int8_weights_round_each_row_to_its_scale_and_untie():
    """use_int8_weights: every linear layer gets int8 weights and a float32 scale per output row (max |W[o]| / 127, a
    row of zeros scale 1); a tied head is untied (the embedding keeps its float32 weights); outputs are float32 and
    equal the product with the rounded weights, within 1 % of the float32 one, through the kernel (1-8 rows) or the
    converted weights (9 rows); an int8 weight without its scale raises."""
    from specresearch.models.kernels import SkinnyLinear, skinny_linear, use_int8_weights

    g = torch.Generator().manual_seed(0)
    embedding = torch.nn.Embedding(96, 48)
    head = torch.nn.Linear(48, 96, bias=False)
    head.weight = embedding.weight  # tied, as SmolLM2's head
    model = torch.nn.Sequential(embedding, torch.nn.Linear(48, 48, bias=True), head)
    with torch.no_grad():
        model[1].weight[3] = 0.0
    reference = [model[1].weight.detach().clone(), model[1].bias.detach().clone(), embedding.weight.detach().clone()]
    assert use_int8_weights(model) == 2
    layer = model[1]
    assert type(layer) is SkinnyLinear and type(model[2]) is SkinnyLinear
    assert layer.weight.dtype == model[2].weight.dtype == torch.int8 and not layer.weight.requires_grad
    assert torch.equal(embedding.weight, reference[2]) and layer.bias.dtype == torch.float32
    scale = reference[0].abs().amax(-1) / 127
    assert layer.weight_scale[3] == 1.0 and (layer.weight[3] == 0).all()
    torch.testing.assert_close(layer.weight_scale[:3], scale[:3])
    assert int(layer.weight.abs().amax(-1)[0]) == 127
    rounded = layer.weight.double() * layer.weight_scale.double()[:, None]
    assert float((rounded - reference[0]).abs().max()) <= float(scale.max()) / 2 + 1e-6
    for rows in (1, 2, 8, 9):
        x = torch.randn(rows, 48, generator=g)
        with torch.no_grad():
            got = layer(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), x.double() @ rounded.t() + reference[1].double(), atol=1e-5, rtol=1e-5)
        want = x @ reference[0].t()
        assert float((got - reference[1] - want).norm() / want.norm()) < 0.01
    with pytest.raises(ValueError, match="weight_scale"):
        skinny_linear(torch.randn(1, 48), layer.weight)


@pytest.mark.parametrize("use", ["use_half_weights", "use_int8_weights"])
def test_half_and_int8_weights_never_change_the_target(use):
    from specresearch.models import kernels

    target = torch.nn.Sequential(torch.nn.Linear(8, 8))
    draft = torch.nn.Sequential(torch.nn.Linear(8, 8), target[0])  # a layer shared with the target
    with pytest.raises(ValueError, match="target"):
        getattr(kernels, use)(draft, shared_with=target)
    assert draft[0].weight.dtype == target[0].weight.dtype == torch.float32
    assert type(draft[0]) is torch.nn.Linear  # nothing was done


def test_causal_lm_switches_to_skinny_linears_on_cpu_only_when_asked_or_auto():
    from transformers import AutoModelForCausalLM

    from specresearch.models.kernels import SkinnyLinear
    from specresearch.models.toy import tiny_llama_config

    def fresh():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB, initializer_range=0.5), dtype=torch.float32)

    auto, off = CausalLM(fresh(), device="cpu"), CausalLM(fresh(), device="cpu", skinny_linear=False)
    assert any(type(m) is SkinnyLinear for m in auto.model.modules())
    assert not any(type(m) is SkinnyLinear for m in off.model.modules())
    assert auto.model.config._attn_implementation == CPU_SDPA and off.model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 5, 6, 7, 8], [4, 9, 9, 2, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding: every later call has a mask
    for lm in (auto, off):
        lm.prefill(ids, mask)
    for k in (1, 2, 3, 5):
        tokens = torch.arange(9, 9 + 2 * k).view(2, k)
        torch.testing.assert_close(auto.score(tokens), off.score(tokens), atol=1e-4, rtol=1e-4)  # float rounding
        for lm in (auto, off):
            lm.rollback(torch.tensor([k - 1, 0]))  # per row: masked slots from here on


@pytest.mark.parametrize("attention", [cpu_sdpa_attention, packed_sdpa_attention], ids=["cpu", "packed"])
@pytest.mark.parametrize("mask_shape", [(2, 1, 3, 7), (1, 1, 3, 7), (2, 4, 3, 7)])
@pytest.mark.parametrize("additive", [False, True])
def test_grouped_sdpa_attention_is_transformers_sdpa_without_the_kv_copies(attention, mask_shape, additive):
    """Grouped heads (4 query heads over 2) with a boolean or additive mask, shared by the heads, by the batch or one
    per head: cpu_sdpa_attention (the groups to the fused kernel) and packed_sdpa_attention (each group's queries in
    one head) give transformers' sdpa output, which repeats K and V; without a mask, transformers' function itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query = torch.randn(2, 3, 4, 8, generator=g).transpose(1, 2)  # [B, h, q, d], strided as a model's
    key, value = (torch.randn(2, 2, 7, 8, generator=g) for _ in range(2))
    mask = torch.rand(*mask_shape, generator=g) > 0.3
    mask[..., 0] = True
    if additive:
        bias = torch.randn(*mask_shape, generator=g).clamp(-1, 1)
        mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min) + bias
    got, weights = attention(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert weights is None and got.shape == (2, 3, 4, 8) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    causal = torch.randn(2, 4, 7, 8, generator=g)
    torch.testing.assert_close(attention(module, causal, key, value, None)[0],
                               sdpa_attention_forward(module, causal, key, value, None)[0], atol=0, rtol=0)


@pytest.mark.parametrize("attention", [cpu_sdpa_attention, packed_sdpa_attention], ids=["cpu", "packed"])
def test_grouped_sdpa_attention_takes_a_kernels_output_in_any_layout(attention, monkeypatch):
    """CUDA's memory-efficient kernel (what float32 gets there) returns ``[B, h, q, d]`` laid out as ``[B, q, h, d]``:
    the grouped attentions take it as they take a contiguous output (a ``view`` of it raised on the H200)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fused = torch.nn.functional.scaled_dot_product_attention

    def strided(*args, **kwargs):
        return fused(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    g = torch.Generator().manual_seed(2)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query = torch.randn(2, 4, 3, 8, generator=g)
    key, value = (torch.randn(2, 2, 7, 8, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, 3, 7, generator=g) > 0.3
    mask[..., 0] = True
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided)
    torch.testing.assert_close(attention(module, query, key, value, mask, scaling=0.3)[0], want, atol=1e-6, rtol=1e-5)


def test_packed_sdpa_scores_as_transformers_sdpa_with_fewer_torch_calls():
    """A tiny grouped-query model switched to packed_sdpa_attention (what CausalLM does on CUDA) scores every
    cached, masked call (left padding, per-row rollback, a tree) as with transformers' sdpa, and a masked call
    issues 4 torch calls a layer fewer (benchmarks/bench_step_ops.py counts the calls a GPU step issues)."""
    from transformers import AutoModelForCausalLM

    from specresearch.engine.timing import HostReads
    from specresearch.models.toy import tiny_llama_config

    def fresh():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB, num_layers=3, initializer_range=0.5),
                                                    dtype=torch.float32)

    packed, plain = (CausalLM(fresh(), device="cpu", skinny_linear=False) for _ in range(2))
    assert use_packed_sdpa(packed.model) and packed.model.config._attn_implementation == PACKED_SDPA
    ids = torch.tensor([[0, 5, 6, 7, 8], [4, 9, 9, 2, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    for lm in (packed, plain):
        lm.prefill(ids, mask)
    calls = {}
    for k in (2, 3):
        tokens = torch.arange(9, 9 + 2 * k).view(2, k)
        for name, lm in (("packed", packed), ("plain", plain)):
            with HostReads() as counter:
                calls[name] = (lm.score(tokens), counter.calls)
            lm.rollback(torch.tensor([k - 1, 0]))
        torch.testing.assert_close(calls["packed"][0], calls["plain"][0], atol=1e-5, rtol=1e-5)
        assert calls["plain"][1] - calls["packed"][1] == 4 * 3
    depth = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]])
    visible = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]] * 2, dtype=torch.bool)
    trees = []
    for lm in (packed, plain):
        lm.begin_tree()
        trees.append(lm.score_tree(torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]]), depth, visible))
    torch.testing.assert_close(trees[0], trees[1], atol=1e-5, rtol=1e-5)


def test_skinny_rows_are_chosen_by_timing_or_pinned(monkeypatch):
    """choose_skinny_rows keeps the row counts where the skinny product is faster by the margin, weighting each
    weight shape by its number of layers; $SPECRESEARCH_SKINNY_ROWS pins the answer; CausalLM applies it."""
    from transformers import AutoModelForCausalLM

    from specresearch.models import kernels
    from specresearch.models.kernels import (
        SkinnyLinear,
        choose_skinny_rows,
        use_skinny_linears,
    )
    from specresearch.models.toy import tiny_llama_config

    def fresh():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB, initializer_range=0.5), dtype=torch.float32)

    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "auto")
    assert choose_skinny_rows(fresh(), timer=lambda *a: pytest.fail("a model under 8 MiB is not timed")) == ()
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 0)  # the tiny model stands in for a large one from here on
    fast_for_few = lambda fn, path, rows: (0.5 if rows <= 2 else 1.5) if path == "skinny" else 1.0  # noqa: E731
    assert choose_skinny_rows(fresh(), timer=fast_for_few) == (1, 2)
    assert choose_skinny_rows(fresh(), timer=lambda fn, path, rows: 0.95 if path == "skinny" else 1.0) == ()  # within the margin
    assert choose_skinny_rows(torch.nn.Sequential(torch.nn.ReLU())) == ()  # no linear layers, nothing timed
    calls, swept = [], []

    def sweep(fn, path, rows):
        calls.append((path, rows))
        swept.append([tuple(y.shape) for y in fn()])
        return 1.0

    model = fresh()
    choose_skinny_rows(model, repeats=3, timer=sweep)
    assert sorted(calls) == sorted((p, r) for p in ("skinny", "plain") for r in range(1, 9) for _ in range(3))
    assert calls[:4] == [("skinny", 1), ("plain", 1), ("skinny", 2), ("plain", 2)]  # round robin over row counts
    layers = [m.weight.shape[0] for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [[s[-1] for s in shapes] for shapes in swept] == [layers] * len(calls)  # each sweep: every layer once
    assert {s[0] for (_, rows), shapes in zip(calls, swept) for s in shapes if rows == 3} == {3}
    for pinned, rows in [("all", tuple(range(1, 9))), ("none", ()), ("3, 1", (1, 3))]:
        monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", pinned)
        assert choose_skinny_rows(fresh(), timer=lambda *a: pytest.fail("a pinned answer times nothing")) == rows
    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "9")
    with pytest.raises(ValueError, match="SPECRESEARCH_SKINNY_ROWS"):
        choose_skinny_rows(fresh())
    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "none")
    plain = CausalLM(fresh(), device="cpu")
    assert not any(type(m) is SkinnyLinear for m in plain.model.modules()) and plain.model.config._attn_implementation == CPU_SDPA
    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "1,2")
    some = CausalLM(fresh(), device="cpu")
    assert {m.skinny_rows for m in some.model.modules() if type(m) is SkinnyLinear} == {(1, 2)}
    forced = CausalLM(fresh(), device="cpu", skinny_linear=True)  # asked for: every row count, whatever the timing
    assert {m.skinny_rows for m in forced.model.modules() if type(m) is SkinnyLinear} == {range(1, 9)}
    ids, mask = torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long)
    for lm in (plain, some, forced):
        lm.prefill(ids, mask)
    for k in (1, 2, 3):  # the same model whichever path each row count takes, up to float rounding
        tokens = torch.arange(6, 6 + k)[None]
        want, *others = (lm.score(tokens) for lm in (plain, some, forced))
        for got in others:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="rows must lie in"):
        use_skinny_linears(fresh(), rows=(0,))


def test_the_skinny_rows_answer_is_timed_once_per_machine(monkeypatch, tmp_path):
    """The first auto choice on this machine times and writes <cache_dir>/skinny_rows.json; a later process (here:
    the in-process table cleared) reads it and times nothing."""
    from transformers import AutoModelForCausalLM

    from specresearch.models import kernels
    from specresearch.models.toy import tiny_llama_config

    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECRESEARCH_ANSWERS", raising=False)  # the default place: the cache folder
    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "auto")
    monkeypatch.setattr(kernels, "_CHOSEN_ROWS", {})
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 0)  # timed for real, though tiny
    model = AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB, hidden_size=24), dtype=torch.float32)
    first = kernels.choose_skinny_rows(model, repeats=1)
    stored = json.loads((tmp_path / "skinny_rows.json").read_text())
    assert list(stored.values()) == [list(first)] and "threads" in next(iter(stored))
    monkeypatch.setattr(kernels, "_CHOSEN_ROWS", {})
    monkeypatch.setattr(kernels, "skinny_linear", lambda *a, **k: pytest.fail("a stored answer times nothing"))
    assert kernels.choose_skinny_rows(model, repeats=1) == first


def test_the_cpu_mask_is_transformers_boolean_mask_made_additive_once():
    """additive_sdpa_mask: where transformers' sdpa mask is None (a call that needs none) so is it; else 0 where the
    boolean mask attends and -inf elsewhere, what scaled_dot_product_attention would make of it in every layer."""
    from transformers.masking_utils import sdpa_mask

    from specresearch.models.attention import additive_sdpa_mask

    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    common = dict(batch_size=2, q_length=2, kv_length=5, q_offset=3, attention_mask=padding)
    boolean = sdpa_mask(**common)
    additive = additive_sdpa_mask(**common, dtype=torch.float32)
    assert boolean.dtype == torch.bool and additive.dtype == torch.float32 and additive.shape == boolean.shape
    assert torch.equal(additive, torch.where(boolean, 0.0, float("-inf")))
    assert sdpa_mask(batch_size=1, q_length=1, kv_length=5, q_offset=4) is None
    assert additive_sdpa_mask(batch_size=1, q_length=1, kv_length=5, q_offset=4) is None


def test_calibration_stops_rows_that_clearly_lose_and_keeps_to_its_budget(monkeypatch):
    """``kernels._race``: a row count whose every candidate sweep is slower than every baseline one after two rounds is
    not timed again; with the real clock the rounds stop once the budget has passed (a slow machine: each clock reading
    3 s later than the last); the answer is decided from the rounds timed."""
    import time

    from specresearch.models import kernels

    calls = []

    def timer(fn, path, rows):
        calls.append((path, rows))
        return (2.0 if rows >= 5 else 0.5) if path == "kernel" else 1.0

    sweeps = {rows: {"kernel": lambda: None, "present": lambda: None} for rows in range(1, 9)}
    assert kernels._race(sweeps, ("kernel", "present"), 5, 0.9, timer) == (1, 2, 3, 4)
    assert all(calls.count(("kernel", r)) == (2 if r >= 5 else 5) for r in range(1, 9))
    now = iter(range(0, 10**6, 3))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(now)))
    timed = []
    slow = {rows: {"kernel": lambda r=rows: timed.append(r), "present": lambda: None} for rows in range(1, 9)}
    kernels._race(slow, ("kernel", "present"), 5, 0.9)
    assert sorted(timed) == sorted(list(range(1, 9)) * 2)  # the warm-up and one round: then 24 s had passed


def test_calibration_sweeps_fewer_weights_where_memory_is_slow(monkeypatch):
    """``kernels._fitted_subset``: the first weights in module order up to SWEEP_BYTES; where one measured sweep says
    the rounds would pass the budget (a 1 s sweep: 0.1 GB/s), a prefix small enough to fit it, never empty and never
    under SWEEP_FLOOR_BYTES."""
    from specresearch.models import kernels

    weights = [torch.zeros(256, 1024) for _ in range(16)]  # 1 MiB each
    monkeypatch.setattr(kernels, "SWEEP_BYTES", 8 << 20)
    monkeypatch.setattr(kernels, "_clock", lambda fn, path, rows: 1e-6)
    fast = kernels._fitted_subset(weights, lambda part: (lambda: None), repeats=5)
    assert len(fast) == 8 and all(a is b for a, b in zip(fast, weights))
    monkeypatch.setattr(kernels, "_clock", lambda fn, path, rows: 1.0)
    monkeypatch.setattr(kernels, "SWEEP_FLOOR_BYTES", 0)
    slow = kernels._fitted_subset(weights, lambda part: (lambda: None), repeats=5)
    assert len(slow) == 1 and slow[0] is weights[0]  # 8 s / (16 x 1.3 x 6 sweeps of 1 s): 6 % of the bytes
    monkeypatch.setattr(kernels, "SWEEP_FLOOR_BYTES", 3 << 20)
    assert len(kernels._fitted_subset(weights, lambda part: (lambda: None), repeats=5)) == 3  # never under the floor


def test_calibration_says_on_stderr_what_it_times_once(monkeypatch, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from specresearch.models import kernels
    from specresearch.models.toy import tiny_llama_config

    monkeypatch.setenv("SPECRESEARCH_ANSWERS", str(tmp_path))
    monkeypatch.setenv("SPECRESEARCH_SKINNY_ROWS", "auto")
    monkeypatch.setattr(kernels, "_CHOSEN_ROWS", {})
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB, hidden_size=24), dtype=torch.float32)
    kernels.choose_skinny_rows(model, repeats=1)
    said = capsys.readouterr().err
    assert "timing the skinny product's row counts on this CPU" in said and "once per machine" in said
    monkeypatch.setattr(kernels, "_CHOSEN_ROWS", {})
    kernels.choose_skinny_rows(model, repeats=1)  # the stored answer: nothing timed, nothing said
    assert "timing" not in capsys.readouterr().err


def test_an_older_transformers_is_named_with_its_fix():
    """Below ``config.TRANSFORMERS_FLOOR`` the package fails at import with both versions and the pip line (before 5.14
    it failed deep inside the first model load: ``cannot import name 'get_layer_types_and_kwargs'``); pyproject's
    floor is the same version, and the command line says it in one line."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from specresearch.checks import OutdatedDependency
    from specresearch.config import TRANSFORMERS_FLOOR
    from specresearch.models import check_transformers

    with pytest.raises(ImportError, match=rf"transformers 4\.57\.6 is installed, and specresearch needs >= "
                                          rf"{TRANSFORMERS_FLOOR}: pip install -U 'transformers>={TRANSFORMERS_FLOOR}'"):
        check_transformers("4.57.6")
    for fine in (TRANSFORMERS_FLOOR, "5.25.0", "5.26.0.dev0", "6.0.0"):
        check_transformers(fine)
    check_transformers()  # this environment's
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'"transformers>=([0-9.]+)"', pyproject).group(1) == TRANSFORMERS_FLOOR
    old = ("import importlib.metadata as m; real = m.version; "
           "m.version = lambda name: '5.0.0' if name == 'transformers' else real(name); "
           "from specresearch.cli import main; raise SystemExit(main(['generate', 'hi']))")
    run = subprocess.run([sys.executable, "-c", old], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"specresearch: error: transformers 5.0.0 is installed, and specresearch needs >= {TRANSFORMERS_FLOOR}: pip "
        f"install -U 'transformers>={TRANSFORMERS_FLOOR}' (docs/environments.md)"], run.stderr
    assert issubclass(OutdatedDependency, ImportError)


def test_a_device_this_machine_lacks_is_named():
    """``resolve_device`` (every model load goes through it): an unknown device, or one this machine lacks, is a
    ValueError naming it and what to pass; torch's own was an AssertionError ("Torch not compiled with CUDA enabled")."""
    from specresearch.models.causal_lm import resolve_device

    with pytest.raises(ValueError, match=r"device 'tpu' is not a device: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=rf"device 'cuda:99': this machine has {torch.cuda.device_count()} CUDA"):
            resolve_device("cuda:99")
    else:
        for device in ("cuda", "cuda:1", torch.device("cuda")):
            with pytest.raises(ValueError, match="torch sees no CUDA device on this machine.*use 'cpu' or 'auto'"):
                resolve_device(device)
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match="torch sees no Apple GPU"):
            resolve_device("mps")
    assert resolve_device("cpu") == torch.device("cpu") == resolve_device(torch.device("cpu"))
    assert resolve_device("auto").type in ("cuda", "mps", "cpu")
