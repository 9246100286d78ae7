"""One family of the main job (``make demo``'s configuration) with overridden settings.

Each spec is a JSON object of guide options plus ``lr``, ``epochs`` (default: the demo's) and
``seed`` (the data order and the fit's seed, default 0). The training loader is rewound to the
seed before every fit, as ``pipeline.run`` does for each family, so a spec's row does not depend
on what ran before it. Unset options take the demo's ``FAMILY_SETTINGS``. One JSON line per spec.

``reference`` instead of a family trains the demo's reference: a plain peft LoRA (r = 8,
α = 16, query/value of all six layers, the head trained, AdamW, no pyrobayes) for 2 epochs on the
demo's training split, scored on its test split (the demo's MAP should come within 0.02 of its
accuracy). Its spec keys: ``lr`` (default 1e-3), ``epochs`` (2), ``seed`` (0).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/demo_family.py ivon '{"seed": 1}' \\
        '{"seed": 1, "hess_init": 0.0003, "ess": 76800000, "weight_decay": 0.0013, "lr": 3}'
    .venv/bin/python benchmarks/demo_family.py reference '{}' '{"seed": 1}'
"""

from __future__ import annotations

import json
import sys
import time

import torch

import pyrobayes as pb
from pyrobayes.demo import data as pbdata
from pyrobayes.demo import pipeline as pl


def reference(loaders: dict, spec: dict) -> dict:
    """Plain peft LoRA fine-tuning (the recipe of the demo's data notes): test metrics."""
    from peft import LoraConfig, get_peft_model

    seed = int(spec.get("seed", 0))
    torch.manual_seed(seed)
    net, _ = pbdata.load_minilm_classifier(2)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["query", "value"],
        lora_dropout=0.0,
        modules_to_save=["classifier"],
    )
    net = get_peft_model(net, config)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(spec.get("lr", 1e-3)))
    pl._rewind(loaders["train"], seed)
    start = time.perf_counter()
    for _ in range(int(spec.get("epochs", 2))):
        net.train()
        for batch in loaders["train"]:
            loss = net(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    fit_s = time.perf_counter() - start
    net.eval()
    log_probs, labels = [], []
    with torch.no_grad():
        for batch in loaders["test"]:
            labels.append(batch.pop("labels"))
            log_probs.append(net(**batch).logits.log_softmax(-1))
    lp = torch.cat(log_probs)
    r = pb.metrics.report(lp.exp().unsqueeze(0), torch.cat(labels))
    return {**{k: round(float(r[k]), 3) for k in ("accuracy", "nll", "ece")}, "fit_s": round(fit_s)}


def main(family: str, specs: list[str]) -> None:
    cfg = pl.resolve_config({})
    loaders = pl.build_data(cfg, pl._load_tokenizer(cfg))
    if family == "reference":
        for spec in specs:
            print(
                json.dumps(
                    {
                        "family": "reference (peft LoRA, 2 epochs)",
                        "spec": spec,
                        **reference(loaders, json.loads(spec)),
                    }
                ),
                flush=True,
            )
        return
    settings = pl.FAMILY_SETTINGS.get(family, {})
    for spec in specs:
        opts = json.loads(spec)
        lr = opts.pop("lr", settings.get("lr", cfg["training"]["lr"]))
        seed = opts.pop("seed", 0)
        epochs = opts.pop("epochs", cfg["training"]["epochs"])
        pl._rewind(loaders["train"], seed)
        model, _ = pl.build_model(cfg, loaders["num_train"], loaders["train"])
        guide = pb.posterior(model, family, **{**settings.get("options", {}), **opts})
        start = time.perf_counter()
        optim = pb.Optimization(optimizer=settings.get("optimizer"))  # the fit's settings
        pb.fit(model, guide, loaders["train"], epochs=epochs, lr=lr, seed=seed, optim=optim)
        fit_s = time.perf_counter() - start
        pred = pb.predict(
            model, guide, loaders["test"], num_samples=cfg["predict"]["num_samples"], seed=0
        )
        r = pb.metrics.report(pred, pred.targets)
        row = {k: round(float(r[k]), 3) for k in ("accuracy", "nll", "ece")}
        print(json.dumps({"family": family, "spec": spec, **row, "fit_s": round(fit_s)}))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
