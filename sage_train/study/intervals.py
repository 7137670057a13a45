"""95% intervals on a mean over seeds x problems, the two crossed random factors of a study.

A study evaluates every (seed, problem) cell once: y[s, p] is pass@k of seed s's model on problem p
(or, for a paired difference, arm minus baseline in that cell). Seeds and problems are both draws
from larger populations, and they are crossed, so the cells follow the two-way random-effects model

    y[s, p] = mu + a[s] + b[p] + e[s, p],  a ~ (0, var_seed), b ~ (0, var_problem), e ~ (0, var_residual)

and the grand mean's variance is var_seed / S + var_problem / P + var_residual / (S P). Neither a
t-interval over the per-seed means (it misses the problem term's share of a new draw of problems)
nor a bootstrap over problems (it misses the seed term) nor the wider of the two estimates it; the
ANOVA does. With the mean squares MS_seed, MS_problem, MS_residual of the two-way table,

    var_seed = (MS_seed - MS_residual) / P,  var_problem = (MS_problem - MS_residual) / S,
    var_residual = MS_residual,  so  var(mean) = (MS_seed + MS_problem - MS_residual) / (S P),

each component truncated at zero (then its mean square drops out of var(mean)). The interval is
mean +- t * sqrt(var(mean)) with Satterthwaite's degrees of freedom for that combination of mean
squares. One seed (or one problem) leaves a component without an estimate: no interval then.
Pure functions on numpy arrays; `sage_train.study.report` applies them to pass@k from counts.
"""

from __future__ import annotations

import functools
import math

import numpy as np

LEVEL = 0.95


def crossed_anova(matrix) -> dict:
    """The two-way random-effects ANOVA of a seeds x problems matrix (one value per cell).

    Returns {mean, seeds, problems, ms_seed, ms_problem, ms_residual, var_seed, var_problem,
    var_residual (the components, truncated at zero), var_mean, df (Satterthwaite; None when
    var_mean is 0: every cell equal)}. Raises ValueError for fewer than 2 seeds or 2 problems."""
    y = np.asarray(matrix, dtype=np.float64)
    if y.ndim != 2:
        raise ValueError(f"matrix must be seeds x problems (2-D), got shape {y.shape}")
    seeds, problems = y.shape
    if seeds < 2 or problems < 2:
        raise ValueError(
            f"matrix has {seeds} seed(s) x {problems} problem(s): the crossed interval needs at least 2 of each "
            "(one seed says nothing about how much another seed would differ)"
        )
    if not np.isfinite(y).all():
        raise ValueError("matrix has a non-finite value")
    mean = float(y.mean())
    seed_means, problem_means = y.mean(axis=1), y.mean(axis=0)
    df_seed, df_problem, df_residual = seeds - 1, problems - 1, (seeds - 1) * (problems - 1)
    ms_seed = problems * float(((seed_means - mean) ** 2).sum()) / df_seed
    ms_problem = seeds * float(((problem_means - mean) ** 2).sum()) / df_problem
    residual = y - seed_means[:, None] - problem_means[None, :] + mean
    ms_residual = float((residual**2).sum()) / df_residual
    # var(mean) * S * P = sum of coefficient x mean square; a truncated component drops its term
    # (a component within rounding of zero, e.g. identical seeds, counts as zero)
    rounding = 1e-12 * max(ms_seed, ms_problem, ms_residual)
    seed_in, problem_in = ms_seed - ms_residual > rounding, ms_problem - ms_residual > rounding
    terms = [
        (float(seed_in), ms_seed, df_seed),
        (float(problem_in), ms_problem, df_problem),
        (1.0 - seed_in - problem_in, ms_residual, df_residual),
    ]
    total = sum(c * ms for c, ms, _ in terms)
    spread = sum((c * ms) ** 2 / df for c, ms, df in terms if c)
    return {
        "mean": mean,
        "seeds": seeds,
        "problems": problems,
        "ms_seed": ms_seed,
        "ms_problem": ms_problem,
        "ms_residual": ms_residual,
        "var_seed": (ms_seed - ms_residual) / problems if seed_in else 0.0,
        "var_problem": (ms_problem - ms_residual) / seeds if problem_in else 0.0,
        "var_residual": ms_residual,
        "var_mean": max(0.0, total) / (seeds * problems),
        "df": total**2 / spread if total > 0 and spread > 0 else None,
    }


