"""pb.fit: steps/epochs, seeding, checkpoints, resume, and failure without loss of state."""

from __future__ import annotations

import inspect
import json
import warnings

import pyro
import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer.checkpoint import latest
from tests.common import conjugate_core, split_batches


def test_epochs_and_steps_and_seed():
    torch.manual_seed(0)  # the cores' N(0, 1e-5²) init draws from the global RNG
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    g1 = pb.guides.MeanFieldGuide(prob.model)
    r1 = pb.fit(prob.model, g1, data, epochs=2, seed=3)
    assert len(r1.losses) == 2 * len(data) and r1.state["epoch"] == 2
    torch.manual_seed(0)
    prob2 = conjugate_core()
    g2 = pb.guides.MeanFieldGuide(prob2.model)
    r2 = pb.fit(prob2.model, g2, data, epochs=2, seed=3)
    assert torch.equal(r1.losses, r2.losses)  # same seed, same trajectory
    r3 = pb.fit(prob.model, g1, data, optim=pb.Optimization(num_steps=3))
    assert len(r3.losses) == 3
    with pytest.raises(ValueError, match="epochs"):
        pb.fit(prob.model, g1, data)


@pytest.mark.parametrize("family", ["meanfield", "map", "ivon", "kron-ivon", "swag"])
def test_resume_continues_where_it_stopped(tmp_path, family):
    # a re-decomposition between the halves
    settings = pb.infer.KronIVON(T_inv=3) if family == "kron-ivon" else None
    # a constant rate: IVON's default cosine over the run differs between the 2-epoch first
    # half and the 4-epoch run (a kill and resume at one length: tests/infer/test_checkpoints.py)
    optim = pb.Optimization(optimizer=settings, scheduler="constant")
    lr = 0.05 if "ivon" in family else 1e-2
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    guide = pb.posterior(prob.model, family)
    full = pb.fit(prob.model, guide, data, epochs=4, seed=0, lr=lr, optim=optim)
    torch.manual_seed(0)
    prob_b = conjugate_core()
    guide_b = pb.posterior(prob_b.model, family)
    pb.fit(
        prob_b.model,
        guide_b,
        data,
        epochs=2,
        seed=0,
        checkpoint=pb.Checkpointing(tmp_path),
        lr=lr,
        optim=optim,
    )
    torch.manual_seed(0)
    prob_c = conjugate_core()
    guide_c = pb.posterior(prob_c.model, family)
    resumed = pb.fit(
        prob_c.model,
        guide_c,
        data,
        epochs=4,
        seed=0,  # another seed is refused (test_resume_refuses_other_run_settings_by_name)
        checkpoint=pb.Checkpointing(tmp_path, resume=True),
        lr=lr,
        optim=optim,
    )
    # guide state, optimizer moments and RNG state restored: the same trajectory to round-off
    torch.testing.assert_close(resumed.losses, full.losses, rtol=1e-10, atol=1e-8)


def test_non_finite_loss_stops_before_update_and_keeps_checkpoint(tmp_path):
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    guide = pb.guides.MeanFieldGuide(prob.model)
    pb.fit(prob.model, guide, data, epochs=1, checkpoint=pb.Checkpointing(tmp_path))
    saved = pb.io.read_header(latest(tmp_path) / "posterior.safetensors")
    assert saved["family"] == "meanfield"
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    # finite targets whose loss overflows, as a diverging run's (NaN data is refused earlier)
    bad = [(prob.x[:16], torch.full_like(prob.y[:16], 1e200))]
    pyro.enable_validation(False)
    with pytest.raises(FloatingPointError, match="step 0"):
        pb.fit(
            prob.model,
            guide,
            bad,
            optim=pb.Optimization(num_steps=1),
            checkpoint=pb.Checkpointing(tmp_path, overwrite=True),
        )
    for k, v in guide.state_dict().items():
        assert torch.equal(v, before[k]), k  # parameters untouched
    restored = pb.load(latest(tmp_path) / "posterior.safetensors", prob.model)
    for k, v in restored.state_dict().items():
        assert torch.equal(v, before[k]), k  # the checkpoint is the last good state


def test_empty_data_is_an_error():
    prob = conjugate_core()
    with pytest.raises(ValueError, match="no batches"):
        pb.fit(
            prob.model, pb.guides.MeanFieldGuide(prob.model), [], optim=pb.Optimization(num_steps=2)
        )


