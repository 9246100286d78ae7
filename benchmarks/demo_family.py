"""One family of the main job (``make demo``'s configuration) with overridden settings.

Each spec is a JSON object of guide options plus ``lr``, ``epochs`` (default: the demo's) and
``seed`` (the data order and the fit's seed, default 0). The training loader is rewound to the
seed before every fit, as ``pipeline.run`` does for each family, so a spec's row does not depend
on what ran before it. Unset options take the demo's ``FAMILY_SETTINGS``. One JSON line per spec.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/demo_family.py ivon '{"seed": 1}' \\
        '{"seed": 1, "hess_init": 0.0003, "ess": 76800000, "weight_decay": 0.0013, "lr": 3}'
"""

from __future__ import annotations

import json
import sys
import time

import pyrobayes as pb
from pyrobayes.demo import pipeline as pl


def main(family: str, specs: list[str]) -> None:
    cfg = pl.resolve_config({})
    loaders = pl.build_data(cfg, pl._load_tokenizer(cfg))
    settings = pl.FAMILY_SETTINGS.get(family, {})
    for spec in specs:
        opts = json.loads(spec)
        lr = opts.pop("lr", settings.get("lr", cfg["training"]["lr"]))
        seed = opts.pop("seed", 0)
        epochs = opts.pop("epochs", cfg["training"]["epochs"])
        pl._rewind(loaders["train"], seed)
        model, _ = pl.build_model(cfg, loaders["num_train"], loaders["train"])
        guide = pb.posterior(model, family, **{**settings.get("options", {}), **opts})
        start = time.perf_counter()
        pb.fit(model, guide, loaders["train"], epochs=epochs, lr=lr, seed=seed)
        fit_s = time.perf_counter() - start
        pred = pb.predict(
            model, guide, loaders["test"], num_samples=cfg["predict"]["num_samples"], seed=0
        )
        r = pb.metrics.report(pred, pred.targets)
        row = {k: round(float(r[k]), 3) for k in ("accuracy", "nll", "ece")}
        print(json.dumps({"family": family, "spec": spec, **row, "fit_s": round(fit_s)}))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
