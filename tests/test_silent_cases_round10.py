"""Two silent cases: an exception raised inside IVON's update (``pyrobayes/infer/ivon.py``,
``IVONOptimizer._update``) left the optimizer's flat state half a step on, and
``PermutationSpec.check_prior`` summed a half model's prior ``log p`` in its own dtype
(``-inf`` in float16 for a 256 × 256 layer), so ``from_model`` called an invariant prior
"not invariant"."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import pyrobayes as pb
import pyrobayes.infer.ivon as ivon
import pyrobayes.infer.kron as kron
from pyrobayes.infer import make_fitter
from pyrobayes.models import FineTuneModel, PermutationSpec
from pyrobayes.testing import tiny_problem

# ---------------------------------------------------------------- an exception inside the update

T_INV = 4  # step 3 re-decomposes the factors ((3 + 1) % 4 == 0), step 2 only moves their EMA


def _raise_linalg(*args: Any, **kwargs: Any) -> Any:
    raise torch.linalg.LinAlgError("eigh: the algorithm failed to converge (ill-conditioned)")


def _raise_runtime(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the Kronecker mean step failed")


#: ``(step, what raises, the error)``: the re-decomposition's ``eigh`` (after ``ivon_step_`` and
#: the factors' EMA have run), or the Kronecker mean step of a step without re-decomposition.
def _raise_reduce(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the all-reduce of the step's statistics failed (a rank went away)")


_FAILURES = {
    "eigh-at-re-decomposition": (3, (torch.linalg, "eigh"), _raise_linalg),
    "kron-mean-step": (2, (kron, "mean_step_"), _raise_runtime),
    # before the update: the point parameters were left at their perturbed draw and the
    # Kronecker layers' recorded statistics kept until the next step
    "statistics-all-reduce": (2, (ivon, "all_reduce_mean_"), _raise_reduce),
}


def _snapshot(guide: Any, fitter: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the guide (means, ``h``, the factors and their decompositions), of the
    optimizer's state (momentum, ``h`` of the point parameters, μ0) and the point parameters."""
    out = {f"guide.{k}": v.detach().clone() for k, v in guide.state_dict().items()}
    state = fitter.optimizer.state["ivon"]
    out.update({f"state.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    out.update({f"point.{i}": p.detach().clone() for i, p in enumerate(fitter.optimizer.extras)})
    return out


def _assert_same(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """Bit for bit (the undone step must leave no trace, not a rounding error's)."""
    assert after.keys() == before.keys()
    moved = [k for k in before if not torch.equal(after[k], before[k])]
    assert not moved, f"changed by the step that raised: {moved}"


Snapshots = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def _fit(
    failure: str | None, steps: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Snapshots | None]:
    """``steps`` kept steps of a Kronecker IVON fit, each under its own seed; with ``failure``,
    one extra step (another draw) raises inside the update first, at its step. Returns the guide,
    the fitter and the snapshots from before and after the step that raised."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "kron-ivon")
    fitter = make_fitter(model, guide, optimizer=pb.infer.KronIVON(T_inv=T_INV), lr=0.1)
    assert guide.kron_sites and fitter.optimizer.extras  # Kronecker sites and a point head
    check = None
    for step in range(steps):
        if failure is not None and step == _FAILURES[failure][0]:
            _, (where, name), raise_ = _FAILURES[failure]
            before = _snapshot(guide, fitter)
            torch.manual_seed(1000 + step)  # another draw than the kept step's
            with monkeypatch.context() as patch:
                patch.setattr(where, name, raise_)
                with pytest.raises((torch.linalg.LinAlgError, RuntimeError), match="failed"):
                    fitter.step(data[step % len(data)])
            check = (before, _snapshot(guide, fitter))
            assert fitter.num_steps == step
        torch.manual_seed(step)
        fitter.step(data[step % len(data)])
    return guide, fitter, check


@pytest.mark.parametrize("failure", list(_FAILURES))
def test_an_exception_inside_the_update_undoes_the_step(failure, monkeypatch):
    """Before the fix, the step that raised left the optimizer's momentum and ``h`` (of the
    point parameters, measured: up to 1.8e-2 and 2e-5 apart), the point parameters at their
    perturbed draw and, at a re-decomposition step, the factors ``A``, ``G`` moved by their EMA
    (its ``undo`` copies were never put back). Now every tensor is as before that step, and a
    fit that catches the error and goes on is, bit for bit, the fit without it (same seeds, same
    float ops)."""
    steps = 6
    guide, fitter, check = _fit(failure, steps, monkeypatch)
    assert check is not None
    _assert_same(check[1], check[0])
    clean_guide, clean_fitter, _ = _fit(None, steps, monkeypatch)
    _assert_same(_snapshot(guide, fitter), _snapshot(clean_guide, clean_fitter))
    assert fitter.optimizer.state["ivon"]["step"] == steps


# ---------------------------------------------------------------- check_prior of a half model

WIDTH = 256  # 256² N(0, 1) entries: Σ log p ≈ −65536 · 1.42 ≈ −9.3e4, past float16's −65504


def _half_mlp(dtype: torch.dtype, model_cls: type = FineTuneModel) -> Any:
    """256 → 256 (Tanh) → 2, both layers latent, in ``dtype``."""
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2))
    model = model_cls(net, None, latent_modules=["0", "2"], num_data=8, trainable_modules=[])
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_models_invariant_prior_passes(dtype):
    """float16: the prior's ``log p`` of the 256 × 256 layer was ``-inf`` on both sides, so the
    gap was NaN and ``from_model`` raised "not invariant (log p changes by nan)". bfloat16 keeps
    the range but its result ``≈ −9.3e4`` has a 512 ulp, so a permuted sum that rounds the other
    way fails ``rtol = 1e-5`` (seen once in 15 draws with several CPU threads, never in 40 with
    the suite's one: this dtype is a guard, float16 the case). In float32 the two sums differ
    only by summation order, ~1e-7 relative, far below rtol."""
    model = _half_mlp(dtype)
    assert model.dtype == dtype
    spec = PermutationSpec.from_model(model)  # runs check_prior
    assert spec.sizes == (WIDTH,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_models_per_unit_prior_is_still_refused(dtype):
    """Per-unit scales 0.5…2 move ``log p`` of the first site (the 256 biases of layer 0) by
    ``½ Σ θ_i² (1/s_π(i)² − 1/s_i²)``, tens to hundreds (133 measured in float16): a finite gap
    is reported, not the NaN of an overflowed float16 sum (the weights' ``-inf``)."""

    class PerUnitPrior(FineTuneModel):
        def site_prior(self, site):
            prior = super().site_prior(site)
            shape = self.latent_sites[site].shape
            scale = torch.linspace(0.5, 2.0, shape[0], dtype=self.dtype)
            scale = scale.reshape(-1, *([1] * (len(shape) - 1))).expand(shape)
            return type(prior.base_dist)(torch.zeros_like(scale), scale).to_event(len(shape))

    model = _half_mlp(dtype, model_cls=PerUnitPrior)
    with pytest.raises(ValueError, match="not invariant") as err:
        PermutationSpec.from_model(model)
    gap = float(str(err.value).split("changes by ")[1].split(")")[0])
    assert math.isfinite(gap) and gap > 1.0
    assert "site '0.bias'" in str(err.value)  # the first site of the sorted list is named
