"""Laplace on the batch forms every other family takes: inputs that are not one tensor (a dict
without ``input_ids``, e.g. ``pixel_values``; a nested ``((a, b), y)``), labels of another integer
dtype or of shape ``(B, 1)``, and a half-precision network. Each gives the posterior of the
plain ``(x, y)`` float32 form (laplace-torch reads the batch size from ``input_ids`` by default,
and its cross-entropy wants ``(B,)`` int64 labels; ``torch.linalg.eigh`` has no bf16 kernel)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRAXS

ROWS, CLASSES = 24, 3


class TwoInputs(nn.Module):
    """``head(tanh(body(cat(a, b))))``, called as ``net(a, b)`` or ``net(a=..., b=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(torch.cat([a, b], -1))))


class OneInput(TwoInputs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x[:, :4], x[:, 4:])


def _fitted(net: nn.Module, batches: list, structure: str = "kron") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the core's initial draw
    model = FineTuneModel(
        net, LoRAXS(rank=3, target_modules=["body"]), num_data=2 * ROWS, trainable_modules=[]
    )
    guide = pb.posterior(model, "laplace", structure=structure, prior_precision=2.0)
    pb.fit(model, guide, batches, epochs=0, progress=False)
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(2 * ROWS, 6), torch.arange(2 * ROWS) % CLASSES


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_laplace_takes_every_batch_form_the_other_families_take(structure):
    x, y = _data()
    torch.manual_seed(0)
    reference_net = OneInput()
    state = reference_net.state_dict()

    def net(cls: type[nn.Module]) -> nn.Module:
        out = cls()
        out.load_state_dict(state)
        return out

    halves = [(x[:ROWS], y[:ROWS]), (x[ROWS:], y[ROWS:])]
    reference = _fitted(net(OneInput), halves, structure)
    forms = {
        "dict without input_ids": [{"a": b[:, :4], "b": b[:, 4:], "labels": t} for b, t in halves],
        "nested tuple": [((b[:, :4], b[:, 4:]), t) for b, t in halves],
    }
    for name, batches in forms.items():
        got = _fitted(net(TwoInputs), batches, structure)
        assert got.keys() == reference.keys(), name
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    labels = {
        "int32 labels": [(b, t.int()) for b, t in halves],
        "(B, 1) labels": [(b, t[:, None]) for b, t in halves],
    }
    for name, batches in labels.items():
        got = _fitted(net(OneInput), batches, structure)
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name}: {key}")


def test_laplace_refuses_float_class_labels_by_name():
    x, y = _data()
    with pytest.raises(ValueError, match="class labels of dtype torch.float32"):
        _fitted(OneInput(), [(x, y.float())])


@pytest.mark.parametrize("family", ["laplace", "swag"])
def test_a_bfloat16_network_gets_the_float32_networks_posterior(family):
    """The curvature (Laplace) and the moments (SWAG) of a bf16 network's sites are kept in float32;
    draws come back in bf16. Predictions agree with the float32 network's to bf16's resolution:
    inputs, weights and activations rounded to 8 mantissa bits (relative 2^-8 ≈ 0.4%) move a
    probability near 1/3 by well under 0.05."""
    x, y = _data()
    batches = [(x[:ROWS], y[:ROWS]), (x[ROWS:], y[ROWS:])]
    probs = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        net = OneInput().to(dtype)
        model = FineTuneModel(
            net, LoRAXS(rank=3, target_modules=["body"]), num_data=2 * ROWS, trainable_modules=[]
        )
        guide = pb.posterior(model, family)
        data = [(b.to(dtype), t) for b, t in batches]
        pb.fit(model, guide, data, epochs=2, lr=1e-2, seed=0, progress=False)
        pred = pb.predict(model, guide, data, num_samples=64, seed=0)
        assert torch.isfinite(pred.probs).all()
        probs[dtype] = pred.probs.float()
    assert (probs[torch.bfloat16] - probs[torch.float32]).abs().max() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_a_half_networks_laplace_keeps_float32_buffers_and_predicts_by_probit(dtype, structure):
    """The curvature, the Kronecker eigenbases and τ are float32 buffers on a half-precision
    network: the probit predictive multiplies them by the float32 Jacobian (bf16 eigenbases
    crashed it: "expected scalar type BFloat16 but found Float"), and a τ of 1e5, above
    float16's largest 65504, stays finite (it was inf, then a Pyro error at predict). The
    probit NLL agrees with the float32 network's to 1e-3 (the networks' rounding, 2^-8
    relative in bf16, moves an NLL near 1 by about that; measured 1e-5 to 1e-4)."""
    x, y = _data()
    batches = [(x[:ROWS], y[:ROWS]), (x[ROWS:], y[ROWS:])]
    nll = {}
    for dt in (torch.float32, dtype):
        torch.manual_seed(0)
        model = FineTuneModel(
            OneInput().to(dt), LoRAXS(rank=3, target_modules=["body"]), num_data=2 * ROWS
        )
        options = {"structure": structure, "pred_type": "probit", "prior_precision": 1e5}
        guide = pb.posterior(model, "laplace", **options)
        data = [(b.to(dt), t) for b, t in batches]
        # post hoc at the pretrained point (Adam refuses to train float16 parameters)
        pb.fit(model, guide, data, epochs=0, seed=0, progress=False)
        buffers = [b for name, b in guide.named_buffers() if b.is_floating_point()]
        assert buffers and all(b.dtype == torch.float32 for b in buffers)
        assert float(guide.prior_precision) == 1e5
        pred = pb.predict(model, guide, data, seed=0)
        assert pred.targets is not None
        nll[dt] = float(pb.metrics.report(pred, pred.targets)["nll"])
    assert abs(nll[dtype] - nll[torch.float32]) < 1e-3


