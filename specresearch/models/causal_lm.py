"""Language-model wrappers with one narrow interface: prefill, score a block, roll back.

Every model the generation engine drives -- a transformers model (:class:`CausalLM`), a toy table
(:class:`ToyLM`) or an n-gram draft (``drafts.NGramDraft``) -- exposes the same methods:

* ``prefill(input_ids [B, L], attention_mask [B, L]) -> logits [B, V]``: start a new batch from a
  left-padded prompt; returns the next-token logits after the prompt (``L >= 1``; a row may be all
  padding, i.e. an empty context, and then its returned logits are meaningless).
* ``reset(batch_size)``: start a new batch with an empty context (what ``prefill`` of 0 tokens would be).
* ``score(tokens [B, k], valid=None [B, k] bool) -> logits [B, k, V]``: append ``k`` tokens and return
  the next-token logits after each of them. A slot with ``valid[b, j] = False`` is appended but masked
  out, as if it were never there (its logits row is meaningless).
* ``rollback(n)``: forget the last ``n`` appended slots (``int``, or ``[B]`` int for per-row counts).
* ``CausalLM`` (``returns_hidden_states = True``): ``prefill`` / ``score`` with ``hidden_layers=(i, ...)``
  also return the hidden states ``[B, k, len(hidden_layers) * H]`` of the slots just fed (``hidden_states``
  indices, concatenated), for drafts that read the target's features (``feature_drafts``); the wrapper
  does not know what reads them.
* ``cache_length`` (physical slots, shared by all rows), ``valid_lengths [B]``, ``vocab_size``, ``device``.

Speed on CPUs: a speculative step scores gamma + 1 tokens in one call, so the target's linear layers
multiply 2-9 rows by each weight, and autoregressive decoding 1. A forward of a small model is bound by
streaming its weights from memory, but MKL (PyTorch's CPU BLAS) computes ``x @ W^T`` with 1 row as a GEMV
that streams W at half the rate of a GEMM here, with 2 or 3 rows as one GEMV per row, and from 4 rows on as
a blocked GEMM that packs W first. ``(W @ x^T)^T`` with ``x`` contiguous is a GEMM with N = rows that streams
W once; with one row it is a GEMV again, so one row is padded to two. :class:`CausalLM` switches the
model's ``nn.Linear`` layers to :class:`SkinnyLinear`, which does that for 1-8 rows on CPU (same
parameters; ``skinny_linear=False`` opts out): on the machine this was measured on, a one-token call of
the embedded target costs 0.6-0.9 of ``nn.Linear``'s and a two-token call 0.4-0.65 (1-2 threads;
``benchmarks/bench_score_cost.py``, figures in ``docs/feature_drafts.md``). On another CPU (a Xeon with
AVX-512 and AMX) the plain product is twice as fast for one row, so by default :class:`CausalLM` times
both on the model's own weights when it loads (:func:`choose_skinny_rows`, ~7 s for the embedded
target) and computes only the row counts where the skinny product wins its own way.

Attention of such calls: every call that scores 2 or more cached tokens carries a mask, and under a
mask transformers' ``"sdpa"`` attention copies K and V once per query group of a grouped-query model
(SmolLM2: 9 heads over 3) to keep CUDA's fused kernels, and a query whose last axis is strided (the
transposed output of ``(W @ x^T)^T``) sends the CPU kernel down its slow unfused path. So
``skinny_linear`` returns row-major outputs and ``CausalLM`` on CPU switches ``"sdpa"`` to
:func:`cpu_sdpa_attention`, which hands the groups to the fused kernel: a two-token call of the embedded
target then costs about what a one-token call costs (it cost 5-6 ms more, ~10%).

Half-precision weights for drafts (:func:`use_half_weights`): a draft's weights stored in float16 halve
the bytes streamed per call; its activations, biases and everything between the linear layers stay
float32. :func:`skinny_linear` sees the dtypes differ and multiplies 1-4 rows in float16 (a oneDNN
product that streams W at twice the float32 rate here) and more rows in float32 against the upcast
weights (float16 products slow down with rows on this CPU). The weights are the float16-rounded ones
either way; the draft's q is whatever it computes, so losslessness is untouched.

Ragged batches (the design choice): rows of a batch accept different numbers of draft tokens, but all
rows share ONE physical cache length. ``rollback(n)`` with per-row ``n`` crops the suffix common to all
rows from the KV cache (``DynamicCache.crop``) and masks out (attention mask 0) the extra slots of rows
that drop more. Position ids are the number of valid slots before each token, so every row sees the
positions of its compacted sequence, and its logits equal those of a plain uncached forward of that
compacted sequence (``tests/test_models.py`` checks it with atol 1e-4 in float32, B = 1 and B > 1 with
left padding). The cost is up to gamma dead slots per step in a batch whose rows disagree; with B = 1
there are never any. The validity mask lives in one object (``SlotMask``): it is the only record of the
cache length, and the KV cache is asserted to agree with it.
"""

