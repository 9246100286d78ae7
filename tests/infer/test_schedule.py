"""pb.fit(scheduler=...): per-step learning-rate schedules for every family, saved on resume."""

from __future__ import annotations

import math

import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer import grouped
from pyrobayes.infer.schedule import make_scheduler
from tests.common import conjugate_core, split_batches


def _fit(family: str, epochs: int = 3, lr: float = 0.05, **kw):
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, family)
    result = pb.fit(
        prob.model,
        guide,
        split_batches(prob.x, prob.y),
        epochs=epochs,
        seed=0,
        lr=lr,
        **grouped(**kw),
    )
    return guide, result


def _recording(optimizer: type[torch.optim.Optimizer], used: list[float]):
    """A factory of ``optimizer`` (lr 0.05) that appends the lr each step uses to ``used``, read
    inside the optimizer's own step."""

    class Recording(optimizer):  # type: ignore[valid-type,misc]
        def step(self, closure=None):  # type: ignore[override]
            used.append(self.param_groups[0]["lr"])
            return super().step(closure)

    return lambda params: Recording(params, lr=0.05)


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_named_schedules_set_the_lr_of_every_step(name):
    used: list[float] = []
    _, result = _fit("map", optimizer=_recording(torch.optim.Adam, used), scheduler=name)
    total = len(result.losses)  # 4 batches x 3 epochs
    assert total == 12
    expected = [
        0.05 * (0.5 * (1 + math.cos(math.pi * t / total)) if name == "cosine" else 1 - t / total)
        for t in range(total)
    ]
    assert used == pytest.approx(expected, rel=1e-12)


def test_warmup_then_decay():
    used: list[float] = []
    _fit("map", optimizer=_recording(torch.optim.SGD, used), scheduler="linear", warmup=0.25)
    # 12 steps, 3 of warm-up (0, 1/3, 2/3 of α), then linear decay over the remaining 9
    expected = [0.05 * t / 3 for t in range(3)] + [0.05 * (1 - k / 9) for k in range(9)]
    assert used == pytest.approx(expected, rel=1e-12)


def test_ivon_follows_the_schedule():
    # IVON's closure-driven optimizer reads lr from param_groups every step: with lr 0 from step
    # 6 on the means stop moving (h keeps updating), and before that they move
    locs: list[torch.Tensor] = []

    def record(step: int, value: float) -> None:
        locs.append(torch.cat([guide.loc(s).detach().reshape(-1) for s in guide.sites]))

    def stop_at_6(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 if t < 6 else 0.0)

    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "ivon")
    pb.fit(
        prob.model,
        guide,
        split_batches(prob.x, prob.y),
        epochs=3,
        seed=0,
        lr=0.05,
        optim=pb.Optimization(scheduler=stop_at_6),
        progress=pb.Progress(callback=record),
    )
    moves = [float((b - a).abs().max()) for a, b in zip(locs, locs[1:], strict=False)]
    assert min(moves[:5]) > 0  # steps 2..6 moved the mean
    assert max(moves[5:]) == 0  # steps 7..12 ran at lr 0


def test_schedule_survives_resume(tmp_path):
    full, full_result = _fit("map", scheduler="cosine")

    def interrupt(step: int, loss: float) -> None:
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _fit(
            "map",
            scheduler="cosine",
            checkpoint_dir=tmp_path,
            checkpoint_every=1,
            callback=interrupt,
        )
    resumed, result = _fit("map", scheduler="cosine", checkpoint_dir=tmp_path, resume=True)
    torch.testing.assert_close(result.losses, full_result.losses, rtol=0, atol=0)
    for k, v in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=0, msg=k)


def test_bad_schedules_are_named():
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "map")
    data = split_batches(prob.x, prob.y)
    with pytest.raises(ValueError, match="scheduler=.*'cosine', 'linear'"):
        pb.fit(prob.model, guide, data, epochs=1, optim=pb.Optimization(scheduler="step"))
    with pytest.raises(ValueError, match="number of steps"):  # no len(), no num_steps
        pb.fit(prob.model, guide, iter(data), epochs=1, optim=pb.Optimization(scheduler="cosine"))
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError, match="factory"):
        pb.fit(
            prob.model,
            guide,
            data,
            epochs=1,
            optim=pb.Optimization(scheduler=torch.optim.lr_scheduler.StepLR(opt, 1)),
        )
    with pytest.raises(ValueError, match="whole run"):
        pb.fit(
            prob.model, guide, data, epochs=1, optim=pb.Optimization(scheduler="cosine", warmup=4)
        )
    # "constant" too, where the run's length is known: its rate never reached α (warm-up=100
    # over 20 steps ended at 0.2 α, in silence)
    with pytest.raises(ValueError, match="whole run of 4 steps, so the learning rate"):
        pb.fit(
            prob.model, guide, data, epochs=1, optim=pb.Optimization(scheduler="constant", warmup=4)
        )
    with pytest.raises(ValueError, match="number of steps .* or a fraction"):  # not 1 step
        pb.fit(
            prob.model, guide, data, epochs=1, optim=pb.Optimization(scheduler="cosine", warmup=1.5)
        )
    with pytest.raises(ValueError, match="named schedule"):
        pb.fit(prob.model, guide, data, epochs=1, optim=pb.Optimization(warmup=2))
    swag = pb.posterior(prob.model, "swag")
    swalr = pb.infer.SWAG(swa_lr=1e-3)
    with pytest.raises(ValueError, match="swa_lr"):
        pb.fit(
            prob.model,
            swag,
            data,
            epochs=1,
            optim=pb.Optimization(optimizer=swalr, scheduler="cosine"),
        )


