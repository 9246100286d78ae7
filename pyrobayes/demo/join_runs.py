"""Join causal-LM run folders that ran the same job under different seeds into one.

A causal-LM job (:mod:`pyrobayes.demo.causal_lm`) fits every family under every seed in one
process. On a machine with several cores (or several machines) the seeds run faster as separate
processes, e.g. ``pyrobayes fit job.toml --seeds 1 --out runs/s1``; :func:`join_runs` then
writes the run folder the one-process job would have written: ``config.json`` with every seed,
``metrics.json`` (the zero-shot row once, then one record per family and seed), ``table.md``
(mean ± sample standard deviation over the seeds), and every input's posteriors and plots, so
that ``pyrobayes evaluate`` reloads and checks all of them.

The inputs must be the same job: their configs equal apart from ``seeds`` and the device, no
seed in two inputs, and their zero-shot rows (the base network on the same test split) equal
within :data:`~pyrobayes.demo.pipeline.DRIFT_TOLERANCE`.

An interrupted input (its config lists seeds that its ``metrics.json`` has no record of, for
some or all of the families) adds only the seeds it recorded for every family, and a logged
warning names the missing (family, seed): the joined
``config.json`` lists the seeds whose records and posteriors it holds, so a missing seed can be
fitted in its own folder and joined in.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .causal_lm import format_table, is_causal_lm_config
from .pipeline import DRIFT_TOLERANCE, RunFolderError, compare_metrics, read_json
from .run_folder import claimed_run_folder, remove_unfinished_run, write_json

logger = logging.getLogger(__name__)

__all__ = ["join_runs"]


def _job(config: dict[str, Any]) -> str:
    """``config`` without the fields a joined run may vary, as canonical JSON: the seeds (what
    is joined) and the training device (it does not change the job)."""
    job = {k: v for k, v in config.items() if k != "seeds"}
    job["training"] = {k: v for k, v in config.get("training", {}).items() if k != "device"}
    return json.dumps(job, sort_keys=True, default=str)


def _read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config_path, metrics_path = run_dir / "config.json", run_dir / "metrics.json"
    if not config_path.is_file() or not metrics_path.is_file():
        raise RunFolderError(
            f"{run_dir} has no config.json and metrics.json; pass the folders `pyrobayes fit` "
            "wrote for a causal-LM config."
        )
    config = read_json(config_path)
    if not is_causal_lm_config(config):
        raise RunFolderError(
            f"{run_dir} is not a causal-LM run (its config has no [causal_lm] section); only "
            "causal-LM runs have seeds to join."
        )
    return config, read_json(metrics_path)


def _recorded_seeds(
    run_dir: Path, config: dict[str, Any], records: list[dict[str, Any]]
) -> list[int]:
    """The seeds of ``config`` that ``records`` hold a family's record of, in its order. An
    interrupted run (the job writes ``metrics.json`` after every family) lacks the rest: they
    are left out of the join, with a logged warning naming the missing (family, seed). So is a
    seed whose recorded fit lost its posterior file (``guides/<family>-seed<seed>.safetensors``
    deleted or never copied): joined, the folder held a record that no posterior backs."""
    have = {(r["family"], r.get("seed")) for r in records}
    lost = sorted(
        (f, s)
        for f, s in have
        if s is not None and f != "zero-shot" and not (run_dir / _guide(f, s)).is_file()
    )
    if lost:
        logger.warning(
            "join: %s's metrics.json records %s, but the posterior file(s) %s are missing; "
            "seed(s) %s are left out of the join. Restore the file(s), or fit the seed in its "
            "own folder (pyrobayes fit CONFIG --seeds S) and join that folder instead.",
            run_dir,
            ", ".join(f"{f}@seed{s}" for f, s in lost),
            ", ".join(_guide(f, s) for f, s in lost),
            sorted({s for _, s in lost}),
        )
        have -= set(lost)
    listed = [int(s) for s in config["seeds"]]
    families = config["families"]
    missing = [f"{f}@seed{s}" for s in listed for f in families if (f, s) not in have]
    # a seed with some families recorded: joined, its config would list it while lacking the
    # rest, and fitting it again in its own folder (as advised) was refused as a duplicate
    present = [s for s in listed if all((f, s) in have for f in families)]
    partial = [s for s in listed if s not in present and any((f, s) in have for f in families)]
    if missing:
        logger.warning(
            "join: %s has no metrics.json record of %s (an interrupted run?); the joined run "
            "takes seeds %s from it%s. Fit a missing seed in its own folder (pyrobayes fit "
            "CONFIG --seeds S) and join that folder too.",
            run_dir,
            ", ".join(missing),
            present,
            f" (not the recorded families of seed(s) {partial}, which lack the others)"
            if partial
            else "",
        )
    return present


def _guide(family: str, seed: Any) -> str:
    """A fit's posterior file, relative to its run folder."""
    return f"guides/{family}-seed{seed}.safetensors"


def _copy_seed_free(
    inputs: Sequence[Path], configs: Sequence[dict[str, Any]], taken: Sequence[list[int]], out: Path
) -> None:
    """Copy the files that are not per (family, seed): the zero-shot diagram and the normalize
    comparison from the first input; the ArviZ export and the comparison plot (both of a job's
    first seed) from the input that gives the joined run its first seed, and only when that
    seed is its own first one. An interrupted first input whose first seed is left out of the
    join holds an export of a fit that the joined folder does not (it was copied anyway)."""
    for name in ("plots/reliability_zero-shot.png", "normalize.json"):
        if (inputs[0] / name).is_file():
            shutil.copy2(inputs[0] / name, out / name)
    source = next(i for i, present in enumerate(taken) if present)
    first_seed = int(configs[source]["seeds"][0])
    if taken[source][0] != first_seed:
        logger.warning(
            "join: %s's posterior.nc and plots/compare.png are of seed %d, which is not joined; "
            "the joined folder has neither (pyrobayes evaluate does not need them).",
            inputs[source],
            first_seed,
        )
        return
    for name in ("plots/compare.png", "posterior.nc"):
        if (inputs[source] / name).is_file():
            shutil.copy2(inputs[source] / name, out / name)