from __future__ import annotations

import inspect
import os
from typing import Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "LanguageModel",
    "CausalLM",
    "SkinnyLinear",
    "skinny_linear",
    "use_skinny_linears",
    "choose_skinny_rows",
    "use_half_weights",
    "cpu_sdpa_attention",
    "use_cpu_sdpa",
    "cache_argument",
    "output_cache",
    "SlotMask",
    "rollback_counts",
    "check_prompt",
    "ToyLM",
    "resolve_device",
    "tiny_llama_config",
    "tiny_llama",
]


@runtime_checkable
class LanguageModel(Protocol):
    """The narrow interface the generation engine uses (see the module docstring)."""

    vocab_size: int
    device: torch.device

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...
    def reset(self, batch_size: int) -> None: ...
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor: ...
    def rollback(self, n) -> None: ...


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> cuda if available, else mps, else cpu; anything else is passed to ``torch.device``."""
    if str(device) != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class SlotMask:
    """Validity mask over the physical cache slots: the one place the cache length is tracked (for
    implementers of ``LanguageModel``: ``CausalLM``, ``ToyLM`` and ``drafts.NGramDraft`` share it)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask.bool()  # [B, L]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def counts(self) -> torch.Tensor:
        """Valid slots per row. -> [B] int64."""
        return self.mask.sum(-1)

    def prompt_positions(self) -> torch.Tensor:
        """Position ids of a left-padded prompt: valid slots count 0, 1, ...; pads get 0. -> [B, L]."""
        return (self.mask.long().cumsum(-1) - 1).clamp(min=0)

    def append(self, valid: torch.Tensor) -> torch.Tensor:
        """Append slots ``valid [B, k]``; return their position ids ``[B, k]`` (valid slots before each)."""
        valid = valid.bool()
        before = self.counts()[:, None] + valid.long().cumsum(-1) - valid.long()  # [B, k]
        self.mask = torch.cat([self.mask, valid], dim=1)
        return before

    def drop(self, n: torch.Tensor) -> int:
        """Forget the last ``n[b]`` slots of row b; return how many trailing slots every row lost."""
        if n.shape != (self.mask.shape[0],) or bool((n < 0).any()) or int(n.max()) > self.length:
            raise ValueError(
                f"n must be between 0 and cache_length={self.length} for each of the {self.mask.shape[0]} rows, "
                f"got {n.tolist()}"
            )
        columns = torch.arange(self.length, device=self.mask.device)
        self.mask = self.mask & (columns[None, :] < self.length - n[:, None])
        common = int(n.min())
        self.mask = self.mask[:, : self.length - common]
        return common


def rollback_counts(n, batch: int, device) -> torch.Tensor:
    """``int`` or ``[B]`` tensor/sequence of rollback counts -> ``[B]`` int64."""
    counts = torch.as_tensor(n, dtype=torch.long, device=device)
    return counts.expand(batch).clone() if counts.ndim == 0 else counts


def check_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``input_ids [B, L]`` (L >= 1) has a left-padded ``attention_mask`` of its shape."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [B, L] with L >= 1, got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    if bool((attention_mask.long().diff(dim=1) < 0).any()):
        raise ValueError("attention_mask must be left-padded: in each row, zeros (padding) and then ones")


