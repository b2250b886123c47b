"""``audit(rule)``: is a verification rule lossless, what does it cost, and how much does it accept?

The verdict is exact: the law of the first ``n_tokens`` of the whole speculative loop is enumerated with
Fractions (:mod:`specresearch.audit.rules`) on random context-dependent small models with exact zeros and on
every context-free pair of a grid of rational rows, where the smallest counterexample is looked for first.
On one instance (the caller's models, or the two-symbol example p = (1/3, 2/3), q = (2/3, 1/3)) the report
gives the exact total-variation distance of the n-token law from the target's, the expected accepted tokens
per step and the best any lossless rule with the same draft law reaches. With ``torch_rule`` it also runs the
statistical test through the generation engine on the embedded pair (:func:`specresearch.experiments.stats.lossless_test`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from fractions import Fraction

from specresearch.audit import rules
from specresearch.audit.engines import ENGINE_RULES, engine_rule, method_law
from specresearch.audit.rules import Rule
from specresearch.exact.multi import MULTI_METHODS
from specresearch.exact.single import (
    METHODS,
    as_model,
    target_distribution,
    two_symbol_example,
)

__all__ = ["AuditReport", "Counterexample", "audit", "config_key", "engine_table", "executed_table", "largest_runs", "EXECUTED_RECORDS",
           "row_config_key"]

_METHODS = METHODS + MULTI_METHODS


@dataclass(frozen=True)
class Counterexample:
    """A pair on which the rule's n-token law is not the target's: the exact rows (or the models) and both laws."""

    target: object  # a row (tuple of Fractions) for a context-free pair, else the model
    draft: object
    law: dict  # {n tokens: P} of the speculative loop
    target_law: dict  # {n tokens: P} of the target
    tv: Fraction
    where: str  # "context-free grid" or "random model #i"

    def __str__(self) -> str:
        show = lambda row: "(" + ", ".join(str(v) for v in row) + ")" if isinstance(row, tuple) else "context-dependent model"
        return f"p = {show(self.target)}, q = {show(self.draft)} ({self.where}); TV = {self.tv}"


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found. Prints as a small table (a notebook shows it as is)."""

    rule: Rule
    lossless: bool
    counterexample: Counterexample | None
    n_tokens: int
    models_checked: int
    grid: tuple[int, int]  # (max vocab, max denominator) of the context-free search
    instance: str
    tv: Fraction  # on the instance, of the n-token law
    acceptance: Fraction  # E[accepted] per step on the instance
    optimum: Fraction | None  # best lossless E[accepted] with the same draft law, on the instance
    chi_square: object = None  # stats.LosslessTestResult when torch_rule was given

    @property
    def claim_holds(self) -> bool | None:
        """Whether the engine's stated claim agrees with the exact verdict (None when the rule states none)."""
        if not self.rule.claim:
            return None
        return self.lossless == (self.rule.claim == "exact")

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) pairs of the table."""
        rule = self.rule
        shape = f"K = {rule.num_drafts}, gamma = {rule.gamma}, drafts: {getattr(rule.draft_law, '__name__', rule.draft_law)}"
        params = ", ".join(f"{k} = {v}" for k, v in rule.params.items())
        exactness = "numerical, 60 digits" if rule.numeric else "exact"
        out = [("rule", f"{rule.name} ({shape}{'; ' + params if params else ''})"),
               (f"lossless, first {self.n_tokens} tokens of the loop", f"{'yes' if self.lossless else 'NO'} ({exactness}; "
                f"{self.models_checked} random models, context-free pairs V <= {self.grid[0]}, denominators <= {self.grid[1]})")]
        if self.counterexample:
            out.append(("smallest counterexample", str(self.counterexample)))
        out += [(f"TV from the target on {self.instance}", _num(self.tv)),
                ("E[accepted] per step", _num(self.acceptance) + (f"  (lossless optimum {_num(self.optimum)})" if self.optimum is not None else ""))]
        if rule.claim:
            out.append(("engine's claim", f"{rule.claim}: {'agrees' if self.claim_holds else 'CONTRADICTED'}"))
        if self.chi_square is not None:
            c = self.chi_square
            out.append(("chi-square through the engine", f"p = {c.p_value:.3g} (N = {c.num_samples}, {len(c.cells)} cells, "
                                                          f"{c.impossible} impossible)"))
        return out

    def __str__(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in self.rows())

    __repr__ = __str__


def _num(value) -> str:
    if isinstance(value, Fraction):
        return f"{value} ({float(value):.4g})" if value.denominator != 1 else str(value)
    return f"{float(value):.6g}"


def _resolve(rule, num_drafts, gamma, draft_law, params) -> Rule:
    """A Rule from an engine name, a verifier name, a Rule or a law callable; shape overrides applied."""
    shape = {k: v for k, v in (("num_drafts", num_drafts), ("gamma", gamma)) if v is not None}
    if isinstance(rule, str) and rule in ENGINE_RULES:
        if draft_law is not None:
            raise ValueError(f"engine rule {rule!r} fixes its draft law; draft_law= is for verifier names and law callables")
        return engine_rule(rule, **shape, **params)
    if params:
        raise ValueError(f"parameters {sorted(params)} are for engine rules (one of {sorted(ENGINE_RULES)})")
    if isinstance(rule, Rule):
        return dataclasses.replace(rule, **shape, **({"draft_law": draft_law} if draft_law is not None else {}))
    if isinstance(rule, str) and rule in _METHODS:
        torch_rule = rule if rule in METHODS and shape.get("num_drafts", 1) == 1 else None
        return Rule(rule, method_law(rule), draft_law or "iid", shape.get("num_drafts", 1), shape.get("gamma", 1),
                    torch_rule=torch_rule)
    if callable(rule):
        return Rule(getattr(rule, "__name__", "custom"), rule, draft_law or "iid", shape.get("num_drafts", 1), shape.get("gamma", 1))
    raise ValueError(f"rule must be an engine rule {sorted(ENGINE_RULES)}, a verifier {list(_METHODS)}, a Rule or a law "
                     f"callable (target, draft, paths, prefix) -> law; got {rule!r}")


def _verdict(rule: Rule, n_tokens: int, num_models: int, seed: int, grid: tuple[int, int]):
    """(lossless, counterexample): the context-free grid first (smallest first), then random models."""
    found = rules.search_counterexample(rule, n_tokens, max_vocab=grid[0], max_denominator=grid[1])
    candidates = [(found, "context-free grid")] if found else []
    candidates += [(pair, f"random model #{i} (seed {seed})") for i, pair in enumerate(rules.random_model_pairs(num_models, seed))]
    for (target, draft), where in candidates:
        law, want = rules.output_law(rule, target, draft, n_tokens), target_distribution(target, n_tokens)
        if rules.differs(rule, law, want):
            with rules.precision(rule):
                return False, Counterexample(target, draft, law, want, rules.total_variation(law, want), where)
    return True, None


def _chi_square(rule: Rule, torch_rule, pair, options: dict):
    from specresearch.config import SamplingConfig
    from specresearch.drafts.registry import load_pair
    from specresearch.experiments.stats import lossless_test

    verifier = rule.torch_rule if torch_rule is True else torch_rule
    if verifier is None:
        raise ValueError(f"rule {rule.name!r} has no torch form; pass torch_rule=<verifier name or callable>")
    if rule.num_drafts != 1 or rule.draft_law != "iid":
        raise ValueError("the statistical test runs single-draft chains drawn from q (num_drafts=1, draft_law='iid')")
    target, draft, tokenizer = pair if pair is not None else load_pair()
    options = {"prompt": "The capital of France is", "k": 2, "num_samples": 20_000, "seed": 0, **options}
    return lossless_test(target, draft, verifier, options.pop("prompt"), sampling=SamplingConfig(temperature=1.0),
                         gamma=rule.gamma, tokenizer=tokenizer, max_new_tokens=max(options["k"], rule.gamma + 1), **options)


def audit(rule, target=None, draft=None, *, num_drafts: int | None = None, gamma: int | None = None, draft_law=None,
          n_tokens: int = 2, torch_rule=None, pair=None, num_models: int = 20, seed: int = 0,
          grid: tuple[int, int] = (3, 4), chi_square: dict | None = None, prefix=(), **params) -> AuditReport:
    """Decide whether ``rule`` is lossless, exactly, and measure its distortion and acceptance.

    Args:
        rule: an engine rule's name (:data:`specresearch.audit.ENGINE_RULES`), a verifier name of
            :mod:`specresearch.exact` (``"token"``, ``"block"``, ``"onehot"``, ``"traversal"``, ...), a
            :class:`~specresearch.audit.rules.Rule` (e.g. from :func:`~specresearch.audit.rule_from_acceptance`)
            or a law callable ``(target, draft, paths, prefix) -> {emitted: P}``.
        target, draft: exact models for the TV / acceptance figures (default: the two-symbol example).
        num_drafts, gamma, draft_law: the draft's shape (default: the rule's own; for names 1, 1, ``"iid"``).
        n_tokens: the verdict compares the laws of the loop's first ``n_tokens`` tokens.
        torch_rule: True (the rule's own torch form) or a verifier name / callable: also run the chi-square test
            through the engine (``chi_square`` options: prompt, k, num_samples, seed) on ``pair`` = (target LM,
            draft LM, tokenizer), by default the embedded pair (:func:`specresearch.drafts.registry.load_pair`).
        num_models, seed: random context-dependent models (V = 2, 3) checked after the context-free grid.
        grid: (max vocabulary, max denominator) of the context-free counterexample search.
        prefix: the context of the instance's step.
        params: an engine rule's settings (``audit("sglang", threshold_acc=0.5)``).
    Returns:
        :class:`AuditReport`.
    """
    rule = _resolve(rule, num_drafts, gamma, draft_law, params)
    if (target is None) != (draft is None):
        raise ValueError("pass both target and draft (exact models), or neither for the two-symbol example")
    instance = "the given models" if target is not None else "the two-symbol example"
    if target is None:
        target, draft = two_symbol_example()
    target, draft = as_model(target), as_model(draft)
    lossless, counterexample = _verdict(rule, n_tokens, num_models, seed, grid)
    law = rules.output_law(rule, target, draft, n_tokens, prefix)
    with rules.precision(rule):
        tv = rules.total_variation(law, target_distribution(target, n_tokens, prefix))
    acceptance, best = rules.expected_accepted(rule, target, draft, prefix), rules.optimum(rule, target, draft, prefix)
    test = _chi_square(rule, torch_rule, pair, chi_square or {}) if torch_rule else None
    return AuditReport(rule, lossless, counterexample, n_tokens, num_models, tuple(grid), instance, tv, acceptance, best, test)


def engine_table() -> str:
    """The engines' table of ``docs/audit.md`` (markdown), computed: every engine rule at its defaults and at its
    lossy setting, the exact verdict, the TV of the 2-token law and E[accepted] against the lossless optimum on the
    two-symbol example (p = (1/3, 2/3), q = (2/3, 1/3))."""
    from specresearch.audit.engines import LOSSY_SETTINGS

    lines = ["| engine rule | draft (K, gamma) | settings | exact? | smallest counterexample (p, q) | TV, 2 tokens | "
             "E[accepted] / lossless optimum |", "|---|---|---|---|---|---|---|"]
    for name in ENGINE_RULES:
        for params in [{}] + ([LOSSY_SETTINGS[name]] if name in LOSSY_SETTINGS else []):
            report = audit(name, **params)
            settings = ", ".join(f"{k} = {v}" for k, v in params.items()) or "defaults"
            found = report.counterexample
            where = f"{_row(found.target)}, {_row(found.draft)}" if found and isinstance(found.target, tuple) else "-"
            draft = f"{getattr(report.rule.draft_law, '__name__', report.rule.draft_law).strip('_')} ({report.rule.num_drafts}, {report.rule.gamma})"
            lines.append(f"| `{name}` | {draft} | {settings} | {'yes' if report.lossless else 'no'} | {where} | {report.tv} | "
                         f"{report.acceptance} / {report.optimum} |")
    return "\n".join(lines)


def _row(row) -> str:
    return "(" + ", ".join(str(v) for v in row) + ")"


EXECUTED_RECORDS = ("audit_executed", "audit_libraries", "audit_mtp", "audit_gemma4", "audit_dflash", "audit_usd",
                    "audit_early_exit", "audit_vllm", "audit_vllm_params",
                    "audit_vllm_dflash2", "audit_vllm_xpress")  # benchmarks/records/<name>.json: the engines run


def executed_table(rows) -> str:
    """The table of ``docs/audit.md``, "Their code, run" (markdown) from the rows of the records
    :data:`EXECUTED_RECORDS` (``ExecutionResult.as_record``, or a
    library's row saying why it did not run): engine and settings, N, the audit's verdict, the p-values against the
    target's and the predicted law, the measured TV from the target (and the noise floor), the TV the run detects and
    the finding (with the p-value against each alternative law the run was also held to)."""
    lines = ["| engine (their code) | settings | N | audit | p vs target | p vs predicted | TV from target (floor) | "
             "detects TV | finding |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        name = row.get("engine") if row.get("engine") != "python" else row.get("library") or row["options"].get("name")
        if row.get("model"):  # a run on another target than the embedded pair's (audit_mtp.json)
            name = f"{name} on a {row['model']}"
        if row.get("ran") is False:
            lines.append(f"| {row['library']} ({row['distribution']}) | - | - | - | - | - | - | - | did not run: {row['why']} |")
            continue
        options = {k: v for k, v in row["options"].items() if k not in ("name", "version")}
        settings = ", ".join(f"{k} = {v}" for k, v in options.items())
        settings = (f"T = {row['temperature']:g}" + (f", {settings}" if settings else "")
                    + f", {row['n_tokens']} token{'s' if row['n_tokens'] > 1 else ''}")
        finding = row["finding"].split(":")[0] if row["finding"].startswith(("agrees", "undecided")) else row["finding"]
        for other, comparison in row.get("alternatives", {}).items():  # the run against other candidate laws
            finding += f"; vs {other}: p = {comparison['p_value']:.2g}"
        lines.append(f"| {name} | {settings} | {row['num_samples']:,} | {row['verdict']} | {row['target']['p_value']:.2g} | "
                     f"{row['predicted']['p_value']:.2g} | {row['target']['tv']:.3f} ({row['target']['tv_floor']:.3f}) | "
                     f"{row['detectable_tv']:.3f} | {finding} |")
    return "\n".join(lines)


def config_key(engine, n_tokens, temperature, options, prompt, n=None) -> str:
    """A run's configuration (engine, tokens, temperature, settings, prompt, and for a power run its N) as one JSON
    text, settings in key order: what names a configuration in ``benchmarks/records/audit_executed.json`` and its
    resumable seed blocks (``benchmarks/audit_executed.py`` hashes it into the blocks' file name)."""
    return json.dumps([engine, n_tokens, temperature, options, prompt] + ([] if n is None else [n]), sort_keys=True)


def row_config_key(row: dict, *, with_n: bool = True) -> str:
    """:func:`config_key` of a row of ``benchmarks/records/audit_executed.json``: with its power run's N
    (``power_n``; none for a row of ``CONFIGS``), or without (``with_n=False``: every N of the configuration)."""
    n = row.get("power_n") if with_n else None
    return config_key(row["engine"], row["n_tokens"], row["temperature"], row["options"], row["prompt"], n)


def largest_runs(rows) -> list[dict]:
    """Of the rows of ``benchmarks/records/audit_executed.json``, the one of largest N for each configuration
    (:func:`row_config_key` without N), in the order the configurations first appear: a power run stands in for the
    smaller run of the same settings, for a figure of one panel a configuration."""
    best: dict[str, dict] = {}  # a replaced value keeps its key's place
    for row in rows:
        config = row_config_key(row, with_n=False)
        if config not in best or row["num_samples"] > best[config]["num_samples"]:
            best[config] = row
    return list(best.values())
