"""A posterior file holds the posterior only; how it was fitted is the fitter's and its checkpoint's.

Per registered family, a whitelist of what a saved file may hold (constructor options in the
header, guide tensors), so that a setting of the fit leaking into the file fails here. The
settings that moved to the fitter (IVON's ``mc_samples``, Kronecker IVON's ``fisher`` /
``T_stats`` / ``T_inv``, SWAG's collection schedule, IBDR's objective and dual controller, σN's diversity term, Laplace's τ search,
mean-field's scale learning rate, the symmetrized objective's K) are
checked end to end: the old guide keyword
still reaches the fitter for one release (``DeprecationWarning`` naming the new spelling), the
fitter's checkpoint carries them and refuses to resume under others, and a file saved when they
were the guide's still loads.
"""

from __future__ import annotations

import dataclasses
import re

import pyro
import pytest
import torch
from safetensors import safe_open

import pyrobayes as pb
from pyrobayes.infer import make_fitter
from pyrobayes.models import LoRAXS
from pyrobayes.registry import _REGISTRY
from tests import families
from tests.common import mlp_problem, split_batches

FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})

_IVON_Q = {"ess", "weight_decay", "point_weight_decay", "point_prior_loc", "hess_init", "init_loc"}

#: family -> the constructor options a file holds that define q: its shape, its prior, its
#: predictive, and where it starts (an initialisation is a constructor option, as Pyro's
#: autoguides' ``init_scale``; IVON's ``hess_init`` is h0, the curvature's start)
POSTERIOR_OPTIONS: dict[str, set[str]] = {
    "map": set(),
    "meanfield": {"init_scale", "init_loc", "prior"},  # prior: the KL of the file's q
    "ivon": _IVON_Q,
    "kron-ivon": _IVON_Q | {"damping"},
    "laplace": {
        "structure",
        "prior_precision",
        "temperature",
        "pred_type",
        "link_samples",
        "subset",
        "prior_structure",
    },
    "swag": {"rank", "scale"},
    "ibdr": {"num_particles", "scale", "init_scale", "average"},
    "signorm": {"num_particles", "scale", "init_scale", "average", "init_noise", "head_init"},
    "symmetrized": {"base", "init_scale", "init_loc", "prior"},
}

#: family -> options still on its guide (so still in its files) that describe the fit, not q:
#: none left (every family's fit settings are its fitter's). None may be added.
KNOWN_FIT_OPTIONS: dict[str, set[str]] = {}


def test_no_family_keeps_fit_settings_in_its_files():
    assert all(not KNOWN_FIT_OPTIONS.get(family) for family in FAMILIES), KNOWN_FIT_OPTIONS


#: family -> its guide tensors in a file, site names as ``<site>`` and site indices as ``<i>``
POSTERIOR_TENSORS: dict[str, set[str]] = {
    "map": {"locs.<site>"},
    "meanfield": {"locs.<site>", "scales.<site>"},
    "ivon": {"locs.<site>", "hess_<i>"},
    "kron-ivon": {
        "locs.<site>",
        *(f"{name}_<i>" for name in ("A", "G", "eigval_in", "eigvec_in", "eigval_out")),
        "eigvec_out_<i>",
    },
    "laplace": {
        "locs.<site>",
        "curv_<i>",
        "eigvecs_in_<i>",
        "eigvecs_out_<i>",
        "lap_fitted",
        "lap_prior_precision",
    },
    "swag": {
        "locs.<site>",
        "swag_num_collected",
        "swag_mean",
        "swag_m2",
        "swag_deviations",
        "swag_fitted",
    },
    "ibdr": {"locs.<site>"},
    "signorm": {"locs.<site>"},
    "symmetrized": {"base.locs.<site>", "base.scales.<site>"},
}


