"""Choose a family's settings on a suite task's **calibration** split (issue 27's "tune on
validation splits of the suite only"): fit the family with each spec and report what the
calibration split says, never the validation split the suite reports.

A spec is a JSON object merged into the task's settings for the family (``benchmarks/suite/
tasks.py``, read at run time): ``lr``, ``epochs``, ``patience`` replace the fit's; ``options``
are merged into the guide's constructor options; ``optimizer`` (an object) replaces the fit's
settings by ``pyrobayes.infer.IVON(**optimizer)`` for IVON,
``pyrobayes.infer.KronIVON(**optimizer)`` for Kronecker IVON (e.g. ``{"fisher": "mc"}``) and
``pyrobayes.infer.MeanField(**optimizer)`` (e.g. ``{"scale_lr": 10}``, ``{"kl_weight": 0.1}``)
for mean-field; on the MLP tasks ``adapter`` (``"lora"``, ``"lora-a"``) fits the family on plain
LoRA instead of LoRA-XS cores. One JSON line per spec and seed: calibration-split accuracy, NLL
and ECE of the selected epoch (the fit's early stopping uses the same split, as the suite's text
tasks do), the epochs run, and for guides with per-site scales the median and 99th percentile of the posterior standard deviation per site
kind (LoRA ``A``/``B`` factors, cores, whole layers) at the end of the fit.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite/tune.py --task polarity --family ivon \\
        --seeds 0,1,2 '{}' '{"options": {"weight_decay": 0.5}}'
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pyro
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import _fit  # noqa: E402
from tasks import TASKS  # noqa: E402

import pyrobayes as pb  # noqa: E402

logger = logging.getLogger("suite.tune")


def _fit_settings(family: str) -> Any:
    """The fit-settings class a spec's ``optimizer`` object builds for ``family``."""
    classes = {
        "ivon": pb.infer.IVON,
        "kron-ivon": pb.infer.KronIVON,  # IVON's fields and fisher, T_stats, T_inv
        "meanfield": pb.infer.MeanField,
    }
    if family not in classes:
        raise ValueError(
            f"tune.py: an 'optimizer' spec is read for {sorted(classes)}, not {family!r}; "
            "drop it or set the family's other settings"
        )
    return classes[family]


def _merged(settings: dict[str, Any], spec: dict[str, Any], family: str) -> dict[str, Any]:
    out = copy.deepcopy(settings)
    for key, value in spec.items():
        if key == "options":
            out["options"] = {**out.get("options", {}), **value}
        elif key == "optimizer":
            out["optimizer"] = _fit_settings(family)(**value)
        else:
            out[key] = value
    return out


def _scale_summary(guide: Any) -> dict[str, float]:
    """Median and 99th percentile of the posterior standard deviation per site kind, and the
    root mean square of the posterior mean per site kind (``loc_<kind>_rms``)."""
    scale = getattr(guide, "scale", None)
    sites = getattr(guide, "site_names", None) or getattr(guide, "sites", None)
    if not callable(scale) or not sites:
        return {}
    loc = getattr(guide, "loc", None)
    kinds: dict[str, list[torch.Tensor]] = {}
    locs: dict[str, list[torch.Tensor]] = {}
    for site in sites:
        kind = site.rsplit(".", 1)[-1]
        try:
            s = scale(site)
        except Exception:  # a Kronecker site has no elementwise scale
            continue
        kinds.setdefault(kind, []).append(s.detach().reshape(-1).double())
        if callable(loc):
            locs.setdefault(kind, []).append(loc(site).detach().reshape(-1).double())
    out: dict[str, float] = {}
    for kind, values in kinds.items():
        v = torch.cat(values)
        out[f"scale_{kind}_median"] = float(v.median())
        out[f"scale_{kind}_q99"] = float(v.quantile(0.99))
    for kind, values in locs.items():
        out[f"loc_{kind}_rms"] = float(torch.cat(values).square().mean().sqrt())
    return {**out, **_factor_spread(guide)}


def _factor_spread(guide: Any) -> dict[str, float]:
    """Kronecker IVON: the median over its Kronecker sites of each factor's eigenvalue ratio
    ``q90 / q10`` (``kron_A_spread``, ``kron_G_spread``; 1: the factor is still a multiple of
    the identity it started from, ``sqrt(h0) I``, and gives q no shape)."""
    is_kron, factors = getattr(guide, "is_kron", None), getattr(guide, "factors", None)
    if not callable(is_kron) or not callable(factors):
        return {}
    spreads: dict[str, list[float]] = {"A": [], "G": []}
    for site in guide.sites:
        if is_kron(site):
            for name, factor in zip("AG", factors(site), strict=True):
                eig = torch.linalg.eigvalsh(factor.detach().double())
                spreads[name].append(float(eig.quantile(0.9) / eig.quantile(0.1)))
    return {f"kron_{k}_spread": float(torch.tensor(v).median()) for k, v in spreads.items() if v}


def _build(task: Any, family: str, settings: dict[str, Any]) -> Any:
    """``task.build_model(family)`` with the family's settings row replaced by ``settings`` while
    it builds: the MLP tasks read the row's ``adapter`` there (e.g. ``{"adapter": "lora"}``)."""
    table = task.settings
    saved = table.get(family)
    table[family] = settings
    try:
        return task.build_model(family, 0)
    finally:
        if saved is None:
            del table[family]
        else:
            table[family] = saved


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, choices=list(TASKS))
    parser.add_argument("--family", required=True)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the task's tiny size (the tests)")
    parser.add_argument("specs", nargs="+", help="JSON objects (see the module docstring)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    rows = []
    for seed in args.seeds:
        task = TASKS[args.task](seed, args.quick)
        for text in args.specs:
            spec = json.loads(text)
            settings = _merged(task.settings.get(args.family, {}), spec, args.family)
            pyro.clear_param_store()
            model = _build(task, args.family, settings)
            guide = pb.posterior(
                model, settings.get("family", args.family), **settings.get("options", {})
            )
            start = time.perf_counter()
            info = _fit(task, model, guide, settings, 1000 * seed)
            pred = pb.predict(model, guide, task.calibration, num_samples=task.num_samples, seed=0)
            assert pred.targets is not None
            report = pb.metrics.report(pred, pred.targets)
            row = {
                "task": args.task,
                "family": args.family,
                "seed": seed,
                "spec": spec,
                "split": "calibration",
                **{k: report[k] for k in ("accuracy", "nll", "ece") if k in report},
                "epochs_run": info["epochs_run"],
                "best_epoch": info["best_epoch"],
                "calibration_nll": info["calibration_nll"],  # after every epoch
                "seconds": time.perf_counter() - start,
                **_scale_summary(guide),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
