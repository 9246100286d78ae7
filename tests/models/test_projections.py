"""Tests for the frozen LoRA-XS projections in :mod:`pyrobayes.models.projections`."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.fft
import torch
from torch import Tensor, nn

from pyrobayes.models.projections import (
    PROJECTIONS,
    InputMoments,
    collect_input_moments,
    dct_ii_matrix,
    dct_projection,
    haar_stiefel,
    project,
    svd_projection,
    wsvd_projection,
)

# Exact-arithmetic identities checked in float64 on matrices of size <= 64 with condition numbers
# <= ~1e3: rounding error is ~1e-13 relative, so 1e-9 leaves four orders of headroom while any
# algebraic mistake (wrong transpose, permutation, missing factor) gives O(1) errors.
EXACT = 1e-9


def _correlated_data(n: int, d_in: int, seed: int = 0) -> Tensor:
    """Rows x = z L^T + mu with a strongly anisotropic, correlated covariance L L^T."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -2, d_in, dtype=torch.float64)
    mixing, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=torch.float64))
    chol = mixing * scales
    mu = torch.randn(d_in, generator=g, dtype=torch.float64) * 3.0
    return torch.randn(n, d_in, generator=g, dtype=torch.float64) @ chol.T + mu


def _covariance(x: Tensor) -> Tensor:
    xc = x - x.mean(0)
    return xc.T @ xc / (x.shape[0] - 1)


# --------------------------------------------------------------------------------------------------
# SVD
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_svd_eckart_young(rank: int) -> None:
    w = torch.randn(20, 12)
    a, b = project(w, rank, "svd")
    assert a.shape == (20, rank) and b.shape == (rank, 12)
    sigma = np.linalg.svd(w.numpy(), compute_uv=False)
    err2 = float((w - a @ b).square().sum())
    # Eckart-Young: the truncated SVD error is exactly the discarded spectral energy; rel 1e-5 per
    # the spec (float64 gives ~1e-14, so this only fails on a wrong factorisation).
    assert err2 == pytest.approx(float((sigma[rank:] ** 2).sum()), rel=1e-5)
    # B = V_r^T has orthonormal rows, A = U_r Sigma_r has orthogonal columns of norm sigma_j.
    torch.testing.assert_close(b @ b.T, torch.eye(rank), atol=EXACT, rtol=0)
    torch.testing.assert_close(
        a.T @ a, torch.diag(torch.tensor(sigma[:rank] ** 2)), atol=EXACT, rtol=0
    )


def test_svd_is_deterministic_and_sign_normalised() -> None:
    w = torch.randn(9, 6)
    a1, b1 = svd_projection(w, 4)
    a2, b2 = svd_projection(w.clone(), 4)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    # sign convention: the largest-magnitude entry of each row of B is positive
    idx = b1.abs().argmax(dim=1, keepdim=True)
    assert (torch.gather(b1, 1, idx) > 0).all()


def test_output_dtype_and_shapes_follow_input() -> None:
    w32 = torch.randn(10, 8, dtype=torch.float32)
    cov = _covariance(_correlated_data(100, 10))
    for method in PROJECTIONS:
        a, b = project(w32, 5, method, covariance=cov, generator=torch.Generator().manual_seed(0))
        assert a.dtype == torch.float32 and b.dtype == torch.float32, method
        assert a.shape == (10, 5) and b.shape == (5, 8), method


def test_projections_constant() -> None:
    assert PROJECTIONS == ("svd", "wsvd", "dct", "random")


