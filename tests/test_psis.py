"""Tests for pyrobayes.diagnostics.psis: Pareto k-hat anchors, agreement with an independent
reference implementation (PSIS computes through ArviZ), smoothing and ESS."""

from __future__ import annotations

import math

import arviz  # its once-a-day FutureWarning is a named ignore in pyproject.toml
import numpy as np
import pytest
import torch
from torch.distributions import Independent, Normal

from pyrobayes.diagnostics.psis import importance_ess, pareto_khat, psis_smooth, psis_tail_length


def normal_log_ratios(dim: int, c: float, num_draws: int = 4000) -> torch.Tensor:
    """r = log p(theta) - log q(theta), theta ~ q, for p = N(0, I_d) and q = N(0, I_d / c)."""
    p = Independent(Normal(torch.zeros(dim), torch.ones(dim)), 1)
    q = Independent(Normal(torch.zeros(dim), torch.full((dim,), c**-0.5)), 1)
    theta = q.sample((num_draws,))
    return p.log_prob(theta) - q.log_prob(theta)


def test_tail_length_formula() -> None:
    # M = ceil(min(0.2 S, 3 sqrt(S / r_eff)))
    assert psis_tail_length(4000) == 190  # min(800, 189.74)
    assert psis_tail_length(4000, r_eff=0.5) == 269  # min(800, 268.33)
    assert psis_tail_length(100) == 20  # min(20, 30)
    assert psis_tail_length(10) == 2


def test_overdispersed_proposal_has_small_khat() -> None:
    # q = N(0, 1/0.67) is wider than p = N(0, 1): w = exp(-0.165 theta^2) * const <= const is
    # bounded, so the true k is negative. Over 400 seeds k-hat was -1.69 +- 0.11 (max -1.29), so
    # the bound 0.5 is > 15 sd away.
    k_hat = pareto_khat(normal_log_ratios(dim=1, c=0.67))
    assert k_hat < 0.5
    assert k_hat < 0.0


def test_underdispersed_proposal_has_large_khat() -> None:
    # q = N(0, I/3) in 10-D: w = exp(|theta|^2) with 3|theta|^2 ~ chi2_10, so
    # P(w > t) ~ (log t)^4 t^(-3/2): asymptotically k = 2/3, pre-asymptotically heavier. Over 400
    # seeds one k-hat (S = 4000) was 0.89 +- 0.14 and 7% of them fell below 0.7, so a single draw
    # is not a reliable test. The mean of 8 independent replicates has sd 0.14 / sqrt(8) = 0.05,
    # leaving the 0.7 bound 0.19 / 0.05 = 3.8 sd below the expected 0.89.
    k_hats = [pareto_khat(normal_log_ratios(dim=10, c=3.0)) for _ in range(8)]
    assert np.mean(k_hats) > 0.7
    assert min(k_hats) > 0.3  # every replicate clearly flags a heavy tail (min of 400 was 0.505)


def test_exact_proposal_gives_uniform_weights() -> None:
    # q = p: every log-ratio is exactly 0, importance sampling is exact.
    dist = Independent(Normal(torch.zeros(3), torch.ones(3)), 1)
    theta = dist.sample((4000,))
    log_ratios = dist.log_prob(theta) - dist.log_prob(theta)
    log_weights, k_hat = psis_smooth(log_ratios)
    assert k_hat == -math.inf  # ArviZ: +inf here (empty tail); see pyrobayes.diagnostics.psis
    assert k_hat < 0.5
    assert torch.allclose(log_weights, torch.full((4000,), -math.log(4000)), rtol=0, atol=1e-12)
    assert importance_ess(log_weights) == pytest.approx(4000, rel=1e-12)


