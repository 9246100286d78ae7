"""σN-ensembles: member norm layers, conversion of pretrained networks, the diversity regularizer,
the members objective (batched and as a Pyro program) and its behaviour on digits."""

from __future__ import annotations

import copy
import math
import statistics
import warnings

import pyro
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyrobayes as pb
from pyrobayes.infer.signorm import (
    SigmaNormDiversity,
    SigmaNormObjective,
    members_guide,
    members_program,
)
from pyrobayes.models.signorm import (
    MemberNorm,
    SigmaNorm,
    SigmaNormEnsemble,
    diversity,
    owner_corner,
)
from tests.common import tiny_bert, tiny_llama


def _bn_mlp(seed: int = 0) -> nn.Sequential:
    """A pretrained-looking MLP with BatchNorm1d: running statistics from a few training batches,
    affine weights away from 1 (several above the sigmoid's range), biases away from 0."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(5, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 3),
    )
    net.train()
    for _ in range(3):
        net(2 * torch.randn(32, 5) + 1)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.weight.uniform_(0.5, 2.5)
                m.bias.normal_()
    return net.eval()


def _bert_with_norms(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    bert = tiny_bert()
    with torch.no_grad():
        for m in bert.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 2.5)
                m.bias.normal_()
    return bert.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---------------------------------------------------------------------------------------------
# the regularizer
# ---------------------------------------------------------------------------------------------

TAUS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


def test_owner_corner_matches_the_table_and_the_continuous_minimizer():
    # the minimizing corner of f(k) = k/τ − M log(k e^{1/τ} + M − k) for M = 8
    assert [owner_corner(8, t) for t in TAUS] == [1, 1, 2, 3, 3, 4, 4]
    for tau in TAUS:  # the integer minimizer of a convex f is next to the continuous one
        relaxed = 8 * (tau - 1 / math.expm1(1 / tau))
        assert abs(owner_corner(8, tau) - relaxed) <= 1.0


def test_diversity_is_the_sum_of_log_softmax_and_is_largest_at_uniform_scales():
    g = torch.randn(5, 7)
    tau = 0.3
    s = torch.sigmoid(g) / tau
    expected = (s - torch.logsumexp(s, dim=0, keepdim=True)).sum()
    assert torch.allclose(
        diversity([g, g[:, :3]], tau),
        expected
        + expected.new_tensor(0)
        + (s[:, :3] - torch.logsumexp(s[:, :3], dim=0, keepdim=True)).sum(),
    )
    # at equal scales every softmax is uniform: M·C·log(1/M), the maximum of Σ_m log p_m
    assert math.isclose(float(diversity([torch.zeros(5, 7)], tau)), 35 * math.log(1 / 5))
    assert float(diversity([g], tau)) < 35 * math.log(1 / 5)


def test_regularizer_alone_reaches_about_k_star_owners_per_feature():
    """Minimizing L_div alone over γ (M = 8, Adam, 2000 steps, γ ~ N(0, 1)) gives about k*(τ)
    members with σ(γ) > ½ per feature: the median over 200 features within ±1 of the table.

    Individual features can stop at a neighbouring corner (σ saturates, its gradient vanishes;
    measured: 65-95% of features within ±1 depending on τ), so the median is asserted, and that
    it does not decrease with τ."""
    medians = []
    for tau in TAUS:
        g = torch.Generator().manual_seed(0)
        gamma = torch.randn(8, 200, generator=g).requires_grad_()
        opt = torch.optim.Adam([gamma], lr=0.01)
        for _ in range(2000):
            opt.zero_grad()
            diversity([gamma], tau).backward()
            opt.step()
        owners = (torch.sigmoid(gamma) > 0.5).sum(0).double()
        median = float(owners.median())
        assert abs(median - owner_corner(8, tau)) <= 1, (tau, median)
        assert float(((owners - owner_corner(8, tau)).abs() <= 1).double().mean()) > 0.5, tau
        medians.append(median)
    assert medians == sorted(medians), medians


# ---------------------------------------------------------------------------------------------
# conversion and the batched forward
# ---------------------------------------------------------------------------------------------


def test_converted_bert_reproduces_the_pretrained_outputs():
    bert = _bert_with_norms()
    ids = torch.randint(1, 99, (3, 9), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        reference = bert(**inputs).logits
    model = SigmaNormEnsemble(copy.deepcopy(bert), num_members=3)
    norms = [m for m in model.net.modules() if isinstance(m, MemberNorm)]
    assert len(norms) == 5  # embeddings + 2 per layer
    assert (torch.cat([m.fixed_scale for m in norms]) > 2.0).any()  # w/σ(γ0) beyond (0, 1)
    assert {"classifier.weight", "classifier.bias"} <= set(model.latent_sites)
    with torch.no_grad():
        out = model.output(inputs, model.init_values())
    assert _rel(out, reference) < 1e-5


def test_converted_batchnorm_mlp_reproduces_the_pretrained_outputs():
    net = _bn_mlp()
    x = torch.randn(10, 5)
    with torch.no_grad():
        reference = net(x)
    model = SigmaNormEnsemble(copy.deepcopy(net), num_members=4, heads=["6"], trainable_modules=[])
    stats = ["running_mean", "running_var"]
    assert list(model.latent_sites) == [
        *(f"{layer}.{role}" for layer in ("1", "4") for role in ("gamma", "beta", *stats)),
        "6.weight",
        "6.bias",
    ]
    with torch.no_grad():
        out = model.output(x, model.init_values())
    assert _rel(out, reference) < 1e-5


def test_batchnorm2d_conversion_reproduces_the_pretrained_outputs():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, 3))  # fmt: skip
    net.train()
    net(torch.randn(16, 2, 6, 6) + 0.5)
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 2.5)
    net.eval()
    x = torch.randn(5, 2, 6, 6)
    with torch.no_grad():
        reference = net(x)
    model = SigmaNormEnsemble(copy.deepcopy(net), num_members=2, heads=["4"], trainable_modules=[])
    with torch.no_grad():
        assert _rel(model.output(x, model.init_values()), reference) < 1e-5


def test_rmsnorm_conversion_on_tiny_llama_and_batched_members():
    """LLaMA's RMSNorms (float32 inside, as Hugging Face computes them) become member layers:
    the converted network reproduces the original, and batched members = separate forwards."""
    torch.manual_seed(0)
    llama = tiny_llama().eval()
    with torch.no_grad():
        for name, p in llama.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 2.5)
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = llama(input_ids=ids).logits
    model = SigmaNormEnsemble(
        copy.deepcopy(llama), pb.models.LoRAXS(rank=2, target_modules=["q_proj", "v_proj"]),
        num_members=2, heads=[],
    )  # fmt: skip
    norms = [m for m in model.net.modules() if isinstance(m, MemberNorm)]
    assert len(norms) == 5 and all(m.norm_kind == "rms" and m.upcast for m in norms)
    with torch.no_grad():
        assert _rel(model.net(input_ids=ids).logits, reference) < 1e-5  # at γ_0, β = 0
        values = _member_values(model, 2)
        inputs = {"input_ids": ids}
        batched = model.batched_output(inputs, values)
        separate = torch.stack(
            [model.output(inputs, {s: v[t] for s, v in values.items()}) for t in range(2)]
        )
    assert (batched - separate).abs().max() < 1e-6


def test_torch_rmsnorm_converts_and_an_unknown_formula_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6), nn.Linear(6, 2))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 2.5)
    x = torch.randn(5, 4)
    with torch.no_grad():
        reference = net(x)
    model = SigmaNormEnsemble(copy.deepcopy(net), num_members=2, heads=["2"], trainable_modules=[])
    with torch.no_grad():
        assert _rel(model.output(x, model.init_values()), reference) < 1e-5

    class GemmaLikeRMSNorm(nn.Module):  # scales by (1 + w): not the recognised formula
        def __init__(self, size: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(size))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return y * (1 + self.weight)

    bad = nn.Sequential(nn.Linear(4, 6), GemmaLikeRMSNorm(6), nn.Linear(6, 2))
    with pytest.raises(ValueError, match="does not reproduce it"):
        SigmaNormEnsemble(bad, num_members=2, heads=["2"], trainable_modules=[])


def _member_values(model, num_members: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        s: v.unsqueeze(0) + 0.3 * torch.randn(num_members, *v.shape, generator=g)
        for s, v in model.init_values().items()
    }


@pytest.mark.parametrize("adapter", [None, "lora-xs", "lora"])
def test_batched_members_equal_separate_forwards_on_bert(adapter):
    bert = _bert_with_norms()
    inner = {
        None: None,
        "lora-xs": pb.models.LoRAXS(rank=2, target_modules=["query", "value"]),
        "lora": pb.models.LoRA(rank=2, target_modules=["query", "value"]),
    }[adapter]
    model = SigmaNormEnsemble(bert, inner, num_members=3)
    if inner is not None:  # the adapter's sites come first, then the norms and the head
        assert next(iter(model.latent_sites)).startswith("bert.encoder.layer.0.attention")
    values = _member_values(model, 3)
    ids = torch.randint(1, 99, (4, 7), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        batched = model.batched_output(inputs, values)
        separate = torch.stack(
            [model.output(inputs, {s: v[t] for s, v in values.items()}) for t in range(3)]
        )
    assert batched.shape == separate.shape == (3, 4, 2)
    assert (batched - separate).abs().max() < 1e-6
    assert (separate[0] - separate[1]).abs().max() > 1e-3  # the members differ


def test_batched_members_equal_separate_forwards_with_member_batchnorm_statistics():
    model = SigmaNormEnsemble(_bn_mlp(), num_members=3, heads=["6"], trainable_modules=[])
    assert {"1.running_mean", "1.running_var", "4.running_mean"} <= set(model.latent_sites)
    values = _member_values(model, 3)  # every member with statistics of its own
    values = {
        s: v.abs() if s.endswith("running_var") else v for s, v in values.items()
    }  # fmt: skip
    x = torch.randn(6, 5)
    with torch.no_grad():
        batched = model.batched_output(x, values)
        separate = torch.stack(
            [model.output(x, {s: v[t] for s, v in values.items()}) for t in range(3)]
        )
    assert (batched - separate).abs().max() < 1e-6
    assert (separate[0] - separate[1]).abs().max() > 1e-3


def test_batchnorm_member_uses_its_own_statistics_in_eval_and_batch_statistics_in_training():
    """Eval: member t normalizes with its running statistics (no gradient reaches them).
    Training: each slice with its own batch statistics, recorded (unbiased variance) for the
    update; the output is c ⊙ σ(γ_t) ⊙ (x − μ)/√(v + ε) + β_t with c = w/σ(0)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4, momentum=0.2)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.normal_()
    layer = MemberNorm(bn)
    gamma, beta = torch.randn(3, 4), torch.randn(3, 4)
    mean, var = torch.randn(3, 4), torch.rand(3, 4) + 0.5
    layer.gamma, layer.beta = nn.Parameter(gamma), nn.Parameter(beta)  # (S, C) member values
    layer.running_mean = nn.Parameter(mean.clone().requires_grad_())
    layer.running_var = nn.Parameter(var.clone().requires_grad_())
    slices = [torch.randn(6, 4) * (t + 1) + 3 * t for t in range(3)]
    x = torch.cat(slices)
    scale = 2 * bn.weight.detach() * torch.sigmoid(gamma)
    out = layer.eval()(x)
    for t in range(3):
        expected = (slices[t] - mean[t]) / torch.sqrt(var[t] + bn.eps) * scale[t] + beta[t]
        torch.testing.assert_close(out[6 * t : 6 * t + 6], expected)
    out.sum().backward()
    assert layer.running_mean.grad is None and layer.running_var.grad is None
    out = layer.train()(x)
    batch_mean, batch_var = layer.batch_statistics
    for t in range(3):
        m, v = slices[t].mean(0), slices[t].var(0, unbiased=False)
        expected = (slices[t] - m) / torch.sqrt(v + bn.eps) * scale[t] + beta[t]
        torch.testing.assert_close(out[6 * t : 6 * t + 6], expected)
        torch.testing.assert_close(batch_mean[t], m)
        torch.testing.assert_close(batch_var[t], slices[t].var(0, unbiased=True))


