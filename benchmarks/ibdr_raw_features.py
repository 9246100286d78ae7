"""IBDR against MAP on raw and standardized tabular features (wine, breast cancer).

An MLP d-64-64-C (ReLU) pretrained on one half of the training rows (all classes, 100 epochs,
Adam 1e-3), then a new head (a point parameter shared by IBDR's particles) and a LoRA-XS r = 4
core on both hidden layers, fitted on the other half (Adam lr 1e-2, 30 epochs, batches of 32);
MAP and IBDR at the library's defaults (K = 4 particles, α = 0 with two or three classes). A
third of the rows is held out and scored (accuracy, NLL; none used for any choice). Inputs are
the datasets' raw values (up to 4,254 on breast cancer) or standardized with the fine-tuning
rows' mean and sd.

Reported per fit: both scores, IBDR's final λ and radius, and the paired NLL difference
IBDR − MAP (mean ± sample sd over seeds). docs/methods/ibdr.md ("Raw features") quotes it; run
at the commit before ``f46bdff`` it gives the numbers from when the robust step also moved the
shared head.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ibdr_raw_features.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
from torch import nn

import pyrobayes as pb


def _task(name: str, seed: int, scaling: str) -> dict[str, torch.Tensor]:
    from sklearn import datasets

    data = datasets.load_wine() if name == "wine" else datasets.load_breast_cancer()
    x = torch.as_tensor(data.data, dtype=torch.float32)
    y = torch.as_tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    held, rest = perm[: len(x) // 3], perm[len(x) // 3 :]
    pre, train = rest[: len(rest) // 2], rest[len(rest) // 2 :]
    parts = {"x": x[train], "held": x[held], "pre": x[pre]}
    if scaling == "standardized":
        loc, scale = parts["x"].mean(0), parts["x"].std(0).clamp_min(1e-3)
        parts = {k: (v - loc) / scale for k, v in parts.items()}
    return {**parts, "y": y[train], "y_held": y[held], "y_pre": y[pre]}


def _body(width: int, classes: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes)
    )


def _pretrained(task: dict[str, torch.Tensor], classes: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = _body(task["x"].shape[1], classes)
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = task["pre"], task["y_pre"]
    for _ in range(100):
        for i in range(0, len(x), 64):
            loss = nn.functional.cross_entropy(net(x[i : i + 64]), y[i : i + 64])
            optim.zero_grad()
            loss.backward()
            optim.step()
    return net.state_dict()


def one(name: str, scaling: str, seed: int) -> dict[str, Any]:
    """MAP and IBDR on one seed's split of ``name``."""
    task = _task(name, seed, scaling)
    classes = int(task["y"].max()) + 1
    state = _pretrained(task, classes, seed)
    x, y = task["x"], task["y"]
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, len(x), 32)]
    held = [(task["held"], task["y_held"])]
    row: dict[str, Any] = {"task": name, "scaling": scaling, "seed": seed}
    for family in ("map", "ibdr"):
        net = _body(x.shape[1], classes)
        net.load_state_dict(state)
        torch.manual_seed(1000 * seed)
        net[4] = nn.Linear(64, classes)
        cores = pb.models.LoRAXS(rank=4, target_modules=["0", "2"])
        model = pb.models.FineTuneModel(net, cores, num_data=len(x), trainable_modules=["4"])
        guide = pb.posterior(model, family)
        result = pb.fit(model, guide, batches, epochs=30, lr=1e-2, seed=seed, progress=False)
        pred = pb.predict(model, guide, held, num_samples=4, seed=0)
        assert pred.targets is not None
        report = pb.metrics.report(pred, pred.targets)
        row[family] = {"accuracy": float(report["accuracy"]), "nll": float(report["nll"])}
        if family == "ibdr":
            row[family].update(lam=result.state["lam"], radius=result.state["radius"])
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=["cancer", "wine"])
    parser.add_argument("--scalings", nargs="+", default=["raw", "standardized"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.tasks:
        for scaling in args.scalings:
            runs = [one(name, scaling, seed) for seed in args.seeds]
            for row in runs:
                print(json.dumps(row), flush=True)
            diffs = [r["ibdr"]["nll"] - r["map"]["nll"] for r in runs]
            spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            print(f"{name} {scaling}: NLL IBDR - MAP {statistics.mean(diffs):+.3f} ± {spread:.3f}")
            rows += runs
    return rows


if __name__ == "__main__":
    main()
