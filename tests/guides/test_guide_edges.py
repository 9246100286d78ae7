"""Edge cases of guide construction and of the arguments around it.

Options given as NumPy / 0-d tensor scalars, ``posterior(init=...)`` from a never-fitted or
out-of-date guide, identical IBDR particles, IVON's ``beta2 = 1``, Laplace's ``link_samples``
set after a fit, ``calibrate``'s ``pool`` / ``seed``, ``posterior``'s family and model, and
``SymmetrizedELBO``'s ``num_particles``.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.calibration import pooled
from pyrobayes.fitted_head import HeadChangedWarning
from pyrobayes.testing import tiny_problem


def _quiet_fit(model: Any, guide: Any, data: Any, **kwargs: Any) -> Any:
    """``pb.fit`` with its advice (a short fit on a tiny problem) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pb.fit(model, guide, data, progress=False, **kwargs)


# ---------------------------------------------------------------- options as NumPy / tensor scalars
@pytest.mark.parametrize(
    ("family", "options", "expected"),
    [
        ("swag", {"rank": np.int64(3)}, {"rank": 3}),
        ("ibdr", {"num_particles": np.int64(2)}, {"num_particles": 2}),
        ("meanfield", {"init_scale": np.float32(0.02)}, {"init_scale": float(np.float32(0.02))}),
        ("meanfield", {"init_scale": torch.tensor(0.02)}, {"init_scale": 0.02}),
        ("ivon", {"ess": np.float32(24.0)}, {"ess": 24.0}),
        ("laplace", {"prior_precision": np.float32(2.0)}, {"prior_precision": 2.0}),
    ],
)
def test_scalar_options_are_recorded_as_python_numbers(family, options, expected):
    model, _ = tiny_problem()
    guide = pb.posterior(model, family, **options)
    config = guide.config()
    for name, value in expected.items():
        assert type(config[name]) is type(value), name
        assert config[name] == pytest.approx(value), name
    json.dumps(config)  # what every checkpoint and pb.save write
    rebuilt = type(guide)(model, **config)
    assert rebuilt.config() == config


def test_a_guide_built_with_numpy_options_saves_after_its_fit(tmp_path):
    model, data = tiny_problem()
    guide = pb.posterior(model, "meanfield", init_scale=np.float32(0.02))
    _quiet_fit(model, guide, data, epochs=1, checkpoint=pb.Checkpointing(tmp_path / "ckpt"))
    path = pb.save(guide, tmp_path / "posterior.safetensors")
    loaded = pb.load(path, tiny_problem()[0])
    assert loaded.config()["init_scale"] == pytest.approx(0.02)


# ---------------------------------------------------------------- posterior(init=<never fitted>)
def _signorm_problem() -> tuple[Any, Any]:
    return tiny_problem(
        adapter=lambda a: pb.models.SigmaNorm(num_members=2, adapter=a),
        net=lambda n: n.append(nn.LayerNorm(3)),
    )


@pytest.mark.parametrize("post_hoc", ["laplace", "swag"])
def test_init_refuses_never_fitted_particles(post_hoc):
    model, data = tiny_problem()
    particles = pb.posterior(model, "ibdr", num_particles=2)
    with pytest.raises(ValueError, match=r"init=.*IBDRGuide was never fitted.*Fit it first"):
        pb.posterior(model, post_hoc, init=particles)
    _quiet_fit(model, particles, data, epochs=1, seed=0)
    assert pb.posterior(model, post_hoc, init=particles).sites == particles.sites


def test_init_refuses_a_never_fitted_signorm_ensemble():
    model, _ = _signorm_problem()
    members = pb.posterior(model, "signorm")
    with pytest.raises(ValueError, match=r"SigmaNormGuide was never fitted"):
        pb.posterior(model, "laplace", init=members)


