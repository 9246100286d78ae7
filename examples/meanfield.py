"""Mean-field Gaussian VI over LoRA-XS cores: ``python examples/meanfield.py [--smoke]``."""

from __future__ import annotations

import math

from _digits import parse_args, report, setup

import pyrobayes as pb

args = parse_args(__doc__)
model, train, test, x_ood = setup(args.smoke, args.seed)
guide = pb.posterior(model, "meanfield", init_scale=1e-2)
result = pb.fit(
    model,
    guide,
    train,
    epochs=2 if args.smoke else 60,
    lr=1e-2,
    seed=args.seed,
    # the fit's settings (pb.infer.MeanField: scale_lr, the scales' learning-rate factor)
    optim=pb.Optimization(loss=pb.infer.ELBO(num_particles=4), optimizer=pb.infer.MeanField()),
)
metrics = report(model, guide, test, x_ood, num_samples=4 if args.smoke else 32)
assert math.isfinite(metrics["nll"]) and result.losses[-1] < result.losses[0]
