"""Join suite runs of the same task made by separate processes (e.g. one seed per CPU core).

Each input is a ``run.py --out`` JSON. A task's seeds are joined when every input ran it with the
same settings (fit, families' settings, ensemble size, predictive draws, task info); a seed
present in two inputs, or settings that differ, are refused. The output keeps every input's
command, commit and date, so the report names all of them.

Run::

    .venv/bin/python benchmarks/suite/merge.py --out benchmarks/results/suite/polarity.json \\
        polarity_s0.json polarity_s1.json polarity_s2.json
"""

from __future__ import annotations

import argparse
import json
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
        "tasks": tasks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    merged = merge([json.loads(p.read_text()) for p in args.inputs])
    merged["command"] += " + " + " ".join(
        ["benchmarks/suite/merge.py", "--out", str(args.out), *map(str, args.inputs)]
    )
    args.out.write_text(json.dumps(merged, indent=1, default=str))
    print(
        f"wrote {args.out}: "
        + ", ".join(f"{n} seeds {list(t['runs'])}" for n, t in merged["tasks"].items())
    )


if __name__ == "__main__":
    main()
