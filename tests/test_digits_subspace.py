"""SPECS 2(d) 6: B-LoRA-XS (SWAG) and L-LoRA-XS (Laplace-KRON) on sklearn digits.

Pretrain an MLP 64-128-128 on digits 0-4, replace the head by a new 10-class head, fine-tune
LoRA-XS (r = 4) cores of both hidden layers (plus the head, as a point estimate) on 200 examples
of all 10 digits; 40 seeds, each scored on its own 450 test images. Run:
``pytest tests/test_digits_subspace.py -m slow`` (~5 min on one busy core), or
``python tests/test_digits_subspace.py`` for the per-seed table and the summary the tests assert.

The effects at stake (~.01 NLL, ~1 test image of accuracy) are below the seed-to-seed spread
(MAP's NLL varies by ~.08 between seeds, its accuracy by ~2 points), so nothing is read off one
seed or a median of three (until 2026-12-02 the file compared medians of 3 seeds, and two of its
criteria flipped with the seed draw). Each claim is a one-sided bound, at 3 standard errors, on
the mean PAIRED difference over the 40 seeds (method - MAP on the same seed and the same test
images): below 0 for an improvement, or within the resolution of one 450-image test set for
non-inferiority (``_resolution``). The bounds were chosen on seeds 0-39 and checked on 40-79.

Two MAP protocols, both tested:

- ``fixed`` (SPECS 2(d) 6 as written: 200 training examples): all 200 train for 60 epochs, the
  last iterate is the MAP;
- ``selected`` (SPECS 2(b) TRAIN_MAP): 160 train, 40 held out, the MAP is the epoch with the best
  validation accuracy (``pb.Validation(val, select_by="accuracy")``); Laplace is fitted there.
  SWAG is never selected (it averages the late iterates).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from pyrobayes.demo.data import load_digits_split
from pyrobayes.guides import LaplaceGuide, SWAGGuide
from pyrobayes.infer.laplace import glm_predict
from pyrobayes.models import FineTuneModel, LoRAXS

NUM_EXAMPLES, EPOCHS, BATCH = 200, 60, 50
NUM_VAL = NUM_EXAMPLES // 5  # SPECS 2(b) TRAIN_MAP: 20% of the training examples held out
NUM_TRAIN = NUM_EXAMPLES - NUM_VAL
SEEDS = tuple(range(40))  # ~3.5 s per seed and protocol (4 fits); see the bounds below


def _pretrained(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    # the 0-4 images of the 10-class training split: the fine-tuning test split stays unseen (a
    # separate 5-class split would put some of its test images into the pretraining)
    split = load_digits_split(seed, id_classes=range(10))
    keep = split.y_train < 5
    x_pre, y_pre = split.x_train[keep], split.y_train[keep]
    net = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 5)
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(300):
        idx = torch.randint(0, len(y_pre), (64,))
        loss = nn.functional.cross_entropy(net(x_pre[idx]), y_pre[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net[4] = nn.Linear(128, 10)  # the new 10-class head
    return net


def _data(seed: int, select: bool):
    split = load_digits_split(seed, id_classes=range(10))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(split.y_train), generator=g)[:NUM_EXAMPLES]
    idx, val_idx = (idx[:NUM_TRAIN], idx[NUM_TRAIN:]) if select else (idx, idx[:0])
    train_set = TensorDataset(split.x_train[idx], split.y_train[idx])
    val = DataLoader(TensorDataset(split.x_train[val_idx], split.y_train[val_idx]), batch_size=500)
    train = DataLoader(
        train_set,
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    test = DataLoader(TensorDataset(split.x_test, split.y_test), batch_size=500)
    # W-SVD's input statistics come from an unshuffled view of the training examples: iterating
    # the shuffled loader would advance its generator and give W-SVD other batches than SVD/RAND
    calibration = DataLoader(train_set, batch_size=BATCH)
    return train, (val if select else None), test, split.y_test, calibration


def _model(seed: int, projection: str, calibration: DataLoader) -> FineTuneModel:
    net = _pretrained(seed)
    torch.manual_seed(seed + 100)
    net[4].reset_parameters()
    return FineTuneModel(
        net,
        LoRAXS(rank=4, projection=projection, target_modules=["0", "2"], seed=seed),
        num_data=len(calibration.dataset),
        trainable_modules=["4"],
        calibration_data=calibration if projection == "wsvd" else None,
    )


def _head_only_optimizer(guide: LaplaceGuide, lr: float):
    """Adam over the head alone: the cores stay at their N(0, 1e-5²) init (no adapter). The
    cores sit in a group of learning rate 0 (Adam's step is then exactly 0), since a fit refuses
    an optimizer that leaves out parameters it trains."""

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        cores = {id(p) for p in guide.parameters()}
        head = [p for p in params if id(p) not in cores]
        frozen = [p for p in params if id(p) in cores]
        return torch.optim.Adam([{"params": head}, {"params": frozen, "lr": 0.0}], lr=lr)

    return make


def _report(prediction, y_test: torch.Tensor) -> dict:
    """``pb.metrics.report`` plus the per-image ``nll_i`` (``-log p̄(y_n|x_n)``), for the paired
    per-image standard error of an NLL difference on the same 450 test images."""
    out: dict = pb.metrics.report(prediction, y_test)
    log_probs = getattr(prediction, "log_probs", None)
    if log_probs is None:
        log_probs = prediction.probs.log()
    log_pred = pb.metrics.predictive_log_probs(log_probs)  # (N, C)
    out["nll_i"] = -log_pred.gather(-1, y_test.view(-1, 1)).squeeze(-1)
    return out


def _relative_update(model: FineTuneModel, values: dict[str, torch.Tensor]) -> float:
    """``max_l ||ΔW_l||_F / ||W0_l||_F`` over the adapted layers at the given cores."""
    ratios = []
    for site, core in values.items():
        layer = model.net.get_submodule(model.latent_sites[site].module_path)
        ratios.append(float(layer.delta_weight(core).norm() / layer.base.weight.norm()))
    return max(ratios)


def run_seed(
    seed: int,
    projection: str = "svd",
    bayes: bool = True,
    head_only: bool = False,
    select: bool = False,
) -> dict[str, dict]:
    """Metrics (accuracy, NLL, ECE with 15 bins) of MAP, Laplace-KRON (GLM, MC link) and SWAG.

    ``head_only``: train the head alone (the cores stay at their init), the no-adapter reference.
    ``select``: the ``selected`` protocol (see the module docstring), else ``fixed``.
    ``out["map"]["rel_update"]`` is the largest relative weight change of an adapted layer.
    """
    train, val, test, y_test, calibration = _data(seed, select)
    out: dict[str, dict] = {}
    model = _model(seed, projection, calibration)
    lap = LaplaceGuide(model, structure="kron")
    optimizer = _head_only_optimizer(lap, 1e-2) if head_only else None
    # selected: the MAP stage keeps the epoch with the best validation accuracy
    fitted = pb.fit(
        model,
        lap,
        train,
        epochs=EPOCHS,
        lr=1e-2,
        seed=seed,
        optim=pb.Optimization(optimizer=optimizer),
        validation=pb.Validation(val, select_by="accuracy") if val is not None else None,
    )
    map_pred = pb.predict(model, lap, test, values={s: v[None] for s, v in lap.mean().items()})
    out["map"] = _report(map_pred, y_test)
    out["map"]["rel_update"] = _relative_update(model, lap.mean())
    out["map"]["best_epoch"] = fitted.state.get("best_epoch", EPOCHS - 1)
    if not bayes:
        return out
    # GLM predictive with the MC link over the logits (SPECS 2(b): "MC link approximation"). The
    # probit link rescales each class's logit by its own variance and ignores the cross-class
    # covariance; here that flips argmaxes (seed 2: acc .804 -> .760) and worsens NLL, while MC
    # over N(f, JΣJᵀ) with 1,000 draws keeps the MAP's ranking (MC error of the NLL < 1e-3).
    glm = glm_predict(model, lap, test, link="mc", num_samples=1000, seed=seed)
    out["laplace_kron"] = _report(glm, y_test)
    out["laplace_kron"]["tau"] = lap.prior_precision
    model = _model(seed, projection, calibration)
    swag = SWAGGuide(model, rank=5, scale=0.5)
    optim = pb.Optimization(optimizer=pb.infer.SWAG(start_epoch=EPOCHS // 2))
    pb.fit(model, swag, train, epochs=EPOCHS, lr=1e-2, seed=seed, optim=optim)
    out["swag"] = _report(pb.predict(model, swag, test, num_samples=15), y_test)
    out["swag_map"] = pb.metrics.report(
        pb.predict(model, swag, test, values={s: v[None] for s, v in swag.mean().items()}), y_test
    )
    return out


Z = 3.0  # every claim below is a one-sided bound at 3 standard errors


def run_protocol(protocol: str, seeds: tuple[int, ...] = SEEDS) -> list[dict]:
    """Per seed: :func:`run_seed`'s metrics, plus the MAPs of W-SVD, RAND and the head alone
    (``rank_wsvd``, ``rank_random``, ``rank_none``); SVD's MAP is ``["map"]`` (the same fit)."""
    select = protocol == "selected"
    out = []
    for s in seeds:
        r = run_seed(s, select=select)
        r["rank_wsvd"] = run_seed(s, "wsvd", bayes=False, select=select)["map"]
        r["rank_random"] = run_seed(s, "random", bayes=False, select=select)["map"]
        r["rank_none"] = run_seed(s, "svd", bayes=False, head_only=True, select=select)["map"]
        out.append(r)
    return out


def _paired(runs: list[dict], method: str, key: str, base: str = "map") -> tuple[float, float]:
    """Mean over seeds of the paired difference ``method - base`` of ``key`` (same seed, same test
    images) and its standard error ``sd / sqrt(n_seeds)``. The seed-to-seed spread holds every
    noise source at once: the training run (init, batch order, SWAG's iterates) and the draw of
    the test split (``load_digits_split`` splits by seed)."""
    d = [r[method][key] - r[base][key] for r in runs]
    return statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d))


