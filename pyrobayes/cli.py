"""The ``pyrobayes`` command line: ``demo``, ``fit CONFIG``, ``evaluate RUN_DIR``.

``pyrobayes demo`` runs the main job (MiniLM + LoRA-XS on the VADER movie sentences, OOD on
tweets and chatterbot dialogue) for every posterior family and prints the comparison table.
``pyrobayes fit config.toml`` runs the same pipeline from a TOML config (sections as in
``pyrobayes.demo.pipeline.DEFAULT_CONFIG``); ``pyrobayes evaluate runs/<run>`` reloads the saved
posteriors and recomputes their metrics.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli backport (same API)
    import tomli as tomllib

from .demo.pipeline import evaluate, format_table, resolve_config, run

__all__ = ["main"]


def _out_dir(arg: str | None, name: str) -> Path:
    if arg:
        return Path(arg)
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _print_records(records: list[dict[str, Any]], out: Path | None) -> None:
    print(format_table(records))
    if out is not None:
        print(f"run folder: {out}")


def _cmd_demo(args: argparse.Namespace) -> int:
    user: dict[str, Any] = {"training": {"device": args.device}}
    if args.families:
        user["families"] = args.families.split(",")
    if args.smoke:  # the size the test suite runs: seconds, not minutes
        user["data"] = {"num_train": 64, "num_test": 32, "num_ood": 32, "ood": ["vader:tweets"]}
        user["predict"] = {"num_samples": 2}
        user["export"] = {"num_samples": 10}
        user.setdefault("families", ["map", "meanfield"])
    config = resolve_config(user, quick=args.quick or args.smoke)
    out = _out_dir(args.out, "demo")
    records = run(config, out, progress_bar=not args.no_progress)
    _print_records(records, out)
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    path = Path(args.config)
    if not path.exists():
        print(f"error: config file {path} does not exist", file=sys.stderr)
        return 2
    with path.open("rb") as f:
        user = tomllib.load(f)
    if args.device:
        user.setdefault("training", {})["device"] = args.device
    config = resolve_config(user, quick=args.quick)
    out = _out_dir(args.out, path.stem)
    records = run(config, out, progress_bar=not args.no_progress)
    _print_records(records, out)
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    records = evaluate(args.run_dir, device=args.device)
    _print_records(records, None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyrobayes", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job on the bundled real model and data")
    demo.add_argument("--quick", action="store_true", help="a ≤ 2-minute version")
    demo.add_argument("--smoke", action="store_true", help="a seconds-long version (tests)")
    demo.add_argument("--device", default="cpu", help="cpu or cuda")
    demo.add_argument("--families", help="comma-separated families (default: all available)")
    demo.add_argument("--out", help="run folder (default runs/demo-<time>)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_cmd_demo)

    fit = sub.add_parser("fit", help="run the pipeline from a TOML config")
    fit.add_argument("config")
    fit.add_argument("--quick", action="store_true")
    fit.add_argument("--device")
    fit.add_argument("--out")
    fit.add_argument("--no-progress", action="store_true")
    fit.set_defaults(func=_cmd_fit)

    ev = sub.add_parser("evaluate", help="reload a run folder's posteriors and recompute metrics")
    ev.add_argument("run_dir")
    ev.add_argument("--device")
    ev.set_defaults(func=_cmd_evaluate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted; completed families are saved in the run folder", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
