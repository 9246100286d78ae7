"""The diagonal GGN of ``fit_laplace`` (per-example Jacobians) against laplace-torch's default.

laplace-torch's default backend (``CurvlinopsGGN``) forms the diagonal GGN from the Jacobian of
the whole batch output; pyrobayes' backend (``per_example_ggn_backend``) from per-example
Jacobian rows, a few at a time, and the centred form of ``Jᵀ(diag p − p pᵀ)J`` (merged chunk by
chunk), never holding the ``(B, K, d)`` Jacobian. Both are the same sums of products of
the same derivatives, in a different order: in float32 they differ by rounding (measured at most
6.2e-6 relative per entry, asserted 1e-5), in float64 by about 1e-16 per product (asserted 1e-10:
any different formula would show far above it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyrobayes as pb
from benchmarks.glm_predictive import peak_bytes  # the benchmark's live-bytes tracker
from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer.laplace import fit_laplace, per_example_ggn_backend
from pyrobayes.linearized import output_jacobian_rows, output_jacobians
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


def _llama_choices() -> tuple[Any, Any]:
    """Choices as continuations on a tiny LLaMA: one network row per choice
    (``rows_per_output``), whose Jacobians come from one backward pass of the summed scores.
    Length-normalised scores: the summed ones of random weights put all mass on one choice
    (GGN ≈ 0, a vacuous comparison)."""
    from pyrobayes.models import MultipleChoice
    from pyrobayes.models.multiple_choice import encode_multiple_choice
    from tests.common import tiny_llama
    from tests.models.test_multiple_choice import CHOICES, PROMPTS, CharTokenizer

    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama(initializer_range=0.2),
        pb.models.LoRA(rank=2, target_modules=["q_proj", "v_proj"]),
        likelihood=MultipleChoice(normalize="length"),
        trainable_modules=[],
        num_data=3,
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2])
    return model, [dict(batch)]


def _fifty_classes() -> Any:
    """50 classes, LoRA factors on both layers of a 20-64-50 MLP (d = 4·(20+64) + 4·(64+50))."""
    return mlp_problem(
        (20, 64, 50), pb.models.LoRA(rank=4, target_modules=["0", "2"]), num_data=40, seed=6
    )


def _mlp(kind: str) -> tuple[Any, Any]:
    if kind == "mlp-classes":
        prob = mlp_problem(
            (5, 8, 8, 4), LoRAXS(rank=3, target_modules=["0", "2"]), num_data=50, seed=3
        )
    elif kind == "mlp-50-classes":  # K = 50: the Jacobian rows streamed in 13 chunks
        prob = _fifty_classes()
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
    "mlp-50-classes",
    "mlp-regression",
    "mlp-2-outputs",
    "llama-choices",
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
    if case == "llama-choices":
        model, data = _llama_choices()
    else:
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


def test_diag_ggn_never_forms_the_batch_jacobian() -> None:
    """The diagonal is accumulated from a few Jacobian rows at a time: with K = 50 classes the
    peak of the live tensor bytes stays far below the (B, K, d) Jacobian's size."""
    prob = _fifty_classes()
    model = prob.model.train(False)
    size, classes = 16, 50
    g = torch.Generator().manual_seed(7)
    shapes = LaplaceGuide(model, structure="diag").sites
    point = {s: 0.5 * torch.randn(shape, generator=g) for s, shape in shapes.items()}
    dim = sum(v.numel() for v in point.values())
    itemsize = 4  # float32
    data = tensor_loader(prob.x[:size], prob.y[:size], size)  # one batch of B = 16
    jacobian_bytes = size * classes * dim * itemsize
    # Live at once in the streamed route (each B·d numbers): the per-example copies of θ̂ (1),
    # the running mean (1), a chunk of 4 rows (4) and its centred squares (4), the chunk's mean
    # and its difference from the running one (2): ≈ 12·B·d, plus activations of B·(20+64+50)
    # numbers and laplace-torch's d-sized H; measured ≈ 12·B·d. The bound 0.5·B·K·d = 25·B·d
    # leaves twice that, and any route holding the (B, K, d) Jacobian (≥ 50·B·d) exceeds it.
    bound = 0.5 * jacobian_bytes
    ours = peak_bytes(lambda: _fit(model, data, point, None))
    assert ours < bound, (ours, bound)
    # the tracker sees a materialised Jacobian: laplace-torch's default and output_jacobians'
    # (B, K, d) route exceed it
    reference = peak_bytes(lambda: _fit(model, data, point, CurvlinopsGGN))
    assert reference > bound, (reference, bound)
    inputs = prob.x[:size]
    full = peak_bytes(lambda: output_jacobians(model, inputs, point, contrast=True))
    assert full >= jacobian_bytes * (classes - 1) / classes > bound, (full, bound)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("contrast", [False, True])
@pytest.mark.parametrize("outputs_per_pass", [1, 3, 49, 60])
def test_jacobian_rows_are_output_jacobians(
    contrast: bool, outputs_per_pass: int, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The streamed rows, concatenated, are output_jacobians' (the same backward passes), also
    when the vmapped backward is unavailable (one pass per row)."""
    prob = _fifty_classes()
    model = prob.model.double().train(False)
    inputs = prob.x[:6].double()
    g = torch.Generator().manual_seed(7)
    shapes = LaplaceGuide(model, structure="diag").sites
    point = {
        s: 0.5 * torch.randn(shape, generator=g, dtype=torch.float64) for s, shape in shapes.items()
    }
    out, jac = output_jacobians(model, inputs, point, contrast=contrast)
    grad = torch.autograd.grad
    single_passes = []

    def unbatched(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("no batching rule (simulated)")
        single_passes.append(1)
        return grad(*args, **kwargs)

    if not batched:
        monkeypatch.setattr(torch.autograd, "grad", unbatched)
    mean, rows = output_jacobian_rows(
        model, inputs, point, contrast=contrast, outputs_per_pass=outputs_per_pass
    )
    chunks = list(rows)
    assert len(single_passes) == (0 if batched else (49 if contrast else 50))
    assert [k0 for k0, _ in chunks] == list(range(0, 49 if contrast else 50, outputs_per_pass))
    torch.testing.assert_close(mean, out, rtol=0.0, atol=0.0)
    for s in point:
        streamed = torch.cat([c[s] for _, c in chunks]).movedim(0, 1)  # (B, K or K − 1, ...)
        expected = jac[s][:, :-1] if contrast else jac[s]
        assert expected.abs().max() > 1e-3
        torch.testing.assert_close(streamed, expected, rtol=1e-12, atol=1e-14)


def test_jacobian_rows_validates_outputs_per_pass() -> None:
    prob = _fifty_classes()
    point = {s: torch.zeros(shape) for s, shape in LaplaceGuide(prob.model).sites.items()}
    with pytest.raises(ValueError, match="outputs_per_pass must be"):
        output_jacobian_rows(prob.model, prob.x[:2], point, outputs_per_pass=0)
