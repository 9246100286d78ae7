"""Per-epoch validation and test metrics of one causal-LM family, with no epoch selection.

docs/causal_lm.md's twelve-epoch table compares a MAP kept at its last epoch with IVON and
mean-field fits that select their epoch of least validation NLL on the validation split. This
script separates the two effects: it fits ``--family`` for ``--epochs`` epochs under the job's
settings for that family (``pyrobayes.demo.causal_lm``) but without early stopping or selection,
and after every epoch scores the posterior predictive (``--num-samples`` draws) on the
validation and test splits. The row a validation-selected fit would report and the last
iterate then come from one run.

Run (one process per family and seed; about 35 min of one core per 12-epoch fit)::

    OMP_NUM_THREADS=1 python benchmarks/lm_epochs.py examples/configs/smollm2_disambiguation_qa.toml \\
        --family meanfield --seed 0 --epochs 12 --out benchmarks/results/lm_epochs/meanfield-s0.json

``pb.predict`` draws from its own seeded generator, so the scoring leaves the fit's trajectory as
it is without it (tests/test_causal_lm_job.py checks the losses equal).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from pyrobayes import posterior, predict
from pyrobayes.cli import tomllib  # tomllib, or tomli on Python 3.10
from pyrobayes.demo import causal_lm
from pyrobayes.demo.pipeline import fit_options
from pyrobayes.infer.loop import fit
from pyrobayes.infer.options import Progress

logger = logging.getLogger(__name__)


def epoch_curve(
    config: dict[str, Any],
    family: str,
    *,
    seed: int = 0,
    epochs: int = 12,
    num_samples: int = 4,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit ``family`` (the job's settings, no selection) and score it after every epoch.

    Returns ``curve`` (per epoch: ``val`` and ``test`` metrics of the posterior predictive),
    ``losses`` (the fit's per-step losses), ``selected_epoch`` (least validation NLL, the epoch
    a validated fit keeps), ``options`` and ``seconds``. A post-hoc family (Laplace, SWAG: an
    ``init`` in the job's settings) is refused."""
    base, tokenizer = causal_lm.load_base(config)
    data = causal_lm.build_data(config, tokenizer)
    settings = causal_lm._settings(family)
    if settings.get("init"):
        raise ValueError(
            f"lm_epochs.py: {family!r} is built post hoc at the {settings['init']} fit, with no "
            "epochs of its own to score; pass a trained family (map, meanfield, ivon, ...)."
        )
    options = {**settings.get("options", {}), **(options or {})}
    model = causal_lm.build_model(config, base, data["num_train"], seed)
    guide = posterior(model, family, **options)
    steps_per_epoch = len(data["train"])
    curve: list[dict[str, Any]] = []

    def score(split: str) -> dict[str, float]:
        pred = predict(model, guide, data[split], num_samples=num_samples, seed=0)
        return causal_lm._metrics(pred)

    def callback(step: int, loss: float) -> None:
        if step % steps_per_epoch:
            return
        curve.append({"epoch": step // steps_per_epoch, "val": score("val"), "test": score("test")})
        logger.info("%s", json.dumps(curve[-1]))

    start = time.perf_counter()
    result = fit(
        model,
        guide,
        data["train"],
        epochs=epochs,
        lr=float(settings.get("lr", config["training"]["lr"])),
        seed=seed,
        optim=fit_options(config, settings, None)["optim"],  # no validation: no selection
        progress=Progress(bar=False, callback=callback),
    )
    return {
        "family": family,
        "seed": seed,
        "options": options,
        "seconds": time.perf_counter() - start,
        "losses": [float(v) for v in result.losses],
        "curve": curve,
        "selected_epoch": min(curve, key=lambda r: r["val"]["nll"])["epoch"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a causal-LM job config (TOML)")
    parser.add_argument("--family", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument(
        "--options",
        default="{}",
        help="JSON constructor options over the job's for the family (e.g. init_scale)",
    )
    parser.add_argument("--latent", default=None, help="'A': LoRA(latent='A'), every B a point")
    parser.add_argument("--quick", action="store_true", help="the job's --quick (tiny LLaMA)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    with open(args.config, "rb") as fh:
        config = causal_lm.resolve_config(tomllib.load(fh), quick=args.quick)
    if args.latent is not None:  # not a job config key: LoRA's own field
        config["adapter"]["latent"] = args.latent
    out = epoch_curve(
        config,
        args.family,
        seed=args.seed,
        epochs=args.epochs,
        num_samples=args.num_samples,
        options=json.loads(args.options),
    )
    out = {"config": args.config, "latent": args.latent, "epochs": args.epochs, **out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
