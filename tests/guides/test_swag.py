"""SWAG (B-LoRA-XS) guide: moments, covariance, schedule, contract, I/O."""

from __future__ import annotations

import json
import warnings

import pyro
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from pyrobayes.guides import SWAGGuide
from pyrobayes.infer.swag import SwagCollector, swag_init, swag_step
from pyrobayes.models import FineTuneModel, LoRAXS
from tests.common import conjugate_core, mlp_problem, tensor_loader


def _two_core_model(num_data: int = 48) -> tuple[FineTuneModel, DataLoader]:
    prob = mlp_problem(
        (6, 5, 3),
        LoRAXS(rank=2, target_modules=["0", "2"]),
        num_data=num_data,
        seed=1,
        trainable_modules=[],
    )
    return prob.model, tensor_loader(prob.x, prob.y, 12)


def _fit_recording(model, guide, loader, epochs, lr=0.05, settings=None):
    """A hand-written loop over the public step API, recording every iterate and lr
    (``settings``: the fit's :class:`pyrobayes.infer.SWAG`)."""
    iterates, lrs = [], []
    fitter = pb.infer.make_fitter(model, guide, lr=lr, optimizer=settings)
    assert isinstance(fitter, pb.infer.SWAGFitter)
    model.train(True)
    fitter.begin(loader)
    for epoch in range(epochs):
        for batch in loader:
            fitter.step(batch)
            iterates.append(guide.iterate().clone())
            lrs.append(fitter.optimizer.param_groups[0]["lr"])
        fitter.epoch_end(epoch)
    fitter.end(loader)
    return torch.stack(iterates), lrs


def test_collector_functional_state() -> None:
    state = swag_init(3, 2)
    new = swag_step(state, torch.tensor([1.0, 2.0, 3.0]))
    assert int(state.num_collected) == 0 and int(new.num_collected) == 1  # old state untouched
    assert torch.equal(new.mean, torch.tensor([1.0, 2.0, 3.0]))
    c = SwagCollector(3, 2)
    for t in torch.arange(12.0).reshape(4, 3):
        c.step(t)
    assert c.state.deviation_matrix.shape == (3, 2)