# --------------------------------------------------------------------------------------------------
# W-SVD
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [2, 5])
def test_wsvd_beats_svd_on_activation_error(rank: int) -> None:
    d_in, d_out = 16, 12
    x = _correlated_data(600, d_in)
    w = torch.randn(d_in, d_out)
    moments = InputMoments().update(x)
    a_w, b_w = project(w, rank, "wsvd", covariance=moments)
    a_s, b_s = project(w, rank, "svd")
    xc = x - x.mean(0)
    err_w = float((xc @ (w - a_w @ b_w)).norm())
    err_s = float((xc @ (w - a_s @ b_s)).norm())
    # W-SVD is the optimum of this very objective, so it must not lose to plain SVD; on data whose
    # covariance spans three decades it should win by a wide margin (observed ratio << 0.5).
    assert err_w <= err_s
    assert err_w < 0.5 * err_s
    # and it attains the optimum: ||X_c E||_F^2 = (n-1) tr(E^T Sigma E) = (n-1) sum_{j>r} S~_j^2
    cov = moments.covariance()
    evals, evecs = torch.linalg.eigh(cov)
    s_tilde = torch.linalg.svdvals(w.T @ (evecs * evals.sqrt()) @ evecs.T)
    optimum = (x.shape[0] - 1) * float(s_tilde[rank:].square().sum())
    assert err_w**2 == pytest.approx(optimum, rel=1e-8)  # float64 identity, see EXACT


def test_wsvd_second_moment_beats_svd_on_raw_activation_error() -> None:
    d_in, d_out, rank = 12, 10, 3
    x = _correlated_data(400, d_in, seed=1)  # non-zero mean, so "second" != "centered"
    w = torch.randn(d_in, d_out)
    moments = InputMoments().update(x)
    a_2, b_2 = wsvd_projection(w, rank, moments, moment="second")
    a_c, b_c = wsvd_projection(w, rank, moments, moment="centered")
    a_s, b_s = svd_projection(w, rank)

    def raw_error(a: Tensor, b: Tensor) -> float:
        return float((x @ (w - a @ b)).norm())

    # the second-moment variant is optimal for the uncentred error, so it beats both others
    assert raw_error(a_2, b_2) <= raw_error(a_s, b_s)
    assert raw_error(a_2, b_2) <= raw_error(a_c, b_c) + 1e-9  # equality only if the mean is 0
    assert not torch.allclose(a_2 @ b_2, a_c @ b_c)


def test_wsvd_with_identity_covariance_is_svd() -> None:
    w = torch.randn(8, 11)
    a_w, b_w = wsvd_projection(w, 4, torch.eye(8))
    a_s, b_s = svd_projection(w, 4)
    # Sigma = I makes W~ = W0^T, so the rank-4 products coincide (the top-4 gap is generic)
    torch.testing.assert_close(a_w @ b_w, a_s @ b_s, atol=EXACT, rtol=0)
    # and with the same sign convention B itself (U~_r^T = V_r^T) coincides too
    torch.testing.assert_close(b_w, b_s, atol=EXACT, rtol=0)


# --------------------------------------------------------------------------------------------------
# exactness at full rank
# --------------------------------------------------------------------------------------------------


# at r = min(d_in, d_out), "random" and "dct" keep only an r-dimensional subspace (r frequencies)
# of the larger side, so they are exact on square W only (DCT on non-square W: see below)
_FULL_RANK_CASES = [
    (method, shape)
    for method in PROJECTIONS
    for shape in [(9, 9), (13, 7), (6, 10)]
    if method in ("svd", "wsvd") or shape[0] == shape[1]
]


@pytest.mark.parametrize(("method", "shape"), _FULL_RANK_CASES)
def test_full_rank_reconstruction_is_exact(method: str, shape: tuple[int, int]) -> None:
    d_in, d_out = shape
    w = torch.randn(d_in, d_out)
    cov = _covariance(_correlated_data(200, d_in))
    rank = min(d_in, d_out)
    a, b = project(w, rank, method, covariance=cov, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a @ b, w, atol=EXACT, rtol=0)


# --------------------------------------------------------------------------------------------------
# DCT
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_dct_matrix_is_orthonormal_dct_ii(n: int) -> None:
    d = dct_ii_matrix(n)
    torch.testing.assert_close(d @ d.T, torch.eye(n), atol=EXACT, rtol=0)
    x = np.random.default_rng(n).standard_normal((n, 3))
    expected = scipy.fft.dct(x, type=2, norm="ortho", axis=0)
    np.testing.assert_allclose((d @ torch.from_numpy(x)).numpy(), expected, atol=EXACT, rtol=0)


