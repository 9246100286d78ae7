"""How many posterior draws the suite's predictive needs: the Monte Carlo bias of its NLL.

The predictive NLL is estimated by ``-log (1/S) Σ_s p(y | x, θ_s)``, which over-states the
exact ``-log E_q[p(y | x, θ)]`` on average (Jensen): few draws penalise a family with spread.
The text tasks predict with the demo's S = 6. This script fits the families of one task and
seed exactly as ``run.py`` does, draws ``--draws`` (96) samples on the calibration split, and
reports the NLL of random subsets of S draws (64 subsets per S < 96: mean and standard
deviation), so the bias at S is ``nll_S - nll_96`` and the Monte Carlo noise its deviation.

    .venv/bin/python benchmarks/suite/draws.py --task polarity --seed 0 \
        --families meanfield ivon swag --out benchmarks/results/suite/draws_polarity_s0.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

import pyrobayes as pb
from pyrobayes.calibration import TEMPERATURE_BUFFER

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import run as suite  # noqa: E402
from tasks import TASKS  # noqa: E402

SUBSETS = (1, 3, 6, 12, 24, 48)


def subset_nll(log_probs: torch.Tensor, targets: torch.Tensor, size: int, gen: Any) -> list[float]:
    """The predictive NLL of 64 random subsets of ``size`` of the ``(S, N, C)`` draws."""
    out = []
    for _ in range(64):
        idx = torch.randperm(log_probs.shape[0], generator=gen)[:size]
        mixed = torch.logsumexp(log_probs[idx], 0) - math.log(idx.numel())
        out.append(float(-mixed.gather(-1, targets[:, None]).mean()))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="polarity", choices=sorted(TASKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="+", default=["meanfield", "ivon", "swag"])
    parser.add_argument("--draws", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = TASKS[args.task](args.seed, False)
    result: dict[str, Any] = {
        **suite.provenance("benchmarks/suite/draws.py", argv),
        "task": args.task,
        "seed": args.seed,
        "split": "calibration",
        "task_num_samples": task.num_samples,
        # rows in run.py's order, named by family; a later variant row of a family (its
        # settings in run.py's task) carries a prime: meanfield' is meanfield-ab on text
        "families": {},
    }
    current: list[str] = []
    posterior, predict = pb.posterior, suite._predict

    def named_posterior(model: Any, name: str, **options: Any) -> Any:
        current[:] = [name]
        return posterior(model, name, **options)

    def measured_predict(task_: Any, model: Any, guide: Any) -> Any:
        out = predict(task_, model, guide)
        if current and TEMPERATURE_BUFFER not in guide._buffers:  # not the +ts rows
            start = time.perf_counter()
            p = pb.predict(model, guide, task_.calibration, num_samples=args.draws, seed=123)
            row: dict[str, Any] = {"predict_s": time.perf_counter() - start}
            gen = torch.Generator().manual_seed(0)
            for size in (s for s in SUBSETS if s < p.log_probs.shape[0]):
                vals = torch.tensor(subset_nll(p.log_probs, p.targets, size, gen))
                row[f"nll_{size}"] = [float(vals.mean()), float(vals.std())]
            row[f"nll_{p.log_probs.shape[0]}"] = [
                subset_nll(p.log_probs, p.targets, args.draws, gen)[0],
                0.0,
            ]
            # a variant row of the same family (e.g. meanfield-ab) comes later: numbered
            name = current[0]
            while name in result["families"]:
                name += "'"
            result["families"][name] = row
            print(name, json.dumps(row), flush=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return out

    pb.posterior, suite._predict = named_posterior, measured_predict
    try:
        suite.run_seed(task, args.seed, ["map", *args.families], members=1, laplace_torch=False)
    finally:
        pb.posterior, suite._predict = posterior, predict
    return result


if __name__ == "__main__":
    main()