def test_old_keywords_still_work_with_a_deprecation_warning(tmp_path):
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    val = data[::2]  # any batches other than the training object (fit warns on that one)
    steps: list[int] = []
    with pytest.warns(DeprecationWarning, match=r"val_data=.*validation=pyrobayes\.Validation"):
        old = pb.fit(
            prob.model,
            pb.posterior(prob.model, "map"),
            data,
            epochs=2,
            seed=0,
            val_data=val,
            patience=1,
            checkpoint_dir=tmp_path / "old",
            callback=lambda step, loss: steps.append(step),
            scheduler="cosine",
        )
    torch.manual_seed(0)
    prob = conjugate_core()
    new = pb.fit(
        prob.model,
        pb.posterior(prob.model, "map"),
        data,
        epochs=2,
        seed=0,
        validation=pb.Validation(val, patience=1),
        checkpoint=pb.Checkpointing(tmp_path / "new"),
        progress=pb.Progress(callback=lambda step, loss: None),
        optim=pb.Optimization(scheduler="cosine"),
    )
    assert steps == list(range(1, 2 * len(data) + 1))
    assert torch.equal(old.losses, new.losses)
    assert old.state["validation"] == new.state["validation"]
    assert latest(tmp_path / "old") is not None
    # the old checks still apply, before any warning
    with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
        pb.fit(prob.model, pb.posterior(prob.model, "map"), data, epochs=1, resume=True)


def test_fit_takes_ten_parameters_and_the_earlier_num_steps_and_device_still_work():
    params = inspect.signature(pb.fit).parameters
    assert len(params) <= 10, list(params)
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    torch.manual_seed(0)
    new = pb.fit(
        prob.model,
        pb.posterior(prob.model, "map"),
        data,
        seed=0,
        optim=pb.Optimization(num_steps=3),
    )
    torch.manual_seed(0)
    prob = conjugate_core()
    with pytest.warns(DeprecationWarning) as seen:
        old = pb.fit(
            prob.model, pb.posterior(prob.model, "map"), data, seed=0, num_steps=3, device="cpu"
        )
    messages = " ".join(str(w.message) for w in seen)
    assert "num_steps= -> optim=pyrobayes.Optimization(num_steps=...)" in messages
    assert "model.to(device)" in messages
    assert len(new.losses) == 3
    assert torch.equal(old.losses, new.losses)
    # a fit with only a step budget and without epochs is told where the budget goes
    with pytest.raises(ValueError, match=r"optim=Optimization\(num_steps=\.\.\.\)"):
        pb.fit(prob.model, pb.posterior(prob.model, "map"), data)


def test_a_group_given_both_ways_or_an_unknown_keyword_is_refused():
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    guide = pb.posterior(prob.model, "map")
    with pytest.raises(ValueError, match="validation=Validation.*or the flat val_data="):
        pb.fit(prob.model, guide, data, epochs=1, validation=pb.Validation(data), val_data=data)
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rate'"):
        pb.fit(prob.model, guide, data, epochs=1, learning_rate=0.1)
    with pytest.raises(TypeError, match=r"validation=\.\.\.\) takes a pyrobayes\.Validation"):
        pb.fit(prob.model, guide, data, epochs=1, validation=data)
    with pytest.raises(TypeError, match="Checkpointing.*every"):
        pb.Checkpointing("x", every=1.5)
    with pytest.raises(TypeError, match="resume must be True or False"):
        pb.Checkpointing("x", resume="yes")
    with pytest.raises(TypeError, match="callback"):
        pb.Progress(callback=3)


def test_a_fit_ended_by_num_steps_leaves_a_resumable_checkpoint(tmp_path):
    # 4 batches per epoch; 6 steps end inside the second epoch, with no periodic checkpoint
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    assert len(data) == 4
    full = pb.fit(
        prob.model,
        pb.posterior(prob.model, "ivon"),
        data,
        # a constant rate: IVON's default cosine over 6 steps is not the 11-step run's
        optim=pb.Optimization(num_steps=11, scheduler="constant"),
        seed=0,
    )
    torch.manual_seed(0)
    prob_b = conjugate_core()
    guide_b = pb.posterior(prob_b.model, "ivon")
    pb.fit(
        prob_b.model,
        guide_b,
        data,
        optim=pb.Optimization(num_steps=6, scheduler="constant"),
        seed=0,
        checkpoint=pb.Checkpointing(tmp_path),
    )
    folder = latest(tmp_path)
    assert folder is not None
    meta = json.loads((folder / "state.json").read_text())
    assert (meta["step"], meta["epoch"], meta["batch"]) == (6, 1, 2)
    torch.manual_seed(0)
    prob_c = conjugate_core()
    guide_c = pb.posterior(prob_c.model, "ivon")
    resumed = pb.fit(
        prob_c.model,
        guide_c,
        data,
        optim=pb.Optimization(num_steps=11, scheduler="constant"),
        seed=0,
        checkpoint=pb.Checkpointing(tmp_path, resume=True),
    )
    assert torch.equal(resumed.losses, full.losses)  # bit for bit
    for k, v in full.guide.state_dict().items():
        assert torch.equal(guide_c.state_dict()[k], v), k