def test_dct_all_frequencies_exact_on_non_square() -> None:
    w = torch.randn(11, 6) * torch.linspace(0.1, 3.0, 6)  # distinct column norms: non-trivial P
    a, b = dct_projection(w, 6, n_row_freq=11)
    assert a.shape == (11, 6) and b.shape == (6, 6)
    torch.testing.assert_close(a @ b, w, atol=EXACT, rtol=0)
    wt = w.T.contiguous()  # the wide case
    a, b = dct_projection(wt, 11, n_row_freq=6)
    torch.testing.assert_close(a @ b, wt, atol=EXACT, rtol=0)


def test_dct_is_equivariant_to_permutations() -> None:
    # the internal sort by L1 norm undoes any row/column shuffle, so folding P^-1 back must make
    # the low-rank product commute with the shuffle (fails if P, P^-1 are applied the wrong way)
    w = torch.randn(10, 8)
    p = torch.randperm(10)
    q = torch.randperm(8)
    a, b = dct_projection(w, 3)
    a_p, b_p = dct_projection(w[p][:, q], 3)
    torch.testing.assert_close(a_p @ b_p, (a @ b)[p][:, q], atol=EXACT, rtol=0)
    assert float((w - a @ b).norm()) > 1e-3  # rank 3 of a generic 10x8 is not exact


def test_dct_keeps_most_energetic_frequencies() -> None:
    # a smooth weight with ascending rows/columns is already sorted (P = identity); by
    # orthonormality the error is exactly the coefficient energy outside C[rows, cols]
    m, n, rank = 12, 9, 3
    rows = torch.linspace(1.0, 2.0, m)[:, None]
    cols = torch.linspace(1.0, 3.0, n)[None, :]
    w = rows * cols + 0.1 * rows**2
    a, b = dct_projection(w, rank)
    c = (dct_ii_matrix(m) @ w @ dct_ii_matrix(n).T).numpy()
    energy = c**2
    top_rows = np.sort(np.argsort(-energy.sum(1), kind="stable")[:rank])
    top_cols = np.sort(np.argsort(-energy.sum(0), kind="stable")[:rank])
    assert list(top_rows) != [0, 1, 2]  # ramps put energy in odd frequencies: not a low-pass
    kept = c[np.ix_(top_rows, top_cols)]
    err2 = float((w - a @ b).square().sum())
    assert err2 == pytest.approx(float(energy.sum() - (kept**2).sum()), rel=1e-8)  # see EXACT
    lowpass = c[:rank, :rank]
    assert err2 < float(energy.sum() - (lowpass**2).sum())
    assert err2 < 0.05 * float(energy.sum())


# --------------------------------------------------------------------------------------------------
# RAND (Haar)
# --------------------------------------------------------------------------------------------------


