"""The chi-square check of sampled draws against exact probabilities."""

from __future__ import annotations

from scipy import stats


def chi_square_pvalue(draws: list[tuple], expected: dict[tuple, float]) -> float:
    """Chi-square of the draws against `expected` (probabilities): cells expecting >= 5
    draws (the test's validity condition), the rest pooled into one cell. Callers assert
    p > 1e-3 with fixed seeds: a correct sampler fails 1 seed set in 1000; one that drops
    truncation or mixes in the draft's q fails outright."""
    n = len(draws)
    big = [c for c, p in expected.items() if p * n >= 5]
    observed = [sum(d == c for d in draws) for c in big]
    exp = [expected[c] * n for c in big]
    observed.append(n - sum(observed))
    exp.append(n - sum(exp))
    if exp[-1] < 1e-9:  # nothing pooled
        observed, exp = observed[:-1], exp[:-1]
    # float32 probabilities sum to 1 within ~1e-6, and SciPy wants the totals equal to
    # ~1e-8: rescale what float rounding left over (a real shortfall fails here instead).
    total = sum(exp)
    assert abs(total - n) < 1e-4 * n, f"expected counts sum to {total}, not {n}"
    return stats.chisquare(observed, [e * n / total for e in exp]).pvalue