def crossed_interval(matrix, level: float = LEVEL) -> dict:
    """{mean, ci_low, ci_high, df, var_seed, var_problem, var_residual, per_seed, note}: the mean of
    a seeds x problems matrix with its crossed `level` interval (`crossed_anova`).

    With one seed or one problem the bounds and df are None and `note` says why; with every cell
    equal the interval is the point (no variation was observed at all) and `note` says so."""
    y = np.asarray(matrix, dtype=np.float64)
    result = {"mean": float(y.mean()), "per_seed": [float(row.mean()) for row in y]}
    try:
        anova = crossed_anova(y)
    except ValueError as error:
        return {**result, "ci_low": None, "ci_high": None, "df": None, "note": str(error)}
    half = 0.0 if anova["df"] is None else t_quantile(0.5 + level / 2, anova["df"]) * math.sqrt(anova["var_mean"])
    return {
        **result,
        "ci_low": result["mean"] - half,
        "ci_high": result["mean"] + half,
        "df": anova["df"],
        **{key: anova[key] for key in ("var_seed", "var_problem", "var_residual")},
        "note": "every cell is equal: no variation observed" if anova["df"] is None else None,
    }


def crossed_p_value(matrix) -> float | None:
    """Two-sided p of "the grand mean is 0" for a seeds x problems matrix: t = mean / sqrt(var(mean))
    on the Satterthwaite degrees of freedom of `crossed_anova` (the test the crossed interval
    inverts). None where the interval has none (one seed or one problem, or every cell equal)."""
    try:
        anova = crossed_anova(matrix)
    except ValueError:
        return None
    if anova["df"] is None:
        return None
    return two_sided_p(anova["mean"] / math.sqrt(anova["var_mean"]), anova["df"])


def two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
    return min(1.0, 2.0 * (1.0 - t_cdf(abs(t), df)))


def t_test(values, level: float = LEVEL) -> dict:
    """{mean, ci_low, ci_high, df, p, per_seed}: the mean of independent `values` (one per seed)
    with its t-interval and the two-sided p of "the mean is 0" (None with fewer than 2 values or
    none spread). For one random factor only, as in the toys, whose prompts are the whole task."""
    values = np.asarray(values, dtype=np.float64)
    bounds, sd = t_interval(values, level), float(values.std(ddof=1)) if values.size > 1 else 0.0
    p = two_sided_p(float(values.mean()) / (sd / math.sqrt(values.size)), values.size - 1) if sd > 0 else None
    return {
        "mean": float(values.mean()),
        "ci_low": bounds[0] if bounds else None,
        "ci_high": bounds[1] if bounds else None,
        "df": values.size - 1 if bounds else None,
        "p": p,
        "per_seed": values.tolist(),
    }


def welch(a, b, level: float = LEVEL) -> dict:
    """{mean, ci_low, ci_high, df, p}: mean(a) - mean(b) for two independent groups of values (one
    per seed), Welch's t-interval and two-sided p with Welch-Satterthwaite degrees of freedom."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size < 2 or b.size < 2:
        raise ValueError(f"welch needs at least 2 values per group, got {a.size} and {b.size}")
    va, vb = float(a.var(ddof=1)) / a.size, float(b.var(ddof=1)) / b.size
    mean, se = float(a.mean() - b.mean()), math.sqrt(va + vb)
    if se == 0:
        return {"mean": mean, "ci_low": None, "ci_high": None, "df": None, "p": None}
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    half = t_quantile(0.5 + level / 2, df) * se
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "df": df, "p": two_sided_p(mean / se, df)}


def holm(p_values: list) -> list:
    """Holm's step-down adjusted p-values, in the given order: the family-wise error rate over
    these hypotheses is at most alpha when each is rejected at adjusted p < alpha. None stays None
    (a hypothesis without a test) and does not count toward the family's size."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted, running = [None] * len(p_values), 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[i] = running
    return adjusted


def t_interval(values, level: float = LEVEL):
    """(low, high): the t-interval of the mean of independent `values` (None with fewer than 2).
    For one factor only (e.g. a training curve's step over seeds), not for seeds x problems."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        return None
    half = t_quantile(0.5 + level / 2, values.size - 1) * float(values.std(ddof=1)) / math.sqrt(values.size)
    return (float(values.mean()) - half, float(values.mean()) + half)


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The p-quantile (0.5 < p < 1) of Student's t with `df` > 0 degrees of freedom, not
    necessarily an integer: bisection on the CDF to float precision."""
    if not 0.5 < p < 1 or not df > 0:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df > 0, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if mid in (low, high):
            break
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def t_cdf(t: float, df: float) -> float:
    """Student's t CDF: 1 - I_x(df/2, 1/2) / 2 at x = df / (df + t^2) for t >= 0 (I the regularized
    incomplete beta function), by symmetry below 0."""
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) from its continued fraction, evaluated on the side of x where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz evaluation)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    value = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            value *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return value