def test_resume_refuses_other_or_missing_validation_data(tmp_path):
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    val = data[:2]
    other = [(x, y + 1.0) for x, y in val]  # same shapes and counts, other targets
    guide = pb.posterior(prob.model, "map")
    first = pb.Checkpointing(tmp_path / "a")
    pb.fit(prob.model, guide, data, epochs=1, validation=pb.Validation(val), checkpoint=first)
    again = pb.Checkpointing(tmp_path / "a", resume=True)
    with pytest.raises(ValueError, match=r"validated on 2 batches \(32 examples\); pass the same"):
        pb.fit(prob.model, guide, data, epochs=2, checkpoint=again)
    with pytest.raises(ValueError, match="validation data differ from those of the checkpoint"):
        pb.fit(prob.model, guide, data, epochs=2, validation=pb.Validation(other), checkpoint=again)
    result = pb.fit(
        prob.model, guide, data, epochs=2, validation=pb.Validation(val), checkpoint=again
    )
    assert [h["epoch"] for h in result.state["validation"]] == [0, 1]
    # a run checkpointed without validation is not resumed with some
    pb.fit(prob.model, guide, data, epochs=1, checkpoint=pb.Checkpointing(tmp_path / "b"))
    with pytest.raises(ValueError, match="written by a fit without validation data"):
        pb.fit(
            prob.model,
            guide,
            data,
            epochs=2,
            validation=pb.Validation(val),
            checkpoint=pb.Checkpointing(tmp_path / "b", resume=True),
        )


def test_a_diverging_fit_is_reported():
    # lr=1e6 on the conjugate core: the loss goes 255 -> ~1e12..1e14 and stays finite
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    with pytest.warns(pb.DivergenceWarning, match=r"diverging.*steps 1\.\.10.*lr=1e\+06"):
        result = pb.fit(
            prob.model,
            pb.posterior(prob.model, "map"),
            data,
            optim=pb.Optimization(num_steps=20),
            lr=1e6,
        )
    assert result.losses.isfinite().all() and result.losses[10:].min() > 1e3 * result.losses[0]
    # the same fit at a sane step size does not warn (warnings are errors in the suite)
    torch.manual_seed(0)
    prob = conjugate_core()
    pb.fit(
        prob.model,
        pb.posterior(prob.model, "map"),
        data,
        optim=pb.Optimization(num_steps=20),
        lr=1e-2,
    )


def test_num_data_below_the_epoch_size_is_reported_once():
    # num_data = 16 (the batch size) for a training set of 64: the prior weighs 4x too much
    prob = conjugate_core(num_data=64)
    data = split_batches(prob.x, prob.y, size=16)
    prob.model.num_data = 16
    with pytest.warns(
        UserWarning, match=r"first epoch yielded 64 examples.*num_data is 16"
    ) as seen:
        pb.fit(prob.model, pb.posterior(prob.model, "meanfield"), data, epochs=3)
    assert len([w for w in seen if "num_data is 16" in str(w.message)]) == 1  # once, not per epoch
    assert seen[0].filename == __file__  # it points at the call
    # a fit ended inside its first epoch that already yielded too many says so too
    with pytest.warns(UserWarning, match=r"first epoch yielded 32 examples"):
        pb.fit(
            prob.model, pb.posterior(prob.model, "map"), data, optim=pb.Optimization(num_steps=2)
        )
    # the right N, or a loader that drops or pads to N, does not warn (warnings are errors here)
    prob.model.num_data = 64
    pb.fit(prob.model, pb.posterior(prob.model, "meanfield"), data, epochs=2)
    prob.model.num_data = 50  # a partial pass (a subset per epoch) is a legitimate plan
    pb.fit(prob.model, pb.posterior(prob.model, "map"), data[:3], epochs=1)


