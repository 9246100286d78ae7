"""This round's device-dependent paths, on the CPU in every run and on CUDA with ``-m gpu``
(``.venv/bin/python -m pytest -m gpu tests/test_device_paths.py`` on a machine with a GPU):

- Kronecker IVON's non-finite factor check uses the fused kernel ``torch.amp.GradScaler`` uses
  (``torch._amp_foreach_non_finite_check_and_unscale_``), whose CUDA implementation differs from
  the CPU one: a spoiled step must be refused and undone on both;
- IVON's undo of an overflowing update (copies on the device, one host read per step);
- the multiple-choice predictive with prompts and lower blocks shared, the prompt layout computed
  once per batch, against the unshared computation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer import make_fitter
from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import unshared
from pyrobayes.testing import tiny_problem
from tests.common import DEVICES, tiny_llama
from tests.models.test_multiple_choice import PROMPTS, CharTokenizer


def _float32_problem(device: str) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    model, data = tiny_problem(net=lambda net: net.float())
    return model.to(device), [(x.float().to(device), y.to(device)) for x, y in data]


def _state(guide: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def _assert_same(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """Bit for bit: an undone step leaves no trace, not a rounding error's."""
    moved = [k for k in before if not torch.equal(after[k], before[k])]
    assert after.keys() == before.keys() and not moved, moved


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_kronecker_factor_is_refused_and_undone(device):
    """A step-1 batch scaled by 1e20: the input factor's Σ a² (~1e40) overflows float32 while
    the tanh keeps the means finite; the step is refused naming the factor and the site, and
    the guide is as before it (T_inv = 10: the step does not re-decompose)."""
    model, data = _float32_problem(device)
    guide = pb.posterior(model, "kron-ivon")
    optimizer = pb.infer.KronIVON(T_inv=10, clip_radius=1e-2)
    fitter = make_fitter(model, guide, optimizer=optimizer, lr=0.1)
    torch.manual_seed(0)
    fitter.step(data[0])
    before = _state(guide)
    x, y = data[1]
    with pytest.raises(FloatingPointError, match=r"input factor A of site 0\.core"):
        fitter.step((x * 1e20, y))
    _assert_same(_state(guide), before)
    fitter.step(data[1])  # the fit goes on
    assert all(bool(v.isfinite().all()) for v in _state(guide).values())


@pytest.mark.parametrize("device", DEVICES)
def test_an_overflowing_ivon_update_is_undone(device):
    """hess_init = 1e30 in float32: the update's correction overflows h; the step is undone
    and named, the guide as before it."""
    model, data = _float32_problem(device)
    guide = pb.posterior(model, "ivon", hess_init=1e30)
    before = _state(guide)
    with pytest.raises(FloatingPointError, match="the step was undone"):
        pb.fit(model, guide, data, epochs=1, progress=False)
    _assert_same(_state(guide), before)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_prompts_and_lower_blocks_predict_as_the_full_rows(device):
    """A three-block LLaMA adapted in blocks 1-2: prompts and block 0 shared across S = 8 draws
    in chunks of 4 (one prompt layout per batch) against the unshared rows. Float32 scores of
    magnitude <= ~150 nats summed in another order: ~1e-5 apart."""
    torch.manual_seed(0)
    net = tiny_llama(num_hidden_layers=3).eval().to(device)
    model = FineTuneModel(
        net,
        LoRA(rank=2, target_modules=r".*layers\.[12]\.self_attn\.(q_proj|v_proj)"),
        likelihood=MultipleChoice(normalize="chars"),
        trainable_modules=[],
        num_data=3,
    )
    guide = pb.posterior(model, "meanfield", init_scale=0.1)
    batch = encode_multiple_choice(
        CharTokenizer(), PROMPTS, [["yes", "no", "maybe"]] * len(PROMPTS), answers=[0, 1, 2]
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    pb.fit(model, guide, [batch], epochs=1, lr=1e-2, progress=False)
    kwargs = {"num_samples": 8, "samples_per_forward": 4, "seed": 0}
    shared = pb.predict(model, guide, [batch], **kwargs)
    with unshared():
        plain = pb.predict(model, guide, [batch], **kwargs)
    assert shared.log_probs is not None and plain.log_probs is not None
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=1e-6, atol=1e-5)