def reference_psis(log_ratios: np.ndarray, r_eff: float = 1.0) -> tuple[np.ndarray, float]:
    """PSIS written from Vehtari et al. (2024), Sec. 3 and App. C, and the Zhang & Stephens
    (2009) empirical-Bayes GPD fit (with ``loo``'s prior on k); the oracle for ``psis_smooth``,
    which calls ArviZ. Returns normalised smoothed log-weights and k-hat."""
    x = np.asarray(log_ratios, dtype=np.float64) - np.max(log_ratios)
    num = x.size
    tail_length = math.ceil(min(num / 5.0, 3.0 * math.sqrt(num / r_eff)))
    order = np.argsort(x, kind="stable")
    log_cut = max(float(x[order[max(num - tail_length - 1, 0)]]), math.log(np.finfo(float).tiny))
    tail = order[x[order] > log_cut]  # ascending
    k_hat = math.inf
    if tail.size >= 5:
        cut = math.exp(log_cut)
        ex = np.exp(x[tail]) - cut  # ascending exceedances
        n = ex.size
        m = 30 + int(math.sqrt(n))
        j = np.arange(1, m + 1, dtype=np.float64)
        b = 1.0 / ex[-1] + (1.0 - np.sqrt(m / (j - 0.5))) / (3.0 * ex[int(n / 4.0 + 0.5) - 1])
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.log1p(-b[:, None] * ex[None, :]).mean(axis=1)
            profile = n * (np.log(-b / k) - k - 1.0)
            w = 1.0 / np.exp(profile[None, :] - profile[:, None]).sum(axis=1)
        keep = w >= 10.0 * np.finfo(float).eps
        b_hat = float(np.sum(b[keep] * w[keep] / w[keep].sum()))
        k_raw = float(np.log1p(-b_hat * ex).mean())
        sigma = -k_raw / b_hat
        k_hat = (n * k_raw + 10.0 * 0.5) / (n + 10.0)  # prior: 10 pseudo-draws at k = 0.5
        p = (np.arange(1, n + 1) - 0.5) / n
        quantiles = sigma * np.expm1(-k_hat * np.log1p(-p)) / k_hat  # GPD inverse CDF
        x[tail] = np.minimum(np.log(quantiles + cut), 0.0)
    top = x.max()
    return x - (top + math.log(np.exp(x - top).sum())), k_hat


@pytest.mark.parametrize(
    ("dim", "c", "r_eff"),
    [(1, 0.67, 1.0), (10, 3.0, 1.0), (1, 3.0, 1.0), (2, 1.5, 0.7), (10, 3.0, 0.4)],
)
def test_matches_reference_psis(dim: int, c: float, r_eff: float) -> None:
    # Same algorithm in float64, different summation order: over 600 random inputs (S = 5 to
    # 4000, Gaussian/Student-t/Pareto ratios, -inf entries, r_eff 0.3-1) the ArviZ route and this
    # reference agreed to 7.1e-15 on log-weights (|log w| < 15: a few ulp) and 4.9e-15 on k-hat,
    # so 1e-12 bounds round-off with a 100x margin while any algorithmic change shows.
    log_ratios = normal_log_ratios(dim, c).numpy()
    log_weights, k_hat = psis_smooth(log_ratios, r_eff=r_eff)
    lw_ref, k_ref = reference_psis(log_ratios, r_eff)
    assert math.isfinite(k_hat)
    assert abs(k_hat - k_ref) < 1e-12
    assert isinstance(log_weights, np.ndarray)
    np.testing.assert_allclose(log_weights, lw_ref, rtol=0, atol=1e-12)
    assert pareto_khat(log_ratios, r_eff) == k_hat
    # the route really is ArviZ's
    lw_arviz, k_arviz = arviz.psislw(log_ratios.copy(), r_eff)
    assert k_hat == float(k_arviz)
    np.testing.assert_array_equal(log_weights, lw_arviz)


def test_ties_get_the_same_weights_as_the_reference_up_to_order() -> None:
    # Tied log-ratios in the tail may receive the smoothed quantiles in another order (ArviZ sorts
    # with NumPy's unstable quicksort): the multiset of weights and k-hat agree, see above.
    log_ratios = np.round(normal_log_ratios(dim=10, c=3.0).numpy(), 1)
    assert np.unique(log_ratios).size < log_ratios.size / 4  # many ties
    log_weights, k_hat = psis_smooth(log_ratios)
    lw_ref, k_ref = reference_psis(log_ratios)
    assert abs(k_hat - k_ref) < 1e-12
    np.testing.assert_allclose(np.sort(log_weights), np.sort(lw_ref), rtol=0, atol=1e-12)