# ---------------------------------------------------------------- posterior(init=...) after the head moved
def test_init_warns_when_a_later_fit_moved_the_head():
    model, data = tiny_problem()
    map_guide = pb.posterior(model, "map")
    _quiet_fit(model, map_guide, data, epochs=3, seed=0)
    pb.posterior(model, "laplace", init=map_guide)  # the head is the MAP's: no warning
    swag = pb.posterior(model, "swag", init=map_guide, rank=2)
    _quiet_fit(model, swag, data, epochs=3, lr=0.05, seed=0)  # trains the shared head
    with pytest.warns(HeadChangedWarning, match=r"posterior\(init=...\).*\['4\.bias'") as record:
        pb.posterior(model, "laplace", init=map_guide)
    assert record[0].filename == __file__  # points at the user's line


# ---------------------------------------------------------------- IBDR particles that start identical
def test_ibdr_warns_when_its_particles_start_identical():
    model, _ = tiny_problem()
    with pytest.warns(UserWarning, match=r"init_scale=0 and scale=0 start all 2 particles") as w:
        guide = pb.posterior(model, "ibdr", num_particles=2, init_scale=0.0)
    assert w[0].filename == __file__
    locs = guide.component_locs()
    assert all(torch.equal(v[0], v[1]) for v in locs.values())  # what the warning says
    # one particle, or components with a spread, or any jitter: nothing to warn about
    pb.posterior(model, "ibdr", num_particles=1, init_scale=0.0)
    pb.posterior(model, "ibdr", num_particles=2, init_scale=0.0, scale=0.1)
    pb.posterior(model, "ibdr", num_particles=2, init_scale=1e-3)


# ---------------------------------------------------------------- IVON's β2 ∈ [0, 1)
@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: pb.infer.IVON(beta2=1.0), "beta2"),
        (lambda: pb.infer.IVON(diag_beta2=1.0), "diag_beta2"),
        (lambda: pb.infer.KronIVON(beta2=1.0), "beta2"),
        (lambda: pb.infer.KronIVON(diag_beta2=1.0), "diag_beta2"),
        (lambda: pb.posterior(tiny_problem()[0], "ivon", beta2=1.0), "beta2"),
        (lambda: pb.posterior(tiny_problem()[0], "kron-ivon", diag_beta2=1.0), "diag_beta2"),
    ],
)
def test_ivon_refuses_a_hessian_ema_that_never_moves(build, name):
    # h ← β2 h + (1 − β2) ĥ: at β2 = 1 the curvature, and so every posterior sd, stays at h0
    with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0 and < 1; got 1"):
        build()
    assert pb.infer.KronIVON(beta2=0.99, diag_beta2=0.0).diag_beta2 == 0.0


# ---------------------------------------------------------------- Laplace's link_samples after the fit
@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-3, ValueError), (2.5, TypeError), ("100", TypeError)]
)
def test_laplace_link_samples_set_after_the_fit_is_checked(bad, error, tmp_path):
    model, data = tiny_problem()
    laplace = pb.posterior(model, "laplace", prior_precision=1.0)
    _quiet_fit(model, laplace, data, epochs=1, seed=0)
    with pytest.raises(error, match=r"LaplaceGuide: link_samples must be an integer >= 1"):
        laplace.link_samples = bad
    assert laplace.link_samples == 100  # unchanged
    laplace.link_samples = np.int64(7)
    assert type(laplace.link_samples) is int and laplace.link_samples == 7
    laplace.link_samples = None  # documented: predict's num_samples
    path = pb.save(laplace, tmp_path / "laplace.safetensors")
    assert pb.load(path, tiny_problem()[0]).link_samples is None


# ---------------------------------------------------------------- calibrate's pool / seed
@pytest.fixture(scope="module")
def calibrated_problem():
    torch.manual_seed(0)
    model, data = tiny_problem()
    guide = pb.posterior(model, "meanfield")
    _quiet_fit(model, guide, data, epochs=2, seed=0)
    g = torch.Generator().manual_seed(3)
    val = [(torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g))]
    return model, guide, val


@pytest.mark.parametrize("flag", ["pool", "all_ranks"])
@pytest.mark.parametrize("bad", ["False", "no", None, 0.0, 1])
def test_calibrate_refuses_a_flag_that_is_not_a_bool(calibrated_problem, flag, bad):
    model, guide, val = calibrated_problem
    before = pooled(guide)
    with pytest.raises(TypeError, match=rf"calibrate: {flag} must be True or False; got"):
        pb.calibrate(model, guide, val, num_samples=2, **{flag: bad})
    assert pooled(guide) == before  # nothing stored


