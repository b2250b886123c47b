"""Fused projections: an attention layer's query, key and value projections, and a gated MLP's gate and up
projections, computed as one matrix product over their weights laid end to end (what vLLM's QKV and merged column
layers and gpt-fast's ``wqkv`` do).

Why: on a GPU a step of a small model costs its kernels, not its weights (docs/engine_and_models.md, "Captured
steps"). An autoregressive step of SmolLM2-135M holds 211 matrix products, 7 a layer and the output head; fused, 4 a
layer and the head: 121. The weights read are the same bytes; what goes is 90 launches a call, in every step kind.

How: :func:`fuse_projections` lays a group's weights (and biases) end to end in one tensor and makes each member's
weight a view of its rows, so the model holds each weight once and its state dict is unchanged. The members become
:class:`FusedLinear`. The first one called computes the whole product; the others, called with that same tensor (the
same object: an attention layer's q, k and v projections all read its hidden states), return their columns of it.
Called with any other tensor, a member computes the product afresh, so nothing depends on the order of the calls or
on a family's code beyond that. It is the same function: each output column is the same dot product, up to the float
rounding a product of another shape may give. With gradients asked for, each member multiplies by its own weight (the
views are separate leaves, so training sees every parameter). Nothing reads the host, so a step stays one graph
(``torch.compile(fullgraph=True)``, a CUDA graph).

A member whose weight no longer lies in its group's tensor (the model was moved or converted after fusing, a weight
replaced) would read stale rows: :func:`fused_intact` says whether every group holds, and :func:`keep_fused`, which
:class:`~specresearch.models.causal_lm.CausalLM` and the feature drafts call as each batch starts, fuses again where
one does not.
On the CPU a group multiplies as its members would (``kernels.skinny_linear`` with the row options
``kernels.use_skinny_linears`` / ``use_kernel_rows`` give them), and the calibrations that choose those options
(``choose_skinny_rows``, ``choose_kernel_rows``) time its product, by its whole weight, as a forward computes it
(``CausalLM`` fuses before it calibrates).
Groups are found by name (``GROUPS``) among each module's children: plain ``nn.Linear`` layers (or the CPU's
``SkinnyLinear`` with float weights) of one input size, dtype and device, all with or all without a bias. Anything
else (half or int8 weights, a family that fuses its own, such as Phi-3's ``qkv_proj`` or GPT-2's ``c_attn``) is left
as it is.
"""

from __future__ import annotations

import torch

from specresearch.models.kernels import SkinnyLinear, skinny_linear

__all__ = ["GROUPS", "FusedLinear", "fuse_projections", "unfuse_projections", "fused_intact", "keep_fused"]

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # children computed as one product


class _Group:
    """A fused group's weight ``[sum(out), in]`` (bias or None), its members' output sizes, and the last product:
    the input it was computed from and its columns, kept until every member has taken its own."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight = weight
        self.bias = bias
        self.sizes = sizes
        self.input = None
        self.outputs = None
        self.left = 0

    def product(self, x: torch.Tensor, index: int, skinny_rows, kernel_rows) -> torch.Tensor:
        """Member ``index``'s columns of ``x``'s product, computed with the calling member's row options (which
        ``kernels.use_skinny_linears`` / ``use_kernel_rows`` give every member alike)."""
        if self.input is not None and x is self.input:
            out = self.outputs[index]
            self.left -= 1
            if self.left <= 0:
                self.input = self.outputs = None
            return out
        outputs = skinny_linear(x, self.weight, self.bias, skinny_rows=skinny_rows,
                                kernel_rows=kernel_rows).split(self.sizes, -1)
        self.input, self.outputs, self.left = x, outputs, len(self.sizes) - 1
        return outputs[index]


class FusedLinear(SkinnyLinear):
    """A member of a fused group (module docstring): ``nn.Linear``'s parameters, its weight a view of the group's."""

    group: _Group
    index: int
    was: type  # the class it had before fusing (unfuse_projections gives it back)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return super().forward(x)
        return self.group.product(x, self.index, self.skinny_rows, self.kernel_rows)

    @property
    def computes(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The weight and bias this member's calls multiply by (what the kernel calibrations of
        :mod:`~specresearch.models.kernels` time): the group's for its first member, none for the others, whose
        columns come from the first one's product."""
        return (self.group.weight, self.group.bias) if self.index == 0 else (None, None)

    def unfuse(self) -> None:
        """Become the layer it was (its weight stays a view: the same values)."""
        self.__class__ = self.was
        for name in ("group", "index", "was"):
            del self.__dict__[name]


def _fusable(members: list[torch.nn.Module]) -> bool:
    first = members[0]
    return (all(type(m) in (torch.nn.Linear, SkinnyLinear) for m in members)
            and first.weight.is_floating_point()
            and all(m.weight.dtype == first.weight.dtype and m.weight.device == first.weight.device
                    and m.in_features == first.in_features and (m.bias is None) == (first.bias is None)
                    and getattr(m, "weight_scale", None) is None and getattr(m, "half_limit", None) is None
                    for m in members)
            and len({id(m) for m in members}) == len(members))


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse ``model``'s projection groups in place (module docstring); returns how many groups are fused. Idempotent:
    groups already fused are laid out again from their members' current weights."""
    unfuse_projections(model)
    count = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if any(m is None for m in members) or not _fusable(members):
                continue
            with torch.no_grad():
                weight = torch.cat([m.weight.detach() for m in members])
                bias = torch.cat([m.bias.detach() for m in members]) if members[0].bias is not None else None
            group = _Group(weight, bias, [m.out_features for m in members])
            start = 0
            for index, m in enumerate(members):
                rows = slice(start, start + m.out_features)
                start += m.out_features
                m.was = type(m)
                if m.was is torch.nn.Linear:
                    m.skinny_rows = ()  # F.linear for every row count, as nn.Linear computes
                m.weight = torch.nn.Parameter(weight[rows], requires_grad=m.weight.requires_grad)
                if bias is not None:
                    m.bias = torch.nn.Parameter(bias[rows], requires_grad=m.bias.requires_grad)
                m.__class__ = FusedLinear
                m.group, m.index = group, index
            count += 1
    return count


def unfuse_projections(model: torch.nn.Module) -> int:
    """Give every fused member of ``model`` its own class back (its weight stays a view: the same values); returns
    how many members were unfused."""
    members = [module for module in model.modules() if isinstance(module, FusedLinear)]
    for module in members:
        module.unfuse()
    return len(members)


def _holds(module: FusedLinear) -> bool:
    group, rows = module.group, module.weight
    return (rows.device == group.weight.device and rows.dtype == group.weight.dtype
            and rows.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
            and (module.bias is None) == (group.bias is None)
            and (module.bias is None or module.bias.untyped_storage().data_ptr()
                 == group.bias.untyped_storage().data_ptr()))


def fused_intact(model: torch.nn.Module) -> bool:
    """Whether every fused member of ``model`` still reads its weight (and bias) from its group's tensor."""
    return all(_holds(m) for m in model.modules() if isinstance(m, FusedLinear))


def keep_fused(model: torch.nn.Module) -> None:
    """Fuse ``model``'s projections again where a group no longer holds (:func:`fused_intact`: moved or converted
    since it was fused)."""
    if not fused_intact(model):
        fuse_projections(model)
