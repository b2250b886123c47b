"""How logits become a sampling distribution, as a frozen config with named presets (pure Python, no torch).

:class:`SamplingConfig` is read by the torch transforms (:mod:`specresearch.core.sampling`) and by their exact
twins (:mod:`specresearch.exact.sampling`) alike, so both sides take the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specresearch.checks import check_int, check_real, named_preset

__all__ = ["SamplingConfig", "PRESETS", "GENERATE_DRAFT", "GENERATE_GAMMA", "GENERATE_TAU", "GENERATE_TAU_GREEDY",
           "GENERATE_TREES", "GENERATE_MARGIN", "COMPILE_CHOICES",
           "CUDA_GRAPH_MODES", "TRANSFORMERS_FLOOR"]

# The default of `specresearch generate` and `specresearch.generate`: prompt lookup, the shipped feature head with
# float16 weights elsewhere, at gamma 1 (the fastest measured against autoregressive decoding on the reference CPU,
# docs/feature_drafts.md), unless the machine's step costs predict another gamma faster by more than GENERATE_MARGIN
# (engine.cost.default_config; the margin is the step model's error where it was checked, docs/trees.md). A chain of
# another gamma is then the head's length off a lookup match too (engine.cost.fit_default_draft).
GENERATE_DRAFT = "ngram+fp16:eagle3-v8k"
GENERATE_GAMMA = 1
GENERATE_MARGIN = 0.10
# The head's tokens per step by gamma (T = 1, 8 held-out prompts; record benchmarks/records/adaptive_amd.csv, checked
# by tests/test_cost.py), which engine.cost.default_config weighs against this machine's step costs.
GENERATE_TAU = {1: 1.5, 2: 1.745, 3: 2.08}
GENERATE_TAU_GREEDY = {1: 1.521, 2: 1.818, 3: 1.967}  # the same at T = 0
# The head's tokens per target call in EAGLE-2's dynamic trees (one-hot rule) by (K children, depth, nodes): (at T = 0,
# at T = 1), on the same 8 held-out prompts (record benchmarks/records/trees_head_h200.csv, checked by
# tests/test_cost.py). With the default draft and verifier, engine.cost.default_config weighs them against this
# machine's tree steps: a device where scoring is nearly free (a GPU) can make a tree the default at T = 0.
GENERATE_TREES = {(4, 4, 10): (2.496, 1.935), (8, 6, 32): (3.132, 2.066)}
# speculative_generate(compile=...) / --compile: "off" the growing loop (engine.generate); "static" the captured steps
# over static caches run eagerly (engine.static); "on" the captured steps compiled for the device (CUDA: captured
# graphs; elsewhere torch.compile's inductor); "auto" "on" on CUDA where the run has captured steps, else "off" (on the
# CPU the step's kernels, not Python, bound a small model's step: docs/engine_and_models.md); or a runner mode by name.
COMPILE_CHOICES = ("auto", "on", "off", "static", "inductor", "reduce-overhead", "cudagraph")
# The oldest transformers the package supports (pyproject.toml's floor, checked when specresearch.models is imported):
# on 5.17 the whole suite runs and its only failures are what 5.25 (scripts/constraints.txt, the records' version)
# changed in transformers itself; before 5.14 the attention layout cannot be read at all (docs/environments.md).
TRANSFORMERS_FLOOR = "5.17"
CUDA_GRAPH_MODES = ("reduce-overhead", "cudagraph")  # the choices (and engine.captured modes) that capture CUDA graphs


@dataclass(frozen=True)
class SamplingConfig:
    """How next-token logits become a sampling distribution (the decoding survey, "Sampling Based Decoding").

    Attributes:
        temperature: ``>= 0``; ``0`` means greedy (one-hot at the first argmax), ``1`` the model itself.
        top_k: keep the ``k >= 1`` most likely tokens (ties: lower token id first), or ``None``.
        top_p: nucleus mass in ``(0, 1]``: keep the smallest most-likely set with mass ``>= top_p``.
        epsilon: in ``[0, 1)``: drop tokens with probability ``< epsilon`` (never the most likely one).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    epsilon: float | None = None

    def __post_init__(self) -> None:
        check_real("temperature", self.temperature)
        if self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}; "
                "use 0 for greedy decoding or a positive value such as 1.0"
            )
        if self.top_k is not None:
            check_int("top_k", self.top_k, meaning="or None: no top-k")
        if self.top_p is not None:
            check_real("top_p", self.top_p)
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1] or None (no nucleus), got {self.top_p!r}; 1 keeps all")
        if self.epsilon is not None:
            check_real("epsilon", self.epsilon)
            if not 0 <= self.epsilon < 1:
                raise ValueError(f"epsilon must be in [0, 1) or None (no epsilon cut), got {self.epsilon!r}")

    @property
    def greedy(self) -> bool:
        """True when the transformed distribution is always one-hot at the first argmax (T = 0 or top_k = 1)."""
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_name(cls, name: str) -> "SamplingConfig":
        """A named preset: one of ``PRESETS`` (e.g. ``"greedy"``, ``"default"``, ``"nucleus"``)."""
        return named_preset(PRESETS, name)


PRESETS: dict[str, SamplingConfig] = {
    "greedy": SamplingConfig(temperature=0.0),
    "default": SamplingConfig(),
    "ancestral": SamplingConfig(),
    "top_k": SamplingConfig(top_k=50),
    "nucleus": SamplingConfig(top_p=0.9),
    "epsilon": SamplingConfig(epsilon=3e-4),
    "cold": SamplingConfig(temperature=0.5),
    "hot": SamplingConfig(temperature=1.5),
}
