"""Tests for :mod:`pyrobayes.distributions` against dense multivariate-normal references.

Conventions checked here (SPECS 0.4 / 5b.3): ``vec`` stacks columns, ``vec(X) = X.mT.reshape(-1)``;
``vec(X) ~ N(vec M, V ⊗ U)`` and ``X.reshape(-1) ~ N(M.reshape(-1), U ⊗ V)``.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from torch.distributions import MultivariateNormal, kl_divergence

from pyrobayes.distributions import KronEigenNormal, MatrixNormal

DT = torch.float64
M_ROWS, N_COLS = 3, 4  # non-square on purpose


def vec(X: torch.Tensor) -> torch.Tensor:
    """Column-stacking vec over the last two dims."""
    return X.mT.reshape(X.shape[:-2] + (-1,))


def rand_tril(k: int, *batch: int) -> torch.Tensor:
    L = torch.randn(*batch, k, k, dtype=DT).tril(-1)
    d = torch.rand(*batch, k, dtype=DT) + 0.5
    return L + torch.diag_embed(d)


def rand_orth(k: int, *batch: int) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(*batch, k, k, dtype=DT))
    return Q


def rand_psd(k: int) -> torch.Tensor:
    B = torch.randn(k, 2 * k, dtype=DT)
    return B @ B.T / (2 * k)


def make_mn(m: int = M_ROWS, n: int = N_COLS, *batch: int) -> MatrixNormal:
    return MatrixNormal(
        torch.randn(*batch, m, n, dtype=DT), rand_tril(m, *batch), rand_tril(n, *batch)
    )


def make_ke(m: int = M_ROWS, n: int = N_COLS, *batch: int) -> KronEigenNormal:
    P = torch.rand(*batch, m, n, dtype=DT) * 3 + 0.2
    return KronEigenNormal(
        torch.randn(*batch, m, n, dtype=DT), rand_orth(n, *batch), rand_orth(m, *batch), P
    )


def dense_mn(d: MatrixNormal) -> MultivariateNormal:
    """Column-vec MVN built independently with torch.kron."""
    U = d.row_scale_tril @ d.row_scale_tril.mT
    V = d.col_scale_tril @ d.col_scale_tril.mT
    return MultivariateNormal(vec(d.loc), covariance_matrix=torch.kron(V, U))


def dense_ke(d: KronEigenNormal) -> MultivariateNormal:
    Q = torch.kron(d.eigvecs_in, d.eigvecs_out)
    prec = Q @ torch.diag(vec(d.precision_eig)) @ Q.T
    return MultivariateNormal(vec(d.loc), precision_matrix=prec)


def iso(s: float, m: int = M_ROWS, n: int = N_COLS) -> MultivariateNormal:
    return MultivariateNormal(
        torch.zeros(m * n, dtype=DT), covariance_matrix=s**2 * torch.eye(m * n, dtype=DT)
    )


# --------------------------------------------------------------------------- MatrixNormal
def test_mn_log_prob_matches_dense_both_orderings():
    d = make_mn()
    X = torch.randn(5, M_ROWS, N_COLS, dtype=DT)
    ref = dense_mn(d)
    torch.testing.assert_close(d.log_prob(X), ref.log_prob(vec(X)))
    # row-major ordering: X.reshape(-1) ~ N(M.reshape(-1), U ⊗ V)
    U, V = d.row_covariance, d.col_covariance
    ref_r = MultivariateNormal(d.loc.reshape(-1), covariance_matrix=torch.kron(U, V))
    torch.testing.assert_close(d.log_prob(X), ref_r.log_prob(X.reshape(5, -1)))
    torch.testing.assert_close(d.to_dense_covariance(), torch.kron(V, U))
    torch.testing.assert_close(d.to_dense_covariance(row_major=True), torch.kron(U, V))
    torch.testing.assert_close(d.to_dense_precision(), torch.linalg.inv(torch.kron(V, U)))


def test_mn_log_prob_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    d = make_mn()
    X = torch.randn(M_ROWS, N_COLS, dtype=DT)
    ref = stats.matrix_normal(
        mean=d.loc.numpy(), rowcov=d.row_covariance.numpy(), colcov=d.col_covariance.numpy()
    ).logpdf(X.numpy())
    assert abs(d.log_prob(X).item() - ref) < 1e-10


def test_mn_entropy_variance_and_kl_isotropic():
    d = make_mn()
    ref = dense_mn(d)
    torch.testing.assert_close(d.entropy(), ref.entropy())
    torch.testing.assert_close(vec(d.variance), ref.covariance_matrix.diagonal())
    for s in (0.3, 1.0, 2.5):
        kl_ref = kl_divergence(ref, iso(s))
        torch.testing.assert_close(d.kl_to_isotropic(s), kl_ref)
        prior = dist.Normal(torch.zeros((), dtype=DT), s).expand([M_ROWS, N_COLS]).to_event(2)
        torch.testing.assert_close(kl_divergence(d, prior), kl_ref)
        # closed form from SPECS 5b.3
        m, n = M_ROWS, N_COLS
        U, V = d.row_covariance, d.col_covariance
        f = 0.5 * (
            U.trace() * V.trace() / s**2
            + d.loc.pow(2).sum() / s**2
            - m * n
            + m * n * math.log(s**2)
            - n * torch.logdet(U)
            - m * torch.logdet(V)
        )
        torch.testing.assert_close(d.kl_to_isotropic(s), f)


def test_mn_batched_matches_loop():
    d = MatrixNormal(
        torch.randn(2, 3, M_ROWS, N_COLS, dtype=DT), rand_tril(M_ROWS, 3), rand_tril(N_COLS, 2, 1)
    )
    assert d.batch_shape == (2, 3) and d.event_shape == (M_ROWS, N_COLS)
    X = d.sample((4,))
    assert X.shape == (4, 2, 3, M_ROWS, N_COLS)
    lp, ent, kl = d.log_prob(X), d.entropy(), d.kl_to_isotropic(0.7)
    for i in range(2):
        for j in range(3):
            dij = MatrixNormal(d.loc[i, j], d.row_scale_tril[i, j], d.col_scale_tril[i, j])
            torch.testing.assert_close(lp[:, i, j], dij.log_prob(X[:, i, j]))
            torch.testing.assert_close(ent[i, j], dij.entropy())
            torch.testing.assert_close(kl[i, j], dij.kl_to_isotropic(0.7))
    e = make_mn().expand([5])
    assert e.batch_shape == (5,) and e.rsample().shape == (5, M_ROWS, N_COLS)


def expected_rel_frob_mc_error(S: torch.Tensor, n: int) -> float:
    """RMS relative Frobenius error of a Gaussian sample covariance from n draws.

    Per entry Var(Ŝ_ab) = (S_aa S_bb + S_ab²)/n, so a diagonal entry has relative error
    sqrt(2/n) (0.45% at n = 10⁵) and E‖Ŝ − S‖_F² = ((tr S)² + ‖S‖_F²)/n.
    """
    return math.sqrt((S.trace() ** 2 + S.pow(2).sum()).item() / n) / S.norm().item()


@pytest.mark.parametrize("kind", ["mn", "ke"])
def test_sample_covariance(kind):
    # Small event (2×3) so the aggregate MC error sqrt(((tr S)² + ‖S‖²)/N)/‖S‖ ≲ sqrt(7/N) ≈ 0.8%
    # stays well under the 2% tolerance (SPECS 5b.2 test) at N = 10⁵.
    n_samp = 100_000
    d = make_mn(2, 3) if kind == "mn" else make_ke(2, 3)
    S = d.to_dense_covariance()
    X = vec(d.rsample((n_samp,)))
    C = torch.cov(X.T)
    rel = ((C - S).norm() / S.norm()).item()
    assert expected_rel_frob_mc_error(S, n_samp) < 0.01
    assert rel < 0.02, rel
    torch.testing.assert_close(X.mean(0), vec(d.mean), atol=0.05, rtol=0)


def test_mn_gradcheck():
    torch.manual_seed(0)
    m, n = 2, 3
    loc = torch.randn(m, n, dtype=DT, requires_grad=True)
    Lu = rand_tril(m).requires_grad_()
    Lv = rand_tril(n).requires_grad_()
    X = torch.randn(m, n, dtype=DT, requires_grad=True)

    def lp(loc, Lu, Lv, X):
        return MatrixNormal(loc, Lu.tril(), Lv.tril(), validate_args=False).log_prob(X)

    def rs(loc, Lu, Lv):
        torch.manual_seed(123)
        return MatrixNormal(loc, Lu.tril(), Lv.tril(), validate_args=False).rsample((2,))

    assert torch.autograd.gradcheck(lp, (loc, Lu, Lv, X))
    assert torch.autograd.gradcheck(rs, (loc, Lu, Lv))

    def ke_lp(loc, P, X):
        return KronEigenNormal(loc, QA, QG, P, validate_args=False).log_prob(X)

    QA, QG = rand_orth(n), rand_orth(m)
    P = (torch.rand(m, n, dtype=DT) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(ke_lp, (loc, P, X))


# --------------------------------------------------------------------------- KronEigenNormal
def test_ke_matches_dense():
    d = make_ke()
    ref = dense_ke(d)
    X = torch.randn(6, M_ROWS, N_COLS, dtype=DT)
    torch.testing.assert_close(d.log_prob(X), ref.log_prob(vec(X)))
    torch.testing.assert_close(d.entropy(), ref.entropy())
    torch.testing.assert_close(d.to_dense_precision(), ref.precision_matrix)
    torch.testing.assert_close(d.to_dense_covariance(), ref.covariance_matrix)
    # row-major ordering: precision (Q_G ⊗ Q_A) diag(P.reshape(-1)) (Q_G ⊗ Q_A)ᵀ
    Qr = torch.kron(d.eigvecs_out, d.eigvecs_in)
    torch.testing.assert_close(
        d.to_dense_precision(row_major=True), Qr @ torch.diag(d.precision_eig.reshape(-1)) @ Qr.T
    )
    torch.testing.assert_close(vec(d.variance), ref.covariance_matrix.diagonal())
    for s in (0.5, 2.0):
        torch.testing.assert_close(d.kl_to_isotropic(s), kl_divergence(ref, iso(s)))
        prior = dist.Normal(torch.zeros((), dtype=DT), s).expand([M_ROWS, N_COLS]).to_event(2)
        torch.testing.assert_close(kl_divergence(d, prior), kl_divergence(ref, iso(s)))


def test_ke_precondition_is_dense_solve():
    d = make_ke()
    g = torch.randn(M_ROWS, N_COLS, dtype=DT)
    ref = torch.linalg.solve(dense_ke(d).precision_matrix, vec(g))
    torch.testing.assert_close(vec(d.precondition(g)), ref)


def test_ke_from_factors_exact():
    A, G = rand_psd(N_COLS), rand_psd(M_ROWS)
    N, pp = 50.0, 0.3
    d = KronEigenNormal.from_factors(torch.zeros(M_ROWS, N_COLS, dtype=DT), A, G, N, pp)
    dense = N * torch.kron(A, G) + pp * torch.eye(M_ROWS * N_COLS, dtype=DT)
    torch.testing.assert_close(d.to_dense_precision(), dense)
    # SPECS 5b.2 step 5: λ · precondition = (A ⊗ G + δ I)⁻¹ Δ with δ = pp / N
    g = torch.randn(M_ROWS, N_COLS, dtype=DT)
    delta = pp / N
    ref = torch.linalg.solve(torch.kron(A, G) + delta * torch.eye(12, dtype=DT), vec(g))
    torch.testing.assert_close(vec(N * d.precondition(g)), ref)


def test_ke_from_factors_factored_is_matrix_normal():
    A, G = rand_psd(N_COLS), 5.0 * rand_psd(M_ROWS)
    N, pp = 40.0, 0.8
    loc = torch.randn(M_ROWS, N_COLS, dtype=DT)
    d = KronEigenNormal.from_factors(loc, A, G, N, pp, damping="factored")
    delta = pp / N
    pi = math.sqrt((A.trace() / N_COLS) / (G.trace() / M_ROWS))
    I_m, I_n = torch.eye(M_ROWS, dtype=DT), torch.eye(N_COLS, dtype=DT)
    U = torch.linalg.inv(N * (G + math.sqrt(delta) / pi * I_m))
    V = torch.linalg.inv(A + pi * math.sqrt(delta) * I_n)
    torch.testing.assert_close(d.to_dense_covariance(), torch.kron(V, U))
    mn = MatrixNormal(loc, torch.linalg.cholesky(U), torch.linalg.cholesky(V))
    X = torch.randn(3, M_ROWS, N_COLS, dtype=DT)
    torch.testing.assert_close(d.log_prob(X), mn.log_prob(X))
    with pytest.raises(ValueError):
        KronEigenNormal.from_factors(loc, A, G, N, pp, damping="bogus")


def test_ke_batched():
    d = make_ke(M_ROWS, N_COLS, 2)
    X = d.rsample((3,))
    assert X.shape == (3, 2, M_ROWS, N_COLS)
    lp = d.log_prob(X)
    for i in range(2):
        di = KronEigenNormal(d.loc[i], d.eigvecs_in[i], d.eigvecs_out[i], d.precision_eig[i])
        torch.testing.assert_close(lp[:, i], di.log_prob(X[:, i]))
    assert d.expand([4, 2]).sample().shape == (4, 2, M_ROWS, N_COLS)


# --------------------------------------------------------------------------- KL registrations
@pytest.mark.parametrize("q_kind", ["mn", "ke"])
@pytest.mark.parametrize("p_kind", ["mn", "ke", "diag"])
def test_kl_pairs_match_dense(q_kind, p_kind):
    q = make_mn() if q_kind == "mn" else make_ke()
    q_ref = dense_mn(q) if q_kind == "mn" else dense_ke(q)
    if p_kind == "diag":
        loc, scale = (
            torch.randn(M_ROWS, N_COLS, dtype=DT),
            torch.rand(M_ROWS, N_COLS, dtype=DT) + 0.3,
        )
        p = dist.Normal(loc, scale).to_event(2)
        p_ref = MultivariateNormal(vec(loc), covariance_matrix=torch.diag(vec(scale) ** 2))
    else:
        p = make_mn() if p_kind == "mn" else make_ke()
        p_ref = dense_mn(p) if p_kind == "mn" else dense_ke(p)
    torch.testing.assert_close(kl_divergence(q, p), kl_divergence(q_ref, p_ref))
    torch.testing.assert_close(kl_divergence(q, q), torch.zeros((), dtype=DT), atol=1e-10, rtol=0)


def test_kl_to_unsupported_independent_raises():
    q = make_mn()
    p = dist.Normal(torch.zeros(M_ROWS * N_COLS, dtype=DT), 1.0).to_event(1)
    with pytest.raises(NotImplementedError):
        kl_divergence(q, p)


# --------------------------------------------------------------------------- Pyro integration
@pytest.mark.parametrize("kind", ["mn", "ke"])
def test_pyro_trace_log_prob_sum(kind):
    d = make_mn() if kind == "mn" else make_ke()

    def model():
        return pyro.sample("w", d)

    tr = pyro.poutine.trace(model).get_trace()
    w = tr.nodes["w"]["value"]
    assert w.shape == (M_ROWS, N_COLS)
    torch.testing.assert_close(tr.log_prob_sum(), d.log_prob(w))

    batched = d.expand([3])

    def model_plate():
        with pyro.plate("layers", 3):
            return pyro.sample("w", batched)

    tr = pyro.poutine.trace(model_plate).get_trace()
    w = tr.nodes["w"]["value"]
    assert w.shape == (3, M_ROWS, N_COLS)
    torch.testing.assert_close(tr.log_prob_sum(), d.log_prob(w).sum())
    ev = batched.to_event(1)
    assert ev.event_shape == (3, M_ROWS, N_COLS)
    torch.testing.assert_close(ev.log_prob(w), d.log_prob(w).sum())


@pytest.mark.parametrize("kind", ["mn", "ke"])
def test_pyro_mean_field_elbo_uses_closed_form_kl(kind):
    q = make_mn() if kind == "mn" else make_ke()
    s = 0.8

    def model():
        pyro.sample(
            "w", dist.Normal(torch.zeros((), dtype=DT), s).expand([M_ROWS, N_COLS]).to_event(2)
        )

    def guide():
        pyro.sample("w", q)

    loss = TraceMeanField_ELBO().loss(model, guide)
    assert abs(loss - q.kl_to_isotropic(s).item()) < 1e-10
    # Trace_ELBO (Monte Carlo) also runs with reparameterised gradients
    elbo = Trace_ELBO(num_particles=2)
    assert math.isfinite(elbo.loss(model, guide))