SKINNY_ROWS = range(1, 9)  # row counts :func:`skinny_linear` computes as (W @ x^T)^T on CPU
HALF_ROWS = 4  # up to this many rows, half weights multiply in their own dtype (module docstring)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  skinny_rows=SKINNY_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on CPU with 1-8 rows computed as ``(W @ x^T)^T`` (module docstring).

    ``x``: ``[..., in]``; rows = ``x.numel() / in``. The product takes ``x`` contiguous (a column-major ``x``,
    such as the previous layer's transposed output, sends MKL down a path ~3x slower) and one row padded
    to two (MKL's one-column product is a GEMV). The same function up to float rounding (~1e-6 relative);
    any other row count (outside ``skinny_rows``), device or an empty input takes ``F.linear`` unchanged. A
    ``weight`` whose dtype differs from ``x``'s (half weights, :func:`use_half_weights`) is multiplied as the
    module docstring says.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    if weight.dtype != x.dtype:  # half weights, float32 activations (use_half_weights)
        y = (torch.nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype) if rows <= HALF_ROWS
             else torch.nn.functional.linear(x, weight.to(x.dtype)))
        return y if bias is None else y + bias
    if rows not in skinny_rows or x.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    flat = (flat.expand(2, -1) if rows == 1 else flat).contiguous()
    y = torch.mm(weight, flat.t()).t()[:rows].contiguous()  # [rows, out], row-major for what follows
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward is :func:`skinny_linear`: 1-8 rows on CPU as ``(W @ x^T)^T``.

    The same function (up to float rounding), parameters and state dict; any other number of rows (>= 9:
    MKL's blocked GEMM wins again) or device takes ``nn.Linear``'s path unchanged.
    """

    SKINNY_ROWS = SKINNY_ROWS
    skinny_rows = SKINNY_ROWS  # the row counts this layer computes its own way (use_skinny_linears may narrow them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias, skinny_rows=self.skinny_rows)


def use_skinny_linears(model: torch.nn.Module, rows=SKINNY_ROWS) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`SkinnyLinear` in place (parameters and state
    dict untouched), computing ``rows`` (a subset of ``SKINNY_ROWS``) its own way; returns how many were
    switched. Subclasses of ``nn.Linear`` are left as they are, and so is every ``nn.Linear`` when ``rows`` is
    empty; every module that carries a ``skinny_rows`` attribute (:class:`SkinnyLinear`, a draft's
    vocabulary-subset head) is given ``rows``."""
    rows = tuple(rows)
    if not set(rows) <= set(SKINNY_ROWS):
        raise ValueError(f"rows must lie in {tuple(SKINNY_ROWS)}, got {rows}")
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and rows:
            module.__class__ = SkinnyLinear
            switched += 1
        if hasattr(module, "skinny_rows"):
            module.skinny_rows = rows if rows != tuple(SKINNY_ROWS) else SKINNY_ROWS
    return switched


SKINNY_ROWS_ENV = "SPECRESEARCH_SKINNY_ROWS"
_CHOSEN_ROWS: dict[tuple, tuple[int, ...]] = {}


def choose_skinny_rows(model: torch.nn.Module, *, repeats: int = 5, margin: float = 0.9, timer=None) -> tuple[int, ...]:
    """The row counts (of ``SKINNY_ROWS``) for which :func:`skinny_linear` beats ``F.linear`` on this machine,
    timed on ``model``'s own float32 linear layers (and modules that carry ``skinny_rows``). For each row
    count, one sweep multiplies an input by every such layer's weight in module order, as a forward
    streams them; ``repeats`` rounds each time both paths' sweeps of every row count in turn, and a row
    count is chosen when its median skinny sweep takes less than ``margin`` times its median plain one.
    A sweep reads each weight once, so a model larger than the CPU's caches is timed from memory, as its
    forwards run (one weight per shape timed over and over stays in cache, where the plain one-row
    product looked 3x faster than the skinny one on an AMD EPYC whose forwards ran it 1.4x slower).
    Which is faster depends on the CPU (docs/engine_and_models.md). ``$SPECRESEARCH_SKINNY_ROWS`` pins the answer without timing: ``all``,
    ``none`` or row counts such as ``1,2,3``; ``auto`` (or unset) times. Answers are kept per layer
    shapes and thread count for the process. ``timer(fn, path, rows) -> seconds`` (path ``"skinny"`` or
    ``"plain"``) replaces the clock that times one sweep ``fn()`` (tests).
    """
    import statistics
    import time

    pinned = os.environ.get(SKINNY_ROWS_ENV, "auto").strip().lower()
    if pinned != "auto":
        if pinned in ("all", "none"):
            return tuple(SKINNY_ROWS) if pinned == "all" else ()
        try:
            rows = tuple(sorted({int(r) for r in pinned.split(",") if r.strip()}))
        except ValueError:
            rows = None
        if rows is None or not set(rows) <= set(SKINNY_ROWS):
            raise ValueError(f"${SKINNY_ROWS_ENV} must be auto, all, none or row counts in {tuple(SKINNY_ROWS)} "
                             f"separated by commas, got {pinned!r}")
        return rows
    weights = []
    for module in model.modules():
        timed = isinstance(module, torch.nn.Linear) or hasattr(module, "skinny_rows")
        if timed and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            weights.append(module.weight.detach())
    if not weights:
        return ()
    key = (tuple(tuple(w.shape) for w in weights), torch.get_num_threads())
    if timer is None and key in _CHOSEN_ROWS:
        return _CHOSEN_ROWS[key]

    def clock(fn, path, rows):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    timer = timer or clock
    sweeps = {}
    for rows in SKINNY_ROWS:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
                  for w in weights}
        sweeps[rows] = {"skinny": lambda x=inputs: [skinny_linear(x[w.shape[1]], w) for w in weights],
                        "plain": lambda x=inputs: [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights]}
    times = {(rows, name): [] for rows in SKINNY_ROWS for name in ("skinny", "plain")}
    with torch.no_grad():
        for rows, paths in sweeps.items():
            for fn in paths.values():
                fn()  # warm
        for _ in range(repeats):  # round robin: a passing slow spell of the host touches every row count alike
            for rows, paths in sweeps.items():
                for name, fn in paths.items():
                    times[rows, name].append(timer(fn, name, rows))
    chosen = [rows for rows in SKINNY_ROWS
              if statistics.median(times[rows, "skinny"]) < margin * statistics.median(times[rows, "plain"])]
    if timer is clock:
        _CHOSEN_ROWS[key] = tuple(chosen)
    return tuple(chosen)


def use_half_weights(model: torch.nn.Module, types: tuple[type, ...] = (), *, shared_with: torch.nn.Module | None = None,
                     dtype: torch.dtype = torch.float16) -> int:
    """Give every ``nn.Linear`` (and module of ``types``: modules whose forward multiplies by ``self.weight``
    through :func:`skinny_linear`) of ``model`` a new weight, its old one in ``dtype``; returns how many.

    For inference: the new weights do not require grad. Plain ``nn.Linear`` layers become
    :class:`SkinnyLinear` (whose forward handles the mixed dtypes on any device); biases and every other
    parameter stay as they are. A weight tied to another module (an output head tied to the input
    embedding) is untied: only the linear layer gets the half copy. ``shared_with``: a model (the target)
    none of whose modules may be changed: a layer ``model`` shares with it raises ``ValueError`` before
    anything is done.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    chosen = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, *types))]
    theirs = set() if shared_with is None else {id(m) for m in shared_with.modules()}
    shared = [type(m).__name__ for m in chosen if id(m) in theirs]
    if shared:
        raise ValueError(f"half weights: {len(shared)} layer(s) ({shared[0]}, ...) belong to the target too; "
                         "changing them would change the target")
    for module in chosen:
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
        module.weight = torch.nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
    return len(chosen)


CPU_SDPA = "specresearch_cpu_sdpa"  # the attention implementation CausalLM selects on CPU (cpu_sdpa_attention)


def cpu_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs):
    """transformers' ``"sdpa"`` attention, except that a masked call of a grouped-query layer on CPU hands the
    groups to the kernel (``enable_gqa``) instead of copying K and V once per group.

    transformers copies them whenever a mask is given (CUDA's fused kernels take grouped heads only without a
    mask), and every call that scores 2 or more cached tokens has a mask. On CPU the fused kernel takes both,
    so the copy (2 x layers x heads x context x head_dim floats per call) is pure cost. Any other call (no
    mask, no groups, another device, position bias, soft-capping, attention weights asked) goes to
    transformers' own function. Inputs ``query [B, h, q, d]``, ``key / value [B, kv, S, d]``; returns
    ``([B, q, h, d], None)`` as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    special = any(kwargs.get(name) is not None for name in ("position_bias", "cache", "softcap")) or kwargs.get("output_attentions")
    if attention_mask is None or groups == 1 or query.device.type != "cpu" or special or key.shape[-1] != value.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_cpu_sdpa(model) -> bool:
    """Switch a transformers model that uses ``"sdpa"`` attention to :func:`cpu_sdpa_attention` (registered with
    transformers as ``CPU_SDPA``, with transformers' sdpa masks); returns whether it was switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(CPU_SDPA, cpu_sdpa_attention)
    AttentionMaskInterface.register(CPU_SDPA, sdpa_mask)
    model.set_attn_implementation(CPU_SDPA)
    return True


def cache_argument(model) -> str:
    """The keyword a transformers model's forward takes its KV cache under: ``"cache"`` (transformers >= 5.24,
    where ``past_key_values`` is deprecated) or ``"past_key_values"``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(output):
    """The KV cache of a transformers model output, under either name (``cache_argument``)."""
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