def _resolution(runs: list[dict]) -> dict[str, float]:
    """What one test set of N = 450 images resolves, median over seeds of MAP's:
    ``nll``: the standard error of a mean NLL, sd(per-image NLL) / sqrt(N) (measured ~.054);
    ``binomial``: that of an accuracy, sqrt(a (1 - a) / N) (~.018). ECE is a binned average of
    |accuracy - confidence| over the same 0/1 outcomes, so ``binomial`` is its resolution too."""
    nll, binom = [], []
    for r in runs:
        m = r["map"]
        n = len(m["nll_i"])
        nll.append(float(m["nll_i"].std()) / math.sqrt(n))
        binom.append(math.sqrt(m["accuracy"] * (1 - m["accuracy"]) / n))
    return {"nll": statistics.median(nll), "binomial": statistics.median(binom)}


PROTOCOLS = ("fixed", "selected")


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {p: run_protocol(p) for p in PROTOCOLS}


# Measured (2026-12-02, float64, seeds 0-39; mean paired difference method - MAP +- its standard
# error over the 40 seeds; "lower" = seeds where the method's NLL is below MAP's):
#   fixed     MAP mean acc .826 NLL .559 ECE .042; resolution NLL .054, binomial .018
#             Laplace  ΔNLL -.0143 +- .0020 (37/40 lower)  ΔECE +.0005 +- .0018  Δacc +.0009 +- .0006
#             SWAG     ΔNLL -.0057 +- .0020 (27/40 lower)  ΔECE +.0013 +- .0020  Δacc +.0008 +- .0009
#   selected  MAP mean acc .795 NLL .623 ECE .047; resolution NLL .054, binomial .019
#             Laplace  ΔNLL -.0123 +- .0018 (35/40 lower)  ΔECE +.0013 +- .0019  Δacc +.0008 +- .0006
#             SWAG     ΔNLL -.0114 +- .0080 (24/40 lower)  ΔECE +.0036 +- .0029  Δacc +.0068 +- .0041
# Held-out seeds 40-79 (not used to choose any bound), same order:
#   fixed     Laplace -.0164 +- .0020 (39/40), +.0025 +- .0019, +.0005 +- .0005
#             SWAG    -.0027 +- .0023 (25/40), +.0009 +- .0013, -.0007 +- .0013
#   selected  Laplace -.0120 +- .0021 (35/40), +.0019 +- .0016, -.0001 +- .0006
#             SWAG    -.0134 +- .0075 (25/40), +.0022 +- .0024, +.0127 +- .0034
# MAP's NLL alone varies between seeds by sd .075 (fixed) / .079 (selected), its accuracy by 1.9 /
# 2.7 points: one seed, or a median of three, cannot resolve these differences.
# Laplace: GLM predictive, MC link with 1,000 draws (MC error of the NLL < 1e-3). The probit link
# rescales each class's logit by its own variance and ignores the cross-class covariance; on an
# earlier run it flipped argmaxes (seed 2 acc .804 -> .760) and failed the NLL criterion.
@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_laplace_glm_improves_map_nll_on_digits(runs: dict[str, list[dict]], protocol: str) -> None:
    # The GLM predictive around the same MAP lowers the NLL: the 3σ upper bound of the mean paired
    # ΔNLL is below 0 (measured t = mean / se = -7.2 fixed, -6.7 selected; seeds 20-39 alone
    # -4.6 / -4.1; held-out seeds 40-79 -8.2 / -5.7). Per seed, the network is MAP's own, so the
    # only noise in the difference is the choice of the 450 test images: each seed's ΔNLL stays
    # below 3 paired per-image standard errors, sd(nll_lap_i - nll_map_i) / sqrt(450) (measured
    # max +1.6 of them on seeds 0-39, +2.1 on 40-79)
    mean, se = _paired(runs[protocol], "laplace_kron", "nll")
    assert mean + Z * se < 0, (mean, se)
    for seed, r in zip(SEEDS, runs[protocol], strict=True):
        d = r["laplace_kron"]["nll_i"] - r["map"]["nll_i"]
        assert float(d.mean()) <= Z * float(d.std()) / math.sqrt(len(d)), (seed, float(d.mean()))


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("method", ["swag", "laplace_kron"])
def test_bayes_not_worse_than_map_on_digits(
    runs: dict[str, list[dict]], method: str, protocol: str
) -> None:
    # Non-inferiority with the margin one test set resolves (``_resolution``): the 3σ bound of the
    # mean paired difference over 40 seeds may not exceed one test-set standard error in MAP's
    # disfavour, for NLL (margin ~.054), ECE and accuracy (~.018 each). SWAG's NLL gain is not
    # established at 3σ (fixed t = -2.8, selected -1.4; seeds 20-39 alone -1.0 / -0.7; 40-79
    # -1.2 / -1.8): SWAG is a separately trained net, and under `selected` it trains on all epochs
    # while MAP is early-stopped, so per seed it is 17 test images worse to 43 better. Only
    # non-inferiority holds for it. Tightest measured headroom: SWAG's ECE under `selected`, bound
    # .0122 vs margin .019 (seeds 40-79: .0095); every other bound is >= 3 standard errors inside.
    res = _resolution(runs[protocol])
    nll, se_nll = _paired(runs[protocol], method, "nll")
    ece, se_ece = _paired(runs[protocol], method, "ece")
    acc, se_acc = _paired(runs[protocol], method, "accuracy")
    assert nll + Z * se_nll <= res["nll"], (nll, se_nll, res)
    assert ece + Z * se_ece <= res["binomial"], (ece, se_ece, res)
    assert acc - Z * se_acc >= -res["binomial"], (acc, se_acc, res)


