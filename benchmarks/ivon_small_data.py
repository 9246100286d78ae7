"""IVON on very small data: the digits transfer task with N = 30 training images.

benchmarks/ivon_depth.py's set-up with one hidden layer (an MLP 64-128-5 pretrained on digits
0-4, a new 7-class point head, a LoRA-XS r = 4 core on the hidden layer), fitted on the first
``--num-train`` of its 300 training images (one batch of 32 per epoch at N = 30) and scored on
its 300 held-out images. MAP and mean-field: Adam lr 1e-2, 30 epochs; Laplace: on that MAP;
IVON: the library's defaults at lr 0.1 for each of ``--ivon-epochs`` (the suite's 60 and
more), and with ``hess_init`` 10 at 60 epochs. Reported per fit: accuracy and NLL of the
predictive (S = 32) and at the posterior mean, and for IVON the median of ``h`` (the Hessian
estimate; ``hess_init`` = 1 at the start) and of the cores' ``|mean|``. docs/methods/ivon.md
("very small data") quotes it.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon_small_data.py --seeds 0 1 2
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


def _runs(ivon_epochs: list[int]) -> list[tuple[str, int, dict[str, Any]]]:
    runs: list[tuple[str, int, dict[str, Any]]] = [
        ("map", 30, {}),
        ("meanfield", 30, {}),
        ("laplace", 30, {}),
    ]
    runs += [("ivon", e, {}) for e in ivon_epochs]
    return runs + [("ivon", 60, {"hess_init": 10.0})]


def one(seed: int, num_train: int, ivon_epochs: list[int]) -> list[dict[str, Any]]:
    """Every fit on one seed's task."""
    x, y, held, train, state = _depth.pretrained(seed, 1)
    train = train[:num_train]
    batches = [(x[train[i : i + 32]], y[train[i : i + 32]]) for i in range(0, len(train), 32)]
    scored = [(x[held], y[held])]

    def build() -> Any:
        body = _depth._body(1)
        body.load_state_dict(state)
        torch.manual_seed(1000 * seed)
        body[2] = nn.Linear(128, 7)
        cores = pb.models.LoRAXS(rank=4, target_modules=["0"])
        return pb.models.FineTuneModel(body, cores, num_data=len(train), trainable_modules=["2"])

    rows = []
    for family, epochs, options in _runs(ivon_epochs):
        model = build()
        lr = 0.1 if family == "ivon" else 1e-2
        if family == "laplace":
            point = pb.posterior(model, "map")
            pb.fit(model, point, batches, epochs=epochs, lr=lr, seed=seed, progress=False)
            guide = pb.posterior(model, "laplace", init=point)
            pb.fit(model, guide, batches, epochs=1, seed=seed, progress=False)
        else:
            guide = pb.posterior(model, family, **options)
            pb.fit(model, guide, batches, epochs=epochs, lr=lr, seed=seed, progress=False)
        mean = {k: v[None] for k, v in guide.mean().items()}
        row: dict[str, Any] = {
            "seed": seed,
            "family": family,
            "epochs": epochs,
            **options,
            **_depth._scores(model, guide, scored, num_samples=32, seed=0),
            "at_mean": _depth._scores(model, guide, scored, values=mean),
        }
        if family == "ivon":
            locs, hess = guide.tensors()
            latent = [(m, h) for m, h in zip(locs, hess, strict=True) if h is not None]
            row["h_median"] = float(torch.cat([h.reshape(-1) for _, h in latent]).median())
            loc = torch.cat([m.detach().reshape(-1) for m, _ in latent])
            row["abs_loc_median"] = float(loc.abs().median())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num-train", type=int, default=30)
    parser.add_argument("--ivon-epochs", nargs="+", type=int, default=[60, 300])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return [row for s in args.seeds for row in one(s, args.num_train, args.ivon_epochs)]


if __name__ == "__main__":
    main()