def _problem(family: str | None = None, seed: int = 0):
    """The registry-wide problem: an MLP with two LoRA-XS cores and a point head, 48 examples."""
    prob = mlp_problem(
        (5, 12, 12, 3),
        LoRAXS(rank=3, target_modules=["0", "2"]),
        num_data=48,
        trainable_modules=["4"],
        seed=seed,
        data_seed=seed,
        family=family,
    )
    return prob.model, split_batches(prob.x, prob.y, 16)


def _file_keys(path, sites) -> tuple[dict, set[str], set[str]]:
    """``(config, guide tensor patterns, model tensor names)`` of the file at ``path``."""
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())  # noqa: SIM118 (safe_open is not a mapping)
    patterns, point = set(), set()
    for key in keys:
        if key.startswith("model."):
            point.add(key[len("model.") :])
            continue
        assert key.startswith("guide."), key
        name = key[len("guide.") :].removesuffix("_unconstrained")
        for site in sorted(sites, key=len, reverse=True):
            name = name.replace(f".{site}", ".<site>")
        patterns.add(re.sub(r"_\d+$", "_<i>", name))
    return pb.io.read_header(path)["config"], patterns, point


@pytest.mark.parametrize("family", FAMILIES)
def test_a_posterior_file_holds_only_the_posterior(tmp_path, family):
    assert family in POSTERIOR_OPTIONS and family in POSTERIOR_TENSORS, (
        f"add {family!r}'s whitelist here: the options and tensors that define its q"
    )
    pyro.clear_param_store()
    model, data = _problem(family)
    guide = families.posterior(model, family)
    pb.fit(model, guide, data, epochs=1, lr=1e-2, seed=0, progress=False)
    config, tensors, point = _file_keys(pb.save(guide, tmp_path / "q.safetensors"), guide.sites)
    allowed = POSTERIOR_OPTIONS[family] | KNOWN_FIT_OPTIONS.get(family, set())
    assert set(config) == allowed, (
        f"{family}: options in the file beyond the posterior's {sorted(set(config) - allowed)}, "
        f"missing {sorted(allowed - set(config))}: a setting of the fit belongs to the fitter"
    )
    assert tensors == POSTERIOR_TENSORS[family], family
    assert point == set(model.point_params)  # the head the posterior was fitted with
    assert not set(getattr(type(guide), "fit_options", ())) & set(config)


# ------------------------------------------------------------------ the settings that moved
#: (family, the old guide keywords, the settings class that takes them now)
MOVED = [
    ("ivon", {"mc_samples": 2}, "IVON"),
    ("kron-ivon", {"fisher": "mc", "T_stats": 2, "T_inv": 2}, "KronIVON"),
    ("kron-ivon", {"mc_samples": 2, "fisher": "ggn"}, "KronIVON"),
    ("swag", {"start_epoch": 1, "collect_every": 2}, "SWAG"),
    ("swag", {"collect_every_steps": 2}, "SWAG"),
    ("ibdr", {"alpha": 0.1, "rho": 0.01, "lam_lr": 1.0}, "IBDR"),
    ("ibdr", {"cost": "function", "loss": "logits"}, "IBDR"),
    ("signorm", {"tau": 0.25, "strength": 0.05}, "SigmaNormDiversity"),
    ("signorm", {"strength": 0.05, "regularized": []}, "SigmaNormDiversity"),
    ("laplace", {"log_prior_bounds": [-1.0, 0.5]}, "Laplace"),
    ("laplace", {"prior_optimization": "alternate", "alternate_epochs": 2}, "Laplace"),
    ("meanfield", {"scale_lr": 10.0}, "MeanField"),
    ("symmetrized", {"num_permutations": 4, "scale_lr": 10.0}, "Symmetrized"),
]


