"""Exact rational twins of the verifiers: the specification each torch sampler is tested against.

Notation (as in :mod:`specresearch`): p = target model, q = draft model, gamma = draft block length.
Every probability is a :class:`fractions.Fraction` (sympy ``Rational`` and ``int`` are accepted on
input and converted); nothing here imports torch. Laws are enumerated, never sampled.

A *model* is anything :func:`as_model` accepts:

* a sequence of V probabilities (a context-free, i.i.d. model),
* a ``dict`` mapping prefix tuples to sequences of V probabilities,
* a callable ``prefix tuple[int, ...] -> sequence of V probabilities``.

Layers, from one verification to the whole decoding loop:

* :func:`verify_exact` -- law of ``(num_accepted, next_token)`` for ONE batch row, given the draft block
  (the exact twin of ``verify.<method>_verify``).
* :func:`step_distribution` -- law of the tokens emitted by one speculative step, draft block enumerated.
* :func:`speculative_distribution` -- law of the first ``n_tokens`` of the full speculative loop,
  compared with :func:`target_distribution` by :func:`is_lossless`.

Multi-draft steps (K paths) live in :mod:`specresearch.exact.multi`; the room's front
(:mod:`specresearch.exact`) routes ``num_drafts=`` / ``draft_law=`` to them.

References: token verification is Leviathan et al. 2023, Algorithm 1 (arXiv 2211.17192, the
"Speculative Decoding Step"); block verification is Sun et al. 2025, Algorithm 2 (arXiv 2403.10444),
backward form as in the shared contract, and the forward form of the two-symbol post (``block_verify``).
"""

from __future__ import annotations

import functools
import numbers
import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from specresearch.checks import check_int

__all__ = [
    "METHODS",
    "as_model",
    "verify_exact",
    "expected_num_accepted_exact",
    "step_distribution",
    "expected_accepted",
    "block_efficiency",
    "speculative_distribution",
    "target_distribution",
    "is_lossless",
    "random_rational_model",
    "two_symbol_example",
]

METHODS = ("token", "block", "greedy")

Row = tuple[Fraction, ...]
Law = dict[tuple[int, int], Fraction]
Model = Callable[[tuple[int, ...]], Row]
Verifier = Callable[[Sequence[Row], Sequence[Row], Sequence[int]], Law]

_ZERO = Fraction(0)
_ONE = Fraction(1)


# ----------------------------------------------------------------------------- input checking


def _to_fraction(value, name: str) -> Fraction:
    """Convert an exact rational (int, Fraction, sympy Rational) to Fraction; reject floats."""
    if isinstance(value, bool) or not isinstance(value, numbers.Rational):
        raise ValueError(
            f"{name} must hold exact rationals (Fraction, int or sympy Rational), got "
            f"{type(value).__name__} {value!r}; write it as Fraction(numerator, denominator)"
        )
    return Fraction(int(value.numerator), int(value.denominator))


def _check_row(row, name: str, vocab_size: int | None = None) -> Row:
    """Validate one probability row: exact rationals, non-negative, summing to exactly 1."""
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise ValueError(f"{name} must be a sequence of probabilities, got {type(row).__name__}")
    out = tuple(_to_fraction(v, name) for v in row)
    if vocab_size is not None and len(out) != vocab_size:
        raise ValueError(f"{name} has {len(out)} entries but the vocabulary size is {vocab_size}")
    if not out:
        raise ValueError(f"{name} is empty; give one probability per vocabulary token")
    if any(v < 0 for v in out):
        raise ValueError(f"{name} has a negative entry: {[str(v) for v in out]}")
    if sum(out) != 1:
        raise ValueError(f"{name} sums to {sum(out)}, not exactly 1; normalise it with Fractions")
    return out


def _check_gamma(gamma) -> int:
    check_int("gamma", gamma)
    return gamma


def _check_method(method) -> Verifier:
    """Map a method name (or a callable with the signature of :func:`verify_exact`) to a law function."""
    if callable(method):
        return method
    if method not in _LAWS:
        raise ValueError(f"method must be one of {METHODS} or a callable, got {method!r}")
    return _LAWS[method]


