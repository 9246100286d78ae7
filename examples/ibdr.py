"""IBDR: K interacting LoRA-XS particles with a diversity term and a robust two-pass step.

``python examples/ibdr.py [--smoke]``. The posterior is the equal-weight mixture of K = 4
particles (point particles, σ = 0); each step evaluates all four in one batched forward, twice
(at θ and at the worst-case θ' = θ + g/(2λ)), and the dual variable λ tracks the radius ρ.
Prediction averages the particles' probabilities (``num_samples`` a multiple of K).
"""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)  # 5 classes: K <= C - 1 = 4
guide = pb.posterior(model, "ibdr", num_particles=4)
optim = pb.Optimization(optimizer=pb.infer.IBDR(alpha=0.02, rho=0.02))  # the fit's settings
epochs = 2 if args.smoke else 30
result = pb.fit(model, guide, train, epochs=epochs, lr=1e-2, seed=args.seed, optim=optim)
print(f"lambda={result.state['lam']:.3g} cost={result.state['cost']:.3g}")
metrics = report(model, guide, test, x_ood, num_samples=4)
pred = pb.predict(model, guide, test, num_samples=4)
print(f"{'disagreement':>20s}: {pb.metrics.disagreement(pred.probs):.4f}")
assert math.isfinite(metrics["nll"])
