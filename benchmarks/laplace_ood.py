"""Laplace OOD detection on sklearn digits: pyrobayes' Laplace configurations against laplace-torch's
last-layer Laplace on the same MAP network (issue 27 item 5).

Task (validation split only, as ``benchmarks/ivon.py``'s digits ``evaluate="val"``): an MLP
64-128-128-5 pretrained on digits 0-4 (without 225 held-out training images), LoRA-XS r=4 cores on
its two hidden layers, fine-tuned by MAP on 300 other training images of digits 0-4; scored on the
225 held-out images (in-distribution) against every image of digits 5-9 (OOD). Two MAP networks
per seed:

* ``point head`` - the head a point parameter (``trainable_modules=["4"]``, the library's
  default for a task head): pyrobayes' Laplace can only cover the cores;
* ``latent head`` - the head's weight and bias latent sites (``latent_modules=["4"]``): trained
  under the same N(0, s_p²) prior as the cores, and available to Laplace.

On each MAP: laplace-torch's ``Laplace(net, "classification", subset_of_weights="last_layer",
hessian_structure="kron")`` + ``optimize_prior_precision()`` (its defaults: marginal likelihood,
probit GLM predictive) on a plain copy of the MAP network, and pyrobayes' ``LaplaceGuide``
configurations started at the MAP (``pb.posterior(model, "laplace", init=map, ...)``,
``pb.fit(..., epochs=0)``). Scores: OOD AUROC with the maximum-probability score
(``1 − max_c p̄``) and the predictive entropy; validation accuracy and NLL.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/laplace_ood.py            # seeds 0-9 (~25 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/laplace_ood.py --seeds 0  # one seed
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.demo.data import load_digits_split  # noqa: E402
from pyrobayes.metrics import max_prob_score, ood_auroc, predictive_entropy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "laplace_ood.json"
NUM_TRAIN, NUM_VAL, BATCH, EPOCHS, LR = 300, 225, 32, 30, 1e-2

#: pyrobayes configurations: (name, head, LaplaceGuide options)
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("pb cores kron (point head)", "point", {}),
    ("pb cores kron probit (point head)", "point", {"pred_type": "probit"}),
    ("pb cores diag (point head)", "point", {"structure": "diag"}),
    (
        "pb cores kron probit T=0.1 (point head)",
        "point",
        {"pred_type": "probit", "temperature": 0.1},
    ),
    ("pb all kron glm", "latent", {}),
    ("pb all kron probit", "latent", {"pred_type": "probit"}),
    ("pb all diag glm", "latent", {"structure": "diag"}),
    ("pb last_layer kron glm", "latent", {"subset": "last_layer"}),
    ("pb last_layer kron probit", "latent", {"subset": "last_layer", "pred_type": "probit"}),
    ("pb adapter kron glm", "latent", {"subset": "adapter"}),
    (
        "pb all kron probit, τ = 1/s_p² (no marglik)",
        "latent",
        {"pred_type": "probit", "prior_precision": "model"},
    ),
    # last: refits the MAP (the guide's own point; the head is a site, so the model is untouched)
    (
        "pb all kron probit, alternate",
        "latent",
        {"pred_type": "probit", "prior_optimization": "alternate"},
    ),
]


def task(seed: int) -> dict[str, Any]:
    """The pretrained network, fine-tuning batches, validation and OOD inputs of one seed."""
    torch.manual_seed(seed)
    split = load_digits_split(seed=seed, id_classes=range(5), dtype=torch.float32)
    perm = torch.randperm(len(split.x_train))
    idx, held = perm[:NUM_TRAIN], perm[NUM_TRAIN : NUM_TRAIN + NUM_VAL]
    keep = torch.ones(len(split.x_train), dtype=torch.bool)
    keep[held] = False  # the validation images are unseen by the pretraining too
    x_pre, y_pre = split.x_train[keep], split.y_train[keep]
    net = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 5)
    )
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(60):
        for i in range(0, len(x_pre), 64):
            loss = nn.functional.cross_entropy(net(x_pre[i : i + 64]), y_pre[i : i + 64])
            optim.zero_grad()
            loss.backward()
            optim.step()
    x, y = split.x_train[idx], split.y_train[idx]
    return {
        "net": net,
        "train": [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, NUM_TRAIN, BATCH)],
        "val": (split.x_train[held], split.y_train[held]),
        "ood": split.x_ood,
    }


def scores(probs: Tensor, y: Tensor, ood_probs: Tensor) -> dict[str, float]:
    """Accuracy, NLL on the validation images; OOD AUROC by max-probability and entropy."""
    p = probs.clamp_min(1e-12)
    return {
        "acc": float((p.argmax(-1) == y).double().mean()),
        "nll": float(-p.gather(-1, y[:, None]).log().mean()),
        "auroc_maxprob": ood_auroc(max_prob_score(probs), max_prob_score(ood_probs)),
        "auroc_entropy": ood_auroc(predictive_entropy(probs), predictive_entropy(ood_probs)),
    }


def pb_probs(model: Any, guide: Any, x: Tensor) -> Tensor:
    pred = pb.predict(model, guide, [(x[i : i + 128],) for i in range(0, len(x), 128)], seed=0)
    return pred.mean_probs


def run_seed(seed: int) -> dict[str, dict[str, float]]:
    data = task(seed)
    xv, yv = data["val"]
    out: dict[str, dict[str, float]] = {}
    for head in ("point", "latent"):
        net = copy.deepcopy(data["net"])
        model = pb.models.FineTuneModel(
            net,
            pb.models.LoRAXS(rank=4, projection="svd", target_modules=["0", "2"]),
            num_data=NUM_TRAIN,
            latent_modules=["4"] if head == "latent" else [],
            trainable_modules=[] if head == "latent" else ["4"],
        )
        map_guide = pb.posterior(model, "map")
        pb.fit(model, map_guide, data["train"], epochs=EPOCHS, lr=LR, seed=seed, progress=False)
        probs = pb_probs(model, map_guide, xv)
        out[f"MAP ({head} head)"] = scores(probs, yv, pb_probs(model, map_guide, data["ood"]))
        # laplace-torch's last-layer Laplace on a plain copy of the MAP network
        plain = copy.deepcopy(model.net)
        with torch.no_grad():
            for s, v in map_guide.mean().items():
                plain.get_parameter(model.latent_sites[s].param_name).copy_(v)
        for p in plain.parameters():
            p.requires_grad_(True)
        plain.eval()
        from laplace import Laplace

        t0 = time.perf_counter()
        la = Laplace(
            plain, "classification", subset_of_weights="last_layer", hessian_structure="kron"
        )
        la.fit(
            torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(*_cat(data["train"])), batch_size=BATCH
            )
        )
        la.optimize_prior_precision()
        with torch.no_grad():
            lt_val, lt_ood = la(xv), la(data["ood"])
        out[f"laplace-torch LL kron ({head} head)"] = {
            **scores(lt_val, yv, lt_ood),
            "tau": float(la.prior_precision),
            "time_s": time.perf_counter() - t0,
        }
        for name, cfg_head, options in CONFIGS:
            if cfg_head != head:
                continue
            t0 = time.perf_counter()
            fit_keys = pb.guides.LaplaceGuide.fit_options  # the fit's (pb.infer.Laplace)
            settings = pb.infer.Laplace(**{k: v for k, v in options.items() if k in fit_keys})
            options = {k: v for k, v in options.items() if k not in fit_keys}
            guide = pb.posterior(model, "laplace", init=map_guide, **options)
            optim = pb.Optimization(optimizer=settings)
            pb.fit(model, guide, data["train"], epochs=0, progress=False, optim=optim)
            val = pb_probs(model, guide, xv)
            out[name] = {
                **scores(val, yv, pb_probs(model, guide, data["ood"])),
                "tau": guide.prior_precision,
                "time_s": time.perf_counter() - t0,
            }
    return out


def _cat(batches: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def summarise(runs: dict[int, dict[str, dict[str, float]]]) -> str:
    """Mean over seeds, and AUROC differences paired against laplace-torch on the same MAP."""
    seeds = sorted(runs)
    names = list(runs[seeds[0]])
    lines = [
        "| method | acc | NLL | AUROC max-p | AUROC entropy | Δ max-p vs LT-LL | Δ entropy vs LT-LL |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        head = "point" if "(point head)" in name else "latent"
        anchor = f"laplace-torch LL kron ({head} head)"

        def stat(key: str, ref: str | None = None, name: str = name) -> str:
            vals = [runs[s][name][key] - (runs[s][ref][key] if ref else 0.0) for s in seeds]
            mean = statistics.fmean(vals)
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            return f"{mean:+.3f} ± {sd:.3f}" if ref else f"{mean:.3f}"

        lines.append(
            f"| {name} | {stat('acc')} | {stat('nll')} | {stat('auroc_maxprob')} | "
            f"{stat('auroc_entropy')} | {stat('auroc_maxprob', anchor)} | "
            f"{stat('auroc_entropy', anchor)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    runs = {}
    for seed in args.seeds:
        t0 = time.perf_counter()
        runs[seed] = run_seed(seed)
        logging.warning("seed %d done in %.0f s", seed, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({str(s): r for s, r in runs.items()}, indent=1))
    print(summarise(runs))  # noqa: T201 (a script's output)


if __name__ == "__main__":
    main()
