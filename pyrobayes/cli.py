"""The ``pyrobayes`` command line: ``demo``, ``fit CONFIG``, ``join``, ``evaluate RUN_DIR``.

``pyrobayes demo`` runs the main job (MiniLM + LoRA on the VADER movie sentences, OOD on tweets
and chatterbot dialogue) for every posterior family of the default config: MAP and the
variational families each fitted until validation NLL stops improving (capped), SWAG and Laplace
built at the fitted MAP; it prints the comparison table and writes ``plots/compare.png``.
``pyrobayes fit config.toml`` runs the same pipeline from a TOML config (sections as in
``pyrobayes.demo.pipeline.DEFAULT_CONFIG``); ``pyrobayes evaluate runs/<run>`` reloads the saved
posteriors, recomputes their metrics and compares them with the run's ``metrics.json``.

An ``--out`` folder that already holds a run (its ``config.json``, ``metrics.json``, posteriors)
is refused unless ``--overwrite`` is given, which removes that run's files first. A run that
fails or is interrupted (Ctrl-C, or SIGTERM: a cluster scheduler's pre-emption, ``kill``,
``timeout``) before its first result removes what it wrote, so the same command starts it
again; one stopped later keeps the families it completed. A run killed before its first result
by SIGKILL (the OOM killer), which no handler sees, leaves its ``config.json``: the same
command (the same config) takes that folder over, with a logged warning; another config is
refused there unless ``--overwrite``.

While a command runs, SIGTERM is handled as Ctrl-C is: the handler (installed by :func:`main`
in the main thread, not by the library, and the previous one restored when it returns; none
where SIGTERM is ignored) raises :class:`Terminated`, a ``KeyboardInterrupt``.

Exit status: 0 on success, 1 when ``evaluate`` finds drift, 2 on a usage, config or run-folder
error, or on an error the library reports about its input after the config check (a model or
file that cannot be read, a value the fit refuses): ``pyrobayes <command>: error: <message>``,
no traceback (``PYROBAYES_TRACEBACK=1`` in the environment prints it too), 130 when
interrupted (Ctrl-C), 143 (128 + 15, as for a process SIGTERM kills) when terminated.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli backport (same API)
    import tomli as tomllib

import torch

from .demo.config import QUICK_OVERRIDES
from .demo.data import DataUnavailableError
from .demo.pipeline import (
    DRIFT_TOLERANCE,
    ConfigError,
    RunFolderError,
    check_inputs,
    compare_metrics,
    evaluate,
    format_table,
    read_json,
    resolve_config,
    run,
)
from .demo.run_folder import claim_run_folder
from .io import PosteriorFileError, PosteriorMismatchError

__all__ = ["Terminated", "main"]

logger = logging.getLogger(__name__)

#: Set to 1 (or any value but 0 / empty) to print the traceback of an error the command line
#: reports as ``pyrobayes <command>: error: <message>``.
TRACEBACK_ENV = "PYROBAYES_TRACEBACK"

_DESCRIPTION = """\
The pyrobayes command line: demo (the main job), fit CONFIG (the job from a
TOML config), join RUN_DIR... (causal-LM runs of one job), evaluate RUN_DIR
(recompute a run's metrics and compare them with its metrics.json).
"""
_EPILOG = f"""\
exit status: 0 on success, 1 when evaluate finds drift, 2 on a usage, config or
run-folder error or an error the library reports about its input (a model or
file that cannot be read), 130 when interrupted (Ctrl-C), 143 when terminated
(SIGTERM, handled as Ctrl-C: a run stopped before its first result removes its
files; the same command takes over a run SIGKILL stopped then). Errors print
"pyrobayes <command>: error: <message>" without a traceback; set
{TRACEBACK_ENV}=1 in the environment to print the traceback as well.
"""


def _out_dir(arg: str | None, name: str) -> Path:
    if arg:
        return Path(arg)
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _claim_out(out: Path, overwrite: bool, config: dict[str, Any]) -> None:
    """The run folder rule of :func:`pyrobayes.demo.run_folder.claim_run_folder`, worded for
    the command line (before the model and data are loaded): ``config`` takes over an
    unfinished run of the same config, and a folder another live run holds is refused (the
    job holds the lock while it runs: :func:`pyrobayes.demo.run_folder.claimed_run_folder`)."""
    claim_run_folder(out, overwrite, folder="--out", replace="--overwrite", config=config)


def _print_records(records: list[dict[str, Any]], out: Path | None) -> None:
    print(format_table(records))
    if out is not None:
        print(f"run folder: {out}")


def _cmd_demo(args: argparse.Namespace) -> int:
    user: dict[str, Any] = {"training": {"device": args.device}}
    if args.families:
        user["families"] = [f.strip() for f in args.families.split(",")]
    if args.smoke:  # the size the test suite runs: seconds, not minutes
        user["data"] = {
            "num_train": 64,
            "num_val": 32,
            "num_test": 32,
            "num_ood": 32,
            "ood": ["vader:tweets"],
        }
        user["training"]["epochs"] = 2
        user["predict"] = {"num_samples": 2}
        user["export"] = {"num_samples": 10}
        # MAP, a VI family and a post-hoc family built at the MAP
        user.setdefault("families", ["map", "meanfield", "laplace"])
    config = resolve_config(user, quick=args.quick or args.smoke)
    check_inputs(config)
    out = _out_dir(args.out, "demo")
    _claim_out(out, args.overwrite, config)
    records = run(config, out, progress_bar=not args.no_progress)
    _print_records(records, out)
    return 0


def _read_config(path: Path) -> dict[str, Any]:
    """The TOML config at ``path``.

    Raises
    ------
    ConfigError
        When ``path`` does not exist, is a folder, or is not UTF-8 TOML (the message names
        the path; a folder and a binary file were reported as ``[Errno 21] Is a directory``
        and a bare ``'utf-8' codec can't decode ...``).
    """
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        inside = sorted(str(p) for p in path.glob("*.toml"))[:3]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise ConfigError(f"config file {path} is a folder; pass the TOML file itself{hint}.")
    with path.open("rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path} is not valid TOML: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path} is not a UTF-8 text file ({err.reason} at byte {err.start}), so not a "
                "TOML config; pass the config's .toml file."
            ) from None


def _warn_quick_overridden(user: dict[str, Any]) -> None:
    """Log (WARNING) the keys of :data:`~pyrobayes.demo.config.QUICK_OVERRIDES` the config sets
    to other values: ``--quick`` applies under the config's values, so those keep the
    config's size (a config with ``epochs = 50`` ran 50 epochs under ``--quick``, silently)."""
    kept = _overridden(user, QUICK_OVERRIDES)
    if kept:
        logger.warning(
            "--quick does not shrink %s: the config's own values win over --quick's sizes. "
            "Remove these keys from the config for the quick run.",
            ", ".join(kept),
        )


def _overridden(user: dict[str, Any], quick: dict[str, Any]) -> list[str]:
    """``"key = config's value (--quick: value)"`` for every key both set, to other values."""
    from .demo.causal_lm_config import differing_keys

    return [f"{k} = {mine!r} (--quick: {q!r})" for k, mine, q in differing_keys(user, quick)]


def _cmd_fit(args: argparse.Namespace) -> int:
    path = Path(args.config)
    user = _read_config(path)
    if args.device:
        training = user.setdefault("training", {})
        if isinstance(training, dict):  # otherwise resolve_config names the wrong type
            training["device"] = args.device
    if "causal_lm" in user:  # the causal-LM multiple-choice job (pyrobayes.demo.causal_lm)
        if args.seeds is not None:
            user["seeds"] = args.seeds
        return _fit_causal_lm(args, path, user)
    if args.seeds is not None:
        raise ConfigError(
            f"{path}: --seeds applies to causal-LM configs (their 'seeds' list); this config "
            "runs one seed, set by [training] seed."
        )
    try:
        config = resolve_config(user, quick=args.quick)
        check_inputs(config)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if args.quick:
        _warn_quick_overridden(user)
    out = _out_dir(args.out, path.stem)
    _claim_out(out, args.overwrite, config)
    records = run(config, out, progress_bar=not args.no_progress)
    _print_records(records, out)
    return 0


def _fit_causal_lm(args: argparse.Namespace, path: Path, user: dict[str, Any]) -> int:
    from .demo import causal_lm

    try:
        config = causal_lm.resolve_config(user, quick=args.quick)
        _check_relative_paths(path, config)
        causal_lm.check_inputs(config)  # before --overwrite removes the old run
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    out = _out_dir(args.out, path.stem)
    _claim_out(out, args.overwrite, config)
    records = causal_lm.run(config, out, progress_bar=not args.no_progress)
    print(causal_lm.format_table(records))
    print(f"run folder: {out}")
    return 0


def _check_relative_paths(config_path: Path, config: dict[str, Any]) -> None:
    """Refuse a relative ``causal_lm.task.path`` or ``causal_lm.model`` that is missing from the
    current folder (where the job reads it) but sits next to the config file: the user wrote it
    relative to the config, so the job would stop with "does not exist" after loading.

    Raises
    ------
    ConfigError
        Naming the key, both places, and the path to write instead.
    """
    here, beside = Path.cwd(), config_path.parent
    if beside.resolve() == here.resolve():
        return
    lm = config["causal_lm"]
    for key, value in (
        ("causal_lm.task.path", lm["task"]["path"]),
        ("causal_lm.model", lm["model"]),
    ):
        relative = Path(str(value))
        if not value or str(value).startswith("~") or relative.is_absolute() or relative.exists():
            continue
        if (beside / relative).exists():
            raise ConfigError(
                f"Config key {key!r} = {value!r} is read from the current folder ({here}), where "
                f"it does not exist; relative paths are not read from the config's folder, "
                f"which holds {beside / relative}. Write {str(beside / relative)!r} (or an "
                f"absolute path), or run pyrobayes from {beside}."
            )


def _is_causal_lm_run(run_dir: Path) -> bool:
    config = run_dir / "config.json"
    return config.is_file() and "causal_lm" in read_json(config)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    metrics_path = run_dir / "metrics.json"
    if run_dir.is_dir() and not metrics_path.exists():  # before the (slow) recomputation
        raise RunFolderError(f"{run_dir} has no metrics.json to compare the metrics with.")
    # read (and so check) the saved metrics before the slow recomputation, not after it
    saved = read_json(metrics_path) if metrics_path.is_file() else None
    if _is_causal_lm_run(run_dir):
        from .demo import causal_lm

        records = causal_lm.evaluate(run_dir, device=args.device)
        print(causal_lm.format_table(records))
        saved = read_json(metrics_path) if saved is None else saved
        drifts = causal_lm.compare(saved, records, tolerance=args.tolerance)
    else:
        records = evaluate(run_dir, device=args.device)
        _print_records(records, None)
        saved = read_json(metrics_path) if saved is None else saved
        drifts = compare_metrics(saved, records, tolerance=args.tolerance)
    if drifts:
        print(
            f"drift: {len(drifts)} metric(s) differ from {metrics_path} "
            f"(tolerance {args.tolerance:g}·max(1, |saved|)):",
            file=sys.stderr,
        )
        for line in drifts:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"no drift: every metric matches {metrics_path} within {args.tolerance:g}")
    return 0


def _cmd_join(args: argparse.Namespace) -> int:
    from .demo import causal_lm
    from .demo.join_runs import join_runs

    records = join_runs(args.run_dirs, args.out, overwrite=args.overwrite)
    print(causal_lm.format_table(records))
    print(f"run folder: {args.out}")
    return 0


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer seeds such as 1,2, got {text!r}"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed, e.g. --seeds 0")
    return seeds


