"""Post-hoc Laplace and SWAG from one fitted MAP: ``python examples/posthoc_from_map.py [--smoke]``.

Fit the MAP once, then build each post-hoc posterior at its point with
``pb.posterior(model, family, init=map_guide)``: Laplace fits its curvature at the MAP with
``pb.fit(..., epochs=0)`` (no MAP step), SWAG runs only its collection phase from the MAP.
"""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)
num_samples = 4 if args.smoke else 32

map_guide = pb.posterior(model, "map")
pb.fit(model, map_guide, train, epochs=2 if args.smoke else 60, lr=1e-2, seed=args.seed)
print("MAP")
report(model, map_guide, test, x_ood, num_samples=1)

laplace = pb.posterior(model, "laplace", init=map_guide, structure="kron")
pb.fit(model, laplace, train, epochs=0)  # curvature and prior precision at the MAP
print(f"Laplace at the MAP (prior precision tau = {laplace.prior_precision:.4g})")
metrics = report(model, laplace, test, x_ood, num_samples=num_samples)

# SWAG moves the model's point parameters (the head) too: it comes last
swag = pb.posterior(model, "swag", init=map_guide, rank=5)
sgd = pb.Optimization(optimizer=pb.infer.SWAG(optimizer="sgd"))  # the fit's optimizer
pb.fit(model, swag, train, epochs=2 if args.smoke else 10, lr=1e-3, seed=args.seed, optim=sgd)
print("SWAG from the MAP")
report(model, swag, test, x_ood, num_samples=num_samples)
assert math.isfinite(metrics["nll"])
