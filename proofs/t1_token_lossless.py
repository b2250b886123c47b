"""Claim (Chen et al. 2023, Theorem 1; the correctness proof of Leviathan et al. 2023): token verification
is lossless for any vocabulary size.

With beta = sum_x min(p(x), q(x)), a draft x ~ q is accepted with probability min(1, p(x)/q(x)) and on
rejection (probability 1 - beta) the token is resampled from max(0, p - q) / sum_x' max(0, p - q), so

    P(X = x) = min(p(x), q(x)) + (1 - beta) * max(0, p(x) - q(x)) / (1 - beta) = p(x).

sympy checks (specresearch.exact.symbolic.token_lossless_checks):
  1. the per-token identity for positive symbols p, q in both orders (p >= q and p <= q, made visible to
     sympy's assumptions by p = q(1 + d) or p = q(1 - e), d, e >= 0), with q min(1, p/q) = min(p, q)
     and max(0, p - q) = p - min(p, q);
  2. for symbolic vectors of size n = 2..6 and every order pattern: the normaliser
     sum_x max(0, p - q) = 1 - beta given sum p = 1, and P(X = x_j) = p_j for all j given
     sum p = sum q = 1 (no 1 - beta shortcut: the full formula with sum_x max(0, p - q) in it);
  3. for general n: sum_i max(0, p_i - q_i) = sum_i (p_i - min_i) = 1 - beta by linearity of Sum;
  4. the degenerate case beta = 1 (and the all-p >= q pattern): equal sums force p = q, nothing is
     rejected and P(X = x) = q(x) min(1, p(x)/q(x)) = p(x).
Run: python proofs/t1_token_lossless.py (exit code 0 iff every check holds).
"""

from specresearch.exact.symbolic import run_checks, token_lossless_checks


def main() -> int:
    return run_checks("Theorem 1: token verification is lossless (Chen et al. 2023; Leviathan et al. 2023)", token_lossless_checks(max_n=6))


if __name__ == "__main__":
    raise SystemExit(main())
