"""How much of the Laplace posterior's spread does the probit link use? (issue 27)

For each seed the MAP and the default Laplace posterior are fitted exactly as ``run.py`` fits
them (same task, settings and seed); on the validation split the linearised covariance of the
logits, ``J(x) Σ J(x)ᵀ`` (K × K per example), is formed and summarised per pair of classes
``(k, j)``: the median correlation of ``f_k`` and ``f_j``, and the median of
``Var(f_k − f_j) / (Var f_k + Var f_j)``. The softmax reads only logit differences; the probit
link ``softmax(f / sqrt(1 + π/8 · diag(J Σ Jᵀ)))`` shrinks each logit by its own variance, so a
ratio near 2 (strongly anti-correlated logits) means it applies about a quarter of the spread
on the decision that the Monte Carlo link applies. The same for laplace-torch's last-layer
Laplace on the same MAP network (``laplace_torch``). docs/methods/swag_laplace.md quotes it.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite/logit_covariance.py --task amazon --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as suite  # noqa: E402
from tasks import TASKS  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.linearized import linearize  # noqa: E402

OUT = HERE.parents[0] / "results" / "suite" / "logit_covariance.json"


def one_seed(name: str, seed: int) -> dict[str, Any]:
    """The default Laplace at the suite's MAP of ``seed``: per class pair, the logits'
    correlation and the variance ratio of their difference (medians over the validation split)."""
    task = TASKS[name](seed, False)
    model, map_guide, _ = suite.fit_map(task, seed)
    settings = task.settings["laplace"]
    laplace = pb.posterior(model, "laplace", init=map_guide, **settings.get("options", {}))
    suite._fit(task, model, laplace, settings, 1000 * seed)
    laplace.pred_type = "probit"  # the plain Jacobian rows (the Monte Carlo link contrasts them)
    lin = linearize(model, laplace, task.validation)
    assert lin is not None
    cov = torch.cat([laplace.functional_covariance(chunk[1]) for chunk in lin.chunks])
    # laplace-torch's last-layer Laplace on the same MAP network, as the suite fits it
    la, _ = suite.fit_laplace_torch(task, model, map_guide)
    with torch.no_grad():
        la_cov = torch.cat([la._glm_predictive_distribution(x)[1] for x in _inputs(task)])
    return {
        "prior_precision": laplace.prior_precision,
        **_summary(cov),
        "laplace_torch": {"prior_precision": float(la.prior_precision.mean()), **_summary(la_cov)},
    }


def _summary(cov: torch.Tensor) -> dict[str, Any]:
    """Medians over examples of a ``(N, K, K)`` logit covariance, per pair of classes."""
    var = cov.diagonal(dim1=-2, dim2=-1)
    pairs = {}
    for k in range(cov.shape[-1]):
        for j in range(k + 1, cov.shape[-1]):
            vk, vj, ckj = var[:, k], var[:, j], cov[:, k, j]
            pairs[f"{k}-{j}"] = {
                "correlation": float((ckj / (vk * vj).sqrt()).median()),
                "diff_var_over_sum": float(((vk + vj - 2 * ckj) / (vk + vj)).median()),
            }
    return {"logit_var_median": float(var.median()), "pairs": pairs}


def _inputs(task: Any) -> list[Any]:
    """The validation split's network inputs (labels dropped)."""
    return [b[0] if isinstance(b, (list, tuple)) else b for b in task.validation]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="amazon", choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        **suite.provenance("benchmarks/suite/logit_covariance.py", argv),
        "task": args.task,
        "seeds": {str(s): one_seed(args.task, s) for s in args.seeds},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for seed, rec in result["seeds"].items():
        print(seed, json.dumps(rec))
    return result


if __name__ == "__main__":
    main()
