"""The compiled product for 1-8 rows (specresearch.models.native) and how the linear layers choose it.

The kernel's own tests need a C compiler and an x86 CPU with AVX-512 or AVX2 and FMA (where either is missing the kernel
is None and the layers keep their paths, which the last tests check); they are skipped, with that reason, only there."""

from __future__ import annotations

import pytest
import torch

from specresearch.models import kernels, native
from specresearch.models.kernels import (
    SkinnyLinear,
    choose_kernel_rows,
    skinny_linear,
    use_kernel_rows,
)

needs_kernel = pytest.mark.skipif(native.skinny_kernel() is None,
                                  reason="no C compiler or neither AVX-512 nor AVX2 here: the kernel is not built")


@needs_kernel
@pytest.mark.parametrize("rows", native.KERNEL_ROWS)
@pytest.mark.parametrize("out, bias", [(37, True), (64, False), (5, True)])
def test_kernel_equals_linear(rows, out, bias):
    generator = torch.Generator().manual_seed(rows * 100 + out)
    x = torch.randn(rows, 48, generator=generator)
    weight = torch.randn(out, 48, generator=generator)
    b = torch.randn(out, generator=generator) if bias else None
    got = native.kernel_linear(x, weight, b)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    batched = native.kernel_linear(x[None], weight, b)  # leading dimensions are kept
    assert batched.shape == (1, rows, out) and torch.equal(batched[0], got)
    strided = torch.randn(48, rows, generator=generator)  # a column-major x: copied, not read where it lies
    assert torch.equal(native.kernel_linear(strided.t(), weight, b), native.kernel_linear(strided.t().contiguous(), weight, b))


