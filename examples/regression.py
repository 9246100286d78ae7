"""Tabular regression with a learned noise scale: ``python examples/regression.py [--smoke]``.

scikit-learn's bundled diabetes set (442 patients, 10 features, a disease-progression score).
A small MLP is pretrained by least squares on the training split; then its two hidden layers get
LoRA-XS cores (rank 4, SVD basis) with a Gaussian prior and the output layer stays a point
estimate. The likelihood is Gaussian, ``y ~ N(f_θ(x), σ²)``, with σ = softplus(ρ) learned with
the other point parameters (``obs_scale="learn"``). Each family's posterior predictive on the
test split is scored by RMSE and NLL (targets standardised, so both are in units of the
training targets' standard deviation), next to the σ it learned.

Runs offline (the data ship inside scikit-learn).
"""

from __future__ import annotations

import argparse
import math

import torch
from sklearn.datasets import load_diabetes
from torch import nn

import pyrobayes as pb

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test suite runs this)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--families",
    default="map,meanfield,ivon,swag,laplace",
    help="comma-separated families (see pyrobayes.available_guides())",
)
args = parser.parse_args()
torch.manual_seed(args.seed)

# ---------------------------------------------------------------- data: a 80/20 split, standardised
x_all, y_all = load_diabetes(return_X_y=True)
x_all = torch.as_tensor(x_all, dtype=torch.float32)
y_all = torch.as_tensor(y_all, dtype=torch.float32)
perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(args.seed))
num_train = int(0.8 * len(x_all))
train_idx, test_idx = perm[:num_train], perm[num_train:]
x_mean, x_std = x_all[train_idx].mean(0), x_all[train_idx].std(0)
y_mean, y_std = y_all[train_idx].mean(), y_all[train_idx].std()
x = (x_all - x_mean) / x_std
y = (y_all - y_mean) / y_std
x_train, y_train, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
batch_size = 32
train = [
    (x_train[i : i + batch_size], y_train[i : i + batch_size])
    for i in range(0, num_train, batch_size)
]
test = [(x_test, y_test)]

# ---------------------------------------------------------------- a pretrained network
pretrained = nn.Sequential(
    nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
)
optimizer = torch.optim.Adam(pretrained.parameters(), lr=1e-3)
for _ in range(3 if args.smoke else 100):  # full-batch-ish least squares, deliberately short
    for xb, yb in train:
        loss = nn.functional.mse_loss(pretrained(xb).squeeze(-1), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
state = {k: v.clone() for k, v in pretrained.state_dict().items()}

# per-family learning rates: IVON's step is scaled by its curvature estimate, not Adam's
LR = {"ivon": 0.1, "kron-ivon": 0.1}
epochs = 2 if args.smoke else 60
num_samples = 4 if args.smoke else 64

rows = []
for family in [f.strip() for f in args.families.split(",") if f.strip()]:
    torch.manual_seed(args.seed)
    net = nn.Sequential(
        nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    net.load_state_dict(state)
    model = pb.models.FineTuneModel(
        net,
        pb.models.LoRAXS(rank=4, projection="svd", target_modules=["0", "2"]),
        likelihood="gaussian",
        obs_scale="learn",  # σ = softplus(ρ), ρ point-estimated
        prior_scale=1.0,
        num_data=num_train,
        trainable_modules=["4"],
    )
    guide = pb.posterior(model, family)
    pb.fit(model, guide, train, epochs=epochs, lr=LR.get(family, 1e-2), seed=args.seed)
    pred = pb.predict(model, guide, test, num_samples=num_samples, seed=0)
    assert pred.targets is not None and pred.scale is not None
    result = pb.metrics.report(pred, pred.targets)
    rows.append((family, result["rmse"], result["nll"], float(pred.scale)))

print(f"diabetes: {num_train} train, {len(test_idx)} test; standardised targets")
print("| family | rmse | nll | learned sigma |")
print("|---|---|---|---|")
for family, rmse, nll, sigma in rows:
    print(f"| {family} | {rmse:.3f} | {nll:.3f} | {sigma:.3f} |")
assert all(math.isfinite(r[1]) and math.isfinite(r[2]) and r[3] > 0 for r in rows)
