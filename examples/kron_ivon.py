"""Kronecker-factored IVON over LoRA-XS cores: ``python examples/kron_ivon.py [--smoke]``."""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)
guide = pb.posterior(model, "kron-ivon", hess_init=0.1)
# the fit's settings, not q's: the factors' EMA and their re-decomposition every 5 steps
ivon = pb.Optimization(optimizer=pb.infer.KronIVON(beta2=0.999, T_inv=5))
epochs = 2 if args.smoke else 60
result = pb.fit(model, guide, train, epochs=epochs, lr=0.1, seed=args.seed, optim=ivon)
site = next(iter(guide.sites))
print(f"q over {site}: {type(guide.get_posterior(site)).__name__}")
metrics = report(model, guide, test, x_ood, num_samples=4 if args.smoke else 32)
assert math.isfinite(metrics["nll"]) and all(math.isfinite(v) for v in result.losses.tolist())
