"""IVON / Kronecker IVON settings on the demo's text task (the demo config, 2 epochs).

Usage: ``python benchmarks/ivon_text_lr.py ivon 1.0,0.5 3.0,0.5,16,1`` (family, then
``lr,hess_init[,ess_scale[,seed]]``). ``ess_scale``: ess = ess_scale·N with δ kept at its
ess = N value 1/(N prior_scale²) (only the noise shrinks); ``seed``: the fit's seed (default 0).
"""

import sys
import time

import pyrobayes as pb
from pyrobayes import pipeline as pl

cfg = pl.resolve_config({"families": ["ivon"]})
loaders = pl.build_data(cfg, pl._load_tokenizer(cfg))
FAMILY = sys.argv[1]
for spec in sys.argv[2:]:
    parts = [float(a) for a in spec.split(",")]
    lr, h0 = parts[0], parts[1]
    scale = parts[2] if len(parts) > 2 else 1.0
    seed = int(parts[3]) if len(parts) > 3 else 0
    model, _ = pl.build_model(cfg, loaders["num_train"], loaders["train"])
    num = loaders["num_train"]
    delta = 1.0 / (num * cfg["prior_scale"] ** 2)
    guide = pb.posterior(model, FAMILY, hess_init=h0, ess=scale * num, weight_decay=delta)
    t = time.perf_counter()
    pb.fit(model, guide, loaders["train"], epochs=2, lr=lr, seed=seed)
    pred = pb.predict(model, guide, loaders["test"], num_samples=6)
    r = pb.metrics.report(pred, pred.targets)
    print(
        f"lr={lr} h0={h0} ess_scale={scale} seed={seed}: acc {r['accuracy']:.3f} "
        f"nll {r['nll']:.3f} ece {r['ece']:.3f} ({time.perf_counter() - t:.0f}s)",
        flush=True,
    )