def join_runs(
    run_dirs: Sequence[str | Path], out_dir: str | Path, *, overwrite: bool = False
) -> list[dict[str, Any]]:
    """Write one causal-LM run folder holding every seed of ``run_dirs``.

    Parameters
    ----------
    run_dirs : sequence of path
        Run folders of the same causal-LM job (configs equal apart from ``seeds`` and the
        device), each with its own seeds.
    out_dir : path
        The joined run folder (not one of ``run_dirs``).
    overwrite : bool
        Replace a run already in ``out_dir``; without it such a folder is refused, except one
        that the same join left without its ``metrics.json`` (killed while copying), which is
        taken over. ``out_dir`` is locked while the join writes it
        (:func:`~pyrobayes.demo.run_folder.claimed_run_folder`). A join that fails (or is
        interrupted) before it writes ``metrics.json`` removes what it wrote
        (:func:`~pyrobayes.demo.run_folder.remove_unfinished_run`), so the folder takes
        another join without ``overwrite``.

    Returns
    -------
    list of dict
        The joined ``metrics.json`` records: the zero-shot row, then one per (family, seed) in
        the order of ``run_dirs``.

    Raises
    ------
    RunFolderError
        Fewer than two inputs, an input that is not a causal-LM run folder, inputs of different
        jobs, a seed in two inputs, zero-shot rows that differ, ``out_dir`` among the inputs,
        or another run writing in ``out_dir``.
    """
    inputs = [Path(d) for d in run_dirs]
    out = Path(out_dir)
    if len(inputs) < 2:
        raise RunFolderError(f"join_runs needs at least two run folders, got {len(inputs)}.")
    if any(out.resolve() == d.resolve() for d in inputs):
        raise RunFolderError(f"{out} is one of the run folders to join; write the join elsewhere.")
    runs = [_read_run(d) for d in inputs]
    first_config, first_records = runs[0]
    seeds: list[int] = []
    taken: list[list[int]] = []  # per input, the seeds it adds
    for run_dir, (config, records) in zip(inputs, runs, strict=True):
        if _job(config) != _job(first_config):
            raise RunFolderError(
                f"{run_dir} ran another job than {inputs[0]} (their config.json differ beyond "
                "'seeds' and the device); only seeds of the same job can be joined."
            )
        present = _recorded_seeds(run_dir, config, records)
        shared = sorted(set(seeds) & set(present))
        if shared:
            raise RunFolderError(
                f"seed(s) {shared} of {run_dir} are already in an earlier run folder; each seed "
                "must come from one run."
            )
        seeds += present
        taken.append(present)
        zero = [r for r in records if r["family"] == "zero-shot"]
        # the base network on the same test split, in another process: equal up to rounding
        drifts = compare_metrics(
            [r for r in first_records if r["family"] == "zero-shot"],
            zero,
            tolerance=DRIFT_TOLERANCE,
        )
        if drifts:
            raise RunFolderError(
                f"the zero-shot rows of {inputs[0]} and {run_dir} differ ({'; '.join(drifts)}): "
                "the base network or the test split is not the same."
            )
    if not seeds:
        raise RunFolderError(
            f"none of {[str(d) for d in inputs]} holds a fitted family's record in metrics.json; "
            "there is nothing to join."
        )
    config = {**first_config, "seeds": seeds}
    # the config first: a join killed while copying leaves it, and the same join takes over
    with claimed_run_folder(
        out, overwrite, folder="out", replace="overwrite", config=config
    ) as made:
        write_json(out / "config.json", config)
        try:
            joined = _copy_fits(inputs, runs, taken, out)
            _copy_seed_free(inputs, [c for c, _ in runs], taken, out)
            write_json(out / "metrics.json", joined)
        except BaseException as err:  # a missing or unreadable file, a full disk, Ctrl-C
            # no metrics.json: leave no half-joined run that refuses a join of other seeds
            if not (out / "metrics.json").exists():
                remove_unfinished_run(out, made, "join", err)
            raise
        (out / "table.md").write_text(format_table(joined))
    logger.info("joined %d run folders (seeds %s) into %s", len(inputs), seeds, out)
    return joined


def _copy_fits(
    inputs: Sequence[Path],
    runs: Sequence[tuple[dict[str, Any], list[dict[str, Any]]]],
    taken: Sequence[list[int]],
    out: Path,
) -> list[dict[str, Any]]:
    """Copy the posterior and the reliability diagram of every joined (family, seed) into
    ``out``; the joined records (the first input's zero-shot row, then the joined fits')."""
    joined = [r for r in runs[0][1] if r["family"] == "zero-shot"]
    for run_dir, (_, records), present in zip(inputs, runs, taken, strict=True):
        fitted = [r for r in records if r["family"] != "zero-shot" and r.get("seed") in present]
        joined += fitted
        for r in fitted:  # the files of the recorded fits only (not an interrupted fit's)
            plot = f"plots/reliability_{r['family']}-seed{r['seed']}.png"
            for file in (_guide(r["family"], r["seed"]), plot):
                if (run_dir / file).is_file():
                    shutil.copy2(run_dir / file, out / file)
    return joined