class _Once(argparse.Action):
    """Store a list-valued option, refusing the option given twice: ``--seeds 1 --seeds 2`` ran
    seed 2 alone (argparse keeps the last), where a list of both was meant."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        previous = getattr(namespace, self.dest, None)
        if previous is not None:
            joined = ",".join(str(v) for v in [*previous, *values])
            raise argparse.ArgumentError(
                self,
                f"given twice ({previous} and {values}); only the last would run. Give one "
                f"comma-separated list: {option_string} {joined}",
            )
        setattr(namespace, self.dest, values)


def _device(text: str) -> str:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        hint = " (did you mean cuda?)" if text.lower().startswith("gpu") else ""
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu, cuda, cuda:1 or mps, got {text!r}{hint}"
        ) from None
    return text


def _tolerance(text: str) -> float:
    value = float(text)
    if not (value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite tolerance >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyrobayes",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job on the bundled real model and data")
    demo.add_argument("--quick", action="store_true", help="a ≤ 2-minute version")
    demo.add_argument("--smoke", action="store_true", help="a seconds-long version (tests)")
    demo.add_argument("--device", type=_device, default="cpu", help="cpu or cuda")
    demo.add_argument(
        "--families",
        help="comma-separated families (default: map,meanfield,ivon,kron-ivon,swag,laplace,symmetrized)",
    )
    demo.add_argument("--out", help="run folder (default runs/demo-<time>)")
    demo.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_cmd_demo)

    fit = sub.add_parser("fit", help="run the pipeline from a TOML config")
    fit.add_argument("config")
    fit.add_argument("--quick", action="store_true")
    fit.add_argument("--device", type=_device, help="overrides [training] device")
    fit.add_argument("--out", help="run folder (default runs/<config name>-<time>)")
    fit.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    fit.add_argument("--no-progress", action="store_true")
    fit.add_argument(
        "--seeds",
        type=_seeds,
        action=_Once,
        help="causal-LM configs: run these comma-separated seeds instead of the config's "
        "(e.g. one process per seed, joined with `pyrobayes join`)",
    )
    fit.set_defaults(func=_cmd_fit)

    join = sub.add_parser(
        "join",
        help="join causal-LM run folders of the same job under different seeds into one",
    )
    join.add_argument("run_dirs", nargs="+")
    join.add_argument("--out", required=True, help="the joined run folder")
    join.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    join.set_defaults(func=_cmd_join)

    ev = sub.add_parser(
        "evaluate",
        help="reload a run folder's posteriors, recompute the metrics, report drift from "
        "metrics.json (exit 1 on drift)",
    )
    ev.add_argument("run_dir")
    ev.add_argument("--device", type=_device, help="default: the run's training.device")
    ev.add_argument(
        "--tolerance",
        type=_tolerance,
        default=DRIFT_TOLERANCE,
        help=f"drift when |recomputed - saved| > tolerance·max(1, |saved|) "
        f"(default {DRIFT_TOLERANCE:g})",
    )
    ev.set_defaults(func=_cmd_evaluate)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM received while a command runs (a cluster scheduler's pre-emption, ``kill``,
    ``timeout``): a ``KeyboardInterrupt``, so the jobs handle it as Ctrl-C (a run stopped
    before its first result removes what it wrote)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"signal {signum} (SIGTERM)")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Raise :class:`Terminated` in the main thread on SIGTERM inside the block, and restore the
    previous handler after it. Nothing is installed off the main thread (Python runs signal
    handlers there only) or where SIGTERM is ignored (a parent asked for that)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:  # None: a handler not installed from Python, which cannot be put back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        with _sigterm_as_interrupt():
            return int(args.func(args))
    except (ConfigError, RunFolderError, PosteriorFileError, PosteriorMismatchError) as err:
        return _report(args.command, err)
    except (ValueError, OSError, DataUnavailableError) as err:
        # what the library raises about its input after the config check (a model folder or
        # hub id that cannot be loaded, a file it cannot read, a value a fit refuses): the
        # message is the library's; anything else (a bug) keeps its traceback
        return _report(args.command, err, hint=True)
    except KeyboardInterrupt as err:
        return _report_interrupt(args.command, err)


def _report_interrupt(command: str, err: KeyboardInterrupt) -> int:
    """Print ``pyrobayes <command>: interrupted`` (``terminated (SIGTERM)`` for
    :class:`Terminated`) and return its exit status: 130, or 143 = 128 + 15 for SIGTERM (as
    for a process the signal kills)."""
    saved = (
        "; the families completed before it are saved in the run folder (a run stopped "
        "before its first result removed its files: the same command starts it again)"
        if command in ("demo", "fit")
        else ""
    )
    if isinstance(err, Terminated):
        print(f"pyrobayes {command}: terminated (SIGTERM){saved}", file=sys.stderr)
        return 128 + signal.SIGTERM.value
    print(f"pyrobayes {command}: interrupted{saved}", file=sys.stderr)
    return 130


def _report(command: str, err: BaseException, *, hint: bool = False) -> int:
    """Print ``pyrobayes <command>: error: <message>`` (with the traceback when
    ``PYROBAYES_TRACEBACK`` is set) and return exit status 2."""
    show = os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0")
    if show:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    message = str(err) or type(err).__name__
    print(f"pyrobayes {command}: error: {message}", file=sys.stderr)
    if hint and not show:
        print(f"(set {TRACEBACK_ENV}=1 to see where it was raised)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