def _raw_moments(iterates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The former collection: running θ̄ and raw θ²̄, ``Σ_diag = max(θ²̄ − θ̄², 1e-30)``."""
    mean = torch.zeros_like(iterates[0])
    sq_mean = torch.zeros_like(iterates[0])
    for i, theta in enumerate(iterates):
        w = 1.0 / (i + 1)
        mean = mean + (theta - mean) * w
        sq_mean = sq_mean + (theta.square() - sq_mean) * w
    return mean, sq_mean, (sq_mean - mean.square()).clamp_min(1e-30)


def test_welford_equals_raw_moments_in_float64() -> None:
    """Welford's M_2/n is the former θ²̄ − θ̄² in float64; θ̄ and D̂ are unchanged bit for bit."""
    g = torch.Generator().manual_seed(0)
    d, rank, n = 50, 4, 300
    # |θ̄|/sd ≤ ~6: the raw-moment formula's own float64 rounding (~eps·(θ̄/sd)²) stays ≪ 1e-12
    loc = torch.randn(d, generator=g, dtype=torch.float64)
    sd = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    iterates = loc + sd * torch.randn(n, d, generator=g, dtype=torch.float64)
    state = swag_init(d, rank, dtype=torch.float64)
    for theta in iterates:
        state = swag_step(state, theta)
    mean, sq_mean, diag = _raw_moments(iterates)
    assert torch.equal(state.mean, mean)
    torch.testing.assert_close(state.diag_variance, diag, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(state.sq_mean, sq_mean, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(state.m2, n * iterates.var(0, unbiased=False), rtol=1e-12, atol=0.0)
    # deviations against the running mean at collection time, as before
    running = torch.stack([iterates[: i + 1].mean(0) for i in range(n - rank, n)])
    torch.testing.assert_close(state.deviation_matrix.T, iterates[n - rank :] - running)


def test_float32_variance_far_from_zero() -> None:
    """|θ̄|/sd = 1000 in float32: Welford's variance is within 1% of float64; θ²̄ − θ̄² is not."""
    g = torch.Generator().manual_seed(1)
    d, n = 500, 256
    sd = torch.exp(torch.randn(d, generator=g, dtype=torch.float64))  # sd over ~e^±3
    sign = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    iterates = (
        1000.0 * sd * sign + sd * torch.randn(n, d, generator=g, dtype=torch.float64)
    ).float()
    exact = iterates.double().var(0, unbiased=False)  # the float32 iterates' variance, in float64
    state = swag_init(d, 2, dtype=torch.float32)
    for theta in iterates:
        state = swag_step(state, theta)
    new_err = ((state.diag_variance.double() - exact).abs() / exact).max()
    assert new_err < 0.01  # measured: 1.2e-4 (median 1.1e-5)
    # the former raw-moment formula in float32 cancels: order-one errors, some variances floored
    _, _, old = _raw_moments(iterates)
    old_err = (old.double() - exact).abs() / exact
    assert old_err.max() > 0.5 and old_err.median() > 0.1  # measured: max 2.3, median 0.32
    assert (old <= 1e-29).any()  # measured: 3.8% of the variances collapse to the 1e-30 floor
    torch.testing.assert_close(state.mean.double(), iterates.double().mean(0), rtol=1e-6, atol=0.0)


def test_load_state_saved_with_raw_second_moment(tmp_path) -> None:
    """Files from before Welford's update hold ``swag_sq_mean``; loading converts it to M_2."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=3)
    settings = pb.infer.SWAG(start_epoch=1)
    iterates, _ = _fit_recording(model, guide, loader, epochs=6, lr=0.05, settings=settings)
    collected = iterates[len(loader) - 1 :: len(loader)][1:]  # epoch ends 2..6
    assert int(guide.swag_num_collected) == collected.shape[0] == 5
    mean, sq_mean, old_diag = _raw_moments(collected)
    path = pb.save(guide, tmp_path / "new.safetensors")
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    assert "guide.swag_m2" in tensors and "guide.swag_sq_mean" not in tensors
    del tensors["guide.swag_m2"]
    tensors["guide.swag_mean"], tensors["guide.swag_sq_mean"] = mean, sq_mean  # the old layout
    # a real old-format header: files from before the integrity hash carry none
    old = json.loads(meta["pyrobayes"])
    old = {k: v for k, v in old.items() if k not in ("sha256", "model")}
    meta = {"pyrobayes": json.dumps({**old, "format_version": 1})}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    loaded = pb.load(tmp_path / "old.safetensors", model)
    assert "swag_m2" in loaded.state_dict() and "swag_sq_mean" not in loaded.state_dict()
    torch.testing.assert_close(loaded.state.diag_variance, old_diag, rtol=1e-14, atol=0.0)
    torch.testing.assert_close(loaded.state.diag_variance, guide.state.diag_variance)
    torch.testing.assert_close(
        loaded.posterior().covariance_matrix, guide.posterior().covariance_matrix
    )
    # an in-memory state dict of the old layout converts the same way (strict load)
    state = {k: v for k, v in guide.state_dict().items() if k != "swag_m2"}
    state["swag_sq_mean"] = sq_mean
    fresh = SWAGGuide(model, rank=3)
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(fresh.swag_m2, guide.swag_m2, rtol=1e-12, atol=1e-15)


def test_moments_match_stored_iterates() -> None:
    """SPECS 2(d) 4: constant-lr SGD on the linear-Gaussian core problem; steps collected."""
    prob = conjugate_core(num_data=64)
    loader = DataLoader(TensorDataset(prob.x, prob.y), batch_size=8, shuffle=True)
    guide = SWAGGuide(prob.model, rank=4, scale=0.5)
    sgd = pb.infer.SWAG(optimizer="sgd", start_epoch=2, collect_every_steps=1)
    iterates, _ = _fit_recording(prob.model, guide, loader, epochs=8, lr=2e-3, settings=sgd)
    steps_per_epoch = len(loader)
    kept = iterates[2 * steps_per_epoch :]  # collection starts after the burn-in epochs
    assert int(guide.swag_num_collected) == kept.shape[0] == 6 * steps_per_epoch
    mean = kept.mean(0)
    var = kept.var(0, unbiased=False)
    assert var.min() > 1e-8  # the iterates really move: the comparison is not vacuous
    torch.testing.assert_close(guide.swag_mean, mean, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(guide.state.diag_variance, var, rtol=1e-6, atol=0.0)
    # deviations against the running mean at collection time (not the final mean)
    n = kept.shape[0]
    running = torch.stack([kept[: i + 1].mean(0) for i in range(n - 4, n)])
    torch.testing.assert_close(guide.state.deviation_matrix.T, kept[n - 4 :] - running)
    assert not torch.allclose(guide.state.deviation_matrix.T, kept[n - 4 :] - mean)
    # the posterior mean is θ̄ split back into the site
    torch.testing.assert_close(guide.mean()[prob.site].reshape(-1), mean, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_sampling_covariance(scale: float) -> None:
    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=3, scale=scale)
    settings = pb.infer.SWAG(start_epoch=1)
    iterates, _ = _fit_recording(model, guide, loader, epochs=7, lr=0.05, settings=settings)
    d = iterates.shape[1]
    assert d == 2 * 4  # two 2x2 cores, concatenated
    epoch_ends = iterates[len(loader) - 1 :: len(loader)][1:]  # collected at epochs 2..7
    diag = (epoch_ends.square().mean(0) - epoch_ends.mean(0).square()).clamp_min(1e-30)
    running = torch.stack([epoch_ends[: i + 1].mean(0) for i in range(len(epoch_ends))])
    dev = (epoch_ends - running)[-3:].T  # (d, K)
    expected = scale * (torch.diag(diag) + dev @ dev.T / (3 - 1))
    q = guide.posterior()
    torch.testing.assert_close(q.covariance_matrix, expected, rtol=1e-8, atol=1e-12)
    assert (expected - torch.diag(torch.diagonal(expected))).abs().max() > 1e-6  # not diagonal
    # sample estimate: Var(Σ̂_ij) = (Σ_ij² + Σ_ii Σ_jj)/S for Gaussian draws; 5 sd per entry
    # (64 entries: a false alarm has probability < 64 · 6e-7)
    num = 40_000
    draws = guide.sample_posterior(num, generator=torch.Generator().manual_seed(0))
    flat = torch.cat([draws[s].reshape(num, -1) for s in guide.sites], -1)
    emp = torch.cov(flat.T)
    sd = ((expected**2 + torch.outer(expected.diag(), expected.diag())) / num).sqrt()
    assert ((emp - expected).abs() <= 5 * sd).all()
    # per-site marginals are the joint's blocks
    site = next(iter(guide.sites))
    marg = guide.get_posterior(site)
    assert marg.event_shape == torch.Size(guide.sites[site])
    torch.testing.assert_close(marg.base_dist.covariance_matrix, expected[:4, :4])
    lp = guide.log_prob(draws)
    torch.testing.assert_close(lp, q.log_prob(flat))


def test_swalr_schedule() -> None:
    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=2)
    settings = pb.infer.SWAG(swa_lr=0.01, anneal_epochs=2, start_epoch=2)
    _, lrs = _fit_recording(model, guide, loader, epochs=6, lr=0.05, settings=settings)
    per = len(loader)
    assert lrs[: 2 * per] == [0.05] * (2 * per)  # plain training until start_epoch
    assert lrs[-1] == pytest.approx(0.01)  # annealed to swa_lr
    # SWALR starts at start_epoch and steps at each later epoch end: halfway after one step
    assert lrs[3 * per] == pytest.approx(0.03)


def test_swalr_from_the_first_epoch_anneals_as_from_a_later_one() -> None:
    # start_epoch=0 built SWALR after epoch 0 and stepped it at once: torch warned that the
    # scheduler stepped before the optimizer, and annealing started one epoch late
    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=2)
    settings = pb.infer.SWAG(swa_lr=0.01, anneal_epochs=2, start_epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's lr_scheduler-order warning included
        _, lrs = _fit_recording(model, guide, loader, epochs=4, lr=0.05, settings=settings)
    per = len(loader)
    assert lrs[:per] == [0.05] * per  # epoch 0 at the start of the annealing
    assert lrs[per] == pytest.approx(0.03)  # halfway after one epoch, as from start_epoch=2
    assert lrs[-1] == pytest.approx(0.01)


def test_settings_given_to_the_guide_beside_a_fit_record_are_said_to_be_unused() -> None:
    # SWAGGuide(start_epoch=5) (deprecated) with optim=SWAG(swa_lr=...) collected from epoch 0
    model, loader = _two_core_model()
    with pytest.warns(DeprecationWarning):
        guide = SWAGGuide(model, rank=2, start_epoch=5)
    with pytest.warns(UserWarning, match=r"\(start_epoch=5; deprecated\) are not used") as w:
        pb.infer.make_fitter(model, guide, lr=0.05, optimizer=pb.infer.SWAG(swa_lr=0.01))
    assert any(r.filename == __file__ for r in w)  # at the user's line


def test_unfitted_raises_and_pyro_contract() -> None:
    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=2)
    with pytest.raises(RuntimeError, match="SWAGGuide is not fitted"):
        guide.sample_posterior(2)
    pb.fit(model, guide, loader, epochs=4, lr=0.05)
    batch = next(iter(loader))
    tr = pyro.poutine.trace(guide).get_trace(batch)
    for site, shape in guide.sites.items():
        assert tr.nodes[site]["value"].shape == shape
    # the Pyro guide and the batched API describe one joint: its aux site carries the joint
    model_tr = pyro.poutine.trace(pyro.poutine.replay(model, tr)).get_trace(batch)
    assert torch.isfinite(model_tr.log_prob_sum())


def test_save_load_round_trip(tmp_path) -> None:
    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=3, scale=2.0)
    optim = pb.Optimization(optimizer=pb.infer.SWAG(start_epoch=1))
    pb.fit(model, guide, loader, epochs=5, lr=0.05, optim=optim)
    path = pb.save(guide, tmp_path / "swag.safetensors")
    loaded = pb.load(path, model)
    assert isinstance(loaded, SWAGGuide) and loaded.scale == 2.0 and loaded.rank == 3
    a = guide.sample_posterior(5, generator=torch.Generator().manual_seed(3))
    b = loaded.sample_posterior(5, generator=torch.Generator().manual_seed(3))
    for s in guide.sites:
        torch.testing.assert_close(a[s], b[s])
    pred = pb.predict(model, loaded, loader, num_samples=4)
    assert pred.log_probs.shape == (4, 48, 3)
    counts = pb.count_parameters(loaded)
    assert counts["latent"] == 8 and counts["posterior_storage"] == 8 * (2 + 3)


def test_optimizer_settings_are_the_fitters_not_the_posteriors(tmp_path) -> None:
    """The old keywords still reach the fitter (one release, DeprecationWarning naming the new
    spelling); the posterior file holds none of them; the fitter's checkpoint holds them and
    refuses to resume under other ones."""
    model, loader = _two_core_model()
    with pytest.warns(DeprecationWarning, match=r"pb\.infer\.SWAG\(start_epoch=2, swa_lr=0\.01"):
        old = SWAGGuide(model, rank=2, start_epoch=2, swa_lr=0.01, anneal_epochs=2)
    new = SWAGGuide(model, rank=2)
    settings = pb.infer.SWAG(swa_lr=0.01, anneal_epochs=2, start_epoch=2)
    _, lrs_old = _fit_recording(model, old, loader, epochs=6, lr=0.05)
    _, lrs_new = _fit_recording(model, new, loader, epochs=6, lr=0.05, settings=settings)
    assert lrs_old == lrs_new and lrs_new[-1] == pytest.approx(0.01)  # the same annealing
    assert old.config() == new.config() and "swa_lr" not in new.config()
    header = pb.io.read_header(pb.save(new, tmp_path / "q.safetensors"))
    assert not {"swa_lr", "anneal_epochs", "anneal_strategy", "optimizer"} & set(header["config"])
    fitter = pb.infer.make_fitter(model, new, lr=0.05, optimizer=settings)
    state = fitter.state_dict()
    assert state["settings"] == {
        "optimizer": "adam",
        "swa_lr": 0.01,
        "anneal_epochs": 2,
        "anneal_strategy": "linear",
        "start_epoch": 2,
        "collect_every": 1,
        "collect_every_steps": None,
    }
    other = pb.infer.make_fitter(model, new, lr=0.05, optimizer=pb.infer.SWAG(optimizer="sgd"))
    with pytest.raises(ValueError, match=r"other SWAG settings \(optimizer='adam' there"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="anneal_strategy must be 'cos' or 'linear'"):
        pb.infer.SWAG(anneal_strategy="cosine")


def test_an_older_file_with_optimizer_settings_still_loads(tmp_path, caplog) -> None:
    """A posterior saved when the settings were the guide's carries them in its options: it
    loads (they are ignored, with a logged note) into an equal guide."""
    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=2)
    pb.fit(model, guide, loader, epochs=3, lr=0.05)
    legacy = {"swa_lr": None, "anneal_epochs": 5, "anneal_strategy": "linear", "optimizer": "sgd"}
    options = guide.config()
    guide.config = lambda: {**options, **legacy}  # what such a file's header holds
    path = pb.save(guide, tmp_path / "old.safetensors")
    assert pb.io.read_header(path)["config"]["optimizer"] == "sgd"
    with caplog.at_level("INFO", logger="pyrobayes.io"):
        loaded = pb.load(path, model)
    assert "ignoring the fit settings" in caplog.text and "optimizer='sgd'" in caplog.text
    for key, value in guide.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key])
    pb.io.load_state(SWAGGuide(model, rank=2), path)  # into a guide built as today: no mismatch


def test_fitting_a_fitted_guide_again_warns_that_its_iterates_are_discarded(tmp_path) -> None:
    # a second pb.fit (even epochs=0, the way Laplace is refitted) reset the collected moments
    # (6 iterates -> 1, a degenerate posterior) with log lines only
    model, loader = _two_core_model()
    guide = SWAGGuide(model, rank=3)
    pb.fit(model, guide, loader, epochs=6, lr=0.05)  # a fresh guide: nothing to discard
    assert int(guide.swag_num_collected) == 6
    with pytest.warns(UserWarning, match=r"held 6 collected iterate\(s\).*discarded.*resume=True"):
        pb.fit(model, guide, loader, epochs=0)
    assert int(guide.swag_num_collected) == 1
    with pytest.warns(UserWarning, match=r"held 1 collected iterate\(s\)") as caught:
        pb.fit(model, guide, loader, epochs=2, lr=0.05)
    assert len([w for w in caught if "collected iterate" in str(w.message)]) == 1  # once per fit
    # resuming a fit from its checkpoint with the guide that ran it restores its moments:
    # nothing is lost, no warning (warnings are errors in this suite)
    other = SWAGGuide(model, rank=3)
    optim = pb.Optimization(num_steps=8)  # 4 batches per epoch: 2 epochs, 2 iterates
    pb.fit(model, other, loader, lr=0.05, optim=optim, checkpoint=pb.Checkpointing(tmp_path))
    assert int(other.swag_num_collected) == 2
    pb.fit(
        model,
        other,
        loader,
        lr=0.05,
        optim=pb.Optimization(num_steps=16),
        checkpoint=pb.Checkpointing(tmp_path, resume=True),
    )
    assert int(other.swag_num_collected) == 4


def test_validation_on_swag_says_it_drops_the_moments_after_the_selected_epoch():
    # Validation restored the selected epoch's guide state: 8 epochs kept 7 iterates (best 6),
    # or 1 (best 0), with no word
    torch.manual_seed(0)
    x, y = torch.randn(80, 4), torch.randint(0, 3, (80,))
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = FineTuneModel(net, LoRAXS(rank=2, target_modules=["0"]), num_data=60)
    guide = SWAGGuide(model, rank=2)
    train = [(x[i : i + 20], y[i : i + 20]) for i in range(0, 60, 20)]
    with pytest.warns(UserWarning, match=r"moments collected after the selected epoch"):
        pb.fit(model, guide, train, epochs=3, validation=pb.Validation([(x[60:], y[60:])]))


def test_swalr_to_zero_is_refused():
    # swa_lr=0 collapsed the collected iterates to one point: a SWAG posterior of zero spread
    with pytest.raises(ValueError, match="swa_lr must be a finite number > 0"):
        pb.infer.SWAG(swa_lr=0.0)
