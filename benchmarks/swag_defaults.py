"""SWAG's documented settings on the suite's cheap tasks, scored on their validation splits.

For each seed of the suite's ``digits`` / ``diabetes`` tasks (``benchmarks/suite/tasks.py``): the
MAP fit (Adam, the task's lr and epochs), then ``pb.posterior(model, "swag", init=map_guide)``
from that MAP for 10 epochs (default guide: rank 10, scale 0.5, one collection per epoch) with

* ``adam``: the suite's settings (``pb.infer.SWAG()``, Adam at lr 1e-3);
* ``sgd``: ``pb.infer.SWAG(optimizer="sgd")`` at the constant rate of Mandt et al. (2017),
  ``η = 2B/N`` for the per-example mean loss, i.e. ``2B/N²`` for pyrobayes' summed loss.

One JSON line per fit, validation NLL and accuracy / RMSE (32 draws). A fit that diverges is
reported with its error.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/swag_defaults.py --task digits --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyro  # noqa: E402
import torch  # noqa: E402
from suite import tasks  # noqa: E402

import pyrobayes as pb  # noqa: E402


def _score(task: tasks.Task, model: object, guide: object) -> dict[str, float]:
    pred = pb.predict(model, guide, task.val, num_samples=32, seed=0)
    report = pb.metrics.report(pred, pred.targets)
    return {k: float(report[k]) for k in ("nll", "accuracy", "rmse") if k in report}


def run(task_name: str, seed: int, batch: int = 32) -> None:
    """MAP, then SWAG from it with each optimizer; prints one JSON line per fit."""
    task = getattr(tasks, task_name)(seed)
    pyro.clear_param_store()
    map_model = task.build_model("map")
    map_guide = pb.posterior(map_model, "map")
    pb.fit(
        map_model, map_guide, task.train, epochs=task.epochs, lr=task.lr, seed=seed, progress=False
    )
    print(
        json.dumps(
            {"task": task_name, "seed": seed, "method": "map", **_score(task, map_model, map_guide)}
        )
    )
    state = copy.deepcopy(map_guide.state_dict())
    head = {k: v.detach().clone() for k, v in map_model.point_params.items()}
    num = task.info["num_train"]
    for name, settings, lr in (
        ("adam", pb.infer.SWAG(), 1e-3),
        ("sgd", pb.infer.SWAG(optimizer="sgd"), 2 * batch / num**2),
    ):
        pyro.clear_param_store()
        model = copy.deepcopy(map_model)
        with torch.no_grad():
            for k, v in head.items():
                model.point_params[k].copy_(v)
        map_guide.load_state_dict(state)
        guide = pb.posterior(model, "swag", init=map_guide)
        row: dict = {"task": task_name, "seed": seed, "method": name, "lr": lr}
        try:
            optim = pb.Optimization(optimizer=settings)
            pb.fit(
                model, guide, task.train, epochs=10, lr=lr, seed=seed, progress=False, optim=optim
            )
            row.update(_score(task, model, guide))
        except FloatingPointError as err:
            row["error"] = str(err).split(";")[0]
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["digits", "diabetes"], default="digits")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    for seed in args.seeds:
        run(args.task, seed)


if __name__ == "__main__":
    main()