def as_model(model, vocab_size: int | None = None) -> Model:
    """Normalise a model to a memoised callable ``prefix tuple -> tuple of V Fractions``.

    Args:
        model: a sequence of V probabilities (context-free), a dict ``prefix tuple -> row`` or a
            callable ``prefix -> row``. Rows must be exact rationals summing to exactly 1.
        vocab_size: if given, every row must have this many entries.
    Returns:
        A callable; each row is validated (ValueError naming the prefix) the first time it is asked for.
    """
    if isinstance(model, Mapping):
        rows = {tuple(k): _check_row(v, f"model[{tuple(k)!r}]", vocab_size) for k, v in model.items()}
        return functools.lru_cache(maxsize=None)(functools.partial(_dict_row, rows))
    if callable(model):
        checked = functools.partial(_callable_row, model, vocab_size)
        return functools.lru_cache(maxsize=None)(checked)
    row = _check_row(model, "model", vocab_size)
    return lambda prefix: row


def _dict_row(rows: dict, prefix: tuple[int, ...]) -> Row:
    if tuple(prefix) not in rows:
        raise ValueError(f"model has no row for prefix {tuple(prefix)!r}; add that key to the dict")
    return rows[tuple(prefix)]


def _callable_row(model: Callable, vocab_size: int | None, prefix: tuple[int, ...]) -> Row:
    return _check_row(model(tuple(prefix)), f"model({tuple(prefix)!r})", vocab_size)


def _check_block(target_rows, draft_rows, draft_tokens) -> tuple[list[Row], list[Row], list[int]]:
    """Validate one verification instance: gamma+1 target rows, gamma draft rows, gamma tokens."""
    if isinstance(draft_rows, (str, bytes)) or not isinstance(draft_rows, Sequence) or not draft_rows:
        raise ValueError("draft_rows must be a non-empty sequence of gamma >= 1 rows")
    gamma = len(draft_rows)
    if not isinstance(target_rows, Sequence) or len(target_rows) != gamma + 1:
        raise ValueError(f"target_rows must hold gamma + 1 = {gamma + 1} rows (one per draft row plus one)")
    if not isinstance(draft_tokens, Sequence) or len(draft_tokens) != gamma:
        raise ValueError(f"draft_tokens must hold gamma = {gamma} tokens, one per draft row")
    ps = [_check_row(r, f"target_rows[{i}]") for i, r in enumerate(target_rows)]
    vocab = len(ps[0])
    ps = [_check_row(r, f"target_rows[{i}]", vocab) for i, r in enumerate(ps)]
    qs = [_check_row(r, f"draft_rows[{i}]", vocab) for i, r in enumerate(draft_rows)]
    for i, x in enumerate(draft_tokens):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < vocab:
            raise ValueError(f"draft_tokens[{i}] must be an integer in [0, {vocab}), got {x!r}")
    return ps, qs, [int(x) for x in draft_tokens]


# ----------------------------------------------------------------------------- one verification


def _normalised(weights: Sequence[Fraction], fallback: Row) -> Row:
    """norm(weights), or ``fallback`` when the weights have zero mass (the contract's fallback)."""
    total = sum(weights, _ZERO)
    return fallback if total == 0 else tuple(w / total for w in weights)


def _residual(target_row: Row, draft_row: Row, scale: Fraction) -> Row:
    """norm(max(scale * p - q, 0)), falling back to p when that has zero mass."""
    weights = [max(scale * p - q, _ZERO) for p, q in zip(target_row, draft_row)]
    return _normalised(weights, target_row)


def _add(law: dict, num_accepted: int, mass: Fraction, token_law: Row) -> None:
    for token, prob in enumerate(token_law):
        if mass * prob:
            law[(num_accepted, token)] += mass * prob


def _accept_prob(p: Fraction, q: Fraction) -> Fraction:
    """P(eta * q < p) for eta ~ U[0, 1): min(1, p/q), and 0 when q = 0 (the contract rejects)."""
    return min(_ONE, p / q) if q > 0 else _ZERO


