"""IVON's default β2 on the suite's cheap tasks, scored on their validation splits (issue 27).

For each seed, the suite's ``digits`` (LoRA-XS cores on a pretrained MLP, a new 7-class head) and
``diabetes`` (LoRA-XS, Gaussian likelihood with a learned noise scale) tasks
(``benchmarks/suite/tasks.py``) are fitted by MAP (the suite's settings: Adam, lr 1e-2) and by
``pb.posterior(model, "ivon")`` with the documented fit settings (lr 0.1, 60 epochs), once per
``--beta2`` given to ``pb.infer.IVON(beta2=...)``. Each fit is scored on the task's validation
split (32 posterior draws), never on its test split; one JSON line per fit, with the learnt
``h`` (mean, min, max over the sites) and, on diabetes, the learned noise scale.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon_defaults.py --task digits --seeds 0 1 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon_defaults.py --task diabetes --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from suite import tasks  # noqa: E402

import pyrobayes as pb  # noqa: E402


def run(task_name: str, seed: int, methods: list[str]) -> list[dict[str, float | str]]:
    """Fit and score ``methods`` ("map" or a β2 value) on one seed of ``task_name``."""
    task = getattr(tasks, task_name)(seed)
    rows = []
    for name in methods:
        beta2 = None if name == "map" else float(name)
        family = "map" if beta2 is None else "ivon"
        model = task.build_model(family)
        guide = pb.posterior(model, family)
        if beta2 is None:
            kw: dict = {"epochs": task.epochs, "lr": task.lr}
        else:
            optim = pb.Optimization(optimizer=pb.infer.IVON(beta2=beta2))
            kw = {"epochs": 60, "lr": 0.1, "optim": optim}
        start = time.perf_counter()
        pb.fit(model, guide, task.train, seed=seed, progress=False, **kw)
        pred = pb.predict(model, guide, task.val, num_samples=32, seed=0)
        report = pb.metrics.report(pred, pred.targets)
        row: dict = {"task": task_name, "seed": seed, "method": name}
        row["fit_s"] = time.perf_counter() - start
        row.update({k: float(report[k]) for k in ("nll", "accuracy", "rmse", "ece") if k in report})
        if beta2 is not None:
            h = torch.cat([v.flatten() for k, v in guide.named_buffers() if k.startswith("hess")])
            row.update(h_mean=float(h.mean()), h_min=float(h.min()), h_max=float(h.max()))
        for key, value in model.named_parameters():
            if "scale" in key and value.numel() == 1:
                row[key] = float(value.detach().exp())
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["digits", "diabetes"], default="digits")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--beta2", nargs="+", default=["0.999", "0.99999"])
    args = parser.parse_args()
    for seed in args.seeds:
        run(args.task, seed, ["map", *args.beta2])


if __name__ == "__main__":
    main()
