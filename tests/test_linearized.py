"""The linearised (GLM) predictive, Laplace's default: closed forms, full-Jacobian references,
memory, and pb.predict's dispatch through the LinearizedPredictive capability."""

from __future__ import annotations

import math

import pytest
import torch

import pyrobayes as pb
from benchmarks.glm_predictive import peak_bytes  # the benchmark's live-bytes tracker
from pyrobayes.contract import LinearizedPredictive, implements
from pyrobayes.guides import LaplaceGuide
from pyrobayes.linearized import output_jacobians
from pyrobayes.models import FineTuneModel, LoRAXS
from tests.common import (
    conjugate_core,
    small_lora_xs_classifier,
    tensor_loader,
    tiny_llama,
)

pytest.importorskip("laplace")


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_glm_regression_equals_closed_form_linear_gaussian(structure: str) -> None:
    """f(x; W) = W0 x + s·up·W·down·x is linear in the core W: the Laplace posterior at the
    exact posterior mean with τ = 1/s_p² is the exact posterior, and the GLM predictive is the
    exact Gaussian predictive N(f(x; m), J P⁻¹ Jᵀ + σ² I), computed here densely in float64."""
    prob = conjugate_core(num_data=40, prior_scale=0.8)
    model = prob.model.double()
    x, y = prob.x.double(), prob.y.double()
    layer = model.net[0]
    s, up, down = layer.scaling, layer.up, layer.down
    w0 = layer.base.weight
    noise, tau, r = 0.5, 1 / 0.8**2, up.shape[1]
    # dense posterior over vec(W) (row-major): J_n[i, j·r + k] = s·up[i, j]·z_n[k], z = down x
    z = x @ down.T  # (N, r)
    jac = s * torch.einsum("ij,nk->nijk", up, z).reshape(len(x), up.shape[0], r * r)
    precision = (
        tau * torch.eye(r * r, dtype=torch.float64)
        + torch.einsum("nid,nie->de", jac, jac) / noise**2
    )
    resid = y - x @ w0.T
    cov = torch.linalg.inv(precision)
    m = cov @ torch.einsum("nid,ni->d", jac, resid) / noise**2
    guide = LaplaceGuide(model, structure=structure, prior_precision="model")
    with torch.no_grad():
        guide.loc(prob.site).copy_(m.reshape(r, r))
    pb.fit(model, guide, tensor_loader(x, y, 16), epochs=0)
    assert guide.pred_type == "glm" and implements(guide, LinearizedPredictive)

    x_test = torch.randn(
        7, x.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    y_test = torch.randn(7, y.shape[1], dtype=torch.float64)
    z_test = x_test @ down.T
    j_test = s * torch.einsum("ij,nk->nijk", up, z_test).reshape(7, up.shape[0], r * r)
    mean = x_test @ w0.T + j_test @ m
    var = torch.einsum("nid,de,nie->ni", j_test, cov, j_test) + noise**2
    pred = pb.predict(model, guide, tensor_loader(x_test, y_test, 3))
    assert pred.loc is not None and pred.loc.shape == (1, 7, y.shape[1])
    torch.testing.assert_close(pred.loc[0], mean, rtol=0, atol=1e-8)
    assert pred.scale == noise and pred.loc_var is not None
    torch.testing.assert_close(pred.loc_var[0], var - noise**2, rtol=0, atol=1e-8)
    torch.testing.assert_close(pred.predictive_scale[0], var.sqrt(), rtol=0, atol=1e-8)
    assert (var - noise**2).min() > 1e-3  # the epistemic term is not negligible
    # the metrics score the exact Gaussian predictive
    exact_nll = -torch.distributions.Normal(mean, var.sqrt()).log_prob(y_test).mean()
    assert abs(pb.metrics.report(pred, pred.targets)["nll"] - float(exact_nll)) < 1e-10


def _mlp_classifier():
    prob = small_lora_xs_classifier()
    model = prob.model.double()
    loader = tensor_loader(prob.x.double(), prob.y, 20)
    guide = LaplaceGuide(model, structure="kron")
    # laplace-torch's evidence: a posterior with spread. The default evidence finds no coordinate
    # of this five-epoch MAP on 60 examples larger than its posterior sd and returns τ at its
    # bound (the MAP itself), which would leave the Monte Carlo checks below nothing to test.
    settings = pb.infer.Laplace(evidence="posterior_mode")
    pb.fit(
        model, guide, loader, epochs=5, lr=0.05, seed=0, optim=pb.Optimization(optimizer=settings)
    )
    return model, guide, prob.x.double(), prob.y, loader


def _reference_linearized(model, guide, inputs, num_samples: int, seed: int):
    """f(x; θ̂) + J(θ_s − θ̂) with J from torch.func.jacrev of the batch output (no copies)."""
    point = guide.linearization_point()
    mean = model.output(inputs, point).detach()
    jac = torch.func.jacrev(lambda vals: model.output(inputs, vals))(point)
    draws = guide.sample_posterior(num_samples, generator=torch.Generator().manual_seed(seed))
    shift = sum(
        torch.einsum(
            "bkd,sd->sbk",
            jac[s].reshape(mean.shape[0], mean.shape[1], -1),
            (draws[s] - point[s]).reshape(num_samples, -1),
        )
        for s in point
    )
    return mean, jac, mean + shift


def test_glm_classification_equals_jacrev_reference_and_probit() -> None:
    model, guide, x, y, loader = _mlp_classifier()
    assert guide.link_samples == 100  # the default, laplace-torch's n_samples
    guide.link_samples = 50
    pred = pb.predict(model, guide, loader, num_samples=4, seed=3)  # the link draws, not S
    assert pred.log_probs is not None and pred.log_probs.shape == (50, 60, 3)
    mean, jac, logits = _reference_linearized(model, guide, x, 50, 3)
    torch.testing.assert_close(pred.log_probs, torch.log_softmax(logits, -1), rtol=0, atol=1e-10)
    # probit: softmax(f / sqrt(1 + π/8 diag(J Σ Jᵀ))) with the dense Σ
    guide.pred_type = "probit"
    probit = pb.predict(model, guide, loader)
    flat = torch.cat([jac[s].reshape(60, 3, -1) for s in guide.sites], -1)
    sigma = torch.block_diag(*[torch.linalg.inv(guide.posterior_precision(s)) for s in guide.sites])
    var = torch.einsum("bkd,de,bke->bk", flat, sigma, flat)
    expected = torch.log_softmax(mean / (1 + math.pi / 8 * var).sqrt(), -1)
    torch.testing.assert_close(probit.log_probs[0], expected, rtol=0, atol=1e-10)
    # network sampling stays available
    guide.pred_type = "nn"
    nn_pred = pb.predict(model, guide, loader, num_samples=4)
    draws = guide.sample_posterior(4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        direct = torch.log_softmax(model.batched_output(x, draws), -1)
    torch.testing.assert_close(nn_pred.log_probs, direct, rtol=0, atol=1e-10)


def test_glm_monte_carlo_converges_to_a_high_sample_reference() -> None:
    """The default ``link_samples`` Monte Carlo mean probabilities against 20 000 independent
    draws.

    Tolerance: p̂ = (1/S) Σ_s p_s estimates p̄ = E p with standard error σ/√S, σ the per-draw
    standard deviation of p_s (estimated from the reference draws); the difference of two
    independent estimates has standard error σ·sqrt(1/S + 1/S_ref). 5 standard errors per entry:
    two-sided normal tail 5.7e-7, times 180 entries (60 examples × 3 classes) < 1e-4 for the
    union. A floor of 1e-12 covers entries whose draws all agree (σ = 0)."""
    model, guide, x, y, loader = _mlp_classifier()
    num_ref = 20_000
    pred = pb.predict(model, guide, loader, num_samples=2, seed=3)
    assert pred.log_probs is not None and pred.log_probs.shape == (100, 60, 3)
    guide.link_samples = num_ref
    ref = pb.predict(model, guide, loader, seed=11)
    assert ref.log_probs is not None
    ref_probs = ref.log_probs.exp()
    sigma = ref_probs.std(0)
    assert float(sigma.max()) > 0.05  # the posterior spreads the probabilities: a real test
    tol = 5 * sigma * math.sqrt(1 / 100 + 1 / num_ref) + 1e-12
    err = (pred.mean_probs - ref_probs.mean(0)).abs()
    assert bool((err <= tol).all()), float((err / tol).max())


def test_link_samples_validated_and_saved(tmp_path) -> None:
    prob = conjugate_core()
    with pytest.raises(ValueError, match="link_samples"):
        LaplaceGuide(prob.model, link_samples=0)
    model, guide, x, y, loader = _mlp_classifier()
    guide.link_samples = 7
    loaded = pb.load(pb.save(guide, tmp_path / "la.safetensors"), model)
    assert loaded.link_samples == 7
    assert pb.predict(model, loaded, loader, num_samples=3).log_probs.shape == (7, 60, 3)
    loaded.link_samples = None
    assert pb.predict(model, loaded, loader, num_samples=3).log_probs.shape == (3, 60, 3)


def test_output_jacobians_per_example_equal_jacrev() -> None:
    model, guide, x, _, _ = _mlp_classifier()
    point = guide.linearization_point()
    out, jac = output_jacobians(model, x[:9], point)
    ref = torch.func.jacrev(lambda vals: model.output(x[:9], vals))(point)
    for s in point:  # jacrev over the shared θ̂: (B, K, *shape), every example's Jacobian
        torch.testing.assert_close(jac[s], ref[s], rtol=0, atol=1e-12)
    torch.testing.assert_close(out, model.output(x[:9], point).detach(), rtol=0, atol=1e-14)


def _llama_problem(vocab: int = 1000, batch: int = 4, length: int = 12):
    torch.manual_seed(0)
    net = tiny_llama(vocab_size=vocab, attn_implementation="eager", initializer_range=0.2)
    net = net.double().eval()
    choices = [5, 6, 7, 8]
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules=["q_proj", "v_proj"]),
        likelihood="multiple_choice",
        choice_token_ids=choices,
        trainable_modules=[],
        num_data=batch,
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 3 :] = 0  # right padding
    labels = torch.randint(0, len(choices), (batch,), generator=g)
    batch_dict = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    guide = LaplaceGuide(model, structure="kron")
    with torch.no_grad():  # a point away from the init, so J is not that of a zero core
        for s in guide.sites:
            guide.loc(s).normal_(0.0, 0.3, generator=g)
    pb.fit(model, guide, [batch_dict], epochs=0)
    return model, guide, batch_dict


