"""Laplace's two marginal likelihoods for τ, at the same MAP: the default (the MAP as the
likelihood's mode, ``pb.infer.Laplace(evidence="likelihood_mode")``) against laplace-torch's (the
MAP as the posterior's mode, ``evidence="posterior_mode"``).

Suite tasks (``benchmarks/suite/tasks.py``): per seed, the suite's MAP (its settings and early
stopping), then Laplace fitted at it under each evidence; one JSON line per seed and method with
the validation-split metrics and OOD AUROCs of ``benchmarks/suite/run.py`` (the split the suite
reports; no choice is made on it) and τ. Causal-LM run folders (``pyrobayes fit`` on a causal-LM
config, with a ``laplace`` posterior): the saved posterior's curvature and mean, τ re-chosen by
each evidence from them (:mod:`pyrobayes.infer.evidence`; no curvature refit) and the test split's
metrics at each. docs/methods/swag_laplace.md, "The evidence on Adam-trained adapters".

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/laplace_evidence.py --task fine --seeds 0 1 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/laplace_evidence.py --lm-run runs/disamb-s0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyro
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "suite"))

from run import _fit, _predict, _scores  # noqa: E402
from tasks import TASKS  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.infer.evidence import (  # noqa: E402
    eigen_coordinates,
    likelihood_mode_log_evidence,
    posterior_mode_log_evidence,
)
from pyrobayes.infer.laplace import EVIDENCE, tune_prior_precision  # noqa: E402


def suite_seed(task_name: str, seed: int, quick: bool = False) -> list[dict[str, Any]]:
    """The suite's MAP on ``seed`` and Laplace at it under each evidence: metrics per method."""
    task = TASKS[task_name](seed, quick=quick)
    pyro.clear_param_store()
    model = task.build_model("map", 0)
    point = pb.posterior(model, "map")
    _fit(task, model, point, task.settings.get("map", {}), 1000 * seed)
    rows = [
        {
            "task": task_name,
            "seed": seed,
            "method": "map",
            **_scores(*_predict(task, model, point)[:2]),
        }
    ]
    for evidence in EVIDENCE:
        laplace = pb.posterior(model, "laplace", init=point)
        settings = pb.infer.Laplace(evidence=evidence)
        pb.fit(
            model,
            laplace,
            task.train,
            epochs=0,
            optim=pb.Optimization(optimizer=settings),
            progress=False,
        )
        pred, ood, _ = _predict(task, model, laplace)
        rows.append(
            {
                "task": task_name,
                "seed": seed,
                "method": f"laplace ({evidence})",
                "tau": laplace.prior_precision,
                **_scores(pred, ood),
            }
        )
    return rows


def evidence_taus(guide: Any) -> dict[str, float]:
    """τ of each evidence from a fitted Laplace guide's stored curvature and mean, searched
    within the fit's default bounds."""
    lo, hi = pb.infer.Laplace().log_prior_bounds
    lam, coords = eigen_coordinates(guide)
    forms = {
        "likelihood_mode": likelihood_mode_log_evidence,
        "posterior_mode": posterior_mode_log_evidence,
    }
    return {
        name: tune_prior_precision(lambda t, f=f: f(lam, coords, t), (lo, hi))
        for name, f in forms.items()
    }


def lm_run(run_dir: Path) -> list[dict[str, Any]]:
    """A causal-LM run folder's Laplace posterior at each evidence's τ: test-split metrics."""
    from pyrobayes.demo import causal_lm as cl
    from pyrobayes.io import load

    config = json.loads((run_dir / "config.json").read_text())
    base, tokenizer = cl.load_base(config)
    data = cl.build_data(config, tokenizer)
    seed = config["seeds"][0]
    model = cl.build_model(config, base, data["num_train"], seed)
    guide = load(cl._guide_path(run_dir, "laplace", seed), model)
    per_forward = int(config["predict"]["samples_per_forward"]) or None
    rows = []
    for evidence, tau in evidence_taus(guide).items():
        guide.set_prior_precision(tau)
        pred = pb.predict(
            model,
            guide,
            data["test"],
            num_samples=int(config["predict"]["num_samples"]),
            seed=0,
            samples_per_forward=per_forward,
        )
        rows.append(
            {
                "run": str(run_dir),
                "method": f"laplace ({evidence})",
                "tau": tau,
                **cl._metrics(pred),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--quick", action="store_true", help="the task's tiny size (the tests)")
    parser.add_argument("--lm-run", type=Path, nargs="*", default=[], help="causal-LM run folders")
    args = parser.parse_args(argv)
    if args.task is None and not args.lm_run:
        parser.error("give --task (a suite task) or --lm-run (causal-LM run folders)")
    rows: list[dict[str, Any]] = []
    for seed in args.seeds if args.task else []:
        rows += suite_seed(args.task, seed, quick=args.quick)
    for run_dir in args.lm_run:
        rows += lm_run(run_dir)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
