"""The diagonal GGN of ``fit_laplace`` (per-example Jacobians) against laplace-torch's default.

laplace-torch's default backend (``CurvlinopsGGN``) forms the diagonal GGN from the Jacobian of
the whole batch output; pyrobayes' backend (``per_example_ggn_backend``) from per-example
Jacobians and the centred form of ``Jᵀ(diag p − p pᵀ)J``. Both are the same sums of products of
the same derivatives, in a different order: in float32 they differ by rounding (measured at most
6.2e-6 relative per entry, asserted 1e-5), in float64 by about 1e-16 per product (asserted 1e-10:
any different formula would show far above it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer.laplace import fit_laplace, per_example_ggn_backend
from pyrobayes.models import FineTuneModel, LoRAXS
from tests.common import mlp_problem, tensor_loader, tiny_bert

laplace = pytest.importorskip("laplace")
from laplace.curvature import CurvlinopsGGN  # noqa: E402


def _bert_batches(num_labels: int, regression: bool = False) -> list[dict[str, torch.Tensor]]:
    """Two batches of token ids with right padding (lengths 3..7 of 7) and labels."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for size in (6, 5):
        ids = torch.randint(1, 90, (size, 7), generator=g)
        lengths = torch.randint(3, 8, (size,), generator=g)
        mask = (torch.arange(7)[None] < lengths[:, None]).long()
        labels = (
            torch.randn(size, generator=g)
            if regression
            else torch.randint(0, num_labels, (size,), generator=g)
        )
        batches.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return batches


def _bert(kind: str) -> tuple[Any, Any]:
    # weights drawn with std 0.2 (BERT's 0.02 leaves the sites' Jacobians near 1e-4 and the GGN
    # near 1e-8: a comparison of rounding noise)
    torch.manual_seed(0)
    if kind == "bert-3-classes":  # LoRA-XS cores on query/value
        model = FineTuneModel(
            tiny_bert(num_labels=3, initializer_range=0.2),
            LoRAXS(rank=2, target_modules=["query", "value"]),
            num_data=11,
        )
        return model, _bert_batches(3)
    if kind == "bert-lora-head":  # plain LoRA factors and the head's weight as sites
        model = FineTuneModel(
            tiny_bert(num_labels=2, initializer_range=0.2),
            pb.models.LoRA(rank=2, target_modules=["value"]),
            latent_modules=["classifier"],
            num_data=11,
        )
        return model, _bert_batches(2)
    # a scalar Gaussian output, its σ learned (laplace-torch's 1/σ² is its _H_factor)
    model = FineTuneModel(
        tiny_bert(num_labels=1, initializer_range=0.2),
        LoRAXS(rank=2, target_modules=["query"]),
        likelihood="gaussian",
        obs_scale="learn",
        num_data=11,
    )
    return model, _bert_batches(1, regression=True)


def _mlp(kind: str) -> tuple[Any, Any]:
    if kind == "mlp-classes":
        prob = mlp_problem(
            (5, 8, 8, 4), LoRAXS(rank=3, target_modules=["0", "2"]), num_data=50, seed=3
        )
    elif kind == "mlp-regression":
        prob = mlp_problem(
            (5, 8, 1),
            LoRAXS(rank=3, target_modules=["0"]),
            num_data=50,
            seed=4,
            likelihood="gaussian",
            obs_scale=0.3,
        )
    else:  # two regression outputs, LoRA factors
        prob = mlp_problem(
            (5, 8, 2),
            pb.models.LoRA(rank=2, target_modules=["0", "2"]),
            num_data=50,
            seed=5,
            likelihood="gaussian",
            obs_scale=0.5,
        )
    return prob.model, tensor_loader(prob.x, prob.y, 16)


CASES = [
    "bert-3-classes",
    "bert-lora-head",
    "bert-regression",
    "mlp-classes",
    "mlp-regression",
    "mlp-2-outputs",
]


def _fit(model: Any, data: Any, point: dict[str, torch.Tensor], backend: Any) -> tuple[Any, Any]:
    guide = LaplaceGuide(model, structure="diag", prior_precision=1.0)
    with torch.no_grad():
        for s, v in point.items():
            guide.loc(s).copy_(v)
    return guide, fit_laplace(model, guide, data, backend=backend)


def _to(data: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of ``data`` (a loader or a list of dict batches) in ``dtype``."""

    def cast(v: Any) -> Any:
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    if isinstance(data, list):
        return [{k: cast(v) for k, v in b.items()} for b in data]
    return [tuple(cast(v) for v in b) for b in data]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_diag_ggn_equals_laplace_torch_default(case: str, dtype: torch.dtype) -> None:
    model, data = _bert(case) if case.startswith("bert") else _mlp(case)
    model.to(dtype).train(False)
    data = _to(data, dtype)
    # float32: measured ≤ 6.2e-6 elementwise (summation order); float64: the same sums exactly
    # up to ≈ 1e-16 per product, so any difference above 1e-10 would be a different formula
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    # a generic point: LoRA's B = 0 at init would zero the Jacobians of A
    g = torch.Generator().manual_seed(7)
    shapes = LaplaceGuide(model, structure="diag").sites
    point = {s: 0.5 * torch.randn(shape, generator=g, dtype=dtype) for s, shape in shapes.items()}
    # the reference is laplace-torch's default backend (what fit_laplace used before)
    la_default = laplace.Laplace(
        torch.nn.Linear(2, 2), "classification", subset_of_weights="all", hessian_structure="diag"
    )
    assert la_default._backend_cls is CurvlinopsGGN
    ref_guide, ref = _fit(model, data, point, CurvlinopsGGN)
    guide, ours = _fit(model, data, point, None)
    assert ours._backend_cls is per_example_ggn_backend()
    assert ref.H.abs().max() > 1e-3  # not a vacuous comparison of zeros
    assert ours.H.dtype == dtype
    torch.testing.assert_close(ours.H, ref.H, rtol=rtol, atol=0.0)
    torch.testing.assert_close(ours.loss, ref.loss, rtol=rtol, atol=0.0)
    assert ours._H_factor == ref._H_factor and ours.n_data == ref.n_data
    torch.testing.assert_close(ours.mean, ref.mean, rtol=0.0, atol=0.0)
    for s in guide.sites:
        torch.testing.assert_close(
            guide.posterior_precision(s), ref_guide.posterior_precision(s), rtol=rtol, atol=0.0
        )
    # the marginal likelihood, hence the tuned τ, is laplace-torch's on the same H
    for tau in (0.1, 1.0, 10.0):
        t = torch.tensor(tau, dtype=dtype)
        torch.testing.assert_close(
            ours.log_marginal_likelihood(prior_precision=t),
            ref.log_marginal_likelihood(prior_precision=t),
            rtol=rtol,
            atol=0.0,
        )
