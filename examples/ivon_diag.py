"""Diagonal IVON over LoRA-XS cores: ``python examples/ivon_diag.py [--smoke]``."""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)
# short runs: h0 near the expected curvature and a faster Hessian EMA (docs/methods/ivon.md)
guide = pb.posterior(model, "ivon", hess_init=0.1)
ivon = pb.Optimization(optimizer=pb.infer.IVON(beta2=0.999))  # the fit's settings, not q's
epochs = 2 if args.smoke else 60
result = pb.fit(model, guide, train, epochs=epochs, lr=0.1, seed=args.seed, optim=ivon)
metrics = report(model, guide, test, x_ood, num_samples=4 if args.smoke else 32)
assert math.isfinite(metrics["nll"]) and all(math.isfinite(v) for v in result.losses.tolist())
