"""σN-ensemble: M members that share a pretrained network and differ in its LayerNorms and heads.

``python examples/signorm.py [--smoke]``. An MLP with LayerNorms is "pretrained" on digits 0–4;
:class:`pyrobayes.models.SigmaNormEnsemble` turns every LayerNorm into a member norm layer
(member t scales by ``c·σ(γ_t)`` and shifts by ``β_t``; at ``γ_t = γ_0`` it is the pretrained
layer) and gives each of the M = 4 members its own new head and LoRA-XS cores. The ``"signorm"``
guide fits the members with the mean member loss plus λ times the softmax-temperature diversity
term, all members in one batched forward per step; prediction averages their probabilities.
A smaller τ makes fewer members own each feature (more diverse members).
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
net = nn.Sequential(
    nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(),
    nn.Linear(64, 5),
)  # fmt: skip
optim = torch.optim.Adam(net.parameters(), lr=1e-3)
for _ in range(2 if args.smoke else 20):  # "pretraining" on the in-distribution train split
    for i in range(0, len(split.x_train), 64):
        loss = nn.functional.cross_entropy(
            net(split.x_train[i : i + 64]), split.y_train[i : i + 64]
        )
        optim.zero_grad()
        loss.backward()
        optim.step()

num_train = 64 if args.smoke else 300
x, y = split.x_train[:num_train], split.y_train[:num_train]
train = [(x[i : i + 32], y[i : i + 32]) for i in range(0, num_train, 32)]
test = [(split.x_test, split.y_test)]
model = pb.models.SigmaNormEnsemble(
    net,
    pb.models.LoRAXS(rank=4, target_modules=["0", "3"]),  # optional: σN alone works too
    num_members=4,
    heads=["6"],  # replicated per member (re-initialised)
    trainable_modules=[],
    num_data=num_train,
)
guide = pb.posterior(model, "signorm")
# the fit's settings: the diversity term's temperature τ and weight λ
optim = pb.Optimization(optimizer=pb.infer.SigmaNormDiversity(tau=0.25, strength=1e-2))
epochs = 2 if args.smoke else 30
result = pb.fit(model, guide, train, epochs=epochs, lr=1e-2, seed=args.seed, optim=optim)
metrics = report(model, guide, test, split.x_ood, num_samples=4)  # S = M: every member once
pred = pb.predict(model, guide, test, num_samples=4)
owners = (torch.sigmoid(guide.loc("1.gamma").detach()) > 0.5).sum(0).double().mean()
print(f"{'disagreement':>20s}: {pb.metrics.disagreement(pred.probs):.4f}")
print(f"{'owners per feature':>20s}: {float(owners):.2f} of 4")
assert math.isfinite(metrics["nll"])