def test_glm_multiple_choice_llama_equals_full_jacobian_within_memory_bound() -> None:
    """K choice scores only: equal to the full-vocabulary Jacobian route (1e-6), in far less
    memory.

    Memory bound. ``output_jacobians`` keeps one autograd graph of the chunk's forward (what a
    training step keeps, at most the step's peak M) and runs K backward passes through it,
    batched (vmapped over the K cotangents): at most K times a training step's backward buffers,
    each at most M; besides, it holds the per-example copies of θ̂ and the Jacobians,
    8·B·d·(1 + K) bytes (float64). So its peak is at most (1 + K)·M plus those bytes, M the
    measured peak of one training step (forward + backward of the MAP loss on the batch). The
    full-Jacobian route instead materialises ∂logits/∂θ over every position and the
    vocabulary, 8·B·L·V·d bytes, and is measured above the bound.
    """
    model, guide, batch = _llama_problem()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    point = guide.linearization_point()
    d = sum(int(v.numel()) for v in point.values())
    bsz, length = inputs["input_ids"].shape
    vocab, k_out = 1000, 4

    def full_reference():
        def logits(vals):
            params = {model.latent_sites[s].param_name: v for s, v in vals.items()}
            # the plain network: every position's logits over the whole vocabulary
            return torch.func.functional_call(model.net, params, args=(), kwargs=inputs).logits

        # forward mode (d tangents): reverse mode would back-propagate B·L·V cotangents
        jac = torch.func.jacfwd(logits)(point)  # (B, L, V, *site): every position and token
        pos = length - 1 - torch.argmax(inputs["attention_mask"].flip(-1), dim=-1)
        ids = torch.tensor([5, 6, 7, 8])
        rows = torch.arange(bsz)
        return {s: j[rows, pos][:, ids] for s, j in jac.items()}

    ref = full_reference()
    _, ours = output_jacobians(model, inputs, point)
    for s in point:
        scale = float(ref[s].abs().max())
        assert scale > 1e-2  # a real Jacobian
        torch.testing.assert_close(ours[s], ref[s], rtol=0, atol=1e-6 * scale)

    # the predictive itself: f̂ + J(θ_s − θ̂) from the full-vocabulary Jacobian
    guide.link_samples = None  # predict's num_samples
    pred = pb.predict(model, guide, [batch], num_samples=16, seed=2)
    draws = guide.sample_posterior(16, generator=torch.Generator().manual_seed(2))
    mean = model.output(inputs, point).detach()
    shift = sum(
        torch.einsum(
            "bkd,sd->sbk", ref[s].reshape(bsz, k_out, -1), (draws[s] - point[s]).reshape(16, -1)
        )
        for s in point
    )
    expected = torch.log_softmax(mean + shift, -1)
    torch.testing.assert_close(pred.log_probs, expected, rtol=0, atol=1e-6)

    def train_step():
        loss = pb.infer.objectives.MAP().loss(model, guide, batch)
        loss.backward()

    train_peak = peak_bytes(train_step)
    ours_peak = peak_bytes(lambda: output_jacobians(model, inputs, point))
    bound = (1 + k_out) * train_peak + 8 * bsz * d * (1 + k_out)
    full_size = 8 * bsz * length * vocab * d
    assert train_peak > 8 * bsz * length * 32  # the tracker sees the step's activations
    assert ours_peak <= bound, (ours_peak, bound)
    assert bound < full_size / 2, (bound, full_size)  # the bound is far below the full route
    full_peak = peak_bytes(full_reference)
    print(f"peaks: train {train_peak}, ours {ours_peak}, bound {bound:.0f}, full {full_peak}")
    assert full_peak > bound  # the full-vocabulary route does not fit in it


