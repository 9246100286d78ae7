"""IVON / Kronecker IVON learning rates on the demo's text task (the demo config, 2 epochs).

Usage: ``python benchmarks/ivon_text_lr.py ivon 1.0,0.5 3.0,0.5`` (family, then lr,hess_init pairs).
"""

import sys
import time

import pyrobayes as pb
from pyrobayes import pipeline as pl

cfg = pl.resolve_config({"families": ["ivon"]})
loaders = pl.build_data(cfg, pl._load_tokenizer(cfg))
FAMILY = sys.argv[1]
for lr, h0 in [(float(a.split(",")[0]), float(a.split(",")[1])) for a in sys.argv[2:]]:
    model, _ = pl.build_model(cfg, loaders["num_train"], loaders["train"])
    guide = pb.posterior(model, FAMILY, hess_init=h0)
    t = time.perf_counter()
    pb.fit(model, guide, loaders["train"], epochs=2, lr=lr, seed=0)
    pred = pb.predict(model, guide, loaders["test"], num_samples=6)
    r = pb.metrics.report(pred, pred.targets)
    print(
        f"lr={lr} h0={h0}: acc {r['accuracy']:.3f} nll {r['nll']:.3f} ece {r['ece']:.3f} ({time.perf_counter() - t:.0f}s)",
        flush=True,
    )