def test_num_data_far_above_the_epoch_size_is_reported():
    # num_data = 640 (the whole set's size) while the fit iterates a subset of 64: the prior
    # and KL weigh 10x too little, the posterior comes out too narrow
    prob = conjugate_core(num_data=64)
    data = split_batches(prob.x, prob.y, size=16)
    prob.model.num_data = 640
    with pytest.warns(
        UserWarning, match=r"yielded 64 examples.*num_data is 640.*10x too large"
    ) as seen:
        pb.fit(prob.model, pb.posterior(prob.model, "meanfield"), data, epochs=2)
    assert len([w for w in seen if "num_data is 640" in str(w.message)]) == 1
    assert seen[0].filename == __file__
    # a fit that ends inside its first epoch cannot tell the epoch's size: no warning (warnings
    # are errors in the suite)
    pb.fit(prob.model, pb.posterior(prob.model, "map"), data, optim=pb.Optimization(num_steps=2))
    # half of num_data per epoch or more passes (a sampled subset of a set is a plan)
    prob.model.num_data = 128
    pb.fit(prob.model, pb.posterior(prob.model, "map"), data, epochs=1)


def test_the_progress_bar_is_on_in_interactive_use_only(monkeypatch):
    from pyrobayes.infer import options

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(options.sys.stderr, "isatty", lambda: True)
    assert pb.Progress().show_bar
    assert not pb.Progress(bar=False).show_bar
    monkeypatch.setenv("CI", "true")
    assert not pb.Progress().show_bar and pb.Progress(bar=True).show_bar
    monkeypatch.delenv("CI")
    monkeypatch.setattr(options.sys.stderr, "isatty", lambda: False)
    assert not pb.Progress().show_bar


def _drowning_problem(adapter):
    """832 latent LoRA values (r = 8, both factors, two layers) for N = 32 examples of a
    3-class rule: the ELBO at the N(0, 1) prior pays more KL than the data term can repay."""
    from torch import nn

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )
    x = torch.randn(32, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    model = pb.models.FineTuneModel(net, adapter, trainable_modules=["4"], num_data=32)
    return model, split_batches(x, y, 16)


def test_a_fit_whose_elbo_buys_kl_with_the_data_term_is_reported():
    """Mean-field on plain LoRA factors with 26 latent values per example: the expected NLL
    falls to .2 and climbs back to chance (log 3 = 1.10) as the scales grow towards the prior;
    the predictive then scores the training data near chance while MAP fits it. The fit warns
    with the cause and the counts; the same fit on LoRA-XS cores (128 values) does not."""
    import warnings

    model, data = _drowning_problem(pb.models.LoRA(rank=8, target_modules=["0", "2"]))
    guide = pb.posterior(model, "meanfield")
    with pytest.warns(UserWarning, match=r"data term .* rose .* 832 latent values for N = 32"):
        pb.fit(model, guide, data, epochs=200, lr=3e-2, seed=0, progress=False)
    pred = pb.predict(model, guide, data, num_samples=16, seed=0)
    assert pred.targets is not None
    assert pb.metrics.report(pred, pred.targets)["nll"] > 0.8  # near log 3: the warning is true
    model, data = _drowning_problem(pb.models.LoRAXS(rank=4, target_modules=["0", "2"]))
    guide = pb.posterior(model, "meanfield")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.fit(model, guide, data, epochs=200, lr=3e-2, seed=0, progress=False)


@pytest.mark.parametrize(
    "tenths,warns",
    [
        ([1.0, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.4, 0.7, 0.9], True),  # gave 80% back
        ([1.0, 0.5, 0.3, 0.2, 0.15, 0.12, 0.1, 0.1, 0.1, 0.1], False),  # a plain descent
        ([1.0, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.3, 0.4], False),  # 1/3 back: the ELBO's σ
        ([0.3, 0.25, 0.2, 0.2, 0.2, 0.2, 0.2, 0.22, 0.25, 0.28], False),  # under 0.1 nats
    ],
)
def test_the_given_back_rule_on_tenths_of_a_run(tenths, warns):
    """The rule of ``warn_if_fit_given_back`` on a run of 10 steps per tenth with a per-step
    spread of ±0.01 (its standard error, 4.5e-3 per tenth, far below every rise here)."""
    import warnings

    from pyrobayes.infer.fit_checks import warn_if_fit_given_back

    model, _ = _drowning_problem(pb.models.LoRA(rank=8, target_modules=["0", "2"]))
    jitter = torch.tensor([0.01, -0.01] * 5)
    nll = [torch.tensor(v) + j for v in tenths for j in jitter]
    terms = {"nll": nll, "kl": [torch.tensor(1.0)] * len(nll)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warn_if_fit_given_back(terms, model)
    assert any("data term" in str(w.message) for w in record) == warns


@pytest.mark.parametrize(
    "then,now,named",
    [
        ({}, {"seed": 1}, "another seed"),
        (
            {"optim": pb.Optimization(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))},
            {
                "optim": pb.Optimization(
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=5.0)
                )
            },
            "optimizer setting 'weight_decay'",
        ),
        ({}, {"optim": pb.Optimization(optimizer=torch.optim.SGD)}, "another optimizer"),
        (
            {"optim": pb.Optimization(scheduler="cosine")},
            {"optim": pb.Optimization(scheduler="linear")},
            "learning-rate schedule",
        ),
        (
            {"optim": pb.Optimization(scheduler="cosine")},
            {"optim": pb.Optimization(scheduler="cosine", warmup=0.5)},
            "learning-rate schedule",
        ),
        ({"select_by": "rmse"}, {"select_by": "nll"}, "validation criterion"),
    ],
)
def test_resume_refuses_other_run_settings_by_name(tmp_path, then, now, named):
    """A resume restores the optimizer (its class and settings), the schedule, the selection
    history and the random streams of the checkpointed run: under other settings it would keep
    the old ones without a word (the optimizer's load_state_dict overwrites every group
    setting; an SGD loading Adam's state failed later on a KeyError), so it is refused with the
    setting's name and both values. (Both calls run 2 epochs: another run length under a
    schedule is refused on its own.)"""
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)

    def kwargs(spec):
        out = {k: v for k, v in spec.items() if k != "select_by"}
        if "select_by" in spec:
            out["validation"] = pb.Validation(data, select_by=spec["select_by"])
        return {"seed": 0, **out}

    guide = pb.posterior(prob.model, "map")
    with warnings.catch_warnings():  # validating on the training data warns: not the point here
        warnings.simplefilter("ignore", UserWarning)
        pb.fit(
            prob.model, guide, data, epochs=2, checkpoint=pb.Checkpointing(tmp_path), **kwargs(then)
        )
        with pytest.raises(ValueError, match=named):
            pb.fit(
                prob.model,
                guide,
                data,
                epochs=2,
                checkpoint=pb.Checkpointing(tmp_path, resume=True),
                **kwargs({**then, **now}),
            )


