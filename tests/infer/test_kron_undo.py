"""Kronecker IVON: a step that IVON's overflow check refuses (the update left ``h`` or ``m``
unusable, ``pyrobayes/infer/ivon.py``'s ``IVONOptimizer._update``) leaves the Kronecker factors
``A``, ``G`` and their eigendecompositions as they were, as it leaves ``m``, ``h`` and the
momentum, so a fit that catches the error and goes on (or a checkpoint written after it) is the
fit without that step."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer import make_fitter
from pyrobayes.testing import tiny_problem


def _guide_state(guide: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the guide (means, the diagonal sites' ``h``, the factors ``A_i``, ``G_i``
    and their eigenvalues and eigenvectors), cloned."""
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def _assert_same(after: dict[str, Any], before: dict[str, Any]) -> None:
    """Bit-for-bit equal (the undone step must leave no trace, not a rounding error's)."""
    assert after.keys() == before.keys()
    moved = [k for k in before if not torch.equal(torch.as_tensor(after[k]), before[k])]
    assert not moved, f"changed by the refused step: {moved}"


def test_a_refused_first_step_leaves_the_factors_and_their_decompositions():
    """hess_init=1e30 in float32: ``A = G = 1e15 I`` and the diagonal sites' ``h`` overflows, so
    step 0 is refused. The factors' EMA had already moved ``A``, ``G`` by ``(1 − β2)(Â − A)``,
    about 1e13 (1 % of 1e15), and step 0's re-decomposition their eigenvalues alike."""
    model, data = tiny_problem(net=lambda net: net.float())
    data = [(x.float(), y) for x, y in data]
    guide = pb.posterior(model, "kron-ivon", hess_init=1e30)
    fitter = make_fitter(model, guide)
    assert guide.kron_sites  # the LoRA-XS cores are Kronecker sites
    before = _guide_state(guide)
    with pytest.raises(FloatingPointError, match="step 0 .*the step was undone"):
        fitter.step(data[0])
    _assert_same(_guide_state(guide), before)
    assert fitter.optimizer.state["ivon"]["step"] == 0 and fitter.num_steps == 0


def _fit(refused: int | None, steps: int, T_inv: int) -> tuple[Any, Any]:
    """``steps`` steps of a fresh Kronecker IVON fit, each under its own seed; at step
    ``refused`` first one at an infinite rate (``m`` becomes non-finite: refused and undone)."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "kron-ivon")
    fitter = make_fitter(model, guide, optimizer=pb.infer.KronIVON(T_inv=T_inv), lr=0.1)
    group = fitter.optimizer.param_groups[0]
    for step in range(steps):
        if step == refused:
            group["lr"] = math.inf
            torch.manual_seed(1000 + step)  # another draw than the kept step's
            with pytest.raises(FloatingPointError, match=f"step {step} .*the step was undone"):
                fitter.step(data[step % len(data)])
            group["lr"] = 0.1
        torch.manual_seed(step)
        fitter.step(data[step % len(data)])
    return guide, fitter


@pytest.mark.parametrize(
    "refused", [2, 3], ids=["factor-ema-only", "factor-ema-and-re-decomposition"]
)
def test_a_fit_that_goes_on_after_a_refused_step_is_the_fit_without_it(refused):
    """T_inv=4: step 2 moves the factors by their EMA only, step 3 also re-decomposes them
    ((3 + 1) % 4 == 0). A fit that catches the refused step and goes on must equal, bit for bit,
    the same fit without it: before the fix the factors kept the refused step's EMA (and, at
    step 3, its eigendecomposition), so the kept steps' noise and preconditioner differed."""
    steps = 6
    guide, fitter = _fit(refused, steps, T_inv=4)
    clean_guide, clean_fitter = _fit(None, steps, T_inv=4)
    _assert_same(_guide_state(guide), _guide_state(clean_guide))
    state, clean = fitter.optimizer.state["ivon"], clean_fitter.optimizer.state["ivon"]
    assert state["step"] == clean["step"] == steps
    assert torch.equal(state["momentum"], clean["momentum"])
    assert torch.equal(state["hess"], clean["hess"])


def test_a_closure_that_raises_drops_the_recorded_layer_outputs():
    """The layer hooks record each Kronecker layer's output (with its autograd graph) during the
    closure; a closure that raised after the forward (here the head's forward: an out-of-memory
    error would do the same) left them in the curvature until the next step, so the caught
    error still held the forward's graph (an LLM's activations)."""
    model, data = tiny_problem()
    guide = pb.posterior(model, "kron-ivon")
    fitter = make_fitter(model, guide)
    recorded: list[Any] = []
    core = model.net.get_submodule("0.core")
    keep = core.register_forward_hook(lambda mod, args, out: recorded.append(weakref.ref(out)))

    def fail(mod: Any, args: Any, out: Any) -> None:
        raise RuntimeError("the head's forward failed")

    stop = model.net.get_submodule("4").register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="the head's forward failed"):
            fitter.step(data[0])
    finally:
        keep.remove()
        stop.remove()
    gc.collect()
    assert len(recorded) == 1 and recorded[0]() is None  # freed with the failed step
    assert fitter.optimizer.curvature.records == {}