@needs_kernel
@pytest.mark.parametrize("rows", native.KERNEL_ROWS)
def test_float16_weights_are_multiplied_as_their_float32_widening(rows):
    """A float16 weight is widened as it is read: the float32 product with the float16-rounded weights (no float16
    arithmetic, so no overflow where the float16 product would overflow)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator)
    weight = torch.randn(21, 64, generator=generator).half()
    b = torch.randn(21, generator=generator)
    got = native.kernel_linear(x, weight, b)
    assert got.dtype == torch.float32 and got.shape == (rows, 21)
    torch.testing.assert_close(got.double(), torch.nn.functional.linear(x.double(), weight.double(), b.double()),
                               rtol=1e-5, atol=1e-5)
    big = native.kernel_linear(x * 1e4, torch.full((3, 64), 60000.0).half())  # float16's sums would pass 65,504
    assert torch.isfinite(big).all()
    torch.testing.assert_close(big, (x * 1e4).sum(-1, keepdim=True).expand(-1, 3) * 60000.0, rtol=1e-4, atol=1.0)
    assert native.kernel_linear(x, weight, b.half()) is None  # a float16 bias: declined
    assert native.kernel_linear(x, weight.bfloat16()) is None  # bfloat16 weights: declined


@needs_kernel
@pytest.mark.parametrize("rows", native.KERNEL_ROWS)
def test_int8_weights_are_multiplied_as_their_conversion_times_their_scales(rows):
    """An int8 weight is converted as it is read and each output row's sum multiplied by its scale:
    ``F.linear(x, weight.float()) * scale + bias`` up to float rounding; without a float32 scale per row, declined."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator)
    weight = torch.randint(-127, 128, (21, 64), generator=generator, dtype=torch.int8)
    scale, b = torch.rand(21, generator=generator) / 100, torch.randn(21, generator=generator)
    got = native.kernel_linear(x, weight, b, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, 21)
    want = torch.nn.functional.linear(x.double(), weight.double()) * scale.double() + b.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert native.kernel_linear(x, weight, b) is None  # no scale
    assert native.kernel_linear(x, weight, b, scale[:20]) is None  # not one per row
    assert native.kernel_linear(x, weight, b, scale.double()) is None
    assert native.kernel_linear(x, weight.float(), b, scale) is not None  # a scale beside a float weight: unread


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype):
    """Each row's partial sums are reduced in one fixed order whatever n is: bit for bit the same."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 576, generator=generator)
    weight = torch.randn(200, 576, generator=generator)
    scale = None
    if dtype is torch.int8:
        weight, scale = torch.randint(-127, 128, (200, 576), generator=generator, dtype=torch.int8), torch.rand(200) / 100
    alone = torch.cat([native.kernel_linear(x[r:r + 1], weight, None, scale) for r in range(8)])
    for n in native.KERNEL_ROWS:
        assert torch.equal(native.kernel_linear(x[:n], weight, None, scale), alone[:n]), n


@needs_kernel
def test_the_kernel_declines_what_it_cannot_take():
    x, weight = torch.randn(2, 32), torch.randn(4, 32)
    assert native.kernel_linear(torch.randn(9, 32), weight) is None  # more than 8 rows
    assert native.kernel_linear(torch.randn(2, 30), torch.randn(4, 30)) is None  # width not a multiple of 16
    assert native.kernel_linear(x.double(), weight.double()) is None
    assert native.kernel_linear(x, torch.randn(32, 4).t()) is None  # a weight that is not contiguous
    assert native.kernel_linear(x, weight, torch.randn(8)[::2]) is None  # nor a bias
    assert native.kernel_linear(torch.randn(2, 48), weight) is None  # a width other than the weight's: declined, F.linear raises
    default = torch.get_default_dtype()
    try:  # the result is float32 whatever torch's default dtype
        torch.set_default_dtype(torch.float64)
        torch.testing.assert_close(native.kernel_linear(x, weight), torch.nn.functional.linear(x, weight))
    finally:
        torch.set_default_dtype(default)


@needs_kernel
def test_skinny_linear_uses_the_kernel_only_without_a_gradient():
    x = torch.randn(3, 32)
    weight = torch.randn(6, 32, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(skinny_linear(x, weight, kernel_rows=(3,)), native.kernel_linear(x, weight))
    y = skinny_linear(x, weight, kernel_rows=(3,))
    y.sum().backward()  # the gradient path: F.linear's
    torch.testing.assert_close(weight.grad, x.sum(0).expand(6, -1))


@needs_kernel
def test_layers_given_kernel_rows_compute_what_they_computed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16, bias=False))
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        before = model(x)
        assert use_kernel_rows(model, (4, 8)) == 2
        assert all(type(m) is SkinnyLinear and m.kernel_rows == (4, 8) and m.skinny_rows == ()
                   for m in (model[0], model[2]))
        after = model(x)  # 8 rows: the kernel
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    assert use_kernel_rows(model, ()) == 2 and model[0].kernel_rows == ()
    with pytest.raises(ValueError, match="rows must lie in"):
        use_kernel_rows(model, (0,))


def test_kernel_rows_are_chosen_by_timing(monkeypatch):
    """A row count is chosen where the kernel's median sweep beats the present path's by the margin; weights that fit
    in cache are not timed at all (their timings are noise)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    assert choose_kernel_rows(model, timer=lambda *a: pytest.fail("a small model is not timed")) == ()
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 0)
    def timer(fn, path, rows):
        return (0.5 if rows >= 3 else 0.95) if path == "kernel" else 1.0

    chosen = choose_kernel_rows(model, timer=timer)
    assert chosen == (3, 4, 5, 6, 7, 8)
    narrow = torch.nn.Sequential(torch.nn.Linear(30, 16))  # width 30: no layer the kernel takes, nothing timed
    assert choose_kernel_rows(narrow, timer=lambda *a: pytest.fail("nothing to time")) == ()


