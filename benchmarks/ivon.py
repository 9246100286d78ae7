"""IVON and Kronecker IVON against AdamW MAP and the ivon-opt reference optimizer (issue 4).

Four methods fine-tune the *same* LoRA-XS network for the same number of epochs on the same
batches:

* ``ivon``      - ``pb.posterior(model, "ivon")`` fitted by its fitter
  (``pb.infer.make_fitter``: ``IVONLoss`` + ``IVONOptimizer``), one ``fitter.step`` per batch
  as ``pb.fit`` drives it;
* ``kron-ivon`` - ``pb.posterior(model, "kron-ivon")`` likewise;
* ``map``       - ``pb.posterior(model, "map")`` (MAP objective) with ``torch.optim.AdamW``;
* ``ivon-opt``  - ivon-opt's ``ivon.IVON`` optimizer (GPL, used here only as an external
  reference; ``pip install ivon-opt``) over the MAP guide's parameters + the point-estimated head,
  the loss the per-example mean NLL at the weights drawn by ``optimizer.sampled_params(train=True)``.
  Same hyperparameters as ``ivon`` (ess, h0, β1, β2, δ, lr), so both are the same algorithm.

Tasks:

* **digits** - sklearn digits, an MLP 64-128-128-5 pretrained on digits 0-4, then LoRA-XS r=4 cores
  on its two hidden layers and a point-estimated head (as ``examples/_digits.py``), fine-tuned on
  ``digits.num_train`` images of the same digits, several seeds. ``--set 'digits.protocol="shift"'``:
  the transfer task of the subspace paper instead (a new 10-class head, fine-tuned on all ten digits).
* **text** - ``all-MiniLM-L6-v2`` with LoRA-XS r=8 on query/value (12 cores of 8x8) and a new
  2-class head (point estimate), VADER movieReviewSnippets binary, ``text.num_train`` sentences,
  max_length 48, 256 test sentences.

Options (``--set task.key=value``, see ``CONFIGS``): ``evaluate="val"`` scores on held-out
training data instead of the test split (for choosing hyperparameters), ``latent_head=true``
makes the head a latent site, ``pretrain_holdout=true`` (digits ``"same"``) tests the model that
``evaluate="val"`` chose its settings on (pretrained without the validation images), ``kron={...}`` passes options to ``KroneckerIVONGuide``,
``ivon={...}`` to ``IVONGuide`` and (where ivon-opt has the same argument) to ivon-opt.

Metrics: accuracy, NLL, ECE (15 bins) of the predictive (``pyrobayes.metrics.report``) on the test
split, ``--samples`` posterior draws for the three IVON variants (ivon-opt draws *all* its
parameters, head included, through ``sampled_params()``, as its README does; the pyrobayes guides
draw the latent cores and keep the head at its mean).

Timing: one optimisation step (zero_grad, forward, backward, update) per method, measured with
``time.perf_counter`` and interleaved round-robin on every batch (the order rotates each round) so
machine load hits all methods alike. Step-time ratios are reported against ivon-opt as the median
over rounds of the per-round ratio and as the ratio of mean step times; the first round is a
warm-up and is dropped.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon.py                 # digits + text
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon.py --quick --task digits
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# This file is named ivon.py: keep its folder off sys.path so ``import ivon`` finds ivon-opt.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pyro  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.batch import split_batch  # noqa: E402
from pyrobayes.demo.data import load_digits_split  # noqa: E402
from pyrobayes.infer.schedule import make_scheduler  # noqa: E402
from pyrobayes.predictive import Prediction  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "ivon.json"
METHODS = ("ivon", "kron-ivon", "map", "ivon-opt")


# ------------------------------------------------------------------------------------ methods
class PyrobayesMethod:
    """A guide fitted through the public step API (``pb.infer.make_fitter``), one
    ``fitter.step`` at a time as ``pb.fit`` does (so the methods' steps can interleave)."""

    def __init__(
        self, model: Any, guide: Any, lr: float, optimizer: Any = None, num_samples: int = 16
    ) -> None:
        self.model, self.guide, self.num_samples = model, guide, num_samples
        self.fitter = pb.infer.make_fitter(model, guide, optimizer=optimizer, lr=lr)
        self.optim = self.fitter.optimizer  # what a learning-rate schedule steps
        self.fitter.begin(None)
        self.epoch = 0

    def step(self, batch: Any) -> float:
        self.model.train(True)
        return self.fitter.step(batch)

    def epoch_end(self) -> None:
        self.fitter.epoch_end(self.epoch)
        self.epoch += 1

    def finish(self) -> None:
        self.fitter.end(None)
        self.model.train(False)

    def predict(self, test: list[Any]) -> Prediction:
        return pb.predict(self.model, self.guide, test, num_samples=self.num_samples, seed=0)


class IvonOptMethod:
    """ivon-opt's ``IVON`` over the MAP guide's parameters and the model's point parameters."""

    def __init__(self, model: Any, hyper: dict[str, Any], lr: float, num_samples: int) -> None:
        import ivon

        self.model, self.num_samples = model, num_samples
        self.guide = pb.posterior(model, "map")
        params = pb.infer.trainable_parameters(model, self.guide)
        hyper = dict(hyper)
        point = hyper.pop("point_weight_decay", None)
        if point is not None:  # IVONGuide(point_weight_decay=...): the point params' own group
            ids = {id(p) for p in model.point_params.values()}
            params = [
                {"params": [p for p in params if id(p) in ids], "weight_decay": point},
                {"params": [p for p in params if id(p) not in ids]},
            ]
        self.optim = ivon.IVON(params, lr=lr, **hyper)

    def _values(self) -> dict[str, Tensor]:
        return {s: self.guide.loc(s).unsqueeze(0) for s in self.guide.sites}

    def step(self, batch: Any) -> float:
        model = self.model
        model.train(True)
        inputs, targets = split_batch(batch, model.label_key)
        with self.optim.sampled_params(train=True):
            self.optim.zero_grad(set_to_none=True)
            params = model.batched_output(inputs, self._values())
            loss = -model.log_likelihood(params, targets).mean()
            loss.backward()
        self.optim.step()
        return float(loss.detach())

    def epoch_end(self) -> None:
        pass

    def finish(self) -> None:
        self.model.train(False)

    def predict(self, test: list[Any]) -> Prediction:
        torch.manual_seed(0)
        parts = []
        for _ in range(self.num_samples):
            with self.optim.sampled_params():
                parts.append(pb.predict(self.model, self.guide, test, num_samples=1))
        return Prediction(
            log_probs=torch.cat([p.log_probs for p in parts]), targets=parts[0].targets
        )


# ------------------------------------------------------------------------------------ tasks
def digits_task(
    seed: int,
    num_train: int,
    batch: int,
    protocol: str = "same",
    evaluate: str = "test",
    latent_head: bool = False,
    prior_scale: float = 1.0,
    pretrain_holdout: bool = False,
) -> dict[str, Any]:
    """``protocol="same"``: pretrain on digits 0-4 and fine-tune on a subset of the same images
    and classes (at the accuracy ceiling). ``"shift"``: the transfer task - pretrain on
    0-4, replace the head by a new 10-class one, fine-tune on ``num_train`` images of all digits.
    ``evaluate="val"`` scores on up to 450 training images outside the fine-tuning set instead of
    the test split (for choosing hyperparameters without looking at the test split); under
    ``"same"`` 225 of them, left out of the pretraining as well.
    ``latent_head``: the head is a latent site (as for the text task), else a point parameter.
    ``pretrain_holdout`` (``"same"`` only): pretrain without those 225 images when testing too,
    so the test-mode model is the one its hyperparameters were chosen on (the validation run's
    backbone: 450 pretraining images, not 675).
    """
    if protocol not in ("same", "shift"):
        raise ValueError(f"digits.protocol must be 'same' or 'shift', got {protocol!r}")
    if evaluate not in ("test", "val"):
        raise ValueError(f"digits.evaluate must be 'test' or 'val', got {evaluate!r}")
    torch.manual_seed(seed)
    classes = range(5) if protocol == "same" else range(10)
    split = load_digits_split(seed=seed, id_classes=classes, dtype=torch.float32)
    # "shift" pretrains on the 0-4 images of the 10-class training split, so no test image is seen
    keep = split.y_train < 5
    x_pre, y_pre = split.x_train[keep], split.y_train[keep]
    net = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 5)
    )
    num_eval = 450
    if protocol == "same" and (evaluate == "val" or pretrain_holdout):
        # the validation images must be unseen by the pretraining too, as the test split is:
        # draw the fine-tuning permutation below ahead of time (nothing between here and there
        # uses the RNG under "same") and pretrain without its validation part. The "same"
        # training split has 675 images, so a third (225) is held out and 450 pretrain.
        num_eval = 225 if evaluate == "val" else num_eval
        state = torch.get_rng_state()
        held = torch.randperm(len(split.x_train))[num_train : num_train + 225]
        torch.set_rng_state(state)
        keep[held] = False
        x_pre, y_pre = split.x_train[keep], split.y_train[keep]
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(60):  # pretraining on the full in-distribution train split (examples/_digits)
        for i in range(0, len(x_pre), 64):
            loss = nn.functional.cross_entropy(net(x_pre[i : i + 64]), y_pre[i : i + 64])
            optim.zero_grad()
            loss.backward()
            optim.step()
    if protocol == "shift":
        net[4] = nn.Linear(128, 10)  # the new 10-class head
    # fine-tuning set: a random subset (under "same" the pretraining saw it too, as in
    # examples/_digits.py; under "shift" it includes the five unseen digits)
    perm = torch.randperm(len(split.x_train))
    idx, rest = perm[:num_train], perm[num_train : num_train + num_eval]
    if protocol == "same" and evaluate == "val":
        assert torch.equal(rest, held), "the held-out images must be the validation images"
    x, y = split.x_train[idx], split.y_train[idx]
    x_eval, y_eval = (
        (split.x_test, split.y_test)
        if evaluate == "test"
        else (split.x_train[rest], split.y_train[rest])
    )
    model = pb.models.FineTuneModel(
        net,
        pb.models.LoRAXS(rank=4, projection="svd", target_modules=["0", "2"]),
        num_data=num_train,
        latent_modules=["4"] if latent_head else [],
        prior_scale=prior_scale,
        trainable_modules=[] if latent_head else ["4"],
    )
    test = [(x_eval[i : i + 128], y_eval[i : i + 128]) for i in range(0, len(x_eval), 128)]

    def epoch_batches(gen: torch.Generator) -> list[Any]:
        perm = torch.randperm(num_train, generator=gen)
        return [
            (x[perm[i : i + batch]], y[perm[i : i + batch]]) for i in range(0, num_train, batch)
        ]

    return {
        "model": model,
        "test": test,
        "batches": epoch_batches,
        "num_data": num_train,
        "steps_per_epoch": -(-num_train // batch),
    }


def text_task(
    seed: int,
    num_train: int,
    batch: int,
    max_length: int = 48,
    latent_head: bool = False,
    evaluate: str = "test",
) -> dict[str, Any]:
    from pyrobayes.demo.data import load_minilm_classifier, load_vader, text_loader

    if evaluate not in ("test", "val"):
        raise ValueError(f"text.evaluate must be 'test' or 'val', got {evaluate!r}")
    torch.manual_seed(seed)
    ds = load_vader("movieReviewSnippets")
    # one permutation, consecutive chunks: the training and test sentences are those of the
    # two-way split; "val" scores on a third chunk of 256 sentences instead of the test chunk
    train_ds, test_ds, val_ds = ds.split([num_train, 256, 256], seed=seed)
    test_ds = test_ds if evaluate == "test" else val_ds
    net, tokenizer = load_minilm_classifier(2)
    # latent_head: the new classifier is a latent site too (every guide gives it a posterior and
    # the predictive samples it), else a point parameter (IVON: ivon-opt-style mean update)
    model = pb.models.FineTuneModel(
        net,
        pb.models.LoRAXS(rank=8, target_modules=["query", "value"]),
        num_data=num_train,
        **({"latent_modules": ["classifier"], "trainable_modules": []} if latent_head else {}),
    )
    loader = text_loader(
        train_ds, tokenizer, batch_size=batch, max_length=max_length, shuffle=True, seed=seed
    )
    test = list(text_loader(test_ds, tokenizer, batch_size=64, max_length=max_length))

    def epoch_batches(gen: torch.Generator) -> list[Any]:
        return list(loader)

    return {
        "model": model,
        "test": test,
        "batches": epoch_batches,
        "num_data": num_train,
        "steps_per_epoch": len(loader),
    }


# ------------------------------------------------------------------------------------ runner
def build_methods(
    task: dict[str, Any], cfg: dict[str, Any], names: tuple[str, ...] = METHODS
) -> dict[str, Any]:
    base = task["model"]
    S = cfg["samples"]
    # ess = ess_scale * N (ess_scale > 1: the tempered, smaller-noise posterior). δ stays at the
    # guides' ess = N default 1/(N prior_scale²), so the mean's objective (mean NLL + δ|m|²/2) is
    # the same for every ess_scale and only the noise σ = 1/sqrt(ess (h + δ)) shrinks.
    num_data = task["num_data"]
    ess = cfg.get("ess_scale", 1.0) * num_data
    delta = 1.0 / (num_data * base.prior_scale**2)
    common = dict(ess=ess, hess_init=cfg["hess_init"], weight_decay=delta)
    # extra IVON options (clip_radius, hess_approx, ...): the same for the guide and ivon-opt
    ivon_kw = dict(common, beta2=cfg["beta2"], **cfg.get("ivon", {}))
    methods: dict[str, Any] = {}
    for name in names:
        pyro.clear_param_store()
        model = copy.deepcopy(base)
        if name == "ivon":
            guide = pb.posterior(model, "ivon", **ivon_kw)
            methods[name] = PyrobayesMethod(model, guide, cfg["lr_ivon"], num_samples=S)
        elif name == "kron-ivon":
            guide = pb.posterior(model, "kron-ivon", **{**common, **cfg.get("kron", {})})
            methods[name] = PyrobayesMethod(model, guide, cfg["lr_kron"], num_samples=S)
        elif name == "map":
            guide = pb.posterior(model, "map")
            lr_map = cfg["lr_map"]
            methods[name] = PyrobayesMethod(
                model, guide, lr_map, optimizer=lambda p, lr=lr_map: torch.optim.AdamW(p, lr=lr)
            )
        else:
            unmirrored = set(cfg.get("ivon", {})) - set(_IVON_OPT_KEYS)
            if unmirrored:  # ivon-opt would silently run another configuration than "ivon"
                raise ValueError(
                    f"ivon={{...}} options {sorted(unmirrored)} have no ivon-opt counterpart in "
                    "this benchmark; drop ivon-opt from --methods to use them."
                )
            ref = pb.posterior(copy.deepcopy(base), "ivon", **ivon_kw)  # same ess, δ as the guide
            hyper = dict(
                ess=ref.ess,
                hess_init=cfg["hess_init"],
                beta1=0.9,
                beta2=cfg["beta2"],
                weight_decay=ref.weight_decay,
                **{k: v for k, v in cfg.get("ivon", {}).items() if k in _IVON_OPT_KEYS},
            )
            methods[name] = IvonOptMethod(model, hyper, cfg["lr_ivon"], S)
    return methods


#: ``ivon={...}`` options that ivon-opt's ``IVON`` takes under the same name (and
#: ``point_weight_decay``, which becomes a parameter group of the point parameters)
_IVON_OPT_KEYS = ("hess_approx", "clip_radius", "debias", "rescale_lr", "point_weight_decay")


def run_task(
    task: dict[str, Any], cfg: dict[str, Any], seed: int, names: tuple[str, ...] = METHODS
) -> dict[str, Any]:
    methods = build_methods(task, cfg, names)
    names = list(methods)
    times: dict[str, list[float]] = {k: [] for k in names}
    losses: dict[str, list[float]] = {k: [] for k in names}
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rnd = 0
    # learning-rate schedule, the same for every method and the same as pb.fit(scheduler=...):
    # "constant", "cosine" or "linear", per step over the run
    total = cfg["epochs"] * task["steps_per_epoch"]
    schedule = cfg.get("schedule", "constant")
    scheds = {
        k: make_scheduler(None if schedule == "constant" else schedule, m.optim, total)
        for k, m in methods.items()
    }
    for _ in range(cfg["epochs"]):
        for batch in task["batches"](gen):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                t0 = time.perf_counter()
                value = methods[name].step(batch)
                times[name].append(time.perf_counter() - t0)
                if scheds[name] is not None:
                    scheds[name].step()
                losses[name].append(value)
            rnd += 1
        for m in methods.values():
            m.epoch_end()
    out: dict[str, Any] = {}
    for name, m in methods.items():
        m.finish()
        t0 = time.perf_counter()
        pred = m.predict(task["test"])
        metrics = pb.metrics.report(pred, pred.targets, num_bins=15)
        out[name] = {
            "accuracy": metrics["accuracy"],
            "nll": metrics["nll"],
            "ece": metrics["ece"],
            "final_train_loss": statistics.fmean(losses[name][-5:]),
            "step_ms_mean": 1e3 * statistics.fmean(times[name][1:]),
            "step_ms_median": 1e3 * statistics.median(times[name][1:]),
            "predict_s": time.perf_counter() - t0,
        }
    ref = times.get("ivon-opt")
    for name in names if ref is not None else ():
        per_round = [a / b for a, b in zip(times[name][1:], ref[1:], strict=True)]
        out[name]["ratio_median_of_rounds"] = statistics.median(per_round)
        out[name]["ratio_of_means"] = statistics.fmean(times[name][1:]) / statistics.fmean(ref[1:])
    out["_steps"] = rnd
    return out


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = [k for k in runs[0] if not k.startswith("_")]
    keys = [k for k in runs[0][names[0]] if isinstance(runs[0][names[0]][k], float)]
    agg: dict[str, Any] = {}
    for name in names:
        agg[name] = {}
        for k in keys:
            vals = [r[name][k] for r in runs]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            agg[name][k] = {"mean": statistics.fmean(vals), "sd": sd}
    return agg


def table(agg: dict[str, Any], num_seeds: int) -> str:
    rows = [
        "| method | accuracy | NLL | ECE | step ms (median) | step / ivon-opt "
        "(median of rounds) | step / ivon-opt (means) |",
        "|---|---|---|---|---|---|---|",
    ]

    def fmt(v: dict[str, float], scale: float = 1.0, digits: int = 3) -> str:
        if num_seeds > 1:
            return f"{scale * v['mean']:.{digits}f} ± {scale * v['sd']:.{digits}f}"
        return f"{scale * v['mean']:.{digits}f}"

    for name, a in agg.items():
        ratios = [
            fmt(a[k], 1, 2) if k in a else "-" for k in ("ratio_median_of_rounds", "ratio_of_means")
        ]
        rows.append(
            f"| {name} | {fmt(a['accuracy'], 100, 1)} | {fmt(a['nll'])} | {fmt(a['ece'])} | "
            f"{fmt(a['step_ms_median'], 1, 2)} | {ratios[0]} | {ratios[1]} |"
        )
    return "\n".join(rows)


CONFIGS: dict[str, dict[str, Any]] = {
    "digits": dict(
        epochs=30,
        batch=32,
        num_train=300,
        seeds=[0, 1, 2],
        samples=32,
        lr_ivon=0.2,
        lr_kron=0.2,
        lr_map=1e-2,
        hess_init=2.0,
        beta2=0.99999,
        ess_scale=1.0,  # ess = ess_scale * num_train for ivon, kron-ivon and ivon-opt
        schedule="constant",  # or "cosine" / "linear" (every method, per step, to 0 over the run)
        protocol="same",  # or "shift": new 10-class head, fine-tune on all digits
        evaluate="test",  # or "val": score on held-out training images (hyperparameter choice)
        latent_head=False,  # True: the head is a latent site (sampled in the predictive)
        prior_scale=1.0,  # the model's N(0, s²) prior: MAP's prior, δ = 1/(N s²) for the IVONs
        pretrain_holdout=False,  # "same": test on the validation runs' backbone (see digits_task)
        kron={},  # extra KroneckerIVONGuide options, e.g. {"beta2": 0.999, "T_inv": 1}
        ivon={},  # extra IVONGuide (and ivon-opt) options, e.g. {"clip_radius": 0.01}
    ),
    # the demo's text configuration (768 sentences, batch 32, 2 epochs = 48 steps, IVON lr 3.0,
    # h0 0.5, AdamW-MAP lr 1e-2); lr 0.1 left IVON at chance in 32-48 steps (docs/benchmarks.md)
    "text": dict(
        epochs=2,
        batch=32,
        num_train=768,
        seeds=[0, 1],
        samples=6,
        lr_ivon=3.0,
        lr_kron=3.0,
        lr_map=1e-2,
        hess_init=0.5,
        beta2=0.99999,
        ess_scale=1.0,  # ess = ess_scale * num_train for ivon, kron-ivon and ivon-opt
        schedule="constant",  # or "cosine" / "linear" (every method, per step, to 0 over the run)
        latent_head=False,  # True: the classifier is a latent site (sampled in the predictive)
        evaluate="test",  # or "val": score on 256 held-out sentences (hyperparameter choice)
        kron={},  # extra KroneckerIVONGuide options, e.g. {"beta2": 0.999, "T_inv": 1}
        ivon={},  # extra IVONGuide (and ivon-opt) options, e.g. {"clip_radius": 0.01}
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["digits", "text", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="fewer epochs / seeds / samples")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--set", nargs="*", default=[], help="override config: task.key=value")
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods to run"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type != "cpu":
        torch.set_default_device(device)
    tasks = ["digits", "text"] if args.task == "all" else [args.task]
    names = tuple(m for m in METHODS if m in args.methods)
    builders: dict[str, Callable[..., dict[str, Any]]] = {"digits": digits_task, "text": text_task}
    results: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "device": str(device),
        "threads": args.threads,
        "loadavg_start": os.getloadavg(),
        "quick": args.quick,
        "methods": list(names),
    }
    for spec in args.set:
        key, value = spec.split("=", 1)
        t, k = key.split(".", 1)
        CONFIGS[t][k] = type(CONFIGS[t][k])(json.loads(value))
    for name in tasks:
        cfg = dict(CONFIGS[name])
        if args.quick:
            cfg.update(epochs=max(1, cfg["epochs"] // 3), seeds=cfg["seeds"][:1])
            cfg["samples"] = max(4, cfg["samples"] // 2)
        runs = []
        t0 = time.perf_counter()
        for seed in cfg["seeds"]:
            keys = ("latent_head", "evaluate")
            keys += () if name == "text" else ("protocol", "prior_scale", "pretrain_holdout")
            extra = {k: cfg[k] for k in keys}
            task = builders[name](seed, cfg["num_train"], cfg["batch"], **extra)
            runs.append(run_task(task, cfg, seed, names))
            print(f"[{name} seed {seed}] done at {time.perf_counter() - t0:.0f}s", flush=True)
        agg = aggregate(runs)
        results[name] = {"config": cfg, "runs": runs, "summary": agg}
        print(f"\n## {name} ({len(cfg['seeds'])} seed(s), {cfg['epochs']} epochs)")
        print(table(agg, len(cfg["seeds"])), flush=True)
    results["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
