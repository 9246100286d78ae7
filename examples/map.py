"""MAP fine-tuning of LoRA-XS cores (the baseline): ``python examples/map.py [--smoke]``."""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)
guide = pb.posterior(model, "map")
result = pb.fit(model, guide, train, epochs=2 if args.smoke else 30, lr=1e-2, seed=args.seed)
metrics = report(model, guide, test, x_ood, num_samples=1)
assert math.isfinite(metrics["nll"]) and result.losses[-1] < result.losses[0]