def test_chunking_does_not_change_the_prediction() -> None:
    model, guide, batch = _llama_problem(vocab=99, batch=5, length=8)
    whole = pb.predict(model, guide, [batch], num_samples=8)
    chunked = pb.predict(model, guide, [batch], num_samples=8, examples_per_forward=2)
    torch.testing.assert_close(chunked.log_probs, whole.log_probs, rtol=0, atol=1e-12)


def test_pred_type_validated() -> None:
    prob = conjugate_core()
    with pytest.raises(ValueError, match="pred_type must be one of"):
        LaplaceGuide(prob.model, pred_type="mc")


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_glm_continuation_multiple_choice_equals_jacrev(normalize: str) -> None:
    """Choices as continuations ((B, K, L) rows, one network row per choice): the per-example
    Jacobians of the K choice scores equal jacrev over the shared θ̂ (9 outputs)."""
    from pyrobayes.models import MultipleChoice
    from pyrobayes.models.multiple_choice import encode_multiple_choice
    from tests.models.test_multiple_choice import CHOICES, PROMPTS, CharTokenizer

    torch.manual_seed(0)
    net = tiny_llama(initializer_range=0.2).double().eval()
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules=["q_proj", "v_proj"]),
        likelihood=MultipleChoice(normalize=normalize),
        trainable_modules=[],
        num_data=3,
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, answers=[0, 0, 0])
    guide = LaplaceGuide(model, structure="diag")
    with torch.no_grad():
        for s in guide.sites:
            guide.loc(s).normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    pb.fit(model, guide, [batch], epochs=0)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    point = guide.linearization_point()
    out, ours = output_jacobians(model, inputs, point)
    assert out.shape == (3, 3)
    ref = torch.func.jacrev(lambda vals: model.output(inputs, vals))(point)
    for s in point:
        scale = float(ref[s].abs().max())
        assert scale > 1e-2
        torch.testing.assert_close(ours[s], ref[s], rtol=0, atol=1e-6 * scale)
    pred = pb.predict(model, guide, [batch], num_samples=8)
    assert pred.log_probs is not None and pred.log_probs.shape == (100, 3, 3)  # link_samples


@pytest.mark.integration
@pytest.mark.parametrize("extra", [[], ["--single-token"]])
def test_benchmark_smoke(extra: list[str]) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    proc = subprocess.run(
        [sys.executable, "benchmarks/glm_predictive.py", "--smoke", "--choices", "2", *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 2 |" in proc.stdout


def test_pred_type_set_after_fitting_is_saved(tmp_path) -> None:
    model, guide, x, y, loader = _mlp_classifier()
    guide.pred_type = "probit"
    loaded = pb.load(pb.save(guide, tmp_path / "la.safetensors"), model)
    assert loaded.pred_type == "probit"
    torch.testing.assert_close(
        pb.predict(model, loaded, loader).log_probs, pb.predict(model, guide, loader).log_probs
    )