RANKED = ("svd", "wsvd", "random")
_RANK_KEY = {"svd": "map", "wsvd": "rank_wsvd", "random": "rank_random", "none": "rank_none"}


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_random_cores_barely_move_the_weights(runs: dict[str, list[dict]], protocol: str) -> None:
    # RAND absorbs R0 = Q1ᵀ W0 Q2 into A (SPECS 2(a)), so ΔW = Q1 R0 δR Q2ᵀ scales with R0, and a
    # Haar r = 4 slice keeps only 2-5% of ||W0||_F here (SVD: 61-72%). Measured max over layers of
    # ||ΔW||/||W0|| at MAP, seeds 0-39, median (range): fixed RAND .013 (.006-.025), SVD .32
    # (.23-.43), W-SVD .29 (.23-.39); selected RAND .010 (.004-.023), SVD .25 (.15-.33), W-SVD .22
    # (.09-.29). Seeds 40-79: RAND <= .032, SVD and W-SVD >= .13.
    # So RAND is the linear probe: its accuracy equals the head alone's up to less than one
    # test-set resolution (``_resolution``, sqrt(a(1-a)/450) ~ .018): |mean paired difference| +
    # 3 se <= it. Measured (head alone - RAND, test images of 450): fixed -0.25 +- 0.14, selected
    # -0.27 +- 0.13 (seeds 40-79: +0.03 +- 0.10, -0.55 +- 0.40), i.e. bounds of .002-.004 against
    # .018. Not per seed: under `selected` the two runs may pick different epochs on 40 validation
    # images (seed 70: epoch 52 vs 41, 13 test images apart); under `fixed` per seed <= 3 images.
    runs_p = runs[protocol]
    med = {p: statistics.median(r[_RANK_KEY[p]]["rel_update"] for r in runs_p) for p in RANKED}
    assert med["random"] < 0.05 < min(med["svd"], med["wsvd"]), med
    diff, se = _paired(runs_p, "rank_none", "accuracy", base="rank_random")
    res = _resolution(runs_p)
    assert abs(diff) + Z * se <= res["binomial"], (diff, se, res)


