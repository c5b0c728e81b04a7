"""Chi-square goodness of fit for the sampling tests: seeded draws against exact laws."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy.stats import chisquare

P_MIN = 1e-3  # p-value floor; every draw is seeded, so a pass is reproducible


def chi_square(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of observed counts against expected_probs; zero-probability tokens must be unseen."""
    assert observed[expected_probs == 0].sum() == 0
    support = expected_probs > 0
    n = observed.sum()
    expected = expected_probs[support] * n
    assert (expected >= 5).all(), "test needs more draws"
    return chisquare(observed[support], expected).pvalue


def joint_fit(observed: Mapping[tuple, int], expected: Mapping[tuple, float], draws: int) -> tuple[float, list, list]:
    """p-value of `draws` observed outcomes against their exact law, with the observed and expected
    counts it compared: outcomes expected at least 5 times each, and one bin pooling the rest (left
    out where nothing is expected in it)."""
    common = [o for o in expected if expected[o] * draws >= 5]
    obs = [observed[o] for o in common] + [draws - sum(observed[o] for o in common)]
    exp = [expected[o] * draws for o in common] + [draws * (1 - sum(expected[o] for o in common))]
    if exp[-1] < 1e-6:
        obs, exp = obs[:-1], exp[:-1]
    assert abs(sum(exp) - sum(obs)) <= 1e-4 * sum(obs), (obs, exp)  # no draw outside the compared bins
    exp = [e * sum(obs) / sum(exp) for e in exp]  # float rounding of the total (float32 laws)
    return chisquare(obs, exp).pvalue, obs, exp
