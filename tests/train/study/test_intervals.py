"""The crossed seeds x problems interval (sage_train/study/intervals.py): its coverage on simulated crossed
data with known components, the components recovered, the degenerate cases, the t quantile
against closed forms, and the pass@k lookup table against the scalar estimator."""

import math

import numpy as np
import pytest

from sage_train.eval.evaluate import pass_at_k, pass_at_k_table
from sage_train.study.intervals import crossed_anova, crossed_interval, t_cdf, t_interval, t_quantile

SEEDS, PROBLEMS, SIMULATIONS = 5, 512, 400


def simulate(rng, sd_seed, sd_problem, sd_residual):
    """One study's seeds x problems matrix with true grand mean 0."""
    return (
        rng.normal(0, sd_seed, (SEEDS, 1))
        + rng.normal(0, sd_problem, (1, PROBLEMS))
        + rng.normal(0, sd_residual, (SEEDS, PROBLEMS))
    )


@pytest.mark.parametrize(
    "sd_seed, sd_problem, sd_residual",
    [
        (0.03, 0.3, 0.1),  # both components present, each half of var(mean): where "the wider of" fails
        (0.0, 0.3, 0.1),  # no seed component: truncated at zero about half the time
        (0.03, 0.0, 0.1),  # no problem component
    ],
)
def test_coverage_of_95_percent_intervals(sd_seed, sd_problem, sd_residual):
    rng = np.random.default_rng(20240)
    results = [crossed_interval(simulate(rng, sd_seed, sd_problem, sd_residual)) for _ in range(SIMULATIONS)]
    covered = np.mean([r["ci_low"] <= 0.0 <= r["ci_high"] for r in results])
    assert 0.92 <= covered <= 0.98, covered
    # the components are recovered: the truncated estimates average to the truth
    means = {key: np.mean([r[key] for r in results]) for key in ("var_seed", "var_problem", "var_residual")}
    assert means["var_residual"] == pytest.approx(sd_residual**2, rel=0.02)
    for key, sd, tolerance in (("var_seed", sd_seed, 0.15), ("var_problem", sd_problem, 0.05)):
        if sd:
            assert means[key] == pytest.approx(sd**2, rel=tolerance)
        else:  # a zero component: only truncated noise around zero, far below the others
            assert 0 <= means[key] < 0.01 * sd_residual**2


def test_additive_matrix_has_exact_components_and_satterthwaite_df():
    seed_effects, problem_effects = np.array([0.0, 0.2, -0.1]), np.array([0.5, -0.3, 0.1, 0.4])
    anova = crossed_anova(seed_effects[:, None] + problem_effects[None, :])  # no residual at all
    assert anova["var_residual"] == pytest.approx(0.0, abs=1e-30)
    assert anova["var_seed"] == pytest.approx(np.var(seed_effects, ddof=1))
    assert anova["var_problem"] == pytest.approx(np.var(problem_effects, ddof=1))
    expected = np.var(seed_effects, ddof=1) / 3 + np.var(problem_effects, ddof=1) / 4
    assert anova["var_mean"] == pytest.approx(expected)
    ms_seed, ms_problem = 4 * np.var(seed_effects, ddof=1), 3 * np.var(problem_effects, ddof=1)
    assert anova["df"] == pytest.approx((ms_seed + ms_problem) ** 2 / (ms_seed**2 / 2 + ms_problem**2 / 3))


def test_identical_seeds_give_the_interval_over_problems():
    row = np.random.default_rng(3).random(40)
    result = crossed_interval(np.tile(row, (4, 1)))  # a zero seed component, exactly
    assert result["var_seed"] == 0.0 and result["df"] == pytest.approx(39)
    assert (result["ci_low"], result["ci_high"]) == pytest.approx(t_interval(row))


def test_degenerate_matrices_say_why():
    one_seed = crossed_interval(np.random.default_rng(0).random((1, 30)))
    assert one_seed["ci_low"] is None and one_seed["ci_high"] is None and "1 seed(s)" in one_seed["note"]
    one_problem = crossed_interval(np.random.default_rng(0).random((4, 1)))
    assert one_problem["ci_low"] is None and "1 problem(s)" in one_problem["note"]
    with pytest.raises(ValueError, match="at least 2 of each"):
        crossed_anova(np.zeros((1, 10)))
    with pytest.raises(ValueError, match="non-finite"):
        crossed_anova(np.array([[0.0, np.nan], [1.0, 0.0]]))
    constant = crossed_interval(np.full((3, 8), 0.25))  # every component zero: no variation observed
    assert constant["ci_low"] == constant["ci_high"] == 0.25 and constant["df"] is None and constant["note"]


