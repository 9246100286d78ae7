"""Fit a posterior in your own training loop with the public step API.

``python examples/custom_loop.py [--smoke] [--family laplace]``

``pb.fit`` is a convenience loop over a :class:`pyrobayes.infer.Fitter`; any loop can drive one
instead (gradient accumulation, custom logging, a trainer of your own). The fitter owns the
objective, the optimizer and the family's statistics; the guide is the posterior.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from _digits import report, setup

import pyrobayes as pb

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test suite runs this)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--family", default="laplace", help="any of pyrobayes.available_guides()")
args = parser.parse_args()

model, train, test, x_ood = setup(args.smoke, args.seed)
torch.manual_seed(args.seed)
guide = pb.posterior(model, args.family)
epochs = 2 if args.smoke else 40

fitter = pb.infer.make_fitter(model, guide, lr=1e-2)  # the family's fitter, objective, optimizer
schedule = torch.optim.lr_scheduler.CosineAnnealingLR(fitter.optimizer, T_max=epochs * len(train))
print(f"{type(guide).__name__} fitted by {type(fitter).__name__}")

model.train(True)
fitter.begin(train)
losses = []
for epoch in range(epochs):
    for batch in train:
        losses.append(fitter.step(batch))  # one update; FloatingPointError on a non-finite loss
        schedule.step()
    fitter.epoch_end(epoch)
    print(f"epoch {epoch}: mean loss {sum(losses[-len(train) :]) / len(train):.4g}")
fitter.end(train)  # post-hoc families (Laplace, SWAG) finish their posterior here

# a checkpoint is the posterior (with the model's point parameters) plus the fitter's state
with tempfile.TemporaryDirectory() as tmp:
    pb.save(guide, Path(tmp) / "posterior.safetensors", model=model)
    torch.save(fitter.state_dict(), Path(tmp) / "fitter.pt")
    restored = pb.load(Path(tmp) / "posterior.safetensors", model)
    for site, value in guide.mean().items():
        torch.testing.assert_close(restored.mean()[site], value)

metrics = report(model, guide, test, x_ood, num_samples=4 if args.smoke else 32)
assert math.isfinite(metrics["nll"]) and math.isfinite(losses[-1])
