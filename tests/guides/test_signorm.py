"""The ``"signorm"`` guide: the members of a σN-ensemble as a posterior (init, predict, export,
save/load, diagnose, adapters) and the τ sweep."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.contract import Mixture
from pyrobayes.infer.signorm import (
    SigmaNormDiversity,
    SigmaNormObjective,
    frontier,
    tau_sweep,
)
from pyrobayes.models.signorm import SigmaNormEnsemble


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3))


def _problem(seed: int = 0, num_members: int = 3, adapter=None):
    model = SigmaNormEnsemble(
        _net(seed), adapter, num_members=num_members, heads=["3"], trainable_modules=[],
        num_data=60,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(60, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return model, [(x[i : i + 20], y[i : i + 20]) for i in range(0, 60, 20)]


def test_members_start_as_the_conversion_prescribes():
    model, _ = _problem()
    guide = pb.posterior(model, "signorm", init_noise=0.2)
    assert isinstance(guide, Mixture) and guide.num_members == 3  # M from the model
    assert SigmaNormObjective().options(model, guide).diversity_sites == ["1.gamma"]
    gamma = guide.loc("1.gamma").detach()
    assert gamma.shape == (3, 12)
    # γ_t = γ_0 + N(0, 0.2²): 36 draws, their sd within 0.2·(1 ± 4/√(2·36)) (4 sigma)
    assert abs(float(gamma.std()) - 0.2) < 0.2 * 4 / math.sqrt(72)
    assert torch.equal(guide.loc("1.beta"), model.site_value("1.beta").expand(3, -1))
    heads = guide.loc("3.weight").detach()  # re-initialised per member: U(−1/√12, 1/√12), distinct
    assert heads.abs().max() <= 1 / math.sqrt(12)
    assert (heads[0] - heads[1]).abs().max() > 0.01
    copied = pb.posterior(model, "signorm", head_init="copy", num_particles=2)
    assert copied.num_members == 2
    assert torch.equal(copied.loc("3.weight"), model.site_value("3.weight").expand(2, -1, -1))


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"tau": 0.0}, ValueError, "tau"),
        ({"strength": -1.0}, ValueError, "strength"),
        ({"head_init": "zeros"}, ValueError, "head_init"),
        ({"regularized": ["nope"]}, ValueError, "regularized"),
        ({"temperature": 1.0}, TypeError, "Its options"),
    ],
)
def test_bad_options_are_named(options, error, words):
    model, _ = _problem()
    with pytest.raises(error, match=words):
        pb.posterior(model, "signorm", **options)


def test_predict_averages_the_member_probabilities():
    model, data = _problem()
    guide = pb.posterior(model, "signorm")
    pb.fit(model, guide, data, epochs=3, lr=0.05, seed=0)
    x = data[0][0]
    pred = pb.predict(model, guide, [(x, data[0][1])], num_samples=3)
    members = torch.stack(
        [
            torch.softmax(model.output(x, {s: guide.loc(s)[t].detach() for s in guide.sites}), -1)
            for t in range(3)
        ]
    )
    # each member appears once among the 3 stratified draws: the averages agree
    torch.testing.assert_close(pred.probs.mean(0), members.mean(0))


def test_save_load_export_and_diagnose_need_no_family_branch(tmp_path):
    pytest.importorskip("arviz")
    model, data = _problem()
    guide = pb.posterior(model, "signorm")
    optim = pb.Optimization(optimizer=SigmaNormDiversity(tau=0.25, strength=0.02))
    pb.fit(model, guide, data, epochs=2, lr=0.05, seed=0, optim=optim)
    path = pb.save(guide, tmp_path / "sn.safetensors", model=model)
    loaded = pb.load(path, model)
    assert loaded.config() == guide.config()
    for site in guide.sites:
        assert torch.equal(loaded.loc(site), guide.loc(site))
    idata = pb.to_inference_data(model, guide, data, num_samples=12, seed=0)
    assert idata.posterior.sizes["chain"] == 3  # ArviZ chains = members
    gamma = idata.posterior["1.gamma"].values  # (chain, draw, 12): each chain one member
    for c in range(3):
        assert (abs(gamma[c] - gamma[c, :1]) < 1e-12).all()
    diag = pb.diagnose(model, guide, data, num_samples=6)
    # point members: log q is the counting measure's log(1/M) at each member, finite
    assert math.isfinite(diag.elbo) and diag.num_samples == 6
    assert set(diag.calibration) >= {"ece", "nll"}


@pytest.mark.parametrize("kind", ["lora", "lora-xs"])
def test_sigma_norm_composes_with_adapters(kind):
    adapter = (
        pb.models.LoRA(rank=2, target_modules=["0"])
        if kind == "lora"
        else pb.models.LoRAXS(rank=2, target_modules=["0"])
    )
    model, data = _problem(adapter=adapter)
    guide = pb.posterior(model, "signorm", init_scale=1e-3)
    adapter_sites = [s for s in guide.sites if s.startswith("0.")]
    assert adapter_sites and SigmaNormObjective().options(model, guide).diversity_sites == [
        "1.gamma"
    ]
    before = {s: guide.loc(s).detach().clone() for s in adapter_sites}
    result = pb.fit(model, guide, data, epochs=3, lr=0.05, seed=0)
    assert math.isfinite(result.losses[-1])
    for s in adapter_sites:  # the members' adapters are trained, each its own
        assert (guide.loc(s) - before[s]).abs().max() > 1e-4
        assert (guide.loc(s)[0] - guide.loc(s)[1]).abs().max() > 1e-6


def test_frontier_keeps_the_non_dominated_rows():
    rows = [
        {"accuracy": 0.9, "ece": 0.05},
        {"accuracy": 0.8, "ece": 0.02},
        {"accuracy": 0.85, "ece": 0.06},  # dominated by the first
        {"accuracy": 0.9, "ece": 0.04},  # dominates the first
    ]
    assert frontier(rows) == [1, 3]


def test_tau_sweep_writes_the_frontier_and_obeys_jensen(tmp_path):
    pytest.importorskip("matplotlib")
    _, data = _problem()

    def make_model():
        return SigmaNormEnsemble(
            _net(0), num_members=3, heads=["3"], trainable_modules=[], num_data=60
        )

    rows = tau_sweep(
        make_model, data, data, taus=(0.1, 1.0), epochs=3, lr=0.05, run_dir=tmp_path,
        strength=0.01,
    )  # fmt: skip
    assert [r["tau"] for r in rows] == [0.1, 1.0]
    for r in rows:
        assert r["nll"] <= r["member_nll"] + 1e-12  # Jensen on every fitted run
        assert 0 <= r["ece"] <= 1 and 0 <= r["disagreement"] <= 1
    assert any(r["on_frontier"] == 1.0 for r in rows)
    assert json.loads((tmp_path / "tau_sweep.json").read_text()) == rows
    assert (tmp_path / "tau_sweep.png").stat().st_size > 1000


def test_auto_heads_that_find_no_head_say_so(caplog):
    # a plain network's output layer is named "3", not a head name: "auto" replicated nothing,
    # so the head stayed frozen and head_init had no effect, without a word
    with caplog.at_level("WARNING", logger="pyrobayes.models.signorm"):
        model = SigmaNormEnsemble(_net(), None, num_members=2, trainable_modules=[], num_data=60)
    assert "found no head" in caplog.text and "heads=[" in caplog.text
    assert not any(s.startswith("3.") for s in model.latent_sites)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pyrobayes.models.signorm"):
        SigmaNormEnsemble(_net(), None, num_members=2, heads=[], trainable_modules=[], num_data=60)
    assert "found no head" not in caplog.text  # an explicit choice
