"""Join suite runs of the same task made by separate processes (e.g. one seed per CPU core).

Each input is a ``run.py --out`` JSON. A task's seeds are joined when every input ran it with the
same settings (fit, families' settings, ensemble size, predictive draws, task info); a seed
present in two inputs, or settings that differ, are refused. The output keeps every input's
command, commit and date, so the report names all of them.

``--base B --families F ...`` instead replaces (or adds) the rows of families ``F`` (and their
``+ts`` rows) in the result ``B`` by those of the inputs, e.g. after a changed default: the
inputs must hold every seed of ``B`` and their MAP must be ``B``'s MAP (the same fit, so the
post-hoc references and paired differences stay valid): every recorded number equal within a
relative 1e-4 or an absolute 1e-5 (another thread count or BLAS path sums in another order; on
the suite's MiniLM tasks such re-runs agree to 7e-5 relative, 1.3e-6 absolute, where the paired
spreads are ~1e-2), every other field exactly; ``B``'s MAP row is kept. The task's fit
settings (e.g. the early-stopping patience) may differ only when every replaced row is post hoc
at the MAP with no epochs of its own (a Laplace at the MAP) and the MAP's selected point is
``B``'s (its best epoch and every score equal: the training curves, which another stopping rule
lengthens past the same best epoch, are not compared); the result then names the inputs' fit
settings per such row (``fit_of_updates``). The families' settings are taken from the inputs,
everything else is refused when it differs. ``run.py --update-only`` results (MAP and the
families, no laplace-torch and no ensemble) are made for this and can only be merged with
``--base``. The result's ``command`` stays the base's (what made MAP and the
anchors); ``updates`` maps each replaced family to the command (runs and merge) its rows now come
from, the latest replacing an earlier one, so the report names what made every row and nothing
that no longer does. ``--drop D ...`` (with ``--base``) removes the rows of ``D`` (a variant the
suite no longer runs) from the tasks the inputs update.

Run::

    .venv/bin/python benchmarks/suite/merge.py --out benchmarks/results/suite/polarity.json \\
        polarity_s0.json polarity_s1.json polarity_s2.json
    .venv/bin/python benchmarks/suite/merge.py --out benchmarks/results/suite/polarity.json \\
        --base benchmarks/results/suite/polarity.json --families ivon kron-ivon \\
        ivon_s0.json ivon_s1.json ivon_s2.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

SAME = ("kind", "info", "fit", "num_samples", "members", "settings")


def _comparable(task: dict[str, Any], key: str) -> str:
    """``task[key]`` as canonical JSON; a task's info names the data seed of the seed that
    wrote it last (the text tasks split per seed), which is not a setting."""
    value = task.get(key)
    if key == "info" and isinstance(value, dict) and isinstance(value.get("data"), dict):
        value = {**value, "data": {k: v for k, v in value["data"].items() if k != "seed"}}
    return json.dumps(value, sort_keys=True, default=str)


def merge(inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """One suite result holding every task and seed of ``inputs`` (see the module docstring)."""
    if not inputs:
        raise SystemExit("merge: no input files")
    if any(d.get("quick") for d in inputs):
        raise SystemExit("merge: a --quick result cannot be merged with full runs")
    tasks: dict[str, dict[str, Any]] = {}
    for data in inputs:
        for name, task in data["tasks"].items():
            if name not in tasks:
                tasks[name] = {**task, "runs": dict(task["runs"])}
                continue
            joined = tasks[name]
            for key in SAME:
                if _comparable(joined, key) != _comparable(task, key):
                    raise SystemExit(f"merge: task {name!r} ran with another {key!r} in one input")
            twice = set(joined["runs"]) & set(task["runs"])
            if twice:
                raise SystemExit(f"merge: task {name!r} seed(s) {sorted(twice)} in two inputs")
            joined["runs"].update(task["runs"])
    for task in tasks.values():
        task["runs"] = dict(sorted(task["runs"].items(), key=lambda kv: int(kv[0])))
    first = inputs[0]
    return {
        **{k: v for k, v in first.items() if k not in ("tasks", "git", "command", "date")},
        "date": max(d["date"] for d in inputs),
        "command": " + ".join(d["command"] for d in inputs),
        "git": [d.get("git") for d in inputs],
        "dates": [d["date"] for d in inputs],
        "loadavg_start": [d.get("loadavg_start") for d in inputs],
        "loadavg_end": [d.get("loadavg_end") for d in inputs],
        "seeds": sorted({s for d in inputs for s in d["seeds"]}),
        "update_only": any(d.get("update_only") for d in inputs),
        "tasks": tasks,
    }


def update(
    base: dict[str, Any], new: dict[str, Any], families: list[str], drop: list[str] | None = None
) -> dict[str, Any]:
    """``base`` with the rows of ``families`` taken from ``new`` (see the module docstring) and
    those of ``drop`` (rows the suite no longer runs, e.g. a variant that became the default)
    removed from the tasks ``new`` updates."""
    out = json.loads(json.dumps(base))
    for name, task in new["tasks"].items():
        if name not in out["tasks"]:
            raise SystemExit(f"merge: task {name!r} is not in the base result")
        joined = out["tasks"][name]
        selected_only = False  # compare the MAP's selected point, not how training got there
        for key in ("kind", "info", "fit", "num_samples"):
            if _comparable(joined, key) == _comparable(task, key):
                continue
            if key == "fit" and _post_hoc_only(task, families):
                # rows built at the MAP alone: another stopping rule that gave the same MAP
                # (checked below, seed by seed) gives the same rows
                out.setdefault("fit_of_updates", {}).update({f: task.get("fit") for f in families})
                selected_only = True
                continue
            raise SystemExit(f"merge: task {name!r} ran with another {key!r} than the base")
        missing = set(joined["runs"]) - set(task["runs"])
        if missing:
            raise SystemExit(f"merge: task {name!r} seed(s) {sorted(missing)} not in the inputs")
        for seed, run in joined["runs"].items():
            fresh = task["runs"][seed]
            view = _selected if selected_only else _untimed
            if not _same_fit(view(fresh["map"]), view(run["map"])):
                raise SystemExit(
                    f"merge: task {name!r} seed {seed}: the inputs' MAP is not the base's "
                    "(another fit: the paired differences would not be paired)"
                )
            for family in families:
                for key in (family, f"{family}+ts"):
                    if key not in fresh:
                        raise SystemExit(f"merge: task {name!r} seed {seed} has no {key!r} row")
                    # the fit-time ratio's reference: the MAP of the same process and load
                    run[key] = {**fresh[key], "map_fit_s": fresh["map"].get("fit_s")}
        for family in families:
            joined["settings"][family] = task["settings"][family]
        for family in drop or []:
            for run in joined["runs"].values():
                run.pop(family, None)
                run.pop(f"{family}+ts", None)
            joined["settings"].pop(family, None)
    updates = {k: v for k, v in base.get("updates", {}).items() if k not in (drop or [])}
    out["updates"] = {**updates, **dict.fromkeys(families, new["command"])}
    out["git"] = [*_as_list(base.get("git")), *_as_list(new.get("git"))]
    out["dates"] = [*_as_list(base.get("dates", base["date"])), *new["dates"]]
    out["date"] = max(base["date"], new["date"])
    return out


def _selected(record: dict[str, Any]) -> dict[str, Any]:
    """A MAP record's selected point: its epoch and every score of its predictive (what a row
    built at the MAP depends on), without the training curves, which another stopping rule
    lengthens past the same best epoch."""
    keep = ("best_epoch", "accuracy", "nll", "ece", "brier", "rmse", "storage")
    return {k: v for k, v in record.items() if k in keep or k.startswith("auroc_")}


def _post_hoc_only(task: dict[str, Any], families: list[str]) -> bool:
    """Every row of ``families`` is post hoc at the MAP with no epochs of its own (a Laplace
    at the MAP): its numbers depend on the task's fit settings only through the MAP."""
    settings = task.get("settings", {})
    return bool(families) and all(
        settings.get(f, {}).get("init") == "map" and settings.get(f, {}).get("epochs") == 0
        for f in families
    )


