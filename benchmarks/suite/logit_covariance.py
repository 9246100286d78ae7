"""How much of the Laplace posterior's spread does the probit link use? (issue 27)

For each seed the MAP and the default Laplace posterior are fitted exactly as ``run.py`` fits
them (same task, settings and seed); on the validation split the linearised covariance of the
logits, ``J(x) Σ J(x)ᵀ`` (K × K per example), is formed and summarised per pair of classes
``(k, j)``: the median correlation of ``f_k`` and ``f_j``, and the median of
``Var(f_k − f_j) / (Var f_k + Var f_j)``. The softmax reads only logit differences; the probit
link ``softmax(f / sqrt(1 + π/8 · diag(J Σ Jᵀ)))`` shrinks each logit by its own variance, so a
ratio near 2 (strongly anti-correlated logits) means it applies about a quarter of the spread
on the decision that the Monte Carlo link applies. The same for laplace-torch's last-layer
Laplace on the same MAP network (``laplace_torch``). On each of the task's OOD sets
(``ood_<name>``), for both: the median variance the softmax reads, ``tr(C Σ_f C)`` with
``C = I − 11ᵀ/K``, in and out of distribution, its AUROC as an OOD score, its rank correlation
with the MAP's margin, and the predictive entropy's AUROC at the point and under 100 and 10,000
Monte Carlo draws of the logits, and the median norm of the features the MAP's head reads in
and out of distribution. docs/methods/swag_laplace.md quotes it.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite/logit_covariance.py --task amazon --seeds 0 1 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite/logit_covariance.py --task fine \
        --out benchmarks/results/suite/logit_covariance_fine.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite/logit_covariance.py --task digits \
        --out benchmarks/results/suite/logit_covariance_digits.json
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

#: Linearised logits on a split: their mean ``(N, K)`` and covariance ``(N, K, K)``.
Moments = tuple[torch.Tensor, torch.Tensor]


def one_seed(name: str, seed: int) -> dict[str, Any]:
    """The default Laplace at the suite's MAP of ``seed``: per class pair, the logits'
    correlation and the variance ratio of their difference (medians over the validation split)."""
    task = TASKS[name](seed, False)
    model, map_guide, _ = suite.fit_map(task, seed)
    settings = task.settings["laplace"]
    laplace = pb.posterior(model, "laplace", init=map_guide, **settings.get("options", {}))
    suite._fit(task, model, laplace, settings, 1000 * seed)
    laplace.pred_type = "probit"  # the plain Jacobian rows (the Monte Carlo link contrasts them)
    moments = _covariance(model, laplace, task.validation)
    # laplace-torch's last-layer Laplace on the same MAP network, as the suite fits it
    la, _ = suite.fit_laplace_torch(task, model, map_guide)
    la_moments = _la_covariance(la, task.validation)
    out: dict[str, Any] = {
        "prior_precision": laplace.prior_precision,
        **_summary(moments[1]),
        "laplace_torch": {
            "prior_precision": float(la.prior_precision.mean()),
            **_summary(la_moments[1]),
        },
    }
    # where the spread falls: the variance the softmax reads (of the logits' deviations from
    # their mean over classes) on the validation split against each OOD set, and how well that
    # variance alone tells the OOD set apart (AUROC, OOD = 1); and the norm of the features the
    # MAP's head reads (laplace-torch's last-layer inputs), which sets a last-layer variance
    norm_id = _feature_norms(la, task.validation)
    for ood_name, loader in task.ood.items():
        norm_ood = _feature_norms(la, loader)
        out[f"ood_{ood_name}"] = {
            "pyrobayes": _spread(moments, _covariance(model, laplace, loader)),
            "laplace_torch": _spread(la_moments, _la_covariance(la, loader)),
            "head_feature_norm_median_id": float(norm_id.median()),
            "head_feature_norm_median_ood": float(norm_ood.median()),
        }
    return out


def _covariance(model: Any, laplace: Any, loader: Any) -> Moments:
    """pyrobayes' linearised logits on ``loader``: ``f(x; θ̂)`` ``(N, K)`` and ``J Σ Jᵀ``
    ``(N, K, K)``."""
    lin = linearize(model, laplace, loader)
    assert lin is not None
    mean = torch.cat([chunk[0].reshape(chunk[0].shape[0], -1) for chunk in lin.chunks])
    cov = torch.cat([laplace.functional_covariance(chunk[1]) for chunk in lin.chunks])
    return mean, cov


def _la_covariance(la: Any, loader: Any) -> Moments:
    """laplace-torch's GLM logits on ``loader``: mean ``(N, K)`` and covariance ``(N, K, K)``."""
    with torch.no_grad():
        parts = [la._glm_predictive_distribution(x) for x in _inputs(loader)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _feature_norms(la: Any, loader: Any) -> torch.Tensor:
    """Euclidean norm, per example, of the features laplace-torch's last layer reads."""
    with torch.no_grad():
        feats = [la.model.forward_with_features(x)[1] for x in _inputs(loader)]
    return torch.cat([f.reshape(f.shape[0], -1) for f in feats]).norm(dim=-1)


def _centred_variance(cov: torch.Tensor) -> torch.Tensor:
    """``tr(C Σ C)`` with ``C = I − 11ᵀ/K``: the logits' variance that a softmax reads (a shift
    common to every class changes no probability), per example."""
    k = cov.shape[-1]
    c = torch.eye(k, dtype=cov.dtype) - torch.full((k, k), 1.0 / k, dtype=cov.dtype)
    return torch.einsum("ij,njk,ki->n", c, cov, c)


def _entropy(mean: torch.Tensor, cov: torch.Tensor | None, num_samples: int) -> torch.Tensor:
    """Predictive entropy of ``softmax(f)``, ``f ~ N(mean, cov)`` by ``num_samples`` Monte
    Carlo draws per example (``cov`` ``None``: the point ``mean``)."""
    if cov is None:
        return pb.metrics.predictive_entropy(torch.softmax(mean, -1).unsqueeze(0))
    k = mean.shape[-1]
    jitter = 1e-6 * torch.eye(k, dtype=torch.float64)
    scale = torch.linalg.cholesky(cov.double() + jitter).to(mean.dtype)
    gen = torch.Generator().manual_seed(0)
    eps = torch.randn(num_samples, *mean.shape, generator=gen)
    draws = mean + torch.einsum("nij,snj->sni", scale, eps)
    return pb.metrics.predictive_entropy(torch.softmax(draws, -1))


def _spread(id_moments: Moments, ood_moments: Moments) -> dict[str, float]:
    """Median centred logit variance in and out of distribution, its OOD AUROC, its rank
    correlation with the point logits' margin in distribution, and the predictive entropy's
    AUROC at the point, at 100 draws and at 10,000 (the Monte Carlo noise of the score)."""
    (m_id, c_id), (m_ood, c_ood) = id_moments, ood_moments
    v_id, v_ood = _centred_variance(c_id), _centred_variance(c_ood)
    top2 = m_id.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    out = {
        "variance_median_id": float(v_id.median()),
        "variance_median_ood": float(v_ood.median()),
        "auroc_variance": pb.metrics.ood_auroc(v_id, v_ood),
        "spearman_variance_margin_id": _spearman(v_id, margin),
    }
    for name, cov_id, cov_ood, s in [
        ("point", None, None, 1),
        ("mc100", c_id, c_ood, 100),
        ("mc10000", c_id, c_ood, 10_000),
    ]:
        out[f"auroc_entropy_{name}"] = pb.metrics.ood_auroc(
            _entropy(m_id, cov_id, s), _entropy(m_ood, cov_ood, s)
        )
    return out


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


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


def _inputs(loader: Any) -> list[Any]:
    """A split's network inputs (labels dropped)."""
    return [b[0] if isinstance(b, (list, tuple)) else b for b in loader]


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
