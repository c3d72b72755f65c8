"""Chi-square tests with torch and math only (no scipy), for checking samplers statistically.

Goodness of fit (counts vs known probabilities) and homogeneity (two sets of counts,
same unknown distribution?). Categories expected below ``min_expected`` (5, the usual
rule) are pooled, the pool absorbing the smallest others until it is large enough.
p-value: ``Q(dof / 2, x / 2)`` via ``torch.special.gammaincc``, in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    dof: int
    p_value: float


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square with ``dof`` degrees of freedom."""
    if dof < 1:
        raise ValueError(f"dof must be >= 1; got {dof}.")
    if statistic <= 0:
        return 1.0
    if math.isinf(statistic):
        return 0.0
    a = torch.tensor(dof / 2, dtype=torch.float64)
    x = torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


def merge_small_bins(scores: torch.Tensor, min_expected: float) -> torch.Tensor:  # [num_categories]
    """Bin id per category so that every bin reaches ``min_expected`` (or one bin is left)."""
    scores = scores.double()  # [num_categories]
    bins = torch.arange(scores.shape[0])
    small = scores < min_expected
    if not bool(small.any()):
        return bins
    pool = int(torch.nonzero(small)[0])
    bins[small] = pool
    large = sorted((float(scores[i]), i) for i in range(scores.shape[0]) if not small[i])
    pooled = float(scores[small].sum())
    for score, i in large:  # absorb the smallest large categories until the pool is big enough
        if pooled >= min_expected:
            break
        bins[i], pooled = pool, pooled + score
    return torch.unique(bins, return_inverse=True)[1]  # renumber 0 .. num_bins - 1


def chi_square_gof(
    observed_counts: torch.Tensor,  # [num_categories]
    expected_probs: torch.Tensor,  # [num_categories], sums to 1
    min_expected: float = 5.0,
) -> ChiSquareResult:
    """Do the counts follow ``expected_probs``? A count in a zero-probability category
    rejects outright (statistic inf, p 0); with a single bin left there is nothing to test (p 1).
    """
    observed = observed_counts.double()  # [num_categories]
    expected_probs = expected_probs.double()
    if observed.shape != expected_probs.shape:
        raise ValueError(
            f"observed_counts and expected_probs differ in shape: "
            f"{tuple(observed.shape)} vs {tuple(expected_probs.shape)}."
        )
    if not math.isclose(float(expected_probs.sum()), 1.0, abs_tol=1e-6):
        raise ValueError(f"expected_probs must sum to 1; got {float(expected_probs.sum())}.")
    if bool((observed[expected_probs == 0] > 0).any()):
        return ChiSquareResult(math.inf, 0, 0.0)
    expected = expected_probs * observed.sum()  # [num_categories]
    bins = merge_small_bins(expected, min_expected)  # [num_categories]
    num_bins = int(bins.max()) + 1
    observed_binned = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, observed)
    expected_binned = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, expected)
    if num_bins < 2:
        return ChiSquareResult(0.0, 0, 1.0)
    statistic = float(((observed_binned - expected_binned) ** 2 / expected_binned).sum())
    return ChiSquareResult(statistic, num_bins - 1, chi2_sf(statistic, num_bins - 1))


def chi_square_homogeneity(
    counts_a: torch.Tensor,  # [num_categories]
    counts_b: torch.Tensor,  # [num_categories]
    min_expected: float = 5.0,
) -> ChiSquareResult:
    """Are two sets of counts draws from the same distribution? (2 x K contingency table,
    no continuity correction.) Bins are merged on the smaller row's expected counts.
    """
    table = torch.stack([counts_a.double(), counts_b.double()])  # [2, num_categories]
    row_totals = table.sum(dim=1)  # [2]
    if bool((row_totals == 0).any()):
        raise ValueError("both samples need at least one count.")
    col_totals = table.sum(dim=0)  # [num_categories]
    bins = merge_small_bins(col_totals * row_totals.min() / row_totals.sum(), min_expected)
    num_bins = int(bins.max()) + 1
    binned = torch.zeros(2, num_bins, dtype=torch.float64)  # [2, num_bins]
    binned.index_add_(1, bins, table)
    if num_bins < 2:
        return ChiSquareResult(0.0, 0, 1.0)
    expected = row_totals[:, None] * binned.sum(dim=0)[None, :] / row_totals.sum()  # [2, num_bins]
    statistic = float(((binned - expected) ** 2 / expected).sum())
    return ChiSquareResult(statistic, num_bins - 1, chi2_sf(statistic, num_bins - 1))
