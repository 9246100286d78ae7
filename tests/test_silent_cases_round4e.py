"""Silent failure cases, round 4e: calibration arguments, family names, batch sizes, PSIS inputs
and the matrix-variate distributions' arguments (each test fails without its fix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyrobayes as pb
from pyrobayes.batch import batch_size
from pyrobayes.calibration import apply_temperature, fit_temperature, pooled, set_temperature
from pyrobayes.diagnostics.psis import importance_ess, pareto_khat, psis_smooth, psis_tail_length
from pyrobayes.distributions import KronEigenNormal, MatrixNormal
from pyrobayes.models import LoRAXS
from pyrobayes.registry import get_guide_class
from tests.common import mlp_problem, tensor_loader


@pytest.fixture(scope="module")
def fitted_map():
    """A small classifier, its fitted MAP guide and a loader of its 64 examples."""
    problem = mlp_problem([4, 8, 3], LoRAXS(rank=2, target_modules=["0", "2"]), num_data=64, seed=0)
    loader = tensor_loader(problem.x, problem.y, 16)
    guide = pb.posterior(problem.model, "map")
    pb.fit(problem.model, guide, loader, epochs=1)
    return problem.model, guide, loader


@pytest.mark.parametrize("bounds", [(0.1, 1.0, 3.0), 1.0, "ab", (0.1,)])
def test_bounds_that_are_not_a_pair_are_named(fitted_map, bounds):
    # before: "too many values to unpack", "'float' object is not iterable", "could not
    # convert string to float": none named bounds
    model, guide, loader = fitted_map
    with pytest.raises(TypeError, match=r"calibrate: bounds must be two finite numbers"):
        pb.calibrate(model, guide, loader, bounds=bounds)
    prediction = pb.predict(model, guide, loader)
    with pytest.raises(TypeError, match=r"fit_temperature: bounds must be two finite numbers"):
        fit_temperature(prediction, bounds=bounds)


def test_a_two_element_tensor_is_still_taken_as_bounds(fitted_map):
    model, guide, loader = fitted_map
    prediction = pb.predict(model, guide, loader)
    value = fit_temperature(prediction, bounds=torch.tensor([0.1, 10.0]))
    assert value == fit_temperature(prediction, bounds=(0.1, 10.0))


def test_calibrate_with_model_and_guide_swapped_says_so(fitted_map):
    # before: AttributeError "'DeltaGuide' object has no attribute 'label_key'" from predict
    model, guide, loader = fitted_map
    with pytest.raises(TypeError, match=r"calibrate: the arguments are the other way round"):
        pb.calibrate(guide, model, loader)


def test_predict_and_diagnose_with_model_and_guide_swapped_say_so(fitted_map):
    # before: the same AttributeError on 'label_key' from inside predict
    model, guide, loader = fitted_map
    with pytest.raises(
        TypeError,
        match=r"predict: the arguments are the other way round.*"
        r"pyrobayes\.predict\(model, guide, data\)",
    ):
        pb.predict(guide, model, loader)
    with pytest.raises(TypeError, match=r"diagnose: the arguments are the other way round"):
        pb.diagnose(guide, model, loader)
    with pytest.raises(TypeError, match=r"to_datatree: the arguments are the other way round"):
        pb.to_inference_data(guide, model, loader)


@pytest.mark.parametrize("flag", ["no", "False", 0, None])
def test_set_temperature_refuses_a_pool_that_is_not_a_bool(fitted_map, flag):
    # before: pool="no" (truthy) stored the pooled form in silence, 0 / None the per-draw one
    _, guide, _ = fitted_map
    set_temperature(guide, None)
    with pytest.raises(TypeError, match=r"set_temperature: pool must be True or False"):
        set_temperature(guide, 2.0, pool=flag)
    assert pb.calibration.temperature(guide) == 1.0 and not pooled(guide)


def test_apply_temperature_refuses_a_pool_that_is_not_a_bool(fitted_map):
    model, guide, loader = fitted_map
    set_temperature(guide, None)
    prediction = pb.predict(model, guide, loader)
    with pytest.raises(TypeError, match=r"apply_temperature: pool must be True or False"):
        apply_temperature(prediction, 2.0, pool="False")
    assert apply_temperature(prediction, 2.0, pool=False).log_probs.shape[0] == 1


def test_an_unknown_family_suggests_the_closest_registered_name():
    with pytest.raises(ValueError, match=r"Did you mean 'meanfield'"):
        get_guide_class("meanfeild")
    with pytest.raises(ValueError, match=r"Did you mean 'laplace'\?"):
        get_guide_class("Laplce")
    with pytest.raises(ValueError, match=r"Unknown posterior family 'xyz'\. Available"):
        get_guide_class("xyz")  # nothing close: no suggestion


def test_a_0_dim_or_empty_input_names_what_the_batch_lacks(fitted_map):
    # before: IndexError "tuple index out of range" from inside predict
    model, guide, _ = fitted_map
    with pytest.raises(TypeError, match=r"0-dim tensor.*leading batch dim"):
        batch_size(torch.tensor(0.5))
    with pytest.raises(TypeError, match=r"empty tuple"):
        batch_size(())
    with pytest.raises(TypeError, match=r"0-dim tensor"):
        pb.predict(model, guide, [(torch.tensor(0.5), torch.tensor([1]))])


def test_psis_refuses_an_infinite_r_eff_instead_of_reporting_an_infinite_khat():
    # before: r_eff=inf left a tail of no draws and k-hat = inf, an "unreliable" verdict
    log_ratios = torch.randn(200, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"r_eff must be a finite number > 0"):
        pareto_khat(log_ratios, r_eff=float("inf"))
    with pytest.raises(ValueError, match=r"r_eff must be a finite number > 0"):
        psis_smooth(log_ratios, r_eff=float("inf"))
    with pytest.raises(TypeError, match=r"r_eff must be a finite number > 0"):
        pareto_khat(log_ratios, r_eff="1")
    assert np.isfinite(pareto_khat(log_ratios, r_eff=np.float64(0.5)))


def test_psis_refuses_complex_log_ratios_and_fractional_draw_counts():
    # before: the imaginary part was dropped (NumPy's ComplexWarning), and 10.5 draws passed
    with pytest.raises(TypeError, match=r"log_weights must be real"):
        importance_ess(np.array([1 + 1j, 2.0]))
    with pytest.raises(TypeError, match=r"log_ratios must be real"):
        pareto_khat(torch.randn(50, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"num_draws must be an integer"):
        psis_tail_length(10.5)
    assert psis_tail_length(np.int64(100)) == 20


@pytest.mark.parametrize("scale", [-2.0, 0.0, float("nan")])
def test_kl_to_isotropic_refuses_a_prior_scale_that_is_not_positive(scale):
    # before: -2 gave the KL to a prior of scale 2; 0 and NaN gave NaN
    loc = torch.zeros(3, 2)
    mn = MatrixNormal(loc, torch.eye(3), torch.eye(2))
    ke = KronEigenNormal(loc, torch.eye(2), torch.eye(3), torch.ones(3, 2))
    for dist, name in ((mn, "MatrixNormal"), (ke, "KronEigenNormal")):
        with pytest.raises(ValueError, match=rf"{name}\.kl_to_isotropic: prior_scale must be"):
            dist.kl_to_isotropic(scale)
        assert torch.isfinite(dist.kl_to_isotropic(torch.tensor(2.0)))


def test_from_factors_refuses_an_asymmetric_factor():
    # before: eigh read the lower triangle of [[1, 5], [0, 1]], the identity, in silence
    loc = torch.zeros(3, 2)
    A = torch.tensor([[1.0, 5.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match=r"from_factors: A must be symmetric"):
        KronEigenNormal.from_factors(loc, A, torch.eye(3), 10, 1.0)
    with pytest.raises(ValueError, match=r"from_factors: G must end in \(3, 3\)"):
        KronEigenNormal.from_factors(loc, torch.eye(2), torch.eye(2), 10, 1.0)
    noisy = torch.eye(2) + 1e-7 * torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # round-off passes
    assert KronEigenNormal.from_factors(loc, noisy, torch.eye(3), 10, 1.0).batch_shape == ()


def test_from_factors_refuses_a_negative_prior_precision_or_data_count():
    # before: prior_precision=-1 lowered every precision in silence (P = 10·1 - 1 = 9)
    loc = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"from_factors: prior_precision must be finite and >= 0"):
        KronEigenNormal.from_factors(loc, torch.eye(2), torch.eye(3), 10, -1.0)
    with pytest.raises(ValueError, match=r"from_factors: num_data must be a finite number > 0"):
        KronEigenNormal.from_factors(loc, torch.eye(2), torch.eye(3), 0, 1.0, damping="factored")
    exact = KronEigenNormal.from_factors(loc, torch.eye(2), torch.eye(3), 0, 1.0)
    assert torch.equal(exact.precision_eig, torch.ones(3, 2))  # λ = 0: the prior itself