def test_bad_schedule_leaves_a_fitted_guide_untouched():
    # the arguments are checked before fit_begin, which would reset SWAG's collected moments
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    swag = pb.posterior(prob.model, "swag")
    optim = pb.Optimization(optimizer=pb.infer.SWAG(start_epoch=1))
    pb.fit(prob.model, swag, data, epochs=3, seed=0, lr=0.05, optim=optim)
    before = {k: v.clone() for k, v in swag.state_dict().items()}
    assert int(swag.swag_num_collected) > 0
    with pytest.raises(ValueError, match="scheduler="):
        pb.fit(prob.model, swag, data, epochs=1, optim=pb.Optimization(scheduler="step"))
    for k, v in before.items():
        torch.testing.assert_close(swag.state_dict()[k], v, rtol=0, atol=0, msg=k)


def _closed_form(name: str, t: int, total: int, warmup: int) -> float:
    """The schedule's multiplier written out (Loshchilov & Hutter 2017, Eq. 5, one half-period;
    linear decay), independent of transformers: α_t / α."""
    if t < warmup:
        return t / warmup
    progress = (t - warmup) / (total - warmup)
    return 0.5 * (1 + math.cos(math.pi * progress)) if name == "cosine" else 1 - progress


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_named_schedules_equal_the_closed_form(name):
    # built by transformers' get_*_schedule_with_warmup; compared over many run lengths, warm-ups
    # as steps and as fractions, every step including the last (t = T, α_T = 0). The two routes
    # differ only in the order of one multiply and one divide: a few ulp of a multiplier <= 1, so
    # 1e-15 absolute (4.5 ulp at 1) is round-off and any formula change (>= 1/T) shows.
    from pyrobayes.infer.schedule import check_schedule, make_scheduler

    checked = 0
    for total in [1, 2, 3, 7, 12, 50, 333]:
        for warmup in [0, 1, 5, 0.1, 0.25, 0.5]:
            try:
                num_warmup = check_schedule(name, total, warmup)
            except ValueError:  # warm-up as long as the run
                continue
            param = torch.zeros(1, requires_grad=True)
            opt = torch.optim.SGD([param], lr=1.0)
            sched = make_scheduler(name, opt, total, warmup)
            got = []
            for _ in range(total):
                got.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
            got.append(opt.param_groups[0]["lr"])
            want = [_closed_form(name, t, total, num_warmup) for t in range(total + 1)]
            assert got == pytest.approx(want, rel=0, abs=1e-15), (total, warmup)
            assert got[-1] == pytest.approx(0.0, abs=1e-15)
            checked += 1
    assert checked >= 35
    # fractions are rounded to whole steps: 0.25 of 12 steps is 3, 0.1 of 7 is 1 (0.7 rounded)
    assert check_schedule(name, 12, 0.25) == 3 and check_schedule(name, 7, 0.1) == 1


def test_named_schedule_state_round_trips_mid_run():
    # what a checkpoint keeps: a fresh optimizer and scheduler loaded with the states of ones
    # stopped at step 5 continue with exactly the lr sequence of the uninterrupted ones
    from pyrobayes.infer.schedule import make_scheduler

    def build():
        param = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([param], lr=0.05)
        return opt, make_scheduler("cosine", opt, 20, 0.2)

    opt, sched = build()
    for _ in range(5):
        opt.step()
        sched.step()
    opt2, sched2 = build()
    opt2.load_state_dict(opt.state_dict())  # the optimizer's groups carry the current lr
    sched2.load_state_dict(sched.state_dict())
    for _ in range(15):
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] > 0
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
    assert sched2.last_epoch == 20 and opt2.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("family", ["ivon", "kron-ivon"])