#: a MAP record's wall-clock fields (not compared)
_TIMES = ("fit_s", "predict_s")


#: how far a re-run of the same MAP fit may differ in a recorded number (summation order only)
_REL_TOL, _ABS_TOL = 1e-4, 1e-5


def _same_fit(a: Any, b: Any) -> bool:
    """``a`` and ``b`` agree field by field, numbers within ``_REL_TOL``/``_ABS_TOL``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_fit(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_fit(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)
    return bool(a == b)


def _untimed(record: dict[str, Any]) -> dict[str, Any]:
    """The record without its times, and without empty lists (a diagnostic with nothing in
    it, e.g. the calibration-NLL curve of a fit without validation, which results from before
    that curve was recorded do not have)."""
    return {k: v for k, v in record.items() if k not in _TIMES and v != []}


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base", type=Path, help="replace --families' rows in this result")
    parser.add_argument("--families", nargs="+", default=[])
    parser.add_argument(
        "--drop", nargs="+", default=[], help="with --base: remove these rows (and their +ts)"
    )
    args = parser.parse_args(argv)
    if bool(args.base) != bool(args.families):
        raise SystemExit("merge: --base and --families go together")
    if args.drop and not args.base:
        raise SystemExit("merge: --drop needs --base")
    merged = merge([json.loads(p.read_text()) for p in args.inputs])
    extra = ["--base", str(args.base), "--families", *args.families] if args.base else []
    extra += ["--drop", *args.drop] if args.drop else []
    extra += ["--"] if extra else []  # the inputs after a list option: the line runs as shown
    merged["command"] += " + " + " ".join(
        ["benchmarks/suite/merge.py", "--out", str(args.out), *extra, *map(str, args.inputs)]
    )
    if args.base:
        merged = update(json.loads(args.base.read_text()), merged, args.families, args.drop)
    elif merged.get("update_only"):
        raise SystemExit(
            "merge: run.py --update-only results have no anchors (laplace-torch, ensemble); "
            "they can only update a finished result: pass --base and --families"
        )
    args.out.write_text(json.dumps(merged, indent=1, default=str))
    print(
        f"wrote {args.out}: "
        + ", ".join(f"{n} seeds {list(t['runs'])}" for n, t in merged["tasks"].items())
    )


if __name__ == "__main__":
    main()