def test_haar_stiefel_orthonormal_with_positive_triangular_factor() -> None:
    n, r = 15, 6
    q1 = haar_stiefel(n, r, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(q1.T @ q1, torch.eye(r), atol=EXACT, rtol=0)
    # the sign fix: Q = G R^-1 with diag(R) > 0, i.e. Q^T G is upper triangular, positive diagonal
    g = torch.randn(n, r, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    r_factor = q1.T @ g
    torch.testing.assert_close(r_factor, torch.triu(r_factor), atol=EXACT, rtol=0)
    assert (torch.diagonal(r_factor) > 0).all()


def test_haar_first_column_is_unbiased() -> None:
    # Haar => Q[0, 0] is symmetric about 0. Without the sign fix LAPACK's Householder QR makes it
    # (almost surely) one-signed with |mean| ~ 0.5. With N draws and Var(Q[0,0]) = 1/n the standard
    # error is sqrt(1/(n N)) ~ 0.016, so 5 SE gives a false-failure rate < 1e-6.
    n, draws = 4, 1000
    gen = torch.Generator().manual_seed(11)
    first = torch.stack([haar_stiefel(n, 2, generator=gen)[0, 0] for _ in range(draws)])
    assert abs(float(first.mean())) < 5 * (1.0 / (n * draws)) ** 0.5


def test_random_projection_reproducible_and_orthonormal_b() -> None:
    w = torch.randn(12, 9)
    a1, b1 = project(w, 4, "random", generator=torch.Generator().manual_seed(5))
    a2, b2 = project(w, 4, "random", generator=torch.Generator().manual_seed(5))
    a3, _ = project(w, 4, "random", generator=torch.Generator().manual_seed(6))
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert not torch.allclose(a1, a3)
    torch.testing.assert_close(b1 @ b1.T, torch.eye(4), atol=EXACT, rtol=0)  # B = Q2^T


# --------------------------------------------------------------------------------------------------
# input moments
# --------------------------------------------------------------------------------------------------


def test_input_moments_against_numpy_cov() -> None:
    d = 6
    rng = np.random.default_rng(1)
    moments = InputMoments()
    kept: list[np.ndarray] = []
    for shape in [(3, 7), (11,), (2, 4), (1, 1), (4, 6), (9,)]:
        x = rng.standard_normal((*shape, d)) * 2.0 + 1.5
        mask = rng.random(shape) > 0.3
        x[~mask] = 1e6  # padding values that would wreck the statistics if not excluded
        moments.update(torch.from_numpy(x), torch.from_numpy(mask))
        kept.append(x[mask])
    moments.update(torch.full((2, 3, d), 1e6), torch.zeros(2, 3, dtype=torch.bool))  # no-op
    data = np.concatenate(kept)
    assert moments.n == data.shape[0]
    # Chan's merge is exact in exact arithmetic; on O(1) data in float64 the discrepancy is
    # ~1e-15, so the spec's 1e-10 absolute tolerance only catches real merge/mask errors.
    np.testing.assert_allclose(moments.mean.numpy(), data.mean(0), atol=1e-10, rtol=0)
    np.testing.assert_allclose(
        moments.covariance("centered").numpy(), np.cov(data, rowvar=False), atol=1e-10, rtol=0
    )
    np.testing.assert_allclose(
        moments.covariance("second").numpy(), data.T @ data / data.shape[0], atol=1e-10, rtol=0
    )


def test_input_moments_merge_of_accumulators() -> None:
    x = _correlated_data(300, 4)
    whole = InputMoments().update(x)
    left = InputMoments().update(x[:37])
    right = InputMoments().update(x[37:200]).update(x[200:])
    left.merge(right).merge(InputMoments())  # merging an empty accumulator is a no-op
    assert left.n == whole.n == 300
    torch.testing.assert_close(left.covariance(), whole.covariance(), atol=1e-10, rtol=0)
    torch.testing.assert_close(
        left.covariance("second"), whole.covariance("second"), atol=1e-10, rtol=0
    )


def test_input_moments_errors() -> None:
    with pytest.raises(ValueError, match="no activations"):
        InputMoments().covariance()
    m = InputMoments().update(torch.randn(1, 3))
    with pytest.raises(ValueError, match="at least 2"):
        m.covariance("centered")
    with pytest.raises(ValueError, match="moment must be one of"):
        m.covariance("raw")
    with pytest.raises(ValueError, match="d_in=3"):
        m.update(torch.randn(2, 4))
    with pytest.raises(ValueError, match="leading shape"):
        m.update(torch.randn(2, 5, 3), torch.ones(2, dtype=torch.bool))


# --------------------------------------------------------------------------------------------------
# collect_input_moments
# --------------------------------------------------------------------------------------------------


def _tiny_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3))


def _has_hooks(net: nn.Module) -> bool:
    return any(len(m._forward_pre_hooks) > 0 for m in net.modules())


