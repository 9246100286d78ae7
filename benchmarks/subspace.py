"""SWAG and Laplace over LoRA-XS cores against LoRA-SWAG and LoRA-Laplace on text (issue 5).

Task: ``all-MiniLM-L6-v2`` with a new 2-class head (point estimate), VADER movieReviewSnippets
binary (``--num-train`` training sentences, ``--num-test`` test sentences, max_length 48), OOD =
``--num-ood`` VADER tweets. Adapters on ``query``/``value`` of all 6 layers (12 adapted maps).

Cells (one training run per cell and posterior family):

* ``loraxs-<projection>-r<r>``: LoRA-XS cores (``r×r``, projection in svd/wsvd/dct/random):

  - ``map``: ``LaplaceGuide`` trained by ``pb.fit`` (MAP objective, Adam), evaluated at its point;
  - ``laplace``: the same run's post-hoc Laplace-KRON over the cores (head fixed at its MAP, τ by
    marginal likelihood), GLM predictive with an MC link over the logits (``--glm-samples``);
  - ``swag``: ``SWAGGuide`` (K = 5, s = 0.5) started at that MAP (cores and head) and run for
    ``--swag-epochs`` more epochs at the same learning rate, collecting ``--collections`` snapshots
    per epoch (every ``steps // collections`` optimizer steps); S = 15 samples. Its fit time
    includes the MAP run.

* ``lora-r8``: the same three methods over a rank-8 LoRA (both ``lora_A`` and ``lora_B`` latent):
  LoRA-SWAG and Laplace over the full LoRA adapter, DIAG (``LoRALinear`` does not call its
  ``lora_A``/``lora_B`` modules, so laplace-torch's K-FAC hooks cannot see their inputs).

Metrics (``pyrobayes.metrics.report``, ECE with 15 bins): accuracy, NLL, ECE, OOD AUROC of the
predictive entropy, posterior storage (``pb.count_parameters(guide)["posterior_storage"]``; 0 for
MAP, which stores only its point) and fit wall time (training + curvature/τ for Laplace).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/subspace.py            # all cells (hours on CPU)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/subspace.py --quick    # svd-r8, lora-r8,
                                                                         # random-r8, wsvd-r8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pyro  # noqa: E402
import torch  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.data import load_minilm_classifier, load_vader, text_loader  # noqa: E402
from pyrobayes.guides import LaplaceGuide, SWAGGuide  # noqa: E402
from pyrobayes.infer.laplace import glm_predict  # noqa: E402
from pyrobayes.models import LoRA, LoRAXS  # noqa: E402
from pyrobayes.models.finetune import FineTuneModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["query", "value"]
KEYS = ("accuracy", "nll", "ece", "auroc_entropy")


def _cells(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    if args.quick:
        cells = [("loraxs", p, 8) for p in ("svd", "random", "wsvd")]
    else:
        cells = [("loraxs", p, r) for p in args.projections for r in args.ranks]
    if not args.no_lora:
        cells.insert(1, ("lora", "-", args.lora_rank))
    return cells


def _model(kind: str, projection: str, rank: int, base: Any, train: Any, n: int) -> FineTuneModel:
    net = copy.deepcopy(base)
    if kind == "lora":
        adapter: Any = LoRA(rank=rank, target_modules=TARGETS)
    else:
        adapter = LoRAXS(rank=rank, projection=projection, target_modules=TARGETS)
    return FineTuneModel(
        net, adapter, num_data=n, calibration_data=train if projection == "wsvd" else None
    )


def _metrics(pred: Any, ood: Any, y: torch.Tensor) -> dict[str, float]:
    r = pb.metrics.report(pred, y, ood_probs=ood)
    return {k: float(r[k]) for k in KEYS}


def run_cell(kind: str, projection: str, rank: int, data: dict[str, Any], args: Any) -> dict:
    n, out = data["num_train"], {}
    y = data["y_test"]
    # ---- MAP + Laplace-KRON (one run)
    pyro.clear_param_store()
    torch.manual_seed(args.seed)
    model = _model(kind, projection, rank, data["net"], data["train"], n)
    # LoRALinear computes x Aᵀ Bᵀ with the weights directly (no call of its lora_A/lora_B
    # modules), so laplace-torch's K-FAC hooks see no inputs there: DIAG for LoRA
    structure = "diag" if kind == "lora" else "kron"
    lap = LaplaceGuide(model, structure=structure)
    t0 = time.perf_counter()
    pb.fit(model, lap, data["train"], epochs=args.epochs, lr=args.lr, seed=args.seed)
    t_lap = time.perf_counter() - t0
    point = {s: v[None] for s, v in lap.mean().items()}
    m_test = pb.predict(model, lap, data["test"], values=point)
    m_ood = pb.predict(model, lap, data["ood"], values=point)
    counts = pb.count_parameters(lap)
    out["map"] = {
        **_metrics(m_test, m_ood, y),
        "posterior_params": 0,
        "trainable": counts["latent"],
        "fit_s": t_lap,
    }
    logging.info("%s %s r=%d map %s", kind, projection, rank, out["map"])
    glm = dict(link="mc", num_samples=args.glm_samples, seed=args.seed)
    l_test = glm_predict(model, lap, data["test_glm"], **glm)
    l_ood = glm_predict(model, lap, data["ood_glm"], **glm)
    out[f"laplace_{structure}"] = {
        **_metrics(l_test, l_ood, y),
        "posterior_params": counts["posterior_storage"],
        "tau": lap.prior_precision,
        "fit_s": t_lap,
    }
    logging.info("%s %s r=%d laplace %s", kind, projection, rank, out[f"laplace_{structure}"])
    # ---- SWAG: continue from the MAP (cores copied into the network, head as trained) for
    # --swag-epochs more epochs, collecting --collections snapshots per epoch
    with torch.no_grad():
        for s, v in lap.mean().items():
            model.net.get_parameter(model.latent_sites[s].param_name).copy_(v)
    steps = len(data["train"])
    swag = SWAGGuide(
        model,
        rank=5,
        scale=0.5,
        start_epoch=0,
        collect_every_steps=max(1, steps // args.collections),
    )
    t0 = time.perf_counter()
    pb.fit(model, swag, data["train"], epochs=args.swag_epochs, lr=args.lr, seed=args.seed + 1)
    t_swag = t_lap + time.perf_counter() - t0
    kw = dict(num_samples=15, seed=args.seed)
    out["swag"] = {
        **_metrics(
            pb.predict(model, swag, data["test"], **kw),
            pb.predict(model, swag, data["ood"], **kw),
            y,
        ),
        "posterior_params": pb.count_parameters(swag)["posterior_storage"],
        "collected": int(swag.swag_num_collected),
        "fit_s": t_swag,
    }
    logging.info("%s %s r=%d swag %s", kind, projection, rank, out["swag"])
    return out


def load_data(args: argparse.Namespace) -> dict[str, Any]:
    ds = load_vader("movieReviewSnippets")
    train_ds, test_ds = ds.split([args.num_train, args.num_test], seed=args.seed)
    ood_ds = load_vader("tweets").subset(args.num_ood, seed=args.seed)
    net, tok = load_minilm_classifier(2)
    kw = dict(max_length=args.max_length)
    return {
        "net": net,
        "num_train": args.num_train,
        "train": text_loader(
            train_ds, tok, batch_size=args.batch, shuffle=True, seed=args.seed, **kw
        ),
        "test": list(text_loader(test_ds, tok, batch_size=64, **kw)),
        "ood": list(text_loader(ood_ds, tok, batch_size=64, **kw)),
        # the GLM predictive's reverse-mode Jacobian costs O(batch) per example: small batches
        "test_glm": list(text_loader(test_ds, tok, batch_size=2, **kw)),
        "ood_glm": list(text_loader(ood_ds, tok, batch_size=2, **kw)),
        "y_test": test_ds.labels,
    }


def _label(name: str, method: str) -> str:
    if name.startswith("lora-"):
        tags = {"map": "LoRA MAP", "swag": "LoRA-SWAG", "laplace_diag": "LoRA Laplace-DIAG"}
        return tags[method]
    proj, r = name.split("-")[1:]
    tag = {"map": "MAP", "swag": "SWAG", "laplace_kron": "Laplace-KRON"}[method]
    return f"LoRA-XS {proj} {r} {tag}"


def table(results: dict[str, Any]) -> str:
    rows = [
        "| adapter / method | acc | NLL | ECE | OOD AUROC (entropy) | posterior params | fit s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, cell in results["cells"].items():
        for method, m in cell.items():
            extra = f" (τ = {m['tau']:.3g})" if "tau" in m else ""
            rows.append(
                f"| {_label(name, method)}{extra} | {m['accuracy']:.3f} | {m['nll']:.3f} | "
                f"{m['ece']:.3f} | {m['auroc_entropy']:.3f} | {m['posterior_params']:,} | "
                f"{m['fit_s']:.0f} |"
            )
    return "\n".join(rows)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    style = {"swag": ("o", "C0"), "laplace_kron": ("s", "C1"), "laplace_diag": ("D", "C3")}
    seen: set[str] = set()
    for name, cell in results["cells"].items():
        for method, m in cell.items():
            if method == "map":
                continue
            marker, color = style[method]
            face = "none" if name.startswith("lora-") else color
            tag = {"swag": "SWAG", "laplace_kron": "Laplace-KRON", "laplace_diag": "Laplace-DIAG"}
            label = tag[method] + (" (LoRA)" if name.startswith("lora-") else " (LoRA-XS)")
            ax.scatter(
                m["posterior_params"],
                m["ece"],
                marker=marker,
                edgecolors=color,
                facecolors=face,
                label=None if label in seen else label,
            )
            seen.add(label)
            ax.annotate(name.replace("loraxs-", ""), (m["posterior_params"], m["ece"]), fontsize=7)
    maps = [c["map"]["ece"] for c in results["cells"].values() if "map" in c]
    if maps:
        ax.axhspan(min(maps), max(maps), color="C2", alpha=0.15, label="MAP ECE range")
    ax.set_xscale("log")
    ax.set_xlabel("posterior parameters (numbers stored)")
    ax.set_ylabel("ECE (15 bins)")
    ax.set_title("MiniLM / VADER movie reviews: ECE vs posterior size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="svd/random/wsvd at r=8 (+ LoRA)")
    p.add_argument("--projections", nargs="+", default=["svd", "wsvd", "dct", "random"])
    p.add_argument("--ranks", nargs="+", type=int, default=[4, 8, 16])
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--no-lora", action="store_true")
    p.add_argument("--num-train", type=int, default=256)
    p.add_argument("--num-test", type=int, default=256)
    p.add_argument("--num-ood", type=int, default=256)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--swag-epochs", type=int, default=1)
    p.add_argument("--collections", type=int, default=8, help="SWAG snapshots per epoch")
    p.add_argument("--glm-samples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/subspace.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs/img/ece_vs_posterior_params.png")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    data = load_data(args)
    results: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} thread(s)",
        "torch": torch.__version__,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cells": {},
    }
    for kind, proj, rank in _cells(args):
        name = f"lora-r{rank}" if kind == "lora" else f"loraxs-{proj}-r{rank}"
        results["cells"][name] = run_cell(kind, proj, rank, data, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))  # partial results survive a timeout
        plot(results, args.plot)
    print(table(results))


if __name__ == "__main__":
    main()