def test_switched_off_the_kernel_is_none_and_nothing_is_chosen(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.skinny_kernel() is None and native.kernel_linear(torch.randn(2, 32), torch.randn(4, 32)) is None
    assert choose_kernel_rows(torch.nn.Sequential(torch.nn.Linear(32, 16))) == ()
    x, weight = torch.randn(3, 32), torch.randn(6, 32)
    torch.testing.assert_close(skinny_linear(x, weight, kernel_rows=(3,)), torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("isa, registers", [("avx512", 32), ("avx2", 16)])
def test_the_source_fits_the_registers(isa, registers):
    """n * OB accumulators and either OB weight vectors and one input vector, or (the inputs held, float32 weights read
    by the FMAs) n input vectors: at most the instruction set's registers (AVX-512's 32, AVX2's 16), so none spills."""
    assert set(native._BLOCKS[isa]) == set(native.KERNEL_ROWS)
    for widened in (False, True):  # float32 weights; float16 or int8 ones, widened into a register first
        for n in native.KERNEL_ROWS:
            ob, held = native._weight_rows(isa, n, widened)
            assert ob >= 1 and not (held and widened)
            assert (n * ob + n if held else n * ob + ob + 1) <= registers, (n, widened)
    for n, groups in native._GROUPS[isa].items():  # row groups sharing the first group's OB weight rows
        ob = native._BLOCKS[isa][groups[0]]
        assert sum(groups) == n and all(g not in native._GROUPS[isa] for g in groups)
        assert all(g * ob + ob + 1 <= registers for g in groups), n
    source = native.kernel_source(isa)
    assert source.count("static void rows_") == 3 * len(native.KERNEL_ROWS)  # float32, float16 and int8 weights
    assert "int skinny_f32(" in source and "int skinny_f16(" in source and "int skinny_i8(" in source
    blocks = source.split("static inline void ")[1:]  # only the int8 blocks multiply by the rows' scales
    assert [("* scale[o + b]" in block) for block in blocks] == [("const signed char *w" in block) for block in blocks]
    assert any("const signed char *w" in block for block in blocks)
    assert ("__m512 " in source) == (isa == "avx512") and ("__m256 " in source) == (isa == "avx2")


@needs_kernel
def test_with_the_kernel_for_every_row_count_a_cached_call_equals_the_uncached_forward_exactly():
    """The kernel's rows do not depend on the rows beside them, so a prompt prefilled in 4 rows and 2 more tokens scored
    give, bit for bit, the hidden states of one uncached 6-row forward (with MKL's products they differ by rounding)."""
    from specresearch.models.toy import tiny_llama

    target = tiny_llama(64, seed=0, init_std=0.6, num_layers=3)
    use_kernel_rows(target.model, native.KERNEL_ROWS)
    seq = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        out = target.model(input_ids=seq, output_hidden_states=True)
    _, prompt = target.prefill(seq[:, :4], torch.ones(1, 4, dtype=torch.long), hidden_layers=(1, -1))
    _, block = target.score(seq[:, 4:], hidden_layers=(1, -1))
    assert torch.equal(torch.cat([prompt, block], 1), torch.cat([out.hidden_states[1], out.hidden_states[-1]], -1))


def test_float16_layers_are_timed_for_the_kernel_too(monkeypatch):
    """Half-weight layers (models.kernels.use_half_weights) are timed against their float16 product and given the rows
    the kernel wins; a model of both dtypes is keyed apart from its float32 self."""
    from specresearch.drafts.distilled import SubsetHead
    from specresearch.models.kernels import use_half_weights

    model = torch.nn.Sequential(torch.nn.Linear(32, 16), SubsetHead(torch.randn(4, 16), torch.arange(4), 10))
    use_half_weights(model, (SubsetHead,))
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 0)
    timed = []

    def timer(fn, path, rows):
        timed.append(path)
        return (0.5 if rows <= 2 else 0.95) if path == "kernel" else 1.0

    assert choose_kernel_rows(model, timer=timer) == (1, 2) and {"kernel", "present"} == set(timed)
    assert use_kernel_rows(model, (1, 2)) == 2 and model[1].kernel_rows == (1, 2)
    whole = torch.nn.Sequential(torch.nn.Linear(32, 16)).half()  # a float16 model: float16 activations, not timed
    assert choose_kernel_rows(whole, timer=lambda *a: pytest.fail("a float16 model's layers are not the kernel's")) == ()


def test_int8_weights_count_toward_what_a_forward_streams(monkeypatch):
    """An int8 draft's float16 input layers are timed when the model's weights, int8 ones included, do not fit in the
    cache, though the float16 ones alone would (drafts.registry.int8_weight_draft)."""
    from specresearch.models.kernels import use_half_weights, use_int8_weights

    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 256))
    use_half_weights(model[0])  # 1 KiB
    use_int8_weights(model[1])  # 4 KiB
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 2048)
    timed = []

    def timer(fn, path, rows):
        timed.append(path)
        return 0.5 if path == "kernel" else 1.0

    assert choose_kernel_rows(model, timer=timer) == tuple(native.KERNEL_ROWS) and timed
    monkeypatch.setattr(kernels, "TIMED_MIN_BYTES", 8192)  # all of it fits: nothing timed
    assert choose_kernel_rows(model, timer=lambda *a: pytest.fail("weights that fit in the cache are not timed")) == ()


@needs_kernel
def test_a_half_weight_subset_head_with_kernel_rows_computes_the_widened_product():
    from specresearch.drafts.distilled import SubsetHead
    from specresearch.models.kernels import use_half_weights

    generator = torch.Generator().manual_seed(0)
    head = SubsetHead(torch.randn(40, 32, generator=generator), torch.arange(0, 80, 2), 80)
    use_half_weights(head, (SubsetHead,))
    use_kernel_rows(head, (2,))
    hidden = torch.randn(1, 2, 32, generator=generator)
    with torch.no_grad():
        logits = head(hidden)
    want = torch.nn.functional.linear(hidden.double(), head.weight.double())
    torch.testing.assert_close(logits[..., 0::2].double(), want, rtol=1e-5, atol=1e-5)
    assert (logits[..., 1::2] == torch.finfo(torch.float32).min).all()