def _fit(family, options=None, settings=None):
    """A 4-epoch fit of ``family`` on a fresh copy of the problem (same seed: same start)."""
    pyro.clear_param_store()
    model, data = _problem(family)
    # the registry-wide options (e.g. IBDR's K = 2 <= C - 1): the same posterior either way
    guide = pb.posterior(model, family, **{**families.options(family), **(options or {})})
    optim = pb.Optimization(optimizer=settings)
    pb.fit(model, guide, data, epochs=4, lr=0.05, seed=0, optim=optim, progress=False)
    state = {**guide.state_dict(), **{f"model.{k}": v for k, v in model.point_params.items()}}
    return model, guide, {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize("family,old,kind", MOVED, ids=lambda v: str(v))
def test_old_guide_keywords_reach_the_fitter_and_are_not_saved(tmp_path, family, old, kind):
    spelled = re.escape(", ".join(f"{k}={v!r}" for k, v in old.items()))
    with pytest.warns(DeprecationWarning, match=rf"pb\.infer\.{kind}\({spelled}\)") as record:
        model, guide_old, state_old = _fit(family, options=old)
    assert record[0].filename == __file__  # the warning points at the caller's line
    settings = getattr(pb.infer, kind)(**old)
    _, guide_new, state_new = _fit(family, settings=settings)
    _, _, state_default = _fit(family)
    # the same fit either way, and not the default one (the setting took effect)
    assert state_old.keys() == state_new.keys()
    for key, value in state_new.items():
        assert torch.equal(value, state_old[key]), key
    assert any(not torch.equal(v, state_default[k]) for k, v in state_new.items())
    assert make_fitter(model, guide_old, lr=0.05).settings == settings
    # q's options only: the two guides are the same posterior, and the file holds none of them
    assert guide_old.config() == guide_new.config() and not set(old) & set(guide_new.config())
    header = pb.io.read_header(pb.save(guide_old, tmp_path / "q.safetensors"))
    assert not set(old) & set(header["config"])


#: family -> the settings a file saved when they were the guide's holds (their old defaults)
LEGACY = {
    "ivon": {"mc_samples": 2},
    "kron-ivon": {"mc_samples": 1, "fisher": "empirical", "T_stats": 1, "T_inv": 10},
    "swag": {"start_epoch": 0, "collect_every": 1, "collect_every_steps": None},
    "ibdr": {
        "alpha": 0.02,
        "rho": 0.0025,
        "lam": 3.0,
        "lam_min": 0.05,
        "lam_max": 50.0,
        "lam_lr": None,
        "max_grad_norm": 0.2,
        "cost": "param",
        "loss": "mean",
        "epsilon": 1e-7,
    },
    "signorm": {"tau": 0.5, "strength": 1e-3, "regularized": "all"},
    "meanfield": {"scale_lr": 1.0},
    "symmetrized": {"num_permutations": 16, "scale_lr": 1.0},
    "laplace": {
        "prior_optimization": "evidence",
        "log_prior_bounds": [-5.0, 10.0],
        "alternate_tol": 1e-3,
        "alternate_max_iter": 20,
        "alternate_epochs": 100,
        "alternate_map_tol": 1e-2,
        "alternate_lr": None,
    },
}


@pytest.mark.parametrize("family", sorted(LEGACY))
def test_an_older_file_with_fit_settings_still_loads(tmp_path, caplog, family):
    """A posterior saved when these settings were the guide's carries them in its options: it
    loads (they are ignored, with a logged note naming the new place) into an equal guide."""
    pyro.clear_param_store()
    model, data = _problem(family)
    guide = families.posterior(model, family)
    pb.fit(model, guide, data, epochs=2, lr=0.05, seed=0, progress=False)
    options = guide.config()
    guide.config = lambda: {**options, **LEGACY[family]}  # what such a file's header holds
    path = pb.save(guide, tmp_path / "old.safetensors")
    assert set(LEGACY[family]) <= set(pb.io.read_header(path)["config"])
    with caplog.at_level("INFO", logger="pyrobayes.io"):
        loaded = pb.load(path, model)
    kind = type(guide).fit_settings_class
    assert "ignoring the fit settings" in caplog.text and f"pb.infer.{kind}(" in caplog.text
    assert loaded.config() == options
    for key, value in guide.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    pb.io.load_state(families.posterior(model, family), path)  # built today: no mismatch


@pytest.mark.parametrize("family", FAMILIES)
def test_a_file_saved_before_an_option_existed_reads_it_as_its_default(tmp_path, family):
    """An option added to a family after a file was saved is absent from that file's header:
    the file loads into an equal guide (the option at its constructor default), and a guide
    built with another value is refused by name. (Found on Laplace files saved before
    ``prior_structure``: ``pb.load`` refused them, whatever the caller passed.)"""
    pyro.clear_param_store()
    model, data = _problem(family)
    guide = families.posterior(model, family)
    pb.fit(model, guide, data, epochs=2, lr=0.05, seed=0, progress=False)
    options = guide.config()
    defaults = pb.io.compatibility._option_defaults(type(guide))
    newer = {
        k for k, v in options.items() if k in defaults and pb.io.format._jsonable(v) == defaults[k]
    }
    if not newer:  # no option with a default (MAP): nothing a file could leave out
        assert not set(options) & set(defaults), family
        return
    guide.config = lambda: {k: v for k, v in options.items() if k not in newer}
    path = pb.save(guide, tmp_path / "older.safetensors")
    assert not newer & set(pb.io.read_header(path)["config"])
    loaded = pb.load(path, model)
    assert loaded.config() == options
    for key, value in guide.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    if family == "laplace":  # a value other than the default the file implies: refused
        other = pb.posterior(model, "laplace", prior_structure="layerwise")
        with pytest.raises(pb.io.PosteriorMismatchError, match="prior_structure='scalar' in the"):
            pb.io.load_state(other, path)


# ------------------------------------------------------------------ the fitter's checkpoint
def test_kronecker_settings_are_in_the_checkpoint_and_checked_on_resume():
    model, _ = _problem()
    guide = pb.posterior(model, "kron-ivon")
    settings = pb.infer.KronIVON(T_inv=3, fisher="mc", mc_samples=2)
    fitter = make_fitter(model, guide, lr=0.1, optimizer=settings)
    assert fitter.optimizer.curvature.settings is settings and fitter.objective.mc_samples == 2
    state = fitter.state_dict()
    assert state["settings"] == dataclasses.asdict(settings)
    assert {"T_inv": 3, "T_stats": 1, "fisher": "mc", "mc_samples": 2}.items() <= set(
        state["settings"].items()
    )
    other = make_fitter(model, guide, lr=0.1, optimizer=dataclasses.replace(settings, T_inv=5))
    with pytest.raises(ValueError, match=r"other KronIVON settings \(T_inv=3 there, 5 here"):
        other.load_state_dict(state)
    # a checkpoint written before these moved to the fitter carries no value for them: it
    # resumes under the current ones
    earlier = {**state, "settings": dataclasses.asdict(pb.infer.IVON())}
    make_fitter(model, guide, lr=0.1, optimizer=pb.infer.KronIVON(T_inv=5)).load_state_dict(earlier)
    # a plain IVON record is Kronecker IVON's with these three at their defaults
    widened = make_fitter(model, guide, lr=0.1, optimizer=pb.infer.IVON(beta2=0.9)).settings
    assert widened == pb.infer.KronIVON(beta2=0.9)
    # and a Kronecker record is refused by diagonal IVON, by name
    with pytest.raises(TypeError, match=r"KronIVON\(\.\.\.\) holds another family's settings"):
        make_fitter(model, pb.posterior(model, "ivon"), lr=0.1, optimizer=settings)


def test_swag_schedule_is_in_the_checkpoint_and_checked_on_resume():
    model, _ = _problem()
    guide = pb.posterior(model, "swag")
    settings = pb.infer.SWAG(start_epoch=2, collect_every_steps=3)
    state = make_fitter(model, guide, lr=0.05, optimizer=settings).state_dict()
    assert state["settings"]["start_epoch"] == 2 and state["settings"]["collect_every_steps"] == 3
    other = make_fitter(model, guide, lr=0.05, optimizer=pb.infer.SWAG(start_epoch=1))
    with pytest.raises(ValueError, match=r"other SWAG settings \(start_epoch=2 there, 1 here"):
        other.load_state_dict(state)


def test_ibdr_settings_are_in_the_checkpoint_and_checked_on_resume(tmp_path):
    model, data = _problem("ibdr")
    guide = families.posterior(model, "ibdr")
    sgd = torch.optim.SGD
    settings = pb.infer.IBDR(rho=0.01, lam_lr=1.0, optimizer=sgd)
    fitter = make_fitter(model, guide, lr=0.05, optimizer=settings)
    assert type(fitter.optimizer) is sgd and fitter.settings is settings
    assert fitter.rho == 0.01 and fitter.lam_lr == 1.0 and fitter.objective.alpha == 0.02
    fitter.step(data[0])
    torch.save(fitter.state_dict(), tmp_path / "fitter.pt")
    state = torch.load(tmp_path / "fitter.pt", weights_only=True)
    assert state["settings"]["rho"] == 0.01 and state["settings"]["optimizer"].endswith("SGD")
    make_fitter(model, guide, lr=0.05, optimizer=settings).load_state_dict(state)  # resumes
    other = make_fitter(model, guide, lr=0.05, optimizer=dataclasses.replace(settings, rho=0.02))
    with pytest.raises(ValueError, match=r"other IBDR settings \(rho=0.01 there, 0.02 here"):
        other.load_state_dict(state)
    # a checkpoint written before the settings moved to the fitter carries none: it resumes
    earlier = {k: v for k, v in state.items() if k != "settings"}
    make_fitter(
        model, guide, lr=0.05, optimizer=dataclasses.replace(settings, rho=0.02)
    ).load_state_dict(earlier)


@pytest.mark.parametrize(
    "build,name",
    [
        (lambda: pb.infer.IVON(mc_samples=0), "mc_samples"),
        (lambda: pb.infer.KronIVON(T_inv=0), "T_inv"),
        (lambda: pb.infer.KronIVON(T_stats=0), "T_stats"),
        (lambda: pb.infer.KronIVON(fisher="exact"), "fisher"),
        (lambda: pb.infer.SWAG(start_epoch=-1), "start_epoch"),
        (lambda: pb.infer.SWAG(collect_every=0), "collect_every"),
        (lambda: pb.infer.SWAG(collect_every_steps=0), "collect_every_steps"),
        (lambda: pb.infer.IBDR(rho=-1.0), "rho"),
        (lambda: pb.infer.IBDR(lam=0.01), "lam_min <= lam"),
        (lambda: pb.infer.IBDR(cost="wasserstein"), "cost"),
        (lambda: pb.infer.SigmaNormDiversity(tau=0.0), "tau"),
        (lambda: pb.infer.Laplace(prior_optimization="mackay"), "prior_optimization"),
        (lambda: pb.infer.Laplace(log_prior_bounds=(1.0, 0.0)), "log_prior_bounds"),
        (lambda: pb.infer.Laplace(alternate_epochs=0), "alternate_epochs"),
        (lambda: pb.infer.SigmaNormDiversity(strength=-1.0), "strength"),
        (lambda: pb.infer.MeanField(scale_lr=0.0), "scale_lr"),
        (lambda: pb.infer.Symmetrized(num_permutations=0), "num_permutations"),
        (lambda: pb.infer.Symmetrized(scale_lr=-1.0), "scale_lr"),
    ],
)
def test_bad_fit_settings_are_refused_by_name(build, name):
    with pytest.raises(ValueError, match=name):
        build()


def test_swag_schedule_with_an_optimizer_of_ones_own(tmp_path):
    """A torch optimizer class (or factory) goes into the SWAG record with the schedule, so a
    custom optimizer needs no guide keyword: the same fit as the built-in "sgd", and the
    checkpoint names the class (it is read with ``weights_only=True``)."""
    states, fitters = [], []
    for optimizer in ("sgd", torch.optim.SGD):
        pyro.clear_param_store()
        model, data = _problem()
        guide = pb.posterior(model, "swag", rank=2)
        settings = pb.infer.SWAG(optimizer=optimizer, start_epoch=1, collect_every_steps=2)
        fitter = make_fitter(model, guide, lr=0.05, optimizer=settings)
        assert type(fitter.optimizer) is torch.optim.SGD
        torch.manual_seed(0)
        fitter.begin(data)
        for epoch in range(3):
            for batch in data:
                fitter.step(batch)
            fitter.epoch_end(epoch)
        fitter.end(data)
        assert int(guide.swag_num_collected) == 3  # steps 4 and 6 (epoch 2), 8 (epoch 3)
        states.append({k: v.clone() for k, v in guide.state_dict().items()})
        fitters.append(fitter)
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key
    torch.save(fitters[1].state_dict(), tmp_path / "fitter.pt")
    saved = torch.load(tmp_path / "fitter.pt", weights_only=True)
    assert saved["settings"]["optimizer"] == "torch.optim.sgd.SGD"
    fitters[1].load_state_dict(saved)  # the same settings: resumes
    with pytest.raises(ValueError, match=r"optimizer='torch\.optim\.sgd\.SGD' there, 'sgd' here"):
        fitters[0].load_state_dict(saved)
    with pytest.raises(TypeError, match="optimizer must be 'adam', 'sgd', a torch optimizer"):
        pb.infer.SWAG(optimizer=3)  # type: ignore[arg-type]


def test_sigma_norm_settings_are_in_the_checkpoint_and_checked_on_resume():
    model, data = _problem("signorm")
    guide = families.posterior(model, "signorm")
    settings = pb.infer.SigmaNormDiversity(tau=0.25, strength=0.05)
    fitter = make_fitter(model, guide, lr=0.05, optimizer=settings)
    assert fitter.settings is settings and fitter.objective.settings is settings
    fitter.step(data[0])
    state = fitter.state_dict()
    assert state["settings"]["tau"] == 0.25 and state["settings"]["strength"] == 0.05
    make_fitter(model, guide, lr=0.05, optimizer=settings).load_state_dict(state)  # resumes
    other = make_fitter(model, guide, lr=0.05, optimizer=dataclasses.replace(settings, tau=1.0))
    with pytest.raises(ValueError, match=r"other SigmaNormDiversity settings \(tau=0.25 there"):
        other.load_state_dict(state)
    # R is resolved when the fitter is made: a layer name that matches none is refused there
    with pytest.raises(ValueError, match="regularized="):
        make_fitter(model, guide, optimizer=pb.infer.SigmaNormDiversity(regularized=["nope"]))


def test_laplace_search_settings_are_in_the_checkpoint_and_checked_on_resume():
    model, _ = _problem("laplace")
    guide = families.posterior(model, "laplace")
    settings = pb.infer.Laplace(prior_optimization="alternate", alternate_epochs=3)
    fitter = make_fitter(model, guide, lr=0.05, optimizer=settings)
    assert fitter.settings is settings and type(fitter.optimizer) is torch.optim.Adam
    state = fitter.state_dict()
    assert state["settings"]["prior_optimization"] == "alternate"
    assert state["settings"]["log_prior_bounds"] == [-5.0, 10.0]  # JSON-able, as saved
    make_fitter(model, guide, lr=0.05, optimizer=settings).load_state_dict(state)  # resumes
    other = make_fitter(model, guide, lr=0.05, optimizer=pb.infer.Laplace())
    with pytest.raises(
        ValueError, match=r"other Laplace settings \(prior_optimization='alternate'"
    ):
        other.load_state_dict(state)


def test_mean_field_scale_lr_is_in_the_checkpoint_and_checked_on_resume(tmp_path):
    model, data = _problem("meanfield")
    guide = families.posterior(model, "meanfield")
    settings = pb.infer.MeanField(scale_lr=10.0)
    fitter = make_fitter(model, guide, lr=0.05, optimizer=settings)
    assert fitter.settings is settings
    assert sorted(g["lr"] for g in fitter.optimizer.param_groups) == pytest.approx([0.05, 0.5])
    fitter.step(data[0])
    torch.save(fitter.state_dict(), tmp_path / "fitter.pt")
    state = torch.load(tmp_path / "fitter.pt", weights_only=True)
    assert state["settings"] == {"scale_lr": 10.0, "kl_weight": 1.0}
    make_fitter(model, guide, lr=0.05, optimizer=settings).load_state_dict(state)  # resumes
    other = make_fitter(model, guide, lr=0.05, optimizer=pb.infer.MeanField(scale_lr=2.0))
    with pytest.raises(ValueError, match=r"other MeanField settings \(scale_lr=10.0 there, 2.0"):
        other.load_state_dict(state)
    tempered = pb.infer.MeanField(scale_lr=10.0, kl_weight=0.5)
    with pytest.raises(ValueError, match=r"other MeanField settings \(kl_weight=1.0 there, 0.5"):
        make_fitter(model, guide, lr=0.05, optimizer=tempered).load_state_dict(state)
    # a checkpoint written before kl_weight existed carries none: it resumes under any weight
    before = {**state, "settings": {"scale_lr": 10.0}}
    make_fitter(model, guide, lr=0.05, optimizer=tempered).load_state_dict(before)
    # a checkpoint written before scale_lr moved to the fitter carries none: it resumes (same
    # two parameter groups, so the optimizer state fits)
    earlier = {k: v for k, v in state.items() if k != "settings"}
    make_fitter(model, guide, lr=0.05, optimizer=settings).load_state_dict(earlier)
    # MAP has no scales and no settings record: mean-field's is refused, by name
    point = pb.posterior(model, "map")
    with pytest.raises(TypeError, match="MeanField.*another family's settings; DeltaGuide takes"):
        make_fitter(model, point, optimizer=settings)
    assert make_fitter(model, point).state_dict().keys() == {"optimizer", "num_steps"}


def test_symmetrized_settings_bind_k_and_are_checked_on_resume():
    model, data = _problem("symmetrized")
    guide = families.posterior(model, "symmetrized")
    settings = pb.infer.Symmetrized(num_permutations=4)
    fitter = make_fitter(model, guide, lr=0.05, optimizer=settings)
    assert fitter.settings is settings and fitter.objective.num_permutations == 4
    # a K given to the objective wins over the settings'
    own = pb.infer.BatchedSymmetrizedELBO(num_permutations=2)
    assert make_fitter(model, guide, loss=own, optimizer=settings).objective is own
    # without settings: the defaults (K = 16), not the guide's saved config
    assert make_fitter(model, guide).objective.num_permutations == 16
    fitter.step(data[0])
    state = fitter.state_dict()
    assert state["settings"] == {"scale_lr": 1.0, "kl_weight": 1.0, "num_permutations": 4}
    make_fitter(model, guide, lr=0.05, optimizer=settings).load_state_dict(state)  # resumes
    other = make_fitter(model, guide, lr=0.05, optimizer=pb.infer.Symmetrized())
    with pytest.raises(
        ValueError, match=r"other Symmetrized settings \(num_permutations=4 there, 16 here"
    ):
        other.load_state_dict(state)
    earlier = {k: v for k, v in state.items() if k != "settings"}
    make_fitter(model, guide, lr=0.05, optimizer=pb.infer.Symmetrized()).load_state_dict(earlier)
