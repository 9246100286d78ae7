"""SWAG over LoRA-XS cores (B-LoRA-XS): ``python examples/swag.py [--smoke]``."""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)
epochs = 4 if args.smoke else 60
guide = pb.posterior(model, "swag", rank=5, scale=0.5)
# the fit's settings, not q's: collect the iterates after each epoch of the second half
swag = pb.Optimization(optimizer=pb.infer.SWAG(start_epoch=epochs // 2))
pb.fit(model, guide, train, epochs=epochs, lr=1e-2, seed=args.seed, optim=swag)
print(pb.count_parameters(guide))
metrics = report(model, guide, test, x_ood, num_samples=4 if args.smoke else 15)
assert math.isfinite(metrics["nll"])
