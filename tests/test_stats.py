"""The chi-square helpers against closed forms and textbook values."""

import math

import pytest
import torch

from specplugin.stats import chi2_sf, chi_square_gof, chi_square_homogeneity, merge_small_bins


@pytest.mark.parametrize(
    ("statistic", "dof", "p_value"),
    [
        (3.841459, 1, 0.05),
        (18.307038, 10, 0.05),
        (6.634897, 1, 0.01),
        (5.991465, 2, 0.05),
        (124.342113, 100, 0.05),
    ],
)
def test_chi2_sf_matches_table(statistic, dof, p_value):
    assert chi2_sf(statistic, dof) == pytest.approx(p_value, rel=1e-5)


@pytest.mark.parametrize("statistic", [0.01, 0.5, 1.0, 3.0, 10.0, 40.0, 120.0])
def test_chi2_sf_matches_closed_forms(statistic):
    # dof 1: erfc(sqrt(x / 2)); dof 2: exp(-x / 2); dof 4: exp(-x / 2) (1 + x / 2)
    assert chi2_sf(statistic, 1) == pytest.approx(math.erfc(math.sqrt(statistic / 2)), rel=1e-9)
    assert chi2_sf(statistic, 2) == pytest.approx(math.exp(-statistic / 2), rel=1e-9)
    dof4 = math.exp(-statistic / 2) * (1 + statistic / 2)
    assert chi2_sf(statistic, 4) == pytest.approx(dof4, rel=1e-9)


def test_chi2_sf_edges():
    assert chi2_sf(0.0, 3) == 1.0
    assert chi2_sf(math.inf, 3) == 0.0
    with pytest.raises(ValueError, match="dof"):
        chi2_sf(1.0, 0)


def test_gof_known_value():
    result = chi_square_gof(torch.tensor([44, 56]), torch.tensor([0.5, 0.5]))
    assert result.statistic == pytest.approx(1.44)
    assert result.dof == 1
    assert result.p_value == pytest.approx(math.erfc(math.sqrt(0.72)), rel=1e-9)  # 0.2301


def test_gof_merges_small_expected_counts():
    # expected counts 50, 40, 6, 2, 2: the last two (4 in all) pool with the 6
    observed = torch.tensor([48, 41, 5, 3, 3])
    result = chi_square_gof(observed, torch.tensor([0.5, 0.4, 0.06, 0.02, 0.02]))
    assert result.dof == 2
    expected_statistic = (48 - 50) ** 2 / 50 + (41 - 40) ** 2 / 40 + (11 - 10) ** 2 / 10
    assert result.statistic == pytest.approx(expected_statistic)


def test_gof_count_in_impossible_category_rejects():
    result = chi_square_gof(torch.tensor([50, 49, 1]), torch.tensor([0.5, 0.5, 0.0]))
    assert result.p_value == 0.0


def test_gof_rejects_bad_probs():
    with pytest.raises(ValueError, match="sum to 1"):
        chi_square_gof(torch.tensor([1, 2]), torch.tensor([0.5, 0.6]))


def test_homogeneity_known_value():
    # [[10, 20], [30, 40]]: expected 12, 18, 28, 42
    result = chi_square_homogeneity(torch.tensor([10, 20]), torch.tensor([30, 40]))
    assert result.statistic == pytest.approx(4 / 12 + 4 / 18 + 4 / 28 + 4 / 42)
    assert result.dof == 1
    assert result.p_value == pytest.approx(math.erfc(math.sqrt(result.statistic / 2)), rel=1e-9)


def test_homogeneity_merges_sparse_columns():
    counts_a, counts_b = torch.tensor([100, 100, 3, 0, 3]), torch.tensor([90, 110, 0, 6, 1])
    result = chi_square_homogeneity(counts_a, counts_b)
    assert result.dof == 2  # three sparse columns become one bin


def test_merge_small_bins_keeps_large_categories_apart():
    bins = merge_small_bins(torch.tensor([10.0, 1.0, 20.0, 1.0, 30.0]), 5.0)
    # the pool (1 + 1) absorbs the smallest large category (10)
    assert bins[0] == bins[1] == bins[3]
    assert len({int(bins[0]), int(bins[2]), int(bins[4])}) == 3


def test_gof_is_calibrated_under_the_null():
    """About 5% of true-null tests fall below 0.05 (and p-values are not all near 1)."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.08, 0.02])
    num_trials, num_draws = 2000, 500
    samples = torch.multinomial(
        probs, num_trials * num_draws, replacement=True, generator=generator
    )  # [num_trials * num_draws]
    counts = torch.nn.functional.one_hot(samples.view(num_trials, num_draws), 5).sum(dim=1)
    p_values = torch.tensor([chi_square_gof(row, probs).p_value for row in counts])
    assert 0.035 < float((p_values < 0.05).double().mean()) < 0.065
    assert 0.45 < float(p_values.median()) < 0.55