SVD_LOSES = (
    "a known loss on this problem (200 examples, a new head): SVD and W-SVD do not beat RAND. MAP "
    "accuracy minus RAND's, paired per seed, mean +- se over seeds 0-39 in test images of 450: "
    "fixed SVD -5.9 +- 1.0, W-SVD -5.0 +- 1.1; selected SVD -5.7 +- 1.3, W-SVD -2.4 +- 1.6 "
    "(seeds 40-79: -6.4 +- 0.9, -5.7 +- 0.9; -6.9 +- 1.4, -5.9 +- 1.9). RAND barely moves W0 (test "
    "above), so it is the linear probe, and an r = 4 update of the hidden layers costs ~6 test "
    "images against it. SVD's mean difference is 4-7 standard errors below 0; "
    "W-SVD under `selected` is undecided."
)


@pytest.mark.slow
@pytest.mark.xfail(reason=SVD_LOSES, strict=True, raises=AssertionError)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_svd_projections_beat_random_on_digits(runs: dict[str, list[dict]], protocol: str) -> None:
    # SPECS 2(d) 6 expects SVD and W-SVD >= RAND; as a claim, the 3σ lower bound of the mean paired
    # accuracy difference over the 40 seeds is above 0. A known loss here (see SVD_LOSES)
    for p in ("svd", "wsvd"):
        diff, se = _paired(runs[protocol], _RANK_KEY[p], "accuracy", base="rank_random")
        assert diff - Z * se > 0, (p, diff, se)


