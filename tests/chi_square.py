"""Pearson's chi-square goodness of fit for the sampling tests, computed so that it cannot fail
on arithmetic: float64 throughout and the expected counts scaled to the observed total (scipy
refuses sums that differ by more than 1.5e-8 relative, which float32 probabilities do)."""
from __future__ import annotations

import numpy as np
from scipy import stats

# With a correct sampler the p-value is uniform on (0, 1): a test with this floor fails on 1 seed
# in 1,000. The tests use a fixed seed, so CI sees the same p every run.
P_FLOOR = 1e-3


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of the observed `counts` under the distribution `probs` (same cells, probs > 0);
    cells expected fewer than `min_expected` times are pooled into one, as the test requires."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    expected = probs / probs.sum() * counts.sum()
    keep = expected >= min_expected
    f_obs = np.append(counts[keep], counts[~keep].sum()) if (~keep).any() else counts[keep]
    f_exp = np.append(expected[keep], expected[~keep].sum()) if (~keep).any() else expected[keep]
    f_exp *= f_obs.sum() / f_exp.sum()  # equal totals to the last bit scipy checks
    return float(stats.chisquare(f_obs, f_exp).pvalue)
