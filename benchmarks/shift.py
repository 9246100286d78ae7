"""Calibration under dataset shift on saved demo posteriors: the same task in another domain.

The demo's "OOD" tweets are not another task: VADER rates them on the same sentiment scale as the
movie sentences the demo trains on, so they are a shifted domain of the same labels (a covariate
shift), the setting of Ovadia et al. (2019, *Can you trust your model's uncertainty? Evaluating
predictive uncertainty under dataset shift*). Where a detector's entropy AUROC asks "does the
model notice the shift", this asks "is it still right, and calibrated, after it": accuracy, NLL,
ECE and Brier on labelled tweets, each family as fitted and with one temperature fitted on the
run's stopping split (what ``pyrobayes.calibrate`` fits, on the same draws; the split the run
already chose its epochs on; no tweet is used for any choice).

Inputs are ``pyrobayes fit`` run folders of the demo's config (any seeds; folders of the same seed
are joined by family, e.g. a ``families = ["map", "laplace"]`` run beside a full one, and a MAP
present in both must have the same saved metrics). Per seed every family is scored on the same
tweets (``--num`` of them, drawn with the seed ``1000 + data seed``; none is ever trained on);
the summary pairs each family with the MAP (and MAP + TS) of its seed.

Run::

    for s in 0 1 2; do OMP_NUM_THREADS=1 pyrobayes fit demo_s$s.toml --out runs/demo-s$s & done; wait
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shift.py runs/demo-s0 runs/demo-s1 runs/demo-s2 \\
        --out benchmarks/results/shift_tweets.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import pyrobayes as pb
from pyrobayes.calibration import apply_temperature, fit_temperature
from pyrobayes.demo import data as pbdata
from pyrobayes.demo import pipeline as pl

METRICS = ("accuracy", "nll", "ece", "brier")


def _labels(loader: Any) -> torch.Tensor:
    return torch.cat([batch["labels"] for batch in loader])


def _metrics(pred: Any, labels: torch.Tensor) -> dict[str, float]:
    report = pb.metrics.report(pred, labels)
    return {k: float(report[k]) for k in METRICS}


def _group(runs: list[Path]) -> dict[int, dict[str, Path]]:
    """``{seed: {family: run folder}}``; a family twice in one seed is refused unless it is the
    same MAP (equal saved metrics)."""
    seeds: dict[int, dict[str, Path]] = {}
    for run in runs:
        config = pl.validate_config(pl.read_json(run / "config.json"))
        seed = int(config["training"]["seed"])
        saved = {r["family"]: r for r in pl.read_json(run / "metrics.json")}
        for path in sorted((run / "guides").glob("*.safetensors")):
            family, have = path.stem, seeds.setdefault(seed, {})
            if family in have:
                other = {r["family"]: r for r in pl.read_json(have[family] / "metrics.json")}
                same = all(
                    math.isclose(saved[family][k], other[family][k], rel_tol=1e-6) for k in METRICS
                )
                if family != "map" or not same:
                    raise SystemExit(f"shift: {family} of seed {seed} in {have[family]} and {run}")
                continue
            have[family] = run
    return seeds


def score_seed(families: dict[str, Path], spec: str, num: int) -> dict[str, Any]:
    """Every family of one seed on the shifted set, as fitted and with the stopping split's
    temperature."""
    first = next(iter(families.values()))
    config = pl.validate_config(pl.read_json(first / "config.json"))
    tokenizer = pl._load_tokenizer(config)
    loaders = pl.build_data(config, tokenizer)
    data = config["data"]
    num_labels = int(config["model"]["num_labels"])
    shifted = pl._load_text(spec, num_labels=num_labels).subset(num, seed=1000 + int(data["seed"]))
    loader = pbdata.text_loader(
        shifted,
        tokenizer,
        batch_size=int(data["batch_size"]),
        max_length=int(config["model"]["max_length"]),
    )
    labels, stop_labels = _labels(loader), _labels(loaders["val"])
    out: dict[str, Any] = {}
    for family, run in families.items():
        run_config = pl.validate_config(pl.read_json(run / "config.json"))
        pl._rewind(loaders["train"], int(data["seed"]))  # the W-SVD calibration of the run
        model, _ = pl.build_model(run_config, loaders["num_train"], loaders["train"], family=family)
        guide = pb.load(run / "guides" / f"{family}.safetensors", model)
        draws = 1 if family == "map" else int(run_config["predict"]["num_samples"])
        # one prediction per split; the temperature is what pb.calibrate fits on the stopping
        # split (pooled, the same draws), applied to both predictions
        stop = pb.predict(model, guide, loaders["val"], num_samples=draws, seed=0)
        pred = pb.predict(model, guide, loader, num_samples=draws, seed=0)
        temperature = fit_temperature(stop, stop_labels)
        record = {
            "run": str(run),
            "draws": draws,
            "num_shifted": int(labels.numel()),
            "temperature": temperature,
            "shift": _metrics(pred, labels),
            "shift+ts": _metrics(apply_temperature(pred, temperature), labels),
            "stopping split nll": _metrics(stop, stop_labels)["nll"],
            "stopping split+ts nll": _metrics(apply_temperature(stop, temperature), stop_labels)[
                "nll"
            ],
        }
        print(f"seed {data['seed']} {family}: {record['shift']} | +ts {record['shift+ts']}")
        sys.stdout.flush()
        out[family] = record
    return out


def _mean_sd(values: list[float], signed: bool = False, digits: int = 3, scale: float = 1.0) -> str:
    """``mean ± sample sd`` of ``scale · values`` (the mean alone for one seed)."""
    mean = scale * statistics.mean(values)
    text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    if len(values) < 2:
        return text
    return f"{text} ± {scale * statistics.stdev(values):.{digits}f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: per family (as fitted and +ts) the shifted set's metrics over seeds, and the
    paired NLL / accuracy differences against MAP and MAP + TS."""
    seeds = list(results)
    families = [f for f in results[seeds[0]] if all(f in results[s] for s in seeds)]
    families.sort(key=lambda f: f != "map")  # the anchor first, the rest as scored
    lines = [
        "| method | acc | NLL | ECE | Brier | ΔNLL vs map | ΔNLL vs map+ts | Δacc (pp) vs map |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family in families:
        for key, name in (("shift", family), ("shift+ts", f"{family}+ts")):
            rows = [results[s][family][key] for s in seeds]
            cells = [_mean_sd([r[m] for r in rows]) for m in METRICS]
            d_map = [
                results[s][family][key]["nll"] - results[s]["map"]["shift"]["nll"] for s in seeds
            ]
            d_ts = [
                results[s][family][key]["nll"] - results[s]["map"]["shift+ts"]["nll"] for s in seeds
            ]
            d_acc = [
                results[s][family][key]["accuracy"] - results[s]["map"]["shift"]["accuracy"]
                for s in seeds
            ]
            paired = [_mean_sd(d_map, signed=True), _mean_sd(d_ts, signed=True)]
            paired.append(_mean_sd(d_acc, signed=True, digits=1, scale=100.0))
            lines.append(f"| {name} | {' | '.join(cells + paired)} |")
    return "\n".join(lines)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument(
        "--render", type=Path, help="re-write the table of this result (after a renderer change)"
    )
    parser.add_argument("--shift", default="vader:tweets", help="the labelled shifted set")
    parser.add_argument("--num", type=int, default=1000, help="shifted examples scored")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", help="where the run folders came from (kept in the result)")
    args = parser.parse_args(argv)
    if args.render is not None:
        payload = json.loads(args.render.read_text())
        payload["table"] = table(payload["results"])
        if args.note is not None:
            payload["note"] = args.note
        args.render.write_text(json.dumps(payload, indent=1))
        print(payload["table"])
        return
    if not args.runs:
        parser.error("give run folders (or --render RESULT)")
    grouped = _group(args.runs)
    for seed, families in grouped.items():
        if "map" not in families:
            raise SystemExit(f"shift: seed {seed} has no MAP posterior to pair with")
    results = {str(s): score_seed(f, args.shift, args.num) for s, f in sorted(grouped.items())}
    text = table(results)
    print(text)
    if args.out is not None:
        payload = {
            "command": " ".join(
                ["benchmarks/shift.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git": _git_commit(),
            "shift": args.shift,
            "num": args.num,
            "note": args.note,
            "runs": [str(r) for r in args.runs],
            "torch": torch.__version__,
            "results": results,
            "table": text,
        }
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
