"""The public step API (``pb.infer.Fitter``) and the written guide contract (protocols)."""

from __future__ import annotations

import copy
import math
import warnings

import pyro
import pytest
import torch

import pyrobayes as pb
from pyrobayes.contract import AnalyticKL, Mixture, OnlineNewton, Posterior, PostHoc
from pyrobayes.infer.schedule import make_scheduler
from pyrobayes.models import LoRAXS
from pyrobayes.registry import _REGISTRY
from tests import families
from tests.common import mlp_problem, split_batches

FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})


def _problem(seed: int = 0, family: str | None = None):
    prob = mlp_problem(
        (5, 8, 3),
        LoRAXS(rank=2, target_modules=["0"]),
        num_data=48,
        trainable_modules=["2"],
        seed=seed,
        data_seed=seed,
        family=family,
    )
    return prob.model, split_batches(prob.x, prob.y, 16)


def _state(model, guide):
    return {
        **{f"g.{k}": v.detach().clone() for k, v in guide.state_dict().items()},
        **{f"m.{k}": p.detach().clone() for k, p in model.point_params.items()},
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hand_written_loop_over_the_fitter_is_fit(family):
    """pb.fit is a loop over the public step API: the same calls give the same posterior."""
    pyro.clear_param_store()
    model, data = _problem(family=family)
    guide = families.posterior(model, family)
    result = pb.fit(model, guide, data, epochs=3, lr=1e-2, seed=5)
    fitted = _state(model, guide)

    pyro.clear_param_store()
    model_b, data_b = _problem(family=family)
    guide_b = families.posterior(model_b, family)
    pyro.set_rng_seed(5)
    fitter = pb.infer.make_fitter(model_b, guide_b, lr=1e-2)
    assert isinstance(fitter, pb.infer.FITTERS[guide_b.default_fitter])
    model_b.train(True)
    fitter.begin(data_b)
    # the family's learning-rate schedule over the run's 9 steps (IVON's cosine after its
    # warm-up; else none)
    sched = make_scheduler(fitter.default_scheduler, fitter.optimizer, 9, fitter.default_warmup)
    losses = []
    for epoch in range(3):
        for batch in data_b:
            losses.append(fitter.step(batch))
            if sched is not None:
                sched.step()
        fitter.epoch_end(epoch)
    fitter.end(data_b)
    assert fitter.num_steps == len(losses) == 9
    assert torch.equal(torch.tensor(losses), result.losses)
    assert result.state["fitter"] == type(fitter).__name__
    looped = _state(model_b, guide_b)
    assert looped.keys() == fitted.keys()
    for key, value in fitted.items():
        assert torch.equal(looped[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_satisfies_the_contract(family):
    pyro.clear_param_store()
    model, _ = _problem(family=family)
    guide = families.posterior(model, family)
    assert isinstance(guide, Posterior)
    assert guide.family == family
    assert guide.default_fitter in pb.infer.FITTERS
    # the optional capabilities, as each family declares them
    expected = {
        "meanfield": {AnalyticKL},
        "ivon": {AnalyticKL, OnlineNewton},
        "kron-ivon": {AnalyticKL, OnlineNewton},
        "swag": {PostHoc},
        "laplace": {PostHoc},
        "map": set(),
        "symmetrized": {AnalyticKL},  # the mean-field base's, passed through
        "ibdr": {Mixture},
        "signorm": {Mixture},
    }
    has = {p for p in (AnalyticKL, PostHoc, OnlineNewton, Mixture) if isinstance(guide, p)}
    assert has == expected.get(family, has), family


def test_fitter_state_dict_round_trip_continues_the_trajectory():
    """A fitter rebuilt from state_dict (plus the guide's state) takes the same next steps."""
    pyro.clear_param_store()
    model, data = _problem()
    guide = pb.posterior(model, "meanfield")
    fitter = pb.infer.make_fitter(model, guide, lr=0.05)
    model.train(True)
    for batch in data:
        fitter.step(batch)
    saved_guide = {k: v.clone() for k, v in guide.state_dict().items()}
    saved_head = {k: p.detach().clone() for k, p in model.point_params.items()}
    saved_fitter = copy.deepcopy(fitter.state_dict())
    torch.manual_seed(7)
    expected = [fitter.step(b) for b in data]
    guide.load_state_dict(saved_guide)
    with torch.no_grad():
        for k, p in model.point_params.items():
            p.copy_(saved_head[k])
    fresh = pb.infer.make_fitter(model, guide, lr=0.05)
    fresh.load_state_dict(saved_fitter)
    assert fresh.num_steps == len(data)
    torch.manual_seed(7)
    assert [fresh.step(b) for b in data] == expected


def test_a_non_finite_loss_raises_before_the_update():
    pyro.clear_param_store()
    model, data = _problem()
    guide = pb.posterior(model, "meanfield")
    elbo = pb.infer.ELBO()

    class Diverged:  # finite data, a loss gone NaN (NaN data is refused earlier, as a data error)
        def loss(self, model, guide, batch):
            return elbo.loss(model, guide, batch) * float("nan")

    fitter = pb.infer.make_fitter(model, guide, loss=Diverged())
    before = _state(model, guide)
    with pytest.raises(FloatingPointError, match="not updated"):
        fitter.step(data[0])
    assert fitter.num_steps == 0
    for key, value in _state(model, guide).items():
        assert torch.equal(value, before[key]), key


def test_bad_fitter_requests_are_refused_by_name():
    pyro.clear_param_store()
    model, _ = _problem()
    guide = pb.posterior(model, "meanfield")
    with pytest.raises(KeyError, match="'svi' is already registered"):
        pb.infer.register_fitter("svi", type("Other", (pb.infer.Fitter,), {}))
    with pytest.raises(TypeError, match="optimizer must be"):
        pb.infer.make_fitter(model, guide, optimizer=3)

    class Unfitted(pb.guides.MeanFieldGuide):
        default_fitter = "no-such-fitter"

    with pytest.raises(ValueError, match="'no-such-fitter' is not a registered fitter"):
        pb.infer.make_fitter(model, Unfitted(model))
    bare = pb.guides.MeanFieldGuide(lambda: None)  # a plain Pyro model: no sites until traced
    with pytest.raises(RuntimeError, match="no sites yet"):
        pb.infer.make_fitter(model, bare)


def test_config_records_the_constructor_options():
    """config() holds what the user passed (and rebuilds the same guide) without re-passing."""
    pyro.clear_param_store()
    model, _ = _problem()
    guide = pb.guides.SWAGGuide(model, rank=3, scale=2.0)
    # the collection schedule and the optimizer are the fit's (pb.infer.SWAG), not saved with q
    assert guide.config() == {"rank": 3, "scale": 2.0}
    rebuilt = pb.guides.SWAGGuide(model, **guide.config())
    assert rebuilt.config() == guide.config()
    lap = pb.guides.LaplaceGuide(model, structure="diag")
    # the τ search's bounds are the fit's (pb.infer.Laplace), not saved with q
    assert lap.config()["structure"] == "diag" and "log_prior_bounds" not in lap.config()


def _head_problem():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = pb.models.FineTuneModel(
        net, LoRAXS(rank=2, target_modules=["0"]), num_data=40, trainable_modules=["2"]
    )
    return model, pb.posterior(model, "map")


def test_an_optimizer_passed_must_step_every_trained_parameter_and_keeps_its_rate():
    # an instance over the guide alone left the trained head fixed, and one over other
    # parameters trained nothing, both without a word; an lr beside one was dropped silently
    model, guide = _head_problem()
    partial = torch.optim.Adam(guide.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"does not hold 2 of the 3 .*'model.net.2.weight'"):
        pb.infer.make_fitter(model, guide, optimizer=partial)
    params = pb.infer.trainable_parameters(model, guide)
    with pytest.warns(UserWarning, match=r"lr=0.5 is not used: .*lr=0.001"):
        fitter = pb.infer.make_fitter(
            model, guide, lr=0.5, optimizer=torch.optim.Adam(params, lr=1e-3)
        )
    assert fitter.lr == 1e-3  # what the optimizer steps at (and a checkpoint records)
    with pytest.warns(UserWarning, match="lr=0.5 is not used"):
        fitter = pb.infer.make_fitter(
            model, guide, lr=0.5, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4)
        )
    assert fitter.lr == 1e-4
    fitter = pb.infer.make_fitter(model, guide, optimizer=torch.optim.SGD(params, lr=0.2))
    assert fitter.lr == 0.2  # no lr given: nothing to warn about


def test_a_fit_at_rate_zero_says_nothing_moves():
    model, guide = _head_problem()
    data = [(torch.randn(20, 4), torch.randint(0, 3, (20,))) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"learning rate is 0"):
        pb.fit(model, guide, data, epochs=1, lr=0)
    with warnings.catch_warnings():  # a warm-up starts at rate 0 by design: silent
        warnings.simplefilter("error")
        pb.fit(model, guide, data, epochs=2, optim=pb.Optimization(scheduler="cosine", warmup=0.5))


def test_a_scheduler_over_another_optimizer_is_refused():
    model, guide = _head_problem()
    data = [(torch.randn(20, 4), torch.randint(0, 3, (20,)))]
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    optim = pb.Optimization(
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(other, lambda s: 0.5)
    )
    with pytest.raises(ValueError, match="scheduler over another optimizer"):
        pb.fit(model, guide, data, epochs=1, optim=optim)


def test_validation_that_no_epoch_end_reaches_is_told():
    # num_steps inside the first epoch: validation, selection and patience never ran, silently
    model, guide = _head_problem()
    data = [(torch.randn(10, 4), torch.randint(0, 3, (10,))) for _ in range(4)]
    val = pb.Validation(data[:1], patience=1)
    with pytest.warns(UserWarning, match=r"num_steps=2 ends the fit inside its first epoch"):
        result = pb.fit(
            model, guide, data, epochs=5, optim=pb.Optimization(num_steps=2), validation=val
        )
    # what the warning is about: no epoch scored, none selected
    assert result.state["validation"] == [] and result.state["best_epoch"] is None


#: the families whose end() fixes the posterior at the current parameters: a step after it
#: would leave the curvature / moments / factor hooks behind (begin() re-opens the first two)
ENDS_THE_FIT = {"laplace": True, "swag": True, "kron-ivon": False}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_after_end_is_refused_where_end_fixed_the_posterior(family):
    pyro.clear_param_store()
    model, data = _problem(family=family)
    guide = families.posterior(model, family)
    fitter = pb.infer.make_fitter(model, guide, lr=1e-2)
    model.train(True)
    fitter.begin(data)
    for batch in data:
        fitter.step(batch)
    fitter.epoch_end(0)
    fitter.end(data)
    if family not in ENDS_THE_FIT:  # an SVI-type fit trains on after end()
        fitter.step(data[0])
        return
    before = _state(model, guide)
    with pytest.raises(RuntimeError, match=r"step\(\) after end\(\)"):
        fitter.step(data[0])
    after = _state(model, guide)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing moved
    if ENDS_THE_FIT[family]:  # begin() starts a new fit, whose steps are taken
        fitter.begin(data)
        with warnings.catch_warnings():  # SWAG's new collection discards the old (warned)
            warnings.filterwarnings("ignore", "SWAGFitter: the SWAGGuide held")
            assert math.isfinite(fitter.step(data[0]))
    else:
        fitter.begin(data)
        with pytest.raises(RuntimeError, match="make a new fitter"):
            fitter.step(data[0])


def test_an_ivon_record_lr_beside_the_fit_lr_warns_and_is_the_fitters_rate():
    """``optimizer=pb.infer.IVON(lr=a)`` sets the rate; an lr given to the fit beside it is not
    used: a warning says so, and fitter.lr (so the checkpoint's record) reads the record's."""
    pyro.clear_param_store()
    model, _ = _problem(family="ivon")
    guide = pb.posterior(model, "ivon")
    with pytest.warns(UserWarning, match=r"lr=0.2 is not used: IVON\(lr=0.05\)") as caught:
        fitter = pb.infer.make_fitter(model, guide, lr=0.2, optimizer=pb.infer.IVON(lr=0.05))
    assert caught[0].filename == __file__  # it points at the line that passed both
    assert fitter.lr == 0.05
    assert fitter.optimizer.param_groups[0]["lr"] == 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same rate twice, or the record's alone: no warning
        assert pb.infer.make_fitter(model, guide, optimizer=pb.infer.IVON(lr=0.05)).lr == 0.05
        pb.infer.make_fitter(model, guide, lr=0.05, optimizer=pb.infer.IVON(lr=0.05))


def test_flag_non_finite_flags_inf_and_nan_only_on_both_paths():
    """The fused check (dense tensors of one device) and its fallback (a sparse tensor, which
    the fused kernel refuses) flag an inf or a NaN and nothing else: entries of 3e38 whose sum
    overflows float32 are finite, so not flagged."""
    from pyrobayes.infer.fitter import flag_non_finite

    huge = torch.full((4,), 3e38, dtype=torch.float32)
    for bad in (float("inf"), float("nan")):
        spoiled = huge.clone()
        spoiled[2] = bad
        for tensors in ([huge, spoiled], [huge, spoiled.to_sparse()]):
            found = flag_non_finite(tensors, torch.zeros(1), torch.ones(1))
            assert float(found) != 0.0, (bad, tensors[1].layout)
    for tensors in ([huge, huge], [huge, huge.to_sparse()]):
        assert float(flag_non_finite(tensors, torch.zeros(1), torch.ones(1))) == 0.0