def test_a_laplace_fit_raises_no_warning_from_laplace_torchs_imports():
    """asdl (imported by laplace-torch) scripts helpers with the deprecated torch.jit.script on
    import; the first Laplace fit of a process must not pass that FutureWarning to the user."""
    code = (
        "import warnings, torch, pyrobayes as pb\n"
        "warnings.simplefilter('error')\n"
        "net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))\n"
        "m = pb.models.FineTuneModel(net, pb.models.LoRAXS(rank=2, target_modules=['0']),"
        " num_data=16, trainable_modules=['2'])\n"
        "x, y = torch.randn(16, 4), torch.arange(16) % 3\n"
        "pb.fit(m, pb.posterior(m, 'laplace', prior_precision=1.0), [(x, y)], epochs=1,"
        " progress=False)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_bfloat16_networks_diagonal_curvature_sums_in_float32():
    """laplace-torch sums the per-batch diagonal GGN in the dtype of the network's first
    parameter: in bfloat16 a sum over 30,000 examples came out half the float32 one (1 - 2^-8
    relative per addition, and a term below half a unit of the sum's last place is lost). The
    network as laplace-torch sees it now leads with an empty float32 parameter; the bf16 and
    float32 networks (the same bf16-representable weights) then agree to the bf16 forward's
    own rounding, under 3% (measured 1.6% at 600, 6,000 and 30,000 examples)."""
    curvature = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).bfloat16().to(dtype)
        model = FineTuneModel(
            net, LoRAXS(rank=3, target_modules=["0"]), num_data=30000, trainable_modules=["2"]
        )
        g = torch.Generator().manual_seed(1)
        x = torch.randn(30000, 4, generator=g)
        y = (x @ torch.randn(4, 3, generator=g)).argmax(-1)
        data = [(x[i : i + 30].to(dtype), y[i : i + 30]) for i in range(0, 30000, 30)]
        guide = pb.posterior(model, "laplace", structure="diag", prior_precision=1.0)
        pb.fit(model, guide, data, epochs=0, progress=False)
        curvature[dtype] = guide.curvature("0.core").float()
    ratio = curvature[torch.bfloat16] / curvature[torch.float32]
    assert float((ratio - 1).abs().max()) < 0.03


def test_a_float16_networks_overflowing_kfac_factors_are_refused_by_name():
    """Inputs of size ~40 on 600 examples: the K-FAC input factor (a sum of squared
    activations) passes float16's 65504 and laplace-torch's eigendecomposition turned its
    NaN eigenvalues into a zero curvature (τ collapsed, the predictive 150x too wide), silently.
    Now refused with the cause and the remedies; the same fit in bfloat16 runs."""
    x, y = torch.randn(600, 4) * 40, torch.arange(600) % 3
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
        model = FineTuneModel(
            net, LoRAXS(rank=3, target_modules=["0"]), num_data=600, trainable_modules=["2"]
        )
        guide = pb.posterior(model, "laplace", structure="kron")
        data = [(x[i : i + 30].to(dtype), y[i : i + 30]) for i in range(0, 600, 30)]
        if dtype == torch.float16:
            with pytest.raises(FloatingPointError, match="float16 network overflowed"):
                pb.fit(model, guide, data, epochs=0, progress=False)
        else:
            pb.fit(model, guide, data, epochs=0, progress=False)
            assert float(guide.curvature("0.core").min()) > 0
