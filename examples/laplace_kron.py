"""Laplace (K-FAC GGN) over LoRA-XS cores (L-LoRA-XS): ``python examples/laplace_kron.py [--smoke]``."""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb
from pyrobayes.infer.laplace import glm_predict

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)
guide = pb.posterior(model, "laplace", structure="kron")
pb.fit(model, guide, train, epochs=2 if args.smoke else 60, lr=1e-2, seed=args.seed)
print(f"prior precision tau = {float(guide.prior_precision):.4g}")
metrics = report(model, guide, test, x_ood, num_samples=4 if args.smoke else 32)  # linearised (GLM)
glm = glm_predict(model, guide, test, link="probit")  # the linearized predictive
print(f"GLM probit NLL: {pb.metrics.nll(glm.probs, glm.targets):.4f}")
assert math.isfinite(metrics["nll"])