def test_collect_input_moments_matches_direct_computation() -> None:
    net = _tiny_net().train()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for t in (5, 3, 7):
        x = torch.randn(2, t, 4, generator=gen, dtype=torch.float64)
        mask = torch.rand(2, t, generator=gen) > 0.25
        batches.append({"x": x, "attention_mask": mask})
    moments = collect_input_moments(
        net,
        ["0", "3"],
        batches,
        forward=lambda m, b: m(b["x"]),
        mask_fn=lambda b: b["attention_mask"],
    )
    rows0 = torch.cat([b["x"][b["attention_mask"]] for b in batches])
    with torch.no_grad():
        rows3 = torch.tanh(net[0](rows0))  # eval mode: dropout is the identity
    # both are float64 computations of the same quantities: ~1e-15 apart
    torch.testing.assert_close(moments["0"].covariance(), _covariance(rows0), atol=1e-10, rtol=0)
    torch.testing.assert_close(moments["3"].covariance(), _covariance(rows3), atol=1e-10, rtol=0)
    assert moments["0"].n == moments["3"].n == rows0.shape[0]
    assert not _has_hooks(net)
    assert net.training and net[2].training  # training flags restored after the eval-mode pass


def test_collect_input_moments_2d_max_batches_and_no_mask() -> None:
    net = _tiny_net()
    batches = [torch.randn(5, 4) for _ in range(4)]
    moments = collect_input_moments(net, ["0"], batches, lambda m, b: m(b), max_batches=2)
    assert moments["0"].n == 10
    rows = torch.cat(batches[:2])
    torch.testing.assert_close(moments["0"].covariance(), _covariance(rows), atol=1e-10, rtol=0)
    # (B,) mask for 2-D activations
    moments = collect_input_moments(
        net, ["0"], batches, lambda m, b: m(b), mask_fn=lambda b: b[:, 0] > 0
    )
    assert moments["0"].n == int(sum(int((b[:, 0] > 0).sum()) for b in batches))


def test_collect_input_moments_removes_hooks_on_error() -> None:
    net = _tiny_net()

    def failing_forward(m: nn.Module, b: Tensor) -> None:
        m(b)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        collect_input_moments(net, ["0", "3"], [torch.randn(2, 4)], failing_forward)
    assert not _has_hooks(net)
    with pytest.raises(ValueError, match="not found"):
        collect_input_moments(net, ["nope"], [], lambda m, b: m(b))


def test_wsvd_from_collected_moments_end_to_end() -> None:
    net = _tiny_net()
    x = _correlated_data(300, 4)
    moments = collect_input_moments(net, ["0"], x.split(50), lambda m, b: m(b))
    w = net[0].weight.detach().T  # (d_in, d_out) = transpose of the Linear weight
    a, b = project(w, 2, "wsvd", covariance=moments["0"])
    a_s, b_s = project(w, 2, "svd")
    xc = x - x.mean(0)
    assert float((xc @ (w - a @ b)).norm()) <= float((xc @ (w - a_s @ b_s)).norm())


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, -1, 7])
def test_rank_out_of_range(rank: int) -> None:
    with pytest.raises(ValueError, match=r"rank must satisfy 1 <= rank <= min\(d_in, d_out\) = 6"):
        project(torch.randn(6, 9), rank, "svd")


def test_error_messages() -> None:
    w = torch.randn(6, 5)
    with pytest.raises(ValueError, match="pass calibration data"):
        project(w, 2, "wsvd")
    with pytest.raises(ValueError, match=r"valid methods are \('svd', 'wsvd', 'dct', 'random'\)"):
        project(w, 2, "pca")
    with pytest.raises(ValueError, match=r"shape \(d_in, d_in\) = \(6, 6\)"):
        project(w, 2, "wsvd", covariance=torch.eye(5))
    with pytest.raises(ValueError, match="2-D"):
        project(torch.randn(6), 1, "svd")
    with pytest.raises(TypeError, match="integer"):
        project(w, 2.0, "svd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_row_freq"):
        dct_projection(w, 2, n_row_freq=7)