def test_batchnorm_running_statistics_are_per_member():
    """With the backbone in training mode every fitted member's running statistics are the
    BatchNorm EMA of its own batch statistics: member t's equal an nn.BatchNorm1d run on member
    t's inputs to that layer, step by step (the second BatchNorm sees member-specific inputs)."""
    net = _bn_mlp()
    model = SigmaNormEnsemble(
        copy.deepcopy(net), num_members=3, heads=["6"], trainable_modules=[],
        train_backbone_mode=True, num_data=32,
    )  # fmt: skip
    guide = pb.posterior(model, "signorm")
    settings = SigmaNormDiversity(strength=0.0)
    fitter = pb.infer.make_fitter(model, guide, lr=0.0, optimizer=settings)  # only the statistics
    batches = [torch.randn(32, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    references = [copy.deepcopy(net[4]).train() for _ in range(3)]
    model.train()
    for xb in batches:
        # member t's input to the second BatchNorm, computed by hand with its own values
        for t, ref in enumerate(references):
            h = net[0](xb)
            h = F.batch_norm(h, None, None, training=True, eps=net[1].eps)
            h = h * 2 * net[1].weight * torch.sigmoid(guide.loc("1.gamma")[t])
            h = net[3](torch.tanh(h + guide.loc("1.beta")[t]))
            ref(h)
        fitter.step((xb, torch.randint(0, 3, (32,))))
    for t, ref in enumerate(references):
        torch.testing.assert_close(guide.loc("4.running_mean")[t], ref.running_mean)
        torch.testing.assert_close(guide.loc("4.running_var")[t], ref.running_var)
    stats = guide.loc("4.running_mean")
    assert (stats[0] - stats[1]).abs().max() > 1e-3  # per member, not shared


def test_the_config_round_trips_through_its_dict():
    from pyrobayes.models.adapters import adapter_from_dict

    for inner in (None, pb.models.LoRAXS(rank=2, target_modules=["0"]), pb.models.LoRA(rank=3)):
        config = SigmaNorm(num_members=3, norm_modules=["1"], heads=["6"], adapter=inner)
        again = adapter_from_dict(config.to_dict())
        assert isinstance(again, SigmaNorm) and again.to_dict() == config.to_dict()


def test_bad_conversions_are_refused_with_clear_errors():
    with pytest.raises(ValueError, match="no LayerNorm"):
        SigmaNormEnsemble(nn.Sequential(nn.Linear(3, 2)), num_members=2, heads=[])
    with pytest.raises(ValueError, match="norm_modules"):
        SigmaNormEnsemble(_bn_mlp(), norm_modules=["nope"], heads=["6"])
    with pytest.raises(ValueError, match="num_members"):
        SigmaNorm(num_members=0)
    with pytest.raises(TypeError, match="adapter"):
        SigmaNorm(adapter="lora")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normalized_shape"):
        MemberNorm(nn.LayerNorm((3, 4)), 2)


# ---------------------------------------------------------------------------------------------
# the objective
# ---------------------------------------------------------------------------------------------


def _ln_mlp(seed: int = 0, width: int = 16, d_in: int = 64, classes: int = 10) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, classes)
    )  # fmt: skip