class CausalLM:
    """A transformers ``AutoModelForCausalLM`` behind the narrow prefill / score / rollback interface.

    Uses transformers' own ``DynamicCache`` (``crop`` for rollback); keeps no state on the HF model object
    and never branches on the model class (on CPU it switches the model's ``nn.Linear`` layers to
    :class:`SkinnyLinear`, see ``skinny_linear``, and its ``"sdpa"`` attention to :func:`cpu_sdpa_attention`).
    Logits are returned in float32.

    Args:
        model: a model name or local path (loaded with ``AutoModelForCausalLM.from_pretrained``), or an instance.
        device: ``"auto"`` (cuda > mps > cpu) or a torch device; ignored when ``device_map`` is given.
        dtype: e.g. ``torch.float32`` / ``torch.bfloat16``; ``None`` keeps the checkpoint's (or instance's) dtype.
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"``: accelerate shards a large target across
            the available GPUs, then CPU). Only with a name or path.
        skinny_linear: switch the model's ``nn.Linear`` layers to :class:`SkinnyLinear` and its ``"sdpa"``
            attention to :func:`cpu_sdpa_attention` (module docstring: cheaper verification calls on CPU).
            ``None``: when the model is on the CPU, the layers for the row counts :func:`choose_skinny_rows`
            finds faster on this machine (none: plain ``nn.Linear``); ``True``: every row count 1-8.
    """

    returns_hidden_states = True  # prefill / score take hidden_layers= (module docstring)

    def __init__(self, model, *, device: str | torch.device = "auto", dtype: torch.dtype | None = None,
                 device_map: str | dict | None = None, skinny_linear: bool | None = None):
        if isinstance(model, (str, os.PathLike)):
            model = _from_pretrained(model, dtype, device_map)
        elif device_map is not None:
            raise ValueError("device_map needs a model name or path (from_pretrained applies it); got an instance")
        if device_map is None:
            model = model.to(device=resolve_device(device), dtype=dtype)
        self.model = model.eval()
        self._cache_argument = cache_argument(self.model)
        if skinny_linear if skinny_linear is not None else self.device.type == "cpu":
            use_skinny_linears(self.model, choose_skinny_rows(self.model) if skinny_linear is None else SKINNY_ROWS)
            use_cpu_sdpa(self.model)
        self._cache = None
        self._slots: SlotMask | None = None

    @property
    def device(self) -> torch.device:
        """Where inputs go: the device of the input embeddings (the first shard under a device_map)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def vocab_size(self) -> int:
        """Size of the logits' last dimension (may exceed ``len(tokenizer)``)."""
        head = self.model.get_output_embeddings()  # out_features: nn.Linear, or a head over a token subset
        return int(getattr(head, "out_features", head.weight.shape[0])) if head is not None else int(self.model.config.get_text_config().vocab_size)

    @property
    def max_context(self) -> int | None:
        """Positions the model supports (config ``max_position_embeddings``); None if the config does not say."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    @property
    def valid_lengths(self) -> torch.Tensor:
        """Number of valid (unmasked) tokens in the context of each row. -> [B]."""
        return self._slots.counts()

    def reset(self, batch_size: int) -> None:
        self._cache = _new_cache(self.model)
        self._slots = SlotMask(torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device))

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden_layers: Sequence[int] | None = None):
        """Run the left-padded prompt ``[B, L]`` through the model; return the last next-token logits ``[B, V]``
        (and, with ``hidden_layers``, the hidden states ``[B, L, n * H]``)."""
        check_prompt(input_ids, attention_mask)
        self.reset(input_ids.shape[0])
        self._slots.append(attention_mask.to(self.device).bool())
        positions = self._slots.prompt_positions()
        logits, hidden = self._forward(input_ids, positions, logits_to_keep=1, hidden_layers=hidden_layers)
        return logits[:, -1] if hidden_layers is None else (logits[:, -1], hidden)

    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, hidden_layers: Sequence[int] | None = None):
        """Append ``tokens [B, k]`` (slots with ``valid = False`` masked out); return logits ``[B, k, V]``
        (and, with ``hidden_layers``, the hidden states ``[B, k, n * H]``)."""
        if self._slots is None:
            raise ValueError("score called before prefill/reset: start a batch first")
        if valid is None:
            valid = torch.ones(tokens.shape, dtype=torch.bool, device=self.device)
        positions = self._slots.append(valid.to(self.device))
        logits, hidden = self._forward(tokens, positions, logits_to_keep=0, hidden_layers=hidden_layers)
        return logits if hidden_layers is None else (logits, hidden)

    def rollback(self, n) -> None:
        """Forget the last ``n`` slots (``int`` or per-row ``[B]``): crop what all rows drop, mask the rest."""
        counts = rollback_counts(n, self._slots.mask.shape[0], self.device)
        common = self._slots.drop(counts)
        if common:
            self._cache.crop(-common)
        assert self._cache.get_seq_length() == self._slots.length

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, logits_to_keep: int, hidden_layers=None):
        """-> (logits float32, the requested hidden states concatenated float32 or None)."""
        with torch.no_grad():
            out = self.model(
                input_ids=tokens.to(self.device),
                attention_mask=self._slots.mask.long(),
                position_ids=positions,
                use_cache=True,
                **{self._cache_argument: self._cache},
                logits_to_keep=logits_to_keep,
                output_hidden_states=hidden_layers is not None,
            )
        assert self._cache.get_seq_length() == self._slots.length
        if hidden_layers is None:
            return out.logits.float(), None
        return out.logits.float(), torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1).float()


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _from_pretrained(name_or_path, dtype, device_map):
    from transformers import AutoModelForCausalLM

    local = os.path.isdir(name_or_path)
    return AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype if dtype is not None else "auto", device_map=device_map, local_files_only=local
    )


class ToyLM:
    """A toy language model from a fixed table, behind the same interface as :class:`CausalLM`.

    ``table [V]``: i.i.d. tokens with next-token logits ``table`` whatever the context.
    ``table [V, V]``: a Markov chain; the logits after token ``t`` are ``table[t]``.
    Entries are logits (use ``probs.log()`` for a probability table; ``-inf`` gives exact zeros).
    """

    def __init__(self, table: torch.Tensor):
        if table.ndim not in (1, 2) or (table.ndim == 2 and table.shape[0] != table.shape[1]):
            raise ValueError(f"table must be [V] (i.i.d.) or [V, V] (Markov), got shape {tuple(table.shape)}")
        self.table = table.float()
        self.vocab_size = table.shape[-1]
        self.device = table.device
        self._slots: SlotMask | None = None

    @classmethod
    def random(cls, vocab_size: int, *, markov: bool = True, concentration: float = 1.0,
               generator: torch.Generator | None = None) -> "ToyLM":
        """A random table: logits ~ N(0, 1) / concentration (lower concentration = peakier rows)."""
        shape = (vocab_size, vocab_size) if markov else (vocab_size,)
        return cls(torch.randn(shape, generator=generator) / concentration)

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    def reset(self, batch_size: int) -> None:
        self._slots = SlotMask(torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device))

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        check_prompt(input_ids, attention_mask)
        self.reset(input_ids.shape[0])
        self._slots.append(attention_mask.bool())
        return self._logits(input_ids[:, -1:])[:, -1]  # left padding: the last column is the last token

    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        self._slots.append(torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid)
        return self._logits(tokens)

    def rollback(self, n) -> None:
        self._slots.drop(rollback_counts(n, self._slots.mask.shape[0], self.device))

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits after each token. [B, k] -> [B, k, V]."""
        if self.table.ndim == 1:
            return self.table.expand(*tokens.shape, self.vocab_size)
        return self.table[tokens]


def tiny_llama_config(vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2, **overrides):
    """A ``LlamaConfig`` for a tiny random-weight model (tests, simulations)."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_llama(vocab_size: int = 64, *, seed: int = 0, init_std: float = 0.02, **config) -> CausalLM:
    """A tiny random Llama wrapped in :class:`CausalLM` on the CPU, reproducible from ``seed``.

    ``init_std`` sets the weight scale: the default 0.02 gives nearly uniform next-token distributions;
    ~0.3-1.0 gives peaked, context-dependent ones (more interesting for speculative decoding).
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_llama_config(vocab_size, initializer_range=init_std, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return CausalLM(model, device="cpu")