def summary(runs: dict[str, list[dict]]) -> list[str]:
    """The statistics the tests assert, one line each (for the file's comments and the docs)."""
    lines = []
    for protocol, rp in runs.items():
        res = _resolution(rp)
        m = {k: statistics.mean(r["map"][k] for r in rp) for k in ("accuracy", "nll", "ece")}
        lines.append(
            f"{protocol} ({len(rp)} seeds) MAP means acc {m['accuracy']:.3f} NLL {m['nll']:.3f} "
            f"ECE {m['ece']:.3f}; resolution NLL {res['nll']:.3f} binomial {res['binomial']:.3f}"
        )
        for method in ("laplace_kron", "swag"):
            parts = []
            for key in ("nll", "ece", "accuracy"):
                mean, se = _paired(rp, method, key)
                parts.append(f"Δ{key} {mean:+.4f} ± {se:.4f} (t {mean / se:+.1f})")
            better = sum(r[method]["nll"] < r["map"]["nll"] for r in rp)
            lines.append(f"  {method}: " + ", ".join(parts) + f"; NLL better {better}/{len(rp)}")
        for p in ("svd", "wsvd", "none"):
            mean, se = _paired(rp, _RANK_KEY[p], "accuracy", base="rank_random")
            n = len(rp[0]["map"]["nll_i"])
            mean, se = mean * n, se * n
            lines.append(f"  {p} - random: {mean:+.2f} ± {se:.2f} test images (t {mean / se:+.1f})")
    return lines


if __name__ == "__main__":  # prints the numbers used in docs/methods/swag_laplace.md
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    all_runs = {p: run_protocol(p) for p in PROTOCOLS}
    for protocol, rp in all_runs.items():
        for s, r in zip(SEEDS, rp, strict=True):
            print(
                protocol,
                s,
                " ".join(
                    f"{k} {r[k]['accuracy']:.3f}/{r[k]['nll']:.3f}/{r[k]['ece']:.3f}"
                    for k in ("map", "laplace_kron", "swag")
                ),
                "acc wsvd/rand/none "
                + "/".join(
                    f"{r[k]['accuracy']:.3f}" for k in ("rank_wsvd", "rank_random", "rank_none")
                ),
            )
    print("\n".join(summary(all_runs)))