def test_one_member_without_diversity_is_plain_training_with_a_sigmoid_bounded_scale():
    """M = 1, λ = 0: the σN fit equals a hand-written Adam loop on a LayerNorm network whose
    scale is c·σ(γ) (c = w/σ(γ_0)), trained over (γ, β, head) with the summed cross-entropy."""
    net = _ln_mlp()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 10, (40,), generator=torch.Generator().manual_seed(4))
    # the reference: the pretrained network with a sigmoid-bounded scale
    ref = copy.deepcopy(net)
    w0 = ref[1].weight.detach().clone()
    gamma = torch.zeros(16, requires_grad=True)
    beta = ref[1].bias.detach().clone().requires_grad_()
    head_w = ref[3].weight.detach().clone().requires_grad_()
    head_b = ref[3].bias.detach().clone().requires_grad_()
    opt = torch.optim.Adam([gamma, beta, head_w, head_b], lr=0.02)

    def reference_loss(xb, yb):
        h = F.layer_norm(ref[0](xb), (16,)) * (w0 / 0.5) * torch.sigmoid(gamma) + beta
        logits = F.linear(torch.tanh(h), head_w, head_b)
        return F.cross_entropy(logits, yb, reduction="sum")  # N/B = 1: the dataset sum

    model = SigmaNormEnsemble(net, num_members=1, heads=["3"], trainable_modules=[], num_data=40)
    guide = pb.posterior(model, "signorm", init_noise=0.0, head_init="copy")
    settings = SigmaNormDiversity(strength=0.0)
    fitter = pb.infer.make_fitter(model, guide, lr=0.02, optimizer=settings)
    for _ in range(25):
        loss = fitter.step((x, y))
        opt.zero_grad()
        expected = reference_loss(x, y)
        expected.backward()
        opt.step()
        assert math.isclose(loss, float(expected.detach()), rel_tol=1e-9)
    torch.testing.assert_close(guide.loc("1.gamma")[0], gamma.detach(), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(guide.loc("3.weight")[0], head_w.detach(), rtol=1e-8, atol=1e-8)


def test_objective_is_the_mean_member_loss_plus_the_scaled_diversity_term():
    net = _ln_mlp()
    model = SigmaNormEnsemble(net, num_members=4, heads=["3"], trainable_modules=[], num_data=100)
    guide = pb.posterior(model, "signorm")
    x = torch.randn(10, 64)
    y = torch.randint(0, 10, (10,))
    loss = SigmaNormObjective(SigmaNormDiversity(tau=0.25, strength=0.03)).loss(
        model, guide, (x, y)
    )
    nll = 0.0
    for t in range(4):
        values = {s: guide.loc(s)[t] for s in guide.sites}
        logits = model.output(x, values)
        nll += F.cross_entropy(logits, y, reduction="sum") * 100 / 10 / 4
    div = diversity([guide.loc("1.gamma")], 0.25)
    assert math.isclose(
        float(loss.detach()), float((nll + 100 * 0.03 * div).detach()), rel_tol=1e-10
    )


def test_the_pyro_program_gives_the_same_loss_and_gradients():
    """Trace_ELBO on (members plate with scale 1/M, prior masked, pyro.factor) with the members'
    Delta guide = the batched objective (Delta's log q = 0)."""
    net = _ln_mlp()
    model = SigmaNormEnsemble(net, num_members=3, heads=["3"], trainable_modules=[], num_data=50)
    guide = pb.posterior(model, "signorm")
    settings = SigmaNormDiversity(tau=0.5, strength=0.1)
    x = torch.randn(10, 64)
    y = torch.randint(0, 10, (10,))
    params = list(guide.parameters())
    batched = SigmaNormObjective(settings).loss(model, guide, (x, y))
    g_batched = torch.autograd.grad(batched, params)
    elbo = pyro.infer.Trace_ELBO()
    program = elbo.differentiable_loss(
        members_program(model, guide, settings), members_guide(guide), (x, y)
    )
    g_program = torch.autograd.grad(program, params)
    assert math.isclose(float(program.detach()), float(batched.detach()), rel_tol=1e-10)
    for a, b in zip(g_batched, g_program, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# fitted on digits
# ---------------------------------------------------------------------------------------------


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x) / 16.0
    y = torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:600], y[:600]), (x[1200:], y[1200:])


