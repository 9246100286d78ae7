"""IVON on deeper adapted networks: the digits transfer task with 2 to 5 hidden layers, a LoRA-XS
r = 4 core on every one, against a MAP fit of the same model.

The suite's digits set-up (``benchmarks/suite/tasks.py``) with the body made deeper: an MLP
64-128-...-128-5 (ReLU) pretrained on digits 0-4 (100 epochs, Adam 1e-3), then a new 7-class head
(a point parameter) and a core on each hidden layer; 300 training images of 0-6, 300 held-out
images of the same pool scored (none used for any choice). MAP and mean-field: Adam lr 1e-2,
30 epochs;
IVON: the suite's settings (library defaults, lr 0.1, 60 epochs, the cosine schedule) and the
``--lrs`` / ``--clips`` given. Reported per fit: accuracy and NLL of the predictive (S = 32),
the same at the posterior mean (one draw: is it the noise or the mean?), and the median |mean|
of each core. docs/methods/ivon.md quotes it.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon_depth.py --seeds 0 1 --depths 2 3 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon_depth.py --seeds 1 --depths 5 \
        --lrs 0.1 0.03 0.01 --clips none 0.01
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ivon_depth.py --seeds 0 1 2 --depths 2 3 5 \
        --warmups 0 0.1
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.demo.data import load_digits_split


def _data(seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    split = load_digits_split(
        seed=seed, id_classes=range(7), test_fraction=0.1, dtype=torch.float32
    )
    x, y = split.x_train, split.y_train
    perm = torch.randperm(len(x))
    held, train, rest = perm[:300], perm[300:600], perm[600:]
    return x, y, held, train, rest[y[rest] < 5]


def _body(depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, 128), nn.ReLU()]
        width = 128
    return nn.Sequential(*layers, nn.Linear(128, 5))


def _scores(model: Any, guide: Any, data: list[Any], **kw: Any) -> dict[str, float]:
    pred = pb.predict(model, guide, data, **kw)
    assert pred.targets is not None
    report = pb.metrics.report(pred, pred.targets)
    return {"accuracy": float(report["accuracy"]), "nll": float(report["nll"])}


def pretrained(seed: int, depth: int) -> tuple[Any, ...]:
    """``(x, y, held, train, state)``: one seed's split and the body of ``depth`` hidden layers
    pretrained on digits 0-4 (100 epochs, Adam 1e-3; also benchmarks/meanfield_depth.py's and
    benchmarks/ivon_small_data.py's)."""
    x, y, held, train, pre = _data(seed)
    net = _body(depth)
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(100):
        for i in range(0, len(pre), 64):
            batch = pre[i : i + 64]
            loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
            optim.zero_grad()
            loss.backward()
            optim.step()
    return x, y, held, train, net.state_dict()


def one(
    seed: int, depth: int, lrs: list[float], clips: list[float | None], warmups: list[float]
) -> list[dict[str, Any]]:
    """MAP, mean-field and IVON (each ``lr`` × ``clip`` × ``warmup``) on one seed's transfer
    task of ``depth`` layers."""
    x, y, held, train, state = pretrained(seed, depth)
    batches = [(x[train[i : i + 32]], y[train[i : i + 32]]) for i in range(0, len(train), 32)]
    scored = [(x[held], y[held])]
    head = str(2 * depth)

    def build() -> Any:
        body = _body(depth)
        body.load_state_dict(state)
        torch.manual_seed(1000 * seed)
        body[2 * depth] = nn.Linear(128, 7)
        cores = pb.models.LoRAXS(rank=4, target_modules=[str(2 * i) for i in range(depth)])
        return pb.models.FineTuneModel(body, cores, num_data=len(train), trainable_modules=[head])

    rows = []
    runs: list[tuple[str, float, int, float | None, float]] = [
        ("map", 1e-2, 30, None, 0.0),
        ("meanfield", 1e-2, 30, None, 0.0),  # an Adam-trained posterior on the same cores
    ]
    runs += [("ivon", lr, 60, clip, w) for lr in lrs for clip in clips for w in warmups]
    for family, lr, epochs, clip, warmup in runs:
        model = build()
        guide = pb.posterior(model, family)
        settings: dict[str, Any] = {}
        if clip is not None:
            settings["optimizer"] = pb.infer.IVON(clip_radius=clip)
        if warmup > 0:  # IVON's default cosine, after a linear warm-up over this fraction
            settings.update(scheduler="cosine", warmup=warmup)
        options = {"optim": pb.Optimization(**settings)} if settings else {}
        pb.fit(model, guide, batches, epochs=epochs, lr=lr, seed=seed, progress=False, **options)
        mean = {k: v[None] for k, v in guide.mean().items()}
        rows.append(
            {
                "seed": seed,
                "depth": depth,
                "family": family,
                "lr": lr,
                "clip_radius": clip,
                "warmup": warmup,
                **_scores(model, guide, scored, num_samples=32, seed=0),
                "at_mean": _scores(model, guide, scored, values=mean),
                "abs_loc_median": [round(float(v.abs().median()), 4) for v in mean.values()],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--depths", nargs="+", type=int, default=[2, 3, 5])
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.1])
    parser.add_argument("--clips", nargs="+", default=["none"])
    parser.add_argument("--warmups", nargs="+", type=float, default=[0.0])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    clips = [None if c == "none" else float(c) for c in args.clips]
    return [
        row
        for s in args.seeds
        for d in args.depths
        for row in one(s, d, args.lrs, clips, args.warmups)
    ]


if __name__ == "__main__":
    main()
