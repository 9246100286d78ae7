"""IBDR against a deep ensemble of K MAP fits and a single MAP fit (digits transfer, issue 18).

Task (Pham et al., 2025, CPU proxy): sklearn digits, an MLP 64-128-128-5 "pretrained" on digits
0-4 of the training split, then a new 10-class head and LoRA r=4 on both hidden layers,
fine-tuned on all ten digits (``--num-train`` images; the rest is the test split). The head is a
latent site (``latent_modules=["4"]``), so every particle / member has its own head.

Methods, same pretrained body, same batches, same epochs:

* ``map``      - one MAP fit (``pb.posterior(model, "map")``), Adam.
* ``ensemble`` - K independent MAP fits (each its own LoRA A and head init), probabilities
  averaged: K times the MAP budget.
* ``ibdr``     - ``pb.posterior(model, "ibdr", num_particles=K)`` fitted with ``pb.infer.IBDR(alpha=α)``: K interacting
  particles, two passes per step, each ONE sample-batched forward over the K particles. Particle
  k starts where ensemble member k starts (its LoRA A and head init; ``--jitter-init`` keeps the
  guide's own init instead: one model init plus independent ``init_scale`` jitter), so the paired
  IBDR − ensemble difference is the interaction and the robust step alone.

Metrics on the test split: accuracy, NLL, ECE (15 bins) of the averaged predictive, OOD AUROC by
predictive entropy against pixel-shuffled test digits (a synthetic OOD set: the same pixel
statistics, no digit structure), member disagreement (``pb.metrics.disagreement``), and the step
time: IBDR's step against K plain MAP steps (the target is <= 2.2x). Paired differences (IBDR −
other) are mean ± standard error over the seeds.

``python benchmarks/ibdr.py [--seeds 5] [--smoke]`` (one thread; about a minute per seed).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import pyro
import torch
from sklearn.datasets import load_digits
from torch import nn

import pyrobayes as pb


def data(seed: int, num_train: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


def pretrain(train, seed: int, epochs: int) -> nn.Sequential:
    """The body: an MLP 64-128-128-5 trained on digits 0-4 of the training split."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 5)
    )
    keep = train[1] < 5
    x, y = train[0][keep], train[1][keep]
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(epochs):
        for i in range(0, len(x), 64):
            loss = nn.functional.cross_entropy(net(x[i : i + 64]), y[i : i + 64])
            optim.zero_grad()
            loss.backward()
            optim.step()
    return net


def build(body: nn.Sequential, num_data: int, seed: int) -> pb.models.FineTuneModel:
    """The pretrained body with a new 10-class head (initialised from ``seed``) and LoRA r=4."""
    torch.manual_seed(seed)
    net = copy.deepcopy(body)
    net[4] = nn.Linear(128, 10)
    return pb.models.FineTuneModel(
        net,
        pb.models.LoRA(rank=4, alpha=4.0, target_modules=["0", "2"]),
        latent_modules=["4"],
        trainable_modules=[],
        num_data=num_data,
    )


def fit(model, guide, batches, args, seed: int, settings=None) -> tuple[float, dict]:
    """(seconds per step, the fitter's final state: λ, cost and radius for IBDR; ``settings``:
    the fit's, e.g. ``pb.infer.IBDR(...)``)."""
    start = time.perf_counter()
    optim = pb.Optimization(optimizer=settings)
    result = pb.fit(model, guide, batches, epochs=args.epochs, lr=args.lr, seed=seed, optim=optim)
    steps = len(result.losses)
    return (time.perf_counter() - start) / steps, dict(result.state or {})


def metrics(probs: torch.Tensor, y: torch.Tensor, ood_probs: torch.Tensor) -> dict[str, float]:
    report = pb.metrics.report(probs, y)
    auroc = pb.metrics.ood_auroc(
        pb.metrics.predictive_entropy(probs), pb.metrics.predictive_entropy(ood_probs)
    )
    return {
        "accuracy": report["accuracy"],
        "nll": report["nll"],
        "ece": report["ece"],
        "auroc": auroc,
        "disagreement": pb.metrics.disagreement(probs) if probs.shape[0] > 1 else 0.0,
    }


