"""Does mean-field's posterior scale leave its initial value? (issue 27; docs/methods/meanfield.md)

Digits transfer (``benchmarks/ivon.py``'s ``digits_task``: MLP 64-128-128 pretrained on digits
0-4, LoRA-XS r=4 cores and a latent 10-class head, 1,000 images, batch 50, scored on 450 held-out
training images), Adam at ``lr``; per setting: KL and median σ before and after, the −ELBO of the
first and last 20 steps, validation accuracy and NLL.

``python benchmarks/meanfield_scale.py '[{"options": {"init_scale": 1e-3}}, {"options":
{"init_scale": 1e-3}, "scale_lr": 10}, {"options": {"init_scale": 1e-3}, "epochs": 40}]'``
(``options``: the posterior's; ``scale_lr``: the fit's, ``pb.infer.MeanField(scale_lr=...)``;
a ``scale_lr`` inside ``options``, the earlier spelling, is moved there)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ivon import digits_task  # noqa: E402

import pyrobayes as pb  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    for cfg in json.loads(sys.argv[1]):
        pyro.clear_param_store()
        task = digits_task(0, 1000, 50, protocol="shift", evaluate="val", latent_head=True)
        model = task["model"]
        options = dict(cfg.get("options", {}))
        settings = pb.infer.MeanField(scale_lr=options.pop("scale_lr", cfg.get("scale_lr", 1.0)))
        guide = pb.posterior(model, "meanfield", **options)
        gen = torch.Generator().manual_seed(0)
        batches = [b for _ in range(cfg.get("epochs", 10)) for b in task["batches"](gen)]
        with torch.no_grad():
            kl0 = float(guide.kl_to_prior(model))
            sig0 = torch.cat([guide.scale(s).flatten() for s in guide.sites])
        optim = pb.Optimization(optimizer=settings)
        res = pb.fit(model, guide, batches, epochs=1, lr=cfg.get("lr", 1e-2), seed=0, optim=optim)
        with torch.no_grad():
            kl1 = float(guide.kl_to_prior(model))
            sig = torch.cat([guide.scale(s).flatten() for s in guide.sites])
        pred = pb.predict(model, guide, task["test"], num_samples=16)
        p = pred.probs.mean(0)
        y = torch.cat([b[1] for b in task["test"]])
        nll = float(-p[torch.arange(len(y)), y].log().mean())
        acc = float((p.argmax(-1) == y).float().mean())
        losses = res.losses
        print(
            f"{cfg}: KL {kl0:.4g} -> {kl1:.4g}, median sigma {sig0.median():.3g} -> "
            f"{sig.median():.3g}, -ELBO {float(losses[:20].mean()):.4g} -> "
            f"{float(losses[-20:].mean()):.4g}, val acc {acc:.3f}, NLL {nll:.4f}"
        )


if __name__ == "__main__":
    main()