def _token_law(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> Law:
    """Token verification, Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1."""
    law: dict = defaultdict(Fraction)
    reach = _ONE  # P(x_1..x_i all accepted)
    for i, x in enumerate(xs):
        accept = _accept_prob(ps[i][x], qs[i][x])
        _add(law, i, reach * (1 - accept), _residual(ps[i], qs[i], _ONE))
        reach *= accept
    _add(law, len(xs), reach, ps[len(xs)])
    return dict(law)


def _block_ratios(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> list[Fraction]:
    """p_0 = 1, p_i = min(p_{i-1} p(x_i | X^{i-1}) / q(x_i | X^{i-1}), 1), 0 when q(x_i) = 0."""
    ratios = [_ONE]
    for i, x in enumerate(xs):
        ratios.append(min(ratios[-1] * ps[i][x] / qs[i][x], _ONE) if qs[i][x] > 0 else _ZERO)
    return ratios


def _block_h(target_row: Row, draft_row: Row, ratio: Fraction) -> Fraction:
    """h_i = sum w_i / (sum w_i + 1 - p_i), and 0 when sum w_i = 0 (Sun et al. Algorithm 2)."""
    mass = sum((max(ratio * p - q, _ZERO) for p, q in zip(target_row, draft_row)), _ZERO)
    return mass / (mass + 1 - ratio) if mass > 0 else _ZERO


def _block_law(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> Law:
    """Block verification, backward form: tau = last i with eta_i < h_i (i = 0 is the fallback).

    P(tau = i) = h_i * prod_{j > i} (1 - h_j) for i >= 1 and prod_{j >= 1} (1 - h_j) for i = 0;
    next token ~ p(. | X^gamma) if tau = gamma, else norm(max(p_tau * p - q, 0)) (fallback p).
    """
    gamma = len(xs)
    ratios = _block_ratios(ps, qs, xs)
    h = [_ONE] + [_block_h(ps[i], qs[i], ratios[i]) for i in range(1, gamma)] + [ratios[gamma]]
    law: dict = defaultdict(Fraction)
    tail = _ONE  # prod_{j > i} (1 - h_j)
    for i in range(gamma, -1, -1):
        token_law = ps[gamma] if i == gamma else _residual(ps[i], qs[i], ratios[i])
        _add(law, i, h[i] * tail, token_law)
        tail *= 1 - h[i]
    return dict(law)


def _block_forward_exact(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> Law:
    """Block verification, forward form of the two-symbol post (``block_verify``), as an exact law.

    Walk n = 0..gamma keeping a candidate output s; at step n, s is replaced by ``x_1..x_n, t`` with
    weights ``max(a p_n - q_n, 0)`` against the keep-weight ``1 - a`` (q_gamma = 0), then
    a <- min(1, a p_n(x_{n+1}) / q_n(x_{n+1})). The law of s is tracked as a running mixture. When
    nothing has been chosen at n = 0 (zero weights) s falls back to ``t ~ p_0``, as in the contract.
    """
    gamma, vocab = len(xs), len(ps[0])
    a, law = _ONE, {}
    for n in range(gamma + 1):
        draft_row = qs[n] if n < gamma else (_ZERO,) * vocab
        weights = [max(a * p - q, _ZERO) for p, q in zip(ps[n], draft_row)]
        mass = sum(weights, _ZERO)
        if mass > 0 or not law:
            replace = mass / (mass + 1 - a) if mass > 0 else _ONE
            fresh: dict = defaultdict(Fraction)
            _add(fresh, n, replace, _normalised(weights, ps[n]))
            for key, prob in law.items():
                fresh[key] += (1 - replace) * prob
            law = {k: v for k, v in fresh.items() if v}
        if n < gamma:
            x = xs[n]
            a = min(_ONE, a * ps[n][x] / qs[n][x]) if qs[n][x] > 0 else _ZERO
    return law


def _argmax(row: Row) -> int:
    """First index of the maximum, as torch.argmax."""
    return max(range(len(row)), key=row.__getitem__)


def _greedy_law(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> Law:
    """Greedy verification: accept while x_i is the target argmax; next token = argmax of row n."""
    n = 0
    while n < len(xs) and xs[n] == _argmax(ps[n]):
        n += 1
    return {(n, _argmax(ps[n])): _ONE}


_LAWS: dict[str, Verifier] = {"token": _token_law, "block": _block_law, "greedy": _greedy_law}


def verify_exact(target_rows, draft_rows, draft_tokens, method) -> Law:
    """Exact law of ``(num_accepted, next_token)`` of ``verify.<method>_verify`` for one batch row.

    Args:
        target_rows: gamma + 1 rows of V probabilities; row i = p(. | prefix, x_1..x_i).
        draft_rows: gamma rows; row i = q(. | prefix, x_1..x_i), from which x_{i+1} was drawn.
        draft_tokens: the gamma draft tokens x_1..x_gamma.
        method: ``"token"`` (Leviathan et al. Alg. 1), ``"block"`` (Sun et al. Alg. 2, backward form),
            ``"greedy"``, or a callable with this signature minus ``method`` returning such a dict.
    Returns:
        ``{(num_accepted, next_token): probability}`` with only positive probabilities, summing to 1.
    """
    law_fn = _check_method(method)
    ps, qs, xs = _check_block(target_rows, draft_rows, draft_tokens)
    law = {k: v for k, v in law_fn(ps, qs, xs).items() if v != 0}
    assert sum(law.values()) == 1, f"verifier law sums to {sum(law.values())}"
    return law


def _token_expectation(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> Fraction:
    """sum_{k=1}^{gamma} prod_{i<=k} min(1, p(x_i)/q(x_i)): P(n >= k) summed over k."""
    total, reach = _ZERO, _ONE
    for i, x in enumerate(xs):
        reach *= _accept_prob(ps[i][x], qs[i][x])
        total += reach
    return total


def _block_expectation(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> Fraction:
    """sum_{i=1}^{gamma} i h_i prod_{j>i} (1 - h_j): tau = the last i with eta_i < h_i."""
    gamma = len(xs)
    ratios = _block_ratios(ps, qs, xs)
    h = [_block_h(ps[i], qs[i], ratios[i]) for i in range(1, gamma)] + [ratios[gamma]]  # h_1..h_gamma
    total, tail = _ZERO, _ONE  # tail = prod_{j > i} (1 - h_j)
    for i in range(gamma, 0, -1):
        total += i * h[i - 1] * tail
        tail *= 1 - h[i - 1]
    return total


def _greedy_expectation(ps: Sequence[Row], qs: Sequence[Row], xs: Sequence[int]) -> Fraction:
    (count, _token), = _greedy_law(ps, qs, xs)
    return Fraction(count)


_EXPECTATIONS = {"token": _token_expectation, "block": _block_expectation, "greedy": _greedy_expectation}


def expected_num_accepted_exact(target_rows, draft_rows, draft_tokens, method) -> Fraction:
    """E[num_accepted] of ``verify.<method>_verify`` for one drafted block, over the uniforms only.

    The exact twin of ``verify.expected_num_accepted`` (one batch row), written as the closed forms
    (token: sum_k prod_{i<=k} min(1, p/q); block: sum_i i h_i prod_{j>i} (1 - h_j)); it equals the mean
    of :func:`verify_exact`'s law, which the tests check. Arguments as :func:`verify_exact`, with
    ``method`` one of ``"token"``, ``"block"``, ``"greedy"``.
    """
    if method not in _EXPECTATIONS:
        raise ValueError(f"method must be one of {sorted(_EXPECTATIONS)}, got {method!r}")
    ps, qs, xs = _check_block(target_rows, draft_rows, draft_tokens)
    return _EXPECTATIONS[method](ps, qs, xs)


# ----------------------------------------------------------------------------- whole steps and loops


def _enumerate_drafts(draft: Model, prefix: tuple[int, ...], gamma: int):
    """Yield (tokens, probability, draft rows) for every draft block of positive probability."""
    if gamma == 0:
        yield (), _ONE, ()
        return
    row = draft(prefix)
    for x, qx in enumerate(row):
        if qx == 0:
            continue
        for rest, prob, rows in _enumerate_drafts(draft, prefix + (x,), gamma - 1):
            yield (x,) + rest, qx * prob, (row,) + rows


def _step_law(target: Model, draft: Model, gamma: int, law_fn: Verifier, prefix: tuple[int, ...]):
    """Law of the emitted sequence (accepted drafts + next token) of one step, drafts enumerated."""
    out: dict = defaultdict(Fraction)
    for tokens, prob, draft_rows in _enumerate_drafts(draft, prefix, gamma):
        target_rows = [target(prefix + tokens[:i]) for i in range(gamma + 1)]
        for (n, token), p in verify_exact(target_rows, list(draft_rows), list(tokens), law_fn).items():
            out[tokens[:n] + (token,)] += prob * p
    return dict(out)


def step_distribution(target, draft, gamma, method, prefix=()) -> dict[tuple[int, ...], Fraction]:
    """Law of one speculative step: ``{accepted drafts + next token: probability}``.

    The draft block x_1..x_gamma is drawn autoregressively from ``draft`` (arXiv 2211.17192, step 1),
    verified by ``method`` (see :func:`verify_exact`); the law is summed over all draft blocks.
    """
    gamma, law_fn = _check_gamma(gamma), _check_method(method)
    return _step_law(as_model(target), as_model(draft), gamma, law_fn, tuple(prefix))




def expected_accepted(target, draft, gamma, method, prefix=()) -> Fraction:
    """E[num_accepted] of one speculative step (accepted draft tokens, 0..gamma).

    """
    law = step_distribution(target, draft, gamma, method, prefix)
    return sum((prob * (len(seq) - 1) for seq, prob in law.items()), _ZERO)


def block_efficiency(target, draft, gamma, method, prefix=()) -> Fraction:
    """Tokens per target call: E[num_accepted] + 1 (Leviathan et al. Eq. 1 for i.i.d. token verification)."""
    return expected_accepted(target, draft, gamma, method, prefix) + 1


def _check_n_tokens(n_tokens) -> int:
    check_int("n_tokens", n_tokens)
    return n_tokens


def speculative_distribution(target, draft, gamma, method, n_tokens, prefix=()) -> dict[tuple[int, ...], Fraction]:
    """Exact law of the first ``n_tokens`` tokens of the full speculative decoding loop.

    Each step emits accepted drafts + one token and the loop continues from the extended prefix until at
    least ``n_tokens`` tokens exist; the output is truncated to ``n_tokens``. Memoised on
    (prefix, tokens still needed), so V = 3, gamma = 3, n_tokens = 4 takes well under a second.
    """
    gamma, law_fn, n_tokens = _check_gamma(gamma), _check_method(method), _check_n_tokens(n_tokens)
    target_m, draft_m = as_model(target), as_model(draft)
    return loop_law(lambda pre: _step_law(target_m, draft_m, gamma, law_fn, pre), n_tokens, prefix)


def loop_law(step_law, n_tokens: int, prefix=()) -> dict[tuple[int, ...], Fraction]:
    """Law of the first ``n_tokens`` tokens of a loop whose step from prefix ``pre`` emits sequence ``seq`` with
    probability ``step_law(pre)[seq]``: steps repeat from the extended prefix until ``n_tokens`` tokens exist,
    then the output is truncated. Memoised on (prefix, tokens still needed); shared by the single- and
    multi-draft loops."""
    step = functools.lru_cache(maxsize=None)(step_law)

    @functools.lru_cache(maxsize=None)
    def law(pre: tuple[int, ...], needed: int) -> dict:
        out: dict = defaultdict(Fraction)
        for seq, prob in step(pre).items():
            if len(seq) >= needed:
                out[seq[:needed]] += prob
                continue
            for rest, rest_prob in law(pre + seq, needed - len(seq)).items():
                out[seq + rest] += prob * rest_prob
        return dict(out)

    return law(tuple(prefix), n_tokens)


def target_distribution(target, n_tokens, prefix=(), *, greedy=False) -> dict[tuple[int, ...], Fraction]:
    """Law of ``n_tokens`` tokens sampled autoregressively from ``target`` (point mass on the argmax
    path when ``greedy``); only sequences of positive probability are listed."""
    n_tokens, target_m = _check_n_tokens(n_tokens), as_model(target)
    laws: dict = {(): _ONE}
    for _ in range(n_tokens):
        grown: dict = {}
        for seq, prob in laws.items():
            row = target_m(tuple(prefix) + seq)
            choices = [(_argmax(row), _ONE)] if greedy else enumerate(row)
            grown.update({seq + (t,): prob * pt for t, pt in choices if pt})
        laws = grown
    return laws


def is_lossless(target, draft, gamma, method, n_tokens, prefix=()) -> bool:
    """True iff the speculative loop's first ``n_tokens`` have exactly the target's law.

    ``"greedy"`` is compared with the greedy (argmax) target path, every other method with sampling.
    """
    spec = speculative_distribution(target, draft, gamma, method, n_tokens, prefix)
    want = target_distribution(target, n_tokens, prefix, greedy=method == "greedy")
    return {k: v for k, v in spec.items() if v} == want


# ----------------------------------------------------------------------------- example models


@dataclass(frozen=True)
class _RandomRationalModel:
    """Context-dependent model whose row for a context is a pure function of (seed, context).

    Every probability is a multiple of 1 / denominator; each token is an exact zero with
    probability zero_prob (at least one token per row is positive). Rows depend on the last
    ``depth`` tokens of the prefix (the whole prefix when depth is None).
    """

    vocab_size: int
    seed: int
    depth: int | None
    zero_prob: float
    denominator: int

    def __call__(self, prefix: tuple[int, ...]) -> Row:
        context = tuple(prefix) if self.depth is None else tuple(prefix)[len(prefix) - self.depth :]
        rng = random.Random(f"{self.seed}/{context}")  # str seeds are hashed with sha512: reproducible
        support = [t for t in range(self.vocab_size) if rng.random() >= self.zero_prob]
        support = support or [rng.randrange(self.vocab_size)]
        cuts = sorted(rng.sample(range(1, self.denominator), len(support) - 1))
        counts = [b - a for a, b in zip([0] + cuts, cuts + [self.denominator])]
        row = [_ZERO] * self.vocab_size
        for token, count in zip(support, counts):
            row[token] = Fraction(count, self.denominator)
        return tuple(row)


def random_rational_model(vocab_size, rng: random.Random, *, depth=None, zero_prob=0.2, denominator=12):
    """A random context-dependent model with exact rational rows and some exact zeros.

    Args:
        vocab_size: V >= 1.
        rng: the only source of randomness (one 64-bit seed is drawn from it), so the model is
            reproducible from the state of ``rng`` and independent of the order rows are asked for.
        depth: rows depend on the last ``depth`` tokens (None: the whole prefix; 0: context-free).
        zero_prob: probability that a token is an exact zero in a row, in [0, 1).
        denominator: every probability is k / denominator; must be >= vocab_size.
    Returns:
        A hashable callable ``prefix tuple -> tuple of V Fractions`` summing exactly to 1.
    """
    check_int("vocab_size", vocab_size)
    if not isinstance(rng, random.Random):
        raise ValueError(f"rng must be a random.Random, got {type(rng).__name__}")
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise ValueError(f"depth must be None or an integer >= 0, got {depth!r}")
    if not 0 <= zero_prob < 1:
        raise ValueError(f"zero_prob must lie in [0, 1), got {zero_prob!r}")
    if not isinstance(denominator, int) or denominator < vocab_size:
        raise ValueError(f"denominator must be an integer >= vocab_size = {vocab_size}, got {denominator!r}")
    return _RandomRationalModel(vocab_size, rng.getrandbits(64), depth, zero_prob, denominator)


def two_symbol_example() -> tuple[Row, Row]:
    """(target, draft) of the two-symbol post: p = (1/3, 2/3), q = (2/3, 1/3) over {A, B}, i.i.d."""
    return (Fraction(1, 3), Fraction(2, 3)), (Fraction(2, 3), Fraction(1, 3))
