"""Kronecker IVON: a step whose factor estimate ``Â`` or ``Ĝ`` is not finite is refused and undone
at that step (``pyrobayes/infer/kron.py``'s ``KronCurvature.estimates_unusable``, folded into
``IVONOptimizer._unusable_state``'s one flag), with a message naming the factor and the site.

The factors are read only when they are re-decomposed (every ``T_inv`` steps). Before the fix a
step that did not re-decompose passed IVON's check (its means were finite) while its EMA left
``A`` or ``G`` holding inf/NaN; measured on the float32 kit problem with ``T_inv=10`` and a
step-1 batch scaled by 1e20, the fit stopped only at step 9 with "IVON's update at step 9 left
... the mean m non-finite ... Lower hess_init", and stopped again at every later
re-decomposition, since the spoiled factor was never undone."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer import make_fitter
from pyrobayes.models import LoRAXS
from pyrobayes.testing import tiny_problem

Batch = tuple[torch.Tensor, torch.Tensor]


def _float32_problem(**kwargs: Any) -> tuple[Any, list[Batch]]:
    """:func:`tiny_problem` in float32 (the suite's default dtype is float64)."""
    model, data = tiny_problem(net=lambda net: net.float(), **kwargs)
    return model, [(x.float(), y) for x, y in data]


def _guide_state(guide: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the guide (means, ``h``, the factors and their decompositions), cloned."""
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def _assert_same(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """Bit-for-bit equal: a refused step leaves no trace, not even a rounding error's."""
    assert after.keys() == before.keys()
    moved = [k for k in before if not torch.equal(after[k], before[k])]
    assert not moved, f"changed by the refused step: {moved}"


def _huge_inputs(model: Any, batch: Batch) -> tuple[Batch, Callable[[], None]]:
    """The batch scaled by 1e20: the core of layer 0 sees inputs of about 1e20, so ``Â``'s
    ``Σ a²`` (about 1e40) overflows float32 (3.4e38). Layer 0's output saturates the tanh, so
    the gradients, and the means, stay finite."""
    return (batch[0] * 1e20, batch[1]), lambda: None


def _huge_gradients(model: Any, batch: Batch) -> tuple[Batch, Callable[[], None]]:
    """The loss's gradient at the output of layer 2's core scaled by 1e25 (a diverging fit's):
    ``Ĝ ∝ gᵀg`` (about 1e48) overflows float32 at both cores (the gradient flows on to layer
    0), while the gradients themselves (about 1e24) and, with ``clip_radius``, the means stay
    finite."""

    def scale(module: Any, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: g * 1e25)

    handle = model.net.get_submodule("2.core").register_forward_hook(scale)
    return batch, handle.remove


def _fit(spoil: Any, at: int | None, steps: int, T_inv: int) -> tuple[Any, Any, str]:
    """``steps`` steps of a fresh float32 fit, each under its own seed; before step ``at`` one
    spoiled by ``spoil`` (refused: its message is returned) under another seed."""
    model, data = _float32_problem()
    guide = pb.posterior(model, "kron-ivon")
    settings = pb.infer.KronIVON(T_inv=T_inv, clip_radius=1e-2)
    fitter = make_fitter(model, guide, optimizer=settings, lr=0.1)
    message = ""
    for step in range(steps):
        batch = data[step % len(data)]
        if step == at:
            before = _guide_state(guide)
            spoiled, remove = spoil(model, batch)
            torch.manual_seed(1000 + step)
            try:
                with pytest.raises(FloatingPointError) as caught:
                    fitter.step(spoiled)
            finally:
                remove()
            message = str(caught.value)
            _assert_same(_guide_state(guide), before)
        torch.manual_seed(step)
        fitter.step(batch)
    return guide, fitter, message


@pytest.mark.parametrize(
    ("spoil", "names", "advice"),
    [
        (_huge_inputs, ["input factor A of site 0.core"], "check the inputs"),
        (
            _huge_gradients,
            [
                "output-gradient factor G of site 0.core",
                "output-gradient factor G of site 2.core",
            ],
            "lower the learning rate",
        ),
    ],
    ids=["input-factor", "output-gradient-factor"],
)
def test_a_non_finite_estimate_is_refused_at_its_own_step(spoil, names, advice):
    """Step 1 does not re-decompose (T_inv=10). It is refused there and named (before the fix:
    no error, the factor held inf, and the fit failed at step 9 naming hess_init), and a fit
    that catches the error and goes on past the next re-decomposition (step 9) is, bit for bit,
    the same fit without the spoiled step."""
    steps = 12
    guide, fitter, message = _fit(spoil, 1, steps, T_inv=10)
    assert "factor estimates at step 1 are not finite" in message
    assert "the step was undone" in message and advice in message
    for name in names:
        assert name in message
    assert "hess_init" not in message  # the update's own check passed: not its advice
    clean_guide, clean_fitter, _ = _fit(spoil, None, steps, T_inv=10)
    _assert_same(_guide_state(guide), _guide_state(clean_guide))
    state, clean = fitter.optimizer.state["ivon"], clean_fitter.optimizer.state["ivon"]
    assert state["step"] == clean["step"] == steps
    assert torch.equal(state["momentum"], clean["momentum"])


def test_a_backend_without_the_fused_check_still_refuses(monkeypatch):
    """Where ``torch._amp_foreach_non_finite_check_and_unscale_`` is missing for a backend (it
    raises NotImplementedError), the flag comes from one ``isfinite`` per estimate instead."""

    def missing(*args: Any) -> None:
        raise NotImplementedError("no fused check on this backend")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    _, _, message = _fit(_huge_inputs, 1, 2, T_inv=10)
    assert "factor estimates at step 1 are not finite" in message
    assert "input factor A of site 0.core" in message


def test_a_re_decomposition_step_never_decomposes_a_non_finite_factor():
    """Step 3 re-decomposes (T_inv=4): its EMA is applied before the ``eigh``. Before the fix the
    ``eigh`` ran on a factor holding inf (on CPU it returned NaN; a backend that raises would
    have escaped the undo) and the step was refused for its NaN means with the advice to lower
    hess_init. Now it is refused before decomposing, naming the input factor."""
    model, data = _float32_problem()
    guide = pb.posterior(model, "kron-ivon")
    fitter = make_fitter(model, guide, optimizer=pb.infer.KronIVON(T_inv=4), lr=0.1)
    decomposed: list[bool] = []
    refresh = guide.refresh

    def checked_refresh() -> None:
        decomposed.append(all(bool(F.isfinite().all()) for F in guide.state_dict().values()))
        refresh()

    guide.refresh = checked_refresh
    for step in range(3):
        fitter.step(data[step % len(data)])
    before = _guide_state(guide)
    spoiled, _ = _huge_inputs(model, data[3 % len(data)])
    with pytest.raises(FloatingPointError, match=r"step 3 .*input factor A of site 0\.core") as e:
        fitter.step(spoiled)
    assert "hess_init" not in str(e.value)
    _assert_same(_guide_state(guide), before)
    assert decomposed == [True]  # step 0's only: step 3 refused before its eigh


def test_a_finite_estimate_whose_entries_sum_past_the_dtype_is_kept():
    """The check flags inf and NaN entries (the fused check of ``torch.amp.GradScaler``); it does
    not sum the entries: a sum of finite entries can overflow, which would refuse a usable step. Layer 0's core (rank 4: ``Â`` is 4x4) is fed
    the constant ``v = 5.5e18`` on each of its 8 rows: ``Σ_rows v² = 2.4e38`` and every entry of
    ``Â`` is ``v² = 3.0e37``, finite in float32 (max 3.4e38), but their sum over the 16 entries,
    4.8e38, is not. The step is kept and ``A`` stays finite."""
    model, data = _float32_problem(adapter=lambda base: LoRAXS(rank=4, target_modules=["0", "2"]))
    guide = pb.posterior(model, "kron-ivon")
    fitter = make_fitter(model, guide, optimizer=pb.infer.KronIVON(T_inv=10), lr=0.1)
    fitter.step(data[0])
    core = model.net.get_submodule("0.core")
    value = 5.5e18
    assert 8 * value**2 < torch.finfo(torch.float32).max < 16 * value**2
    handle = core.register_forward_pre_hook(lambda mod, args: (torch.full_like(args[0], value),))
    try:
        fitter.step(data[1])
    finally:
        handle.remove()
    A, _ = guide.factors("0.core")
    assert bool(A.isfinite().all())
    # A ← β2 A + (1−β2) Â moved the factor by 1 % of Â's v² (float32 rounding: rel 1e-6)
    assert math.isclose(float(A.max()), 0.01 * value**2, rel_tol=1e-3)
    assert fitter.optimizer.state["ivon"]["step"] == 2
