"""IVON recipes on a causal-LM multiple-choice job: the job's against IVON-LoRA's settings.

Each variant sets ``pyrobayes.demo.causal_lm.LM_FAMILY_SETTINGS["ivon"]`` (over the demo's
``FAMILY_SETTINGS["ivon"]``, which the job runs without it) and runs the job
(``pyrobayes fit CONFIG --seeds S``) with ``families = ["ivon"]``; give the config
``[training] keep = "best"`` and ``patience = 0`` so that the fit validates every epoch (its log,
``-v``, has the validation NLL per epoch). IVON-LoRA: Cong et al. (2024), *Variational low-rank
adaptation using IVON*, whose released runs use α = 0.03, h0 = 3e-4 to 1e-3, ess = 1e6 to 1e8,
β2 = 0.99999, clip radius 1e-3 and 10,000 steps.

Run (one process per variant)::

    for v in recipe recipe_ess lora_a1 lora_a03 lora_a1_norescale lora_a03_norescale; do
        OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lm_ivon_recipes.py $v CONFIG --out runs/ivon-$v \\
            > runs/ivon-$v.log 2>&1 & done; wait
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pyrobayes.demo.causal_lm as causal_lm
from pyrobayes.cli import main as cli_main
from pyrobayes.infer.ivon import IVON

VARIANTS: dict[str, dict[str, Any]] = {
    # the job's recipe until 2026-12-06 (the MiniLM demo's then): α 0.3, h0 10, ess = N, clip 1e-3
    "recipe": {"lr": 0.3, "options": {"hess_init": 10.0}},
    # that recipe with IVON-LoRA's effective sample size (less noise, the same steps)
    "recipe_ess": {"lr": 0.3, "options": {"hess_init": 10.0, "ess": 1e7}},
    # IVON-LoRA's h0 and ess, at α = 1 and 0.3 with the default rescale_lr (the step is then
    # α (h0 + δ) times the clipped preconditioned gradient: ≤ 1e-6 per coordinate) ...
    "lora_a1": {"lr": 1.0, "options": {"hess_init": 1e-3, "ess": 1e7}},
    "lora_a03": {"lr": 0.3, "options": {"hess_init": 1e-3, "ess": 1e7}},
    # ... and without it, as IVON-LoRA runs (a step ≤ α · 1e-3: Adam's 1e-3 at α = 1); at
    # α = 0.3 the job's recipe since 2026-12-06 (and the MiniLM demo's)
    "lora_a1_norescale": {
        "lr": 1.0,
        "options": {"hess_init": 1e-3, "ess": 1e7},
        "rescale_lr": False,
    },
    "lora_a03_norescale": {
        "lr": 0.3,
        "options": {"hess_init": 1e-3, "ess": 1e7},
        "rescale_lr": False,
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("config", help="a causal-LM job config with families = ['ivon']")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="the job's tiny LLaMA (tests)")
    args = parser.parse_args(argv)
    settings = {**VARIANTS[args.variant], "scheduler": "constant"}
    rescale = bool(settings.pop("rescale_lr", True))
    optimizer = IVON(clip_radius=1e-3, rescale_lr=rescale)
    job = ["-v", "fit", args.config, "--seeds", args.seeds, "--out", args.out, "--no-progress"]
    saved = causal_lm.LM_FAMILY_SETTINGS.get("ivon")
    causal_lm.LM_FAMILY_SETTINGS["ivon"] = {**settings, "optimizer": optimizer}
    try:
        return cli_main(job + (["--quick"] if args.quick else []))
    finally:
        if saved is None:
            del causal_lm.LM_FAMILY_SETTINGS["ivon"]
        else:
            causal_lm.LM_FAMILY_SETTINGS["ivon"] = saved


if __name__ == "__main__":
    sys.exit(main())