def test_smoothing_structure() -> None:
    # Algorithm invariants, independent of ArviZ, on a heavy tail (so the smoothing matters).
    log_ratios = normal_log_ratios(dim=10, c=3.0)
    log_weights, k_hat = psis_smooth(log_ratios)
    assert isinstance(log_weights, torch.Tensor) and log_weights.dtype == log_ratios.dtype
    num_draws = log_ratios.numel()
    tail = psis_tail_length(num_draws)
    order = torch.argsort(log_ratios)
    body, tail_idx = order[: num_draws - tail], order[num_draws - tail :]
    # normalised
    assert torch.logsumexp(log_weights, 0).item() == pytest.approx(0.0, abs=1e-12)
    # the body keeps its raw weights up to the common normaliser
    shift = log_weights[body] - log_ratios[body]
    assert torch.allclose(shift, shift[0].expand_as(shift), rtol=0, atol=1e-10)
    # the tail is replaced by increasing GPD quantiles: ranks kept, values changed, none above
    # the largest raw weight and none below the threshold
    smoothed_tail = log_weights[tail_idx] - shift[0]
    assert torch.all(smoothed_tail[1:] >= smoothed_tail[:-1])
    assert not torch.allclose(smoothed_tail, log_ratios[tail_idx])
    assert smoothed_tail.max() <= log_ratios.max() + 1e-12
    assert smoothed_tail.min() >= log_ratios[body].max() - 1e-12
    assert k_hat > 0.3


@pytest.mark.parametrize("k_true", [0.2, 0.8])
def test_khat_recovers_gpd_shape(k_true: float) -> None:
    # Weights w ~ GPD(k, sigma = 1) (inverse CDF), so the tail exceedances over any threshold are
    # GPD with the same k. S = 1e5 gives M = 949 tail draws; the estimator's sd is about
    # (1 + k) / sqrt(M) <= 1.8 / 30.8 = 0.06 and the shrinkage bias (5 - 10 k) / (M + 10) is
    # <= 0.004, so a tolerance of 0.2 is > 3 sd (over 100 seeds: sd 0.04-0.05, max error 0.12).
    u = torch.rand(100_000)
    weights = torch.expm1(-k_true * torch.log1p(-u)) / k_true
    assert abs(pareto_khat(weights.log()) - k_true) < 0.2


def test_short_tail_gives_infinite_khat_and_plain_normalisation() -> None:
    # S = 10: M = ceil(min(2, 9.5)) = 2 < 5 tail draws, so no fit and no smoothing.
    log_ratios = torch.randn(10)
    log_weights, k_hat = psis_smooth(log_ratios)
    assert k_hat == math.inf
    assert torch.allclose(log_weights, log_ratios - torch.logsumexp(log_ratios, 0), atol=1e-12)
    _, k_arviz = arviz.psislw(log_ratios.numpy().copy())
    assert float(k_arviz) == math.inf


def test_zero_weights_allowed_and_bad_input_rejected() -> None:
    log_ratios = normal_log_ratios(dim=1, c=0.67)
    log_ratios[:10] = -math.inf
    log_weights, k_hat = psis_smooth(log_ratios)
    assert math.isfinite(k_hat)
    assert torch.all(log_weights[:10] == -math.inf)
    assert torch.logsumexp(log_weights, 0).item() == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="NaN"):
        pareto_khat(torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="1-D"):
        pareto_khat(torch.zeros(4, 4))


def test_importance_ess() -> None:
    # equal weights: ESS = S
    assert importance_ess(torch.zeros(4000)) == pytest.approx(4000, rel=1e-12)
    # w = (1, 1, 2, 2) -> normalised (1/6, 1/6, 1/3, 1/3); sum w^2 = 2/36 + 2/9 = 10/36 -> 3.6,
    # invariant to the scale of the weights (additive constant in log space)
    log_w = torch.tensor([1.0, 1.0, 2.0, 2.0]).log()
    assert importance_ess(log_w) == pytest.approx(3.6, rel=1e-12)
    assert importance_ess(log_w.numpy() + 123.0) == pytest.approx(3.6, rel=1e-12)
    # one dominant weight: ESS -> 1
    assert importance_ess(torch.tensor([0.0, -50.0, -50.0])) == pytest.approx(1.0, abs=1e-12)