def test_t_quantile_matches_closed_forms():
    # df 1 is the Cauchy distribution, df 2 has t_p = (2p - 1) / sqrt(2 p (1 - p))
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-12)
    assert t_quantile(0.975, 2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-12)
    assert t_quantile(0.975, 1e8) == pytest.approx(1.959963984540054, rel=1e-7)  # the normal's
    for df in (0.7, 3.3, 40.5):  # Satterthwaite's df are not integers: the CDF inverts and is monotone
        assert t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-13)
        assert t_quantile(0.975, math.floor(df) or 0.5) > t_quantile(0.975, df) > t_quantile(0.975, math.ceil(df))
    assert t_cdf(-1.3, 4.0) == pytest.approx(1 - t_cdf(1.3, 4.0), abs=1e-15)


def test_pass_at_k_table_is_the_scalar_estimator():
    for n in (1, 7, 16):
        ks = list(range(1, n + 1))
        table = pass_at_k_table(n, ks)
        assert all(table[k - 1, c] == pass_at_k(n, c, k) for k in ks for c in range(n + 1))  # the same bits
    with pytest.raises(ValueError, match="k must be in"):
        pass_at_k_table(4, [5])


def test_p_values_invert_the_intervals():
    """p < 0.05 exactly when the 95% interval excludes 0: the crossed one and the one-factor one."""
    from sage_train.study.intervals import crossed_p_value, t_test

    rng = np.random.default_rng(7)
    for shift in (0.0, 0.01, 0.02, 0.04):
        matrix = simulate(rng, 0.03, 0.1, 0.1) + shift
        ci, p = crossed_interval(matrix), crossed_p_value(matrix)
        assert (p < 0.05) == (ci["ci_low"] > 0 or ci["ci_high"] < 0)
        edge = crossed_interval(matrix - ci["ci_low"])  # shifted so the interval's low end is at 0
        assert crossed_p_value(matrix - ci["ci_low"]) == pytest.approx(0.05, abs=1e-9) and edge[
            "ci_low"
        ] == pytest.approx(0)
        values = rng.normal(shift * 20, 1.0, 30)
        test = t_test(values)
        assert (test["p"] < 0.05) == (test["ci_low"] > 0 or test["ci_high"] < 0)
    assert crossed_p_value(np.ones((3, 4))) is None and t_test([1.0, 1.0])["p"] is None
    # a mean t_{0.975, 29} = 2.045230 standard errors from 0 (30 values) is p = 0.05
    assert t_test(np.array([-1.0, 1.0] * 15) + 2.045230 * math.sqrt(30 / 29) / math.sqrt(30))["p"] == pytest.approx(
        0.05, abs=1e-4
    )


def test_holm_steps_down_and_stays_monotone():
    from sage_train.study.intervals import holm

    adjusted = holm([0.01, 0.04, 0.03, None])
    assert adjusted[:3] == pytest.approx([0.03, 0.06, 0.06]) and adjusted[3] is None
    assert holm([0.034, 0.045, 0.2, 0.5]) == pytest.approx([0.136, 0.136, 0.4, 0.5])
    assert holm([0.9, 0.3]) == pytest.approx([0.9, 0.6]) and holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])


def test_welch_matches_its_formula_and_inverts_its_interval():
    from sage_train.study.intervals import welch

    a, b = [1.0, 2.0, 4.0, 7.0], [0.0, 0.5, 0.2, 0.1, 0.4, 0.3]
    result = welch(a, b)
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 6
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 5)
    assert result["df"] == pytest.approx(df) and result["mean"] == pytest.approx(np.mean(a) - np.mean(b))
    assert result["ci_high"] - result["mean"] == pytest.approx(t_quantile(0.975, df) * math.sqrt(va + vb))
    assert (result["p"] < 0.05) == (result["ci_low"] > 0)
    edge = welch(np.array(a) - result["ci_low"], b)
    assert edge["p"] == pytest.approx(0.05, abs=1e-9)
    with pytest.raises(ValueError, match="at least 2"):
        welch([1.0], b)
