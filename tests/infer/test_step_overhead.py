"""The fit step's hot path: the same numbers as the plain formulas, few operations beyond them,
and checks that stay (issue 29: ``pb.fit``'s step within 1.05x a ``functional_call`` step)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyro
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pyrobayes as pb
from pyrobayes.infer.objectives import split_training_batch
from pyrobayes.models import LoRAXS
from tests.common import mlp_problem, split_batches


def _problem(likelihood: str = "categorical", family: str = "meanfield"):
    prob = mlp_problem(
        (5, 8, 3),
        LoRAXS(rank=2, target_modules=["0"]),
        num_data=48,
        trainable_modules=["2"],
        seed=0,
        data_seed=0,
        likelihood=likelihood,
    )
    pyro.clear_param_store()
    guide = pb.posterior(prob.model, family)
    return prob.model, guide, split_batches(prob.x, prob.y, 16)


def _grads(model, guide) -> list[torch.Tensor]:
    params = pb.infer.trainable_parameters(model, guide)
    return [p.grad.clone() for p in params]


def _plain_nll(model, values, batch) -> torch.Tensor:
    """``−(N/B) Σ_b mean_s log p(y_b | θ_s)`` written out: the formula the objectives compute."""
    x, y = batch
    log_lik = model.log_likelihood(model.batched_output(x, values), y)
    return -((model.num_data / x.shape[0]) * log_lik.mean(0).sum())


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
@pytest.mark.parametrize("particles", [1, 3])
def test_the_elbo_is_the_plain_formula_bit_for_bit(likelihood, particles):
    """One draw sums directly and the sign rides on the N/B scale: the loss, its terms and every
    gradient are the plain formula's bits (rounding to nearest is symmetric, and the mean over
    one draw is that draw), so resumed and uninterrupted fits stay bit-identical."""
    model, guide, data = _problem(likelihood)
    model.train(True)
    elbo = pb.infer.ELBO(num_particles=particles)
    for batch in data:
        torch.manual_seed(1)
        values, kl = guide.rsample_with_kl(particles, model)
        plain = _plain_nll(model, values, batch) + kl
        plain.backward()
        expected = _grads(model, guide)
        model.zero_grad(set_to_none=True)
        guide.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = elbo.loss(model, guide, batch)
        loss.backward()
        assert torch.equal(loss, plain)
        for got, want in zip(_grads(model, guide), expected, strict=True):
            assert torch.equal(got, want)
        terms = elbo.terms()
        assert torch.equal(terms["kl"], kl.detach() / model.num_data)
        guide.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)


def test_map_is_the_plain_formula_bit_for_bit():
    model, guide, data = _problem(family="map")
    model.train(True)
    objective = pb.infer.MAP()
    for batch in data:
        values = guide.rsample(1)
        plain = _plain_nll(model, values, batch) - model.log_prior(values).sum()
        assert torch.equal(objective.loss(model, guide, batch), plain)


def test_a_non_finite_gradient_is_refused_and_the_next_step_is_free():
    """The gradient check keeps its flag between steps: after a refused step (nothing updated),
    a finite step updates as usual."""
    model, guide, data = _problem()
    fitter = pb.infer.make_fitter(model, guide, lr=1e-2)
    model.train(True)
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    poison = [True]

    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if poison[0]:
            out.register_hook(lambda g: g * float("nan"))
        return out

    handle = model.net[0].register_forward_hook(hook)
    try:
        with pytest.raises(FloatingPointError, match="Non-finite gradient"):
            fitter.step(data[0])
        for k, v in guide.state_dict().items():
            assert torch.equal(v, before[k]), k
        poison[0] = False
        value = fitter.step(data[0])
    finally:
        handle.remove()
    assert torch.isfinite(torch.tensor(value)) and fitter.num_steps == 1
    assert any(not torch.equal(v, before[k]) for k, v in guide.state_dict().items())


class _CountOps(TorchDispatchMode):
    """Counts the aten operations dispatched while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _count(fn) -> Counter[str]:
    with _CountOps() as counter:
        fn()
    return counter.ops


def test_the_fitter_adds_one_fused_gradient_check_to_a_plain_step():
    """Fitter.step against the same objective, backward and optimizer step written by hand:
    the only operations it adds are the fused non-finite check over all gradients and reading
    its flag (no per-parameter checks, no per-step allocations). Both sides read the loss."""
    model, guide, data = _problem()
    model.train(True)
    fitter = pb.infer.make_fitter(model, guide, lr=1e-2)
    optim, objective = fitter.optimizer, fitter.objective
    fitter.step(data[0])  # the optimizer's state and the check's flag exist from here on

    def plain() -> None:
        optim.zero_grad(set_to_none=True)
        loss = objective.loss(model, guide, data[1])
        loss.item()
        loss.backward()
        optim.step()

    plain()
    by_hand = _count(plain)
    fitted = _count(lambda: fitter.step(data[1]))
    extra = fitted - by_hand
    assert by_hand - fitted == Counter()
    check = "_amp_foreach_non_finite_check_and_unscale_"
    assert extra == Counter({check: 1, "_local_scalar_dense": 1}), extra


def test_the_data_check_is_one_sum_per_tensor_and_one_read():
    """split_training_batch's non-finite check: a sum per floating-point tensor, their total
    and one read (integer labels are not summed)."""
    model, _, data = _problem()
    counted = _count(lambda: split_training_batch(model, data[0]))
    assert counted["sum"] == 1  # the inputs; the class labels are integers
    assert sum(counted.values()) <= 3, counted
    gaussian = _problem("gaussian")
    counted = _count(lambda: split_training_batch(gaussian[0], gaussian[2][0]))
    assert counted["sum"] == 2 and counted["add"] == 1 and sum(counted.values()) <= 4, counted
