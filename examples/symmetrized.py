"""Symmetrized (permutation-invariant) mean-field VI on a Bayesian MLP over digits:
``python examples/symmetrized.py [--smoke]``.

Every layer of a ``64-32-32-5`` MLP is latent (``latent_modules``); its hidden units can be
permuted without changing the function, so the posterior has 32!·32! equivalent modes. The
symmetrized guide fits a mean-field q with ``L_K = ELBO(q) + I_K`` (Gelberg et al., 2024) and
predicts as q. ``FitResult.state["terms"]`` holds ``L_K``, the plain ``elbo`` and ``I_K`` per step.
"""

from __future__ import annotations

import math

import torch
from _digits import parse_args, report
from torch import nn

import pyrobayes as pb
from pyrobayes.demo.data import load_digits_split

args = parse_args(__doc__)
torch.manual_seed(args.seed)
split = load_digits_split(seed=args.seed, dtype=torch.float32)
num_train = 128 if args.smoke else len(split.x_train)
x, y = split.x_train[:num_train], split.y_train[:num_train]
net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))
model = pb.models.FineTuneModel(
    net, None, latent_modules=["0", "2", "4"], num_data=num_train, prior_scale=0.5
)
print(pb.models.PermutationSpec.from_model(model))  # two hidden layers of 32 units
guide = pb.posterior(model, "symmetrized", base="meanfield", init_scale=1e-3)
settings = pb.infer.Symmetrized(num_permutations=16)  # K: the fit's setting, not the posterior's
train = [(x[i : i + 64], y[i : i + 64]) for i in range(0, num_train, 64)]
test = [
    (split.x_test[i : i + 128], split.y_test[i : i + 128]) for i in range(0, len(split.x_test), 128)
]
result = pb.fit(
    model,
    guide,
    train,
    epochs=2 if args.smoke else 60,
    lr=1e-2,
    seed=args.seed,
    optim=pb.Optimization(optimizer=settings),
)
terms = result.state["terms"]
window = max(1, len(result.losses) // 10)
for name in ("L_K", "elbo", "I_K"):
    print(f"{name:>20s}: {terms[name][-window:].mean():.2f} (mean of the last {window} steps)")
print(f"{'log K':>20s}: {math.log(settings.num_permutations):.2f}")
metrics = report(model, guide, test, split.x_ood, num_samples=4 if args.smoke else 32)
assert math.isfinite(metrics["nll"]) and bool(torch.isfinite(terms["L_K"]).all())
