"""Shared set-up for the examples: a small MLP pretrained on digits 0–4, LoRA-XS on its layers.

The examples fine-tune the pretrained network's LoRA-XS cores (and a point-estimated head) on the
same five classes with a small training set, then report calibration on the test split and OOD
detection on digits 5–9.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.demo.data import load_digits_split


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes (the test suite runs this)"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup(smoke: bool, seed: int = 0, num_train: int = 200):
    """Return (model, train_loader, test_loader, ood_inputs)."""
    torch.manual_seed(seed)
    split = load_digits_split(seed=seed, dtype=torch.float32)
    net = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 5)
    )
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(3 if smoke else 60):  # "pretraining" on the full in-distribution train split
        for i in range(0, len(split.x_train), 64):
            loss = nn.functional.cross_entropy(
                net(split.x_train[i : i + 64]), split.y_train[i : i + 64]
            )
            optim.zero_grad()
            loss.backward()
            optim.step()
    num_train = 64 if smoke else num_train
    x, y = split.x_train[:num_train], split.y_train[:num_train]
    model = pb.models.FineTuneModel(
        net,
        pb.models.LoRAXS(rank=4, projection="svd", target_modules=["0", "2"]),
        num_data=num_train,
        trainable_modules=["4"],
    )
    train = [(x[i : i + 32], y[i : i + 32]) for i in range(0, num_train, 32)]
    test = [
        (split.x_test[i : i + 128], split.y_test[i : i + 128])
        for i in range(0, len(split.x_test), 128)
    ]
    return model, train, test, split.x_ood


def report(model, guide, test, x_ood, num_samples: int) -> dict[str, float]:
    pred = pb.predict(model, guide, test, num_samples=num_samples)
    ood = pb.predict(model, guide, [x_ood], num_samples=num_samples)
    result = pb.metrics.report(pred, pred.targets, ood_probs=ood.probs)
    for key, value in result.items():
        print(f"{key:>20s}: {value:.4f}")
    return result