def run_seed(seed: int, args) -> dict[str, dict[str, float]]:
    train, test = data(seed, args.num_train)
    shuffle = torch.randperm(64, generator=torch.Generator().manual_seed(1000 + seed))
    ood = test[0][:, shuffle]
    body = pretrain(train, seed, args.pretrain_epochs)
    batches = [
        (train[0][i : i + args.batch_size], train[1][i : i + args.batch_size])
        for i in range(0, len(train[0]), args.batch_size)
    ]
    k = args.num_particles
    out: dict[str, dict[str, float]] = {}

    def predict(model, guide, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        pred = pb.predict(model, guide, [test], num_samples=num_samples, seed=seed)
        ood_pred = pb.predict(model, guide, [(ood,)], num_samples=num_samples, seed=seed)
        return pred.probs, ood_pred.probs

    # single MAP and the deep ensemble (member 0 is the single MAP fit)
    members, members_ood, map_time, inits = [], [], [], []
    for member in range(k):
        pyro.clear_param_store()
        model = build(body, args.num_train, seed=100 * seed + member)
        inits.append(model.init_values())
        guide = pb.posterior(model, "map")
        step_s, _ = fit(model, guide, batches, args, seed=100 * seed + member)
        map_time.append(step_s)
        probs, ood_probs = predict(model, guide, 1)
        members.append(probs)
        members_ood.append(ood_probs)
        if member == 0:
            out["map"] = metrics(probs, test[1], ood_probs) | {"step_ms": 1e3 * step_s}
    ens, ens_ood = torch.cat(members), torch.cat(members_ood)
    out["ensemble"] = metrics(ens, test[1], ens_ood) | {"step_ms": 1e3 * sum(map_time)}
    for alpha, rho in [(a, r) for a in args.alphas for r in args.rhos]:
        pyro.clear_param_store()
        model = build(body, args.num_train, seed=100 * seed)
        options = {} if rho is None else {"rho": rho}
        guide = pb.posterior(model, "ibdr", num_particles=k)
        settings = pb.infer.IBDR(alpha=alpha, **options)
        if not args.jitter_init:  # particle k starts at ensemble member k's init
            with torch.no_grad():
                for site, locs in guide.component_locs().items():
                    for member in range(k):
                        locs[member].copy_(inits[member][site])
        step_s, state = fit(model, guide, batches, args, seed=100 * seed, settings=settings)
        probs, ood_probs = predict(model, guide, k)  # S = K: each particle once
        row = metrics(probs, test[1], ood_probs) | {"step_ms": 1e3 * step_s}
        row["step_vs_k_map"] = step_s / (k * statistics.mean(map_time))
        row |= {key: float(state[key]) for key in ("lam", "cost", "radius") if key in state}
        name = f"ibdr a={alpha:g}" + ("" if rho is None else f" rho={rho:g}")
        out[name] = row
    return out


def paired(results, a: str, b: str, key: str) -> tuple[float, float]:
    diffs = [r[a][key] - r[b][key] for r in results]
    mean = statistics.mean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return mean, se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--num-particles", type=int, default=4)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.02])
    parser.add_argument(
        "--rhos",
        type=lambda v: None if v == "default" else float(v),
        nargs="+",
        default=[None],
        help="ρ values ('default': the guide's; 0: the robust step off)",
    )
    parser.add_argument("--jitter-init", action="store_true", help="the guide's own init")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one seed")
    parser.add_argument("--out", type=Path, default=None, help="write the raw results as JSON")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.num_train, args.epochs, args.pretrain_epochs = 1, 200, 1, 1
    torch.set_num_threads(1)
    results = [run_seed(seed, args) for seed in range(args.seeds)]
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": None}, "results": results}))
    methods = list(results[0])
    keys = ["accuracy", "nll", "ece", "auroc", "disagreement", "step_ms", "lam", "cost"]
    print(
        f"digits transfer (body pretrained on 0-4, LoRA r=4 + latent head, all 10 classes), "
        f"K={args.num_particles}, {args.num_train} train images, {args.epochs} epochs, "
        f"Adam lr {args.lr}, {args.seeds} seeds (mean ± sd)"
    )
    print("| method | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for m in methods:
        cells = []
        for key in keys:
            values = [r[m][key] for r in results if key in r[m]]
            if not values:
                cells.append("–")
                continue
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.4g} ± {sd:.2g}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    for m in methods:
        if not m.startswith("ibdr"):
            continue
        ratio = statistics.mean(r[m]["step_vs_k_map"] for r in results)
        print(f"{m}: step time / (K x MAP step) = {ratio:.2f} (target <= 2.2)")
        for other in ("map", "ensemble"):
            diffs = ", ".join(
                "{}: {:+.4f} ± {:.4f}".format(key, *paired(results, m, other, key))
                for key in ("accuracy", "nll", "ece", "auroc")
            )
            print(f"  {m} − {other} (paired, mean ± se): {diffs}")


if __name__ == "__main__":
    main()
