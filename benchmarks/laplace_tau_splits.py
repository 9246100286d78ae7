"""Laplace's held-out NLL against its prior precision on a demo run's two held-out splits.

The demo early-stops its MAP on the validation split; choosing Laplace's τ on that same split
(``pb.infer.Laplace(prior_optimization="validation")``) then inherits the selection's optimism
for the MAP. This script shows it: for each run folder with a ``laplace`` posterior it loads the
posterior, and for every multiple of its starting τ (the marginal likelihood's; the grid of
``pyrobayes.infer.prior_precision.DEFAULT_FACTORS``) prints the linearised predictive's NLL on
the validation split (where the MAP was selected) and on the test split (docs/methods/
swag_laplace.md, "Why it is not the demo's setting"). The network passes run once per split
(``linearized.linearize``); the draws are the run's (``predict.num_samples``, seed 0).

Run::

    pyrobayes fit CONFIG --out runs/demo-s1     # a demo config with families map, laplace
    .venv/bin/python benchmarks/laplace_tau_splits.py runs/demo-s1 [more run folders]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pyrobayes import metrics as pbmetrics
from pyrobayes.demo import pipeline as pl
from pyrobayes.infer.prior_precision import DEFAULT_FACTORS
from pyrobayes.io import load
from pyrobayes.linearized import linearize, linearized_predict


def tau_curves(run_dir: str | Path) -> dict[str, Any]:
    """``{"tau_start": τ₀, "rows": [{"factor", "tau", "val_nll", "test_nll"}, ...]}`` of the
    run's Laplace posterior, ``τ₀`` the τ it started from (the evidence's) where the run chose
    another, else its own."""
    run = Path(run_dir)
    config = pl.validate_config(pl.read_json(run / "config.json"))
    loaders = pl.build_data(config, pl._load_tokenizer(config))
    pl._rewind(loaders["train"], int(config["data"]["seed"]))  # as pipeline.evaluate
    model, _ = pl.build_model(config, loaders["num_train"], loaders["train"], family="laplace")
    guide = load(run / "guides" / "laplace.safetensors", model)
    tau_start = guide.prior_precision
    for record in json.loads((run / "metrics.json").read_text()):
        if record["family"] == "laplace" and "prior_precision_start" in record:
            tau_start = float(record["prior_precision_start"])
    num_samples = int(config["predict"]["num_samples"])
    splits = {name: linearize(model, guide, loaders[name]) for name in ("val", "test")}
    rows = []
    for factor in sorted(set(DEFAULT_FACTORS) | {1.0}):
        guide.set_prior_precision(tau_start * factor)
        row = {"factor": factor, "tau": tau_start * factor}
        for name, lin in splits.items():
            pred = linearized_predict(model, guide, [], num_samples=num_samples, linearization=lin)
            row[f"{name}_nll"] = pbmetrics.nll(None, pred.targets, log_probs=pred.log_probs)
        rows.append(row)
    return {"tau_start": tau_start, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="demo run folders with 'laplace'")
    args = parser.parse_args(argv)
    for run in args.runs:
        curves = tau_curves(run)
        print(f"{run}: starting τ {curves['tau_start']:.4g}")
        print("| τ / starting τ | validation NLL | test NLL |\n|---|---|---|")
        for row in curves["rows"]:
            print(f"| {row['factor']:.3g} | {row['val_nll']:.4f} | {row['test_nll']:.4f} |")


if __name__ == "__main__":
    main()