def test_ivon_families_default_to_a_cosine_schedule_after_a_warmup(family):
    """IVON's fit anneals α by a cosine unless told otherwise (Shen et al. 2024), after a linear
    warm-up over the first 10% of the run (its first steps, at h = h0, threw the cores of deep
    adapters far off): the default fit is the explicit schedule's bit for bit, and differs from
    the cosine without the warm-up and from scheduler="constant"."""
    default, default_result = _fit(family)
    warmed, warmed_result = _fit(family, scheduler="cosine", warmup=0.1)
    _, cosine_result = _fit(family, scheduler="cosine")
    _, constant_result = _fit(family, scheduler="constant")
    assert torch.equal(default_result.losses, warmed_result.losses)
    for k, v in warmed.state_dict().items():
        assert torch.equal(default.state_dict()[k], v), k
    assert not torch.equal(default_result.losses, cosine_result.losses)
    # the first loss is the start's under all; later steps differ
    assert default_result.losses[0] == constant_result.losses[0]
    assert not torch.equal(default_result.losses, constant_result.losses)


def test_other_families_keep_a_constant_rate_and_constant_is_no_schedule():
    _, plain = _fit("meanfield")
    _, constant = _fit("meanfield", scheduler="constant")
    assert torch.equal(plain.losses, constant.losses)
    fitter = pb.infer.make_fitter(*_problem_for("meanfield"), lr=0.1)
    assert fitter.default_scheduler is None
    assert make_scheduler("constant", fitter.optimizer, 12) is None


def test_constant_with_warmup_ramps_then_holds():
    used: list[float] = []
    _fit("map", optimizer=_recording(torch.optim.SGD, used), scheduler="constant", warmup=4)
    assert used == pytest.approx([0.05 * t / 4 for t in range(4)] + [0.05] * 8, rel=1e-12)


def test_ivon_default_schedule_without_a_run_length_stays_constant(caplog):
    # a data iterable without len() and no num_steps: no T for the cosine, so no schedule
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "ivon")
    batches = split_batches(prob.x, prob.y)
    with caplog.at_level("INFO", logger="pyrobayes.infer.loop"):
        result = pb.fit(prob.model, guide, iter(batches), epochs=1, seed=0, lr=0.05)
    assert len(result.losses) == 4
    assert "needs the run's length" in caplog.text
    _, constant = _fit("ivon", epochs=1, scheduler="constant")
    assert torch.equal(result.losses, constant.losses)


def test_resume_under_another_schedule_is_refused(tmp_path):
    """A checkpoint written at a constant rate resumed under IVON's default cosine (or the
    reverse) would follow another rate than the run it continues: refused by name."""
    _fit("ivon", epochs=1, scheduler="constant", checkpoint_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="without a learning-rate schedule.*'constant'"):
        _fit("ivon", epochs=2, checkpoint_dir=tmp_path / "a", resume=True)
    _, resumed = _fit(
        "ivon", epochs=2, scheduler="constant", checkpoint_dir=tmp_path / "a", resume=True
    )
    assert len(resumed.losses) == 8
    _fit("ivon", epochs=1, checkpoint_dir=tmp_path / "b")  # the default cosine
    with pytest.raises(ValueError, match="with a learning-rate schedule"):
        _fit("ivon", epochs=1, scheduler="constant", checkpoint_dir=tmp_path / "b", resume=True)


def test_resume_with_another_family_names_the_family_first(tmp_path):
    """A mean-field checkpoint resumed by IVON (whose default cosine schedule the mean-field run
    did not have): the family is what differs, so that is the refusal, not the schedule."""
    from pyrobayes.io import PosteriorMismatchError

    _fit("meanfield", epochs=1, checkpoint_dir=tmp_path / "a")
    with pytest.raises(PosteriorMismatchError, match="holds a 'meanfield' posterior.*overwrite"):
        _fit("ivon", epochs=2, checkpoint_dir=tmp_path / "a", resume=True)


def test_resume_with_another_rate_or_schedule_length_is_refused(tmp_path):
    """A resumed optimizer restores the checkpointed rate, so a new ``lr`` would be ignored
    without a word, and a schedule over another number of steps would join two curves: both
    refused by name; the same settings resume, and so do more epochs at a constant rate."""
    _fit("map", epochs=1, checkpoint_dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"fit\(lr=0.01\).*lr=0.05"):
        _fit("map", epochs=2, lr=0.01, checkpoint_dir=tmp_path / "a", resume=True)
    _, resumed = _fit("map", epochs=2, checkpoint_dir=tmp_path / "a", resume=True)
    assert len(resumed.losses) == 8  # a constant rate: more epochs continue the run
    _fit("map", epochs=1, scheduler="cosine", checkpoint_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="spans 4 steps; this fit's spans 8"):
        _fit("map", epochs=2, scheduler="cosine", checkpoint_dir=tmp_path / "b", resume=True)
    _, same = _fit("map", epochs=1, scheduler="cosine", checkpoint_dir=tmp_path / "b", resume=True)
    assert len(same.losses) == 4


def _problem_for(family: str):
    torch.manual_seed(0)
    prob = conjugate_core()
    return prob.model, pb.posterior(prob.model, family)