def test_calibrate_refuses_a_seed_that_is_not_an_integer(calibrated_problem):
    model, guide, val = calibrated_problem
    with pytest.raises(TypeError, match=r"calibrate: seed must be an integer; got 1\.5"):
        pb.calibrate(model, guide, val, num_samples=2, seed=1.5)
    with pytest.raises(TypeError, match=r"calibrate: seed must be an integer; got '3'"):
        pb.calibrate(model, guide, val, num_samples=2, seed="3")


# ---------------------------------------------------------------- posterior's family and model
@pytest.mark.parametrize("family", [None, 3, pb.guides.MeanFieldGuide])
def test_posterior_refuses_a_family_that_is_not_a_name(family):
    model, _ = tiny_problem()
    with pytest.raises(TypeError, match=r"family must be a registered family name.*'meanfield'"):
        pb.posterior(model, family)


def test_posterior_names_the_class_passed_as_a_family():
    model, _ = tiny_problem()
    with pytest.raises(
        TypeError, match=r"got the class MeanFieldGuide\. .*MeanFieldGuide\(model\)"
    ):
        pb.posterior(model, pb.guides.MeanFieldGuide)


def test_posterior_refuses_the_plain_network():
    model, _ = tiny_problem()
    with pytest.raises(TypeError, match=r"plain torch network \(Sequential\).*FineTuneModel"):
        pb.posterior(model.net, "meanfield")
    # a Pyro model of the user's own is still the guide classes' (traced on its first call)
    guide = pb.posterior(lambda batch: model(batch), "meanfield")
    assert guide.sites == {}
    guide(next(iter(tiny_problem()[1])))
    assert set(guide.sites) == set(model.latent_sites)


# ---------------------------------------------------------------- SymmetrizedELBO's counts
@pytest.mark.parametrize(
    ("build", "name", "error"),
    [
        (lambda: pb.infer.SymmetrizedELBO(num_particles=2.5), "num_particles", TypeError),
        (lambda: pb.infer.SymmetrizedELBO(num_particles=0), "num_particles", ValueError),
        (lambda: pb.infer.SymmetrizedELBO(num_permutations=2.5), "num_permutations", TypeError),
        (lambda: pb.infer.BatchedSymmetrizedELBO(num_particles=2.5), "num_particles", TypeError),
        (
            lambda: pb.infer.BatchedSymmetrizedELBO(num_permutations=0),
            "num_permutations",
            ValueError,
        ),
    ],
)
def test_symmetrized_elbo_refuses_a_count_that_is_not_a_whole_number(build, name, error):
    with pytest.raises(error, match=rf"SymmetrizedELBO: {name} must be an integer >= 1"):
        build()
    objective = pb.infer.SymmetrizedELBO(num_particles=np.int64(2), num_permutations=3)
    assert type(objective.num_particles) is int and objective.num_particles == 2
    assert objective.batched_objective().num_particles == 2


# ---------------------------------------------------------------- the ELBO's and predict's own
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_particles": 2.5}, "num_particles must be an integer"),
        ({"num_particles": True}, "num_particles must be an integer"),
        ({"num_particles": 0}, "num_particles"),
        ({"analytic_kl": "no"}, "analytic_kl must be True or False"),
    ],
)
def test_the_elbo_refuses_counts_and_flags_of_another_type(kwargs, match):
    """ELBO(num_particles=2.5) ran 2 particles, True ran 1 and analytic_kl='no' was truthy."""
    with pytest.raises((TypeError, ValueError), match=match):
        pb.infer.ELBO(**kwargs)


def test_predict_refuses_a_seed_that_is_not_an_integer():
    """predict(seed=1.5) reached torch's bare 'manual_seed expected a long'."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "meanfield")
    _quiet_fit(model, guide, data, epochs=1)
    with pytest.raises(TypeError, match="predict: seed must be an integer"):
        pb.predict(model, guide, data, num_samples=2, seed=1.5)
