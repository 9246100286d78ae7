"""MAP, mean-field and the symmetrized guide on plain LoRA factors of a deeper network.

benchmarks/ivon_depth.py's digits transfer task (an MLP 64-128-...-128-5 pretrained on digits
0-4, a new 7-class point head, 300 training and 300 held-out images of 0-6) with a plain LoRA
r = 4 on every hidden layer, both factors latent (the library's default adapter), or LoRA-XS
r = 4 cores (``--arms map-xs meanfield-xs``). Adam lr 1e-2, batches of 32, ``--epochs``
epochs; mean-field and symmetrized at their defaults (``--scale-lr`` sets both fits'
``scale_lr``). Reported per fit: accuracy and NLL of the predictive (S = 32) and at the
posterior mean, the median posterior sd and the fit's last KL(q ‖ p)/N.
docs/methods/meanfield.md ("Many latent factors per example") quotes it.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/meanfield_depth.py --seeds 0 1 2 --depths 2 3 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/meanfield_depth.py --seeds 0 1 2 --depths 5 \
        --arms meanfield --epochs 10 60 120
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pyrobayes as pb

_spec = importlib.util.spec_from_file_location(
    "ivon_depth", Path(__file__).resolve().parent / "ivon_depth.py"
)
assert _spec is not None and _spec.loader is not None
_depth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_depth)

ARMS = {  # arm: (family, adapter)
    "map": ("map", "lora"),
    "meanfield": ("meanfield", "lora"),
    "symmetrized": ("symmetrized", "lora"),
    "map-xs": ("map", "lora_xs"),
    "meanfield-xs": ("meanfield", "lora_xs"),
}


def one(
    seed: int, depth: int, arms: list[str], epochs: int, scale_lr: float
) -> list[dict[str, Any]]:
    """Every arm on one seed's task of ``depth`` hidden layers."""
    x, y, held, train, state = _depth.pretrained(seed, depth)
    batches = [(x[train[i : i + 32]], y[train[i : i + 32]]) for i in range(0, len(train), 32)]
    targets = [str(2 * i) for i in range(depth)]
    rows = []
    for arm in arms:
        family, kind = ARMS[arm]
        body = _depth._body(depth)
        body.load_state_dict(state)
        torch.manual_seed(1000 * seed)
        body[2 * depth] = nn.Linear(128, 7)
        adapter = (pb.models.LoRA if kind == "lora" else pb.models.LoRAXS)(
            rank=4, target_modules=targets
        )
        model = pb.models.FineTuneModel(
            body, adapter, num_data=len(train), trainable_modules=[str(2 * depth)]
        )
        guide = pb.posterior(model, family)
        options: dict[str, Any] = {}
        if family != "map" and scale_lr != 1.0:
            settings = {"meanfield": pb.infer.MeanField, "symmetrized": pb.infer.Symmetrized}
            options["optim"] = pb.Optimization(optimizer=settings[family](scale_lr=scale_lr))
        result = pb.fit(
            model, guide, batches, epochs=epochs, lr=1e-2, seed=seed, progress=False, **options
        )
        mean = {k: v[None] for k, v in guide.mean().items()}
        row: dict[str, Any] = {
            "seed": seed,
            "depth": depth,
            "arm": arm,
            "epochs": epochs,
            **_depth._scores(model, guide, [(x[held], y[held])], num_samples=32, seed=0),
            "at_mean": _depth._scores(model, guide, [(x[held], y[held])], values=mean),
        }
        if family != "map":
            base = guide.base if family == "symmetrized" else guide
            scales = torch.cat([base._loc_scale(s)[1].detach().flatten() for s in base.sites])
            row["sd_median"] = float(scales.median())
            terms = result.state.get("terms", {})
            if "kl" in terms:  # mean-field's ELBO terms (the symmetrized one reports L_K, I_K)
                row["kl_per_example"] = float(terms["kl"][-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--depths", nargs="+", type=int, default=[2, 3, 5])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS)[:3])
    parser.add_argument("--epochs", nargs="+", type=int, default=[30])
    parser.add_argument("--scale-lr", type=float, default=1.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return [
        row
        for s in args.seeds
        for d in args.depths
        for e in args.epochs
        for row in one(s, d, args.arms, e, args.scale_lr)
    ]


if __name__ == "__main__":
    main()
