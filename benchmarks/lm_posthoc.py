"""Post-hoc choices on the validation split of a saved causal-LM run: what a user would try.

docs/causal_lm.md's tables report every family as fitted. The cheapest fixes a user would reach
for instead are post-hoc and tuned on held-out data: one temperature (``pb.calibrate``, Guo et
al. 2017) on MAP, SWAG or Laplace, and Laplace's prior precision τ chosen by the validation NLL
(``pyrobayes.infer.select_prior_precision``) instead of the marginal likelihood. This script
loads the posteriors of a ``pyrobayes fit`` run folder (causal-LM config), makes those choices
on the run's validation split and scores the test split, beside each posterior as saved:

    OMP_NUM_THREADS=1 python benchmarks/lm_posthoc.py runs/smollm2-disambiguation_qa \\
        --out benchmarks/results/lm_posthoc/disambiguation_qa-s0.json

Rows: ``<family>`` (as saved; reproduces the run's table), ``<family>+ts`` (a temperature fitted
on the validation split), ``laplace-gs`` (τ of least validation NLL over the default grid, then
scored; its ``tau_evidence`` is the saved τ). Every choice reads the validation split only.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

import pyrobayes as pb
from pyrobayes.demo import causal_lm
from pyrobayes.infer.prior_precision import select_prior_precision

logger = logging.getLogger(__name__)

#: The saved families this script re-scores (post-hoc steps apply to any; these are the job's
#: families with a predictive a temperature or τ changes).
FAMILIES = ("map", "laplace", "swag", "ivon", "meanfield")


def posthoc_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every saved posterior of ``run_dir`` as saved, with a validation temperature, and (Laplace)
    with τ chosen on the validation split; metrics on the test split."""
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    base, tokenizer = causal_lm.load_base(config)
    data = causal_lm.build_data(config, tokenizer)
    num_samples = int(config["predict"]["num_samples"])
    per_forward = int(config["predict"]["samples_per_forward"]) or None

    def score(model: Any, guide: Any) -> dict[str, float]:
        start = time.perf_counter()
        pred = pb.predict(
            model,
            guide,
            data["test"],
            num_samples=num_samples,
            seed=0,
            samples_per_forward=per_forward,
        )
        return {**causal_lm._metrics(pred), "predict_s": time.perf_counter() - start}

    rows: list[dict[str, Any]] = []
    for path in sorted((run_dir / "guides").glob("*-seed*.safetensors")):
        family, seed_text = path.stem.rsplit("-seed", 1)
        if family not in FAMILIES:
            continue
        seed = int(seed_text)
        model = causal_lm.build_model(config, base, data["num_train"], seed, family)
        guide = pb.load(path, model)
        rows.append({"family": family, "seed": seed, **score(model, guide)})
        if family == "laplace":
            tau_evidence = float(guide.prior_precision)
            tau = select_prior_precision(
                model,
                guide,
                data["val"],
                num_samples=num_samples,
                seed=0,
                samples_per_forward=per_forward,
            )
            rows.append(
                {
                    "family": "laplace-gs",
                    "seed": seed,
                    "tau_evidence": tau_evidence,
                    "tau": tau,
                    **score(model, guide),
                }
            )
            guide = pb.load(path, model)  # the saved τ again, for its temperature
        temperature = pb.calibrate(model, guide, data["val"], num_samples=num_samples, seed=0)
        rows.append(
            {
                "family": f"{family}+ts",
                "seed": seed,
                "temperature": temperature,
                **score(model, guide),
            }
        )
        logger.info("%s seed %d: %s", family, seed, rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a pyrobayes fit run folder of a causal-LM config")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    rows = posthoc_rows(args.run)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"run": str(args.run), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