def test_adam_on_float16_parameters_is_refused_before_its_first_step():
    """Adam's eps = 1e-8 rounds to 0 in float16 and a small gradient's squared average
    underflows: torch's own Adam turns a gradient of 1e-3 into -inf and one of 0 into NaN, at
    any learning rate, and the fit then blamed the rate. The fit's own optimizer steps float32
    masters of a float16 head (and the guide's locations are float32), so a float16 network
    trains; an Adam passed built over the float16 head itself is refused before the first
    update, naming it; a post-hoc fit that takes no step is not; bfloat16 trains."""
    from torch import nn

    x, y = torch.randn(32, 4, dtype=torch.float32), torch.arange(32) % 3
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
        adapter = pb.models.LoRAXS(rank=2, target_modules=["0"])
        model = pb.models.FineTuneModel(net, adapter, num_data=32, trainable_modules=["2"])
        data = [(x.to(dtype), y)]
        guide = pb.posterior(model, "map")
        if dtype == torch.float16:
            built = torch.optim.Adam(pb.infer.trainable_parameters(model, guide), lr=1e-2)
            with pytest.raises(TypeError, match=r"float16 \(2\.weight, 2\.bias.*eps = 1e-08"):
                pb.fit(model, guide, data, epochs=1, progress=False,
                       optim=pb.Optimization(optimizer=built))  # fmt: skip
            pb.fit(model, pb.posterior(model, "laplace"), data, epochs=0, progress=False)
            guide = pb.posterior(model, "map")
        result = pb.fit(model, guide, data, epochs=3, progress=False)
        assert torch.isfinite(result.losses).all()


def _loader(x, y, **kwargs):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), **kwargs)