def _fit_digits(tau: float, seed: int, strength: float = 0.01):
    (x, y), (xt, yt) = _digits()
    net = _ln_mlp(seed, width=32)
    model = SigmaNormEnsemble(net, num_members=4, heads=["3"], trainable_modules=[], num_data=600)
    pyro.set_rng_seed(seed)
    guide = pb.posterior(model, "signorm")
    data = [(x[i : i + 100], y[i : i + 100]) for i in range(0, 600, 100)]
    optim = pb.Optimization(optimizer=SigmaNormDiversity(tau=tau, strength=strength))
    pb.fit(model, guide, data, epochs=25, lr=0.02, seed=seed, optim=optim)
    pred = pb.predict(model, guide, [(xt, yt)], num_samples=4)
    owners = (torch.sigmoid(guide.loc("1.gamma")) > 0.5).sum(0).double().mean()
    return pred.probs, yt, float(owners)


def _disagreement(probs):
    labels = probs.argmax(-1)
    pairs = [(a, b) for a in range(len(labels)) for b in range(a + 1, len(labels))]
    return sum(float((labels[a] != labels[b]).double().mean()) for a, b in pairs) / len(pairs)


def test_jensen_and_monotone_diversity_in_tau_on_digits():
    """Lower τ → fewer owners per feature and more member disagreement (median of 3 seeds), and
    on every fitted run the NLL of the member average ≤ the mean member NLL (Jensen)."""
    taus = (0.05, 0.5, 5.0)
    disagreement: dict[float, list[float]] = {t: [] for t in taus}
    owners: dict[float, list[float]] = {t: [] for t in taus}
    for tau in taus:
        for seed in range(3):
            probs, labels, own = _fit_digits(tau, seed)
            nll_avg = -torch.log(probs.mean(0).gather(-1, labels[:, None])).mean()
            nll_members = -torch.log(probs.gather(-1, labels.expand(4, -1)[..., None])).mean()
            assert float(nll_avg) <= float(nll_members) + 1e-12
            accuracy = float((probs.mean(0).argmax(-1) == labels).double().mean())
            assert accuracy > 0.8, (tau, seed, accuracy)  # a fitted run, not a broken one
            disagreement[tau].append(_disagreement(probs))
            owners[tau].append(own)
    med_d = [statistics.median(disagreement[t]) for t in taus]
    med_o = [statistics.median(owners[t]) for t in taus]
    assert med_d[0] > med_d[1] > med_d[2], (med_d, disagreement)
    assert med_o[0] < med_o[1] < med_o[2], (med_o, owners)


def test_members_that_start_identical_are_warned_of():
    # init_noise=0 with head_init="copy" (and init_scale=0) gave M identical members that
    # stay identical (member spread 0, disagreement 0) without a word
    model = SigmaNormEnsemble(_ln_mlp(), num_members=3, heads=["3"], trainable_modules=[])
    with pytest.warns(UserWarning, match=r"start all 3 members identical") as caught:
        pb.posterior(model, "signorm", init_noise=0.0, head_init="copy")
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any source of difference: silent
        pb.posterior(model, "signorm", init_noise=0.0)  # heads re-initialised per member
        pb.posterior(model, "signorm", head_init="copy")  # norm scales perturbed


def test_a_network_whose_norms_sigma_n_cannot_convert_is_refused_naming_them():
    """Gemma's RMSNorm scales by (1 + w) and keeps its ε as ``eps``: σN converts none of its
    norms, and the refusal names the class it found instead of saying the network has none."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GemmaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        num_labels=3,
        pad_token_id=0,
    )
    net = transformers.GemmaForSequenceClassification(config)
    with pytest.raises(ValueError, match=r"its GemmaRMSNorm computes another formula"):
        pb.models.FineTuneModel(net, pb.models.SigmaNorm(), num_data=8)