@pytest.mark.parametrize(
    "now,named",
    [
        ({"batch_size": 20}, r"batch size: 16 then, 20 now"),  # 4 batches of 64 either way
        ({"shuffle": False}, r"sampler \(shuffle on or off\): torch\.utils\.data\.sampler\.Rand"),
        ({"x_offset": 1.0}, r"examples themselves \(a hash of the first, middle and last\)"),
        ({"examples": 60}, r"number of examples: 64 then, 60 now"),  # 4 batches again
    ],
)
def test_resume_refuses_other_training_data_of_the_same_batch_count(tmp_path, now, named):
    """A resume goes on from the run's position (epoch, batch) in its data: on other training
    data with the same number of batches per epoch (which the schedule's length checks) it
    went on without a word. The loader's dataset size, batch size, sampler and three of its
    examples are compared, each named when it differs; the same data in a fresh loader with
    a new shuffling order resumes."""
    torch.manual_seed(0)
    prob = conjugate_core()
    assert len(prob.x) == 64  # the batch counts in the cases above assume 64 examples
    settings = {"batch_size": 16, "shuffle": True, "x_offset": 0.0, "examples": 64}

    def data(spec):
        spec = {**settings, **spec}
        n, offset = spec.pop("examples"), spec.pop("x_offset")
        return _loader(prob.x[:n] + offset, prob.y[:n], **spec)

    guide = pb.posterior(prob.model, "map")
    pb.fit(prob.model, guide, data({}), epochs=2, seed=0, checkpoint=pb.Checkpointing(tmp_path))
    again = pb.Checkpointing(tmp_path, resume=True)
    with pytest.raises(ValueError, match=rf"on other training data \({named}"):
        pb.fit(prob.model, guide, data(now), epochs=2, seed=0, checkpoint=again)
    fresh = _loader(prob.x.clone(), prob.y.clone(), batch_size=16, shuffle=True)
    result = pb.fit(prob.model, guide, fresh, epochs=2, seed=0, checkpoint=again)
    assert result.state["epoch"] == 2


def test_resume_refuses_another_list_of_batches_and_data_of_another_kind(tmp_path):
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    guide = pb.posterior(prob.model, "map")
    pb.fit(prob.model, guide, data, epochs=2, seed=0, checkpoint=pb.Checkpointing(tmp_path))
    again = pb.Checkpointing(tmp_path, resume=True)
    other = [(x * 2.0, y) for x, y in data]
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with torch.no_grad():  # moved after the run, so a restored checkpoint would show
        for p in guide.parameters():
            p.add_(1.0)
    moved = {k: v.clone() for k, v in guide.state_dict().items()}
    with pytest.raises(ValueError, match=r"examples themselves \(a hash of the first, middle"):
        pb.fit(prob.model, guide, other, epochs=2, seed=0, checkpoint=again)
    # refused before anything was restored: the guide keeps the caller's values
    assert all(torch.equal(guide.state_dict()[k], v) for k, v in moved.items())
    assert any(not torch.equal(before[k], v) for k, v in moved.items())
    loader = _loader(prob.x, prob.y, batch_size=16)
    with pytest.raises(ValueError, match=r"a list or tuple of batches then, a DataLoader now"):
        pb.fit(prob.model, guide, loader, epochs=2, seed=0, checkpoint=again)
    copied = [(x.clone(), y.clone()) for x, y in data]
    assert pb.fit(prob.model, guide, copied, epochs=2, seed=0, checkpoint=again).state["epoch"] == 2


def test_the_training_data_record_is_the_same_under_random_augmentation_and_draws_nothing():
    """A dataset whose ``__getitem__`` draws (an augmentation from torch's, NumPy's or
    Python's global generator) gives the same record on every call, and recording moves none
    of the caller's generators."""
    import random

    import numpy as np

    from pyrobayes.infer.data_record import training_data_record

    class Augmented(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            noise = torch.randn(3) + np.random.rand() + random.random()
            return torch.full((3,), float(i)) + noise, i % 2

    loader = torch.utils.data.DataLoader(Augmented(), batch_size=4)
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    first = training_data_record(loader)
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    second = training_data_record(loader)
    assert first == second and first["sample_sha256"] is not None
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1]) and random.getstate() == states[2]
    assert first["examples"] == 10 and first["batch_size"] == 4 and first["drop_last"] is False
    assert training_data_record(iter([])) is None  # a one-shot iterator: nothing to compare
    # NumPy scalars, arrays, strings and nested mappings are read by value
    for a, b in [
        (np.float32(1.0), np.float32(2.0)),
        (np.arange(3), np.arange(3) + 1),
        ("good", "bad"),
        ({"ids": [1, 2], "label": 0}, {"ids": [1, 3], "label": 0}),
        (torch.eye(3).to_sparse(), (2 * torch.eye(3)).to_sparse()),  # read densely
    ]:
        assert (
            training_data_record([a])["sample_sha256"] != training_data_record([b])["sample_sha256"]
        )
        assert training_data_record([a]) == training_data_record([a])
