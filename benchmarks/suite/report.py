"""Tables, paired differences and plots of the suite's JSON; ``--choosing`` writes docs/choosing.md.

Paired differences: for a method m and an anchor a, ``d_s = metric_s(m) - metric_s(a)`` on each
seed s both ran (same data split, same pretrained network, same MAP for post-hoc methods); the
tables give ``mean ± sd`` of ``d_s`` over the seeds (sd: the sample standard deviation, the
"paired spread"; one seed: no spread). A method *beats* an anchor on NLL when ``mean(d) < 0`` and
``|mean(d)| > sd(d)``; it is *level* on AUROC when ``mean(d) + sd(d) >= 0``.

Run::

    .venv/bin/python benchmarks/suite/report.py --choosing     # every JSON in results/suite/
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "suite"
DOCS = ROOT / "docs"
ANCHORS = ("map", "map+ts", "ensemble", "laplace-torch")
TASK_ORDER = ("digits", "mnist", "diabetes", "autompg", "polarity", "fine", "amazon")
TASK_TITLES = {
    "digits": "digits: LoRA-XS on a pretrained MLP, new 7-class head (OOD: digits 7-9)",
    "mnist": "mnist: digits' set-up on 5,000 real MNIST digits, 784 pixels (OOD: 7-9)",
    "diabetes": "diabetes: LoRA-XS on a pretrained MLP, Gaussian likelihood, learned noise",
    "autompg": "autompg: diabetes' recipe on UCI Auto MPG, 392 cars (held out of every default)",
    "polarity": "polarity: MiniLM + LoRA, VADER movie sentences, 2 classes (OOD: tweets, chatterbot)",
    "fine": "fine-grained: MiniLM + LoRA, VADER movie sentences, 5 classes (OOD: NYT editorials)",
    "amazon": "amazon: MiniLM + LoRA, VADER Amazon review sentences, 2 classes (OOD: NYT "
    "editorials; held out of the demo's settings but its early-stopping patience, which its "
    "calibration split showed)",
}


# ------------------------------------------------------------------------------------ numbers
def methods(task: dict[str, Any]) -> list[str]:
    """Every method of a task in a stable order: anchors, then families (each then its +ts)."""
    seen: list[str] = []
    for run in task["runs"].values():
        for name in run:
            if name not in seen:
                seen.append(name)
    anchors = [
        a
        for a in (
            "map",
            "map+ts",
            "ensemble",
            "ensemble+ts",
            "laplace-torch",
            "laplace-torch+ts",
            "laplace-torch-gs",
        )
        if a in seen
    ]
    rest = [m for m in seen if m not in anchors]
    return anchors + rest


def ok(record: Any) -> bool:
    return isinstance(record, dict) and "error" not in record and "skipped" not in record


def values(task: dict[str, Any], method: str, metric: str) -> dict[str, float]:
    out = {}
    for seed, run in task["runs"].items():
        rec = run.get(method)
        if ok(rec) and isinstance(rec.get(metric), (int, float)):
            out[seed] = float(rec[metric])
    return out


def summary(vals: list[float]) -> tuple[float, float | None, int]:
    if not vals:
        return float("nan"), None, 0
    sd = statistics.stdev(vals) if len(vals) > 1 else None
    return statistics.fmean(vals), sd, len(vals)


def paired(
    task: dict[str, Any], method: str, anchor: str, metric: str
) -> tuple[float, float | None, int]:
    a, b = values(task, method, metric), values(task, anchor, metric)
    return summary([a[s] - b[s] for s in a if s in b])


def beats(diff: tuple[float, float | None, int], lower_better: bool = True) -> bool | None:
    mean, sd, n = diff
    if n < 2 or sd is None or mean != mean:
        return None
    signed = mean if lower_better else -mean
    return signed < 0 and abs(mean) > sd


def level(diff: tuple[float, float | None, int]) -> bool | None:
    """Higher-is-better metric: within the paired spread of the anchor or above it."""
    mean, sd, n = diff
    if n < 2 or sd is None or mean != mean:
        return None
    return mean + sd >= 0


def fmt(
    stat: tuple[float, float | None, int], scale: float = 1.0, digits: int = 3, sign: bool = False
) -> str:
    mean, sd, n = stat
    if n == 0 or mean != mean:
        return "–"
    s = f"{scale * mean:+.{digits}f}" if sign else f"{scale * mean:.{digits}f}"
    return s + (f" ± {scale * sd:.{digits}f}" if sd is not None else "")


def ood_sets(task: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for run in task["runs"].values():
        for rec in run.values():
            if ok(rec):
                for k in rec:
                    if (
                        k.startswith("auroc_")
                        and not k.startswith(("auroc_maxprob_", "auroc_mi_"))
                        and k[6:] not in out
                    ):
                        out.append(k[6:])
    return out


# ------------------------------------------------------------------------------------ tables
def absolute_table(task: dict[str, Any]) -> str:
    reg = task["kind"] == "regression"
    oods = ood_sets(task)
    cols = ["RMSE", "NLL"] if reg else ["acc", "NLL", "ECE", "Brier"]
    cols += [f"AUROC {o}" for o in oods] + ["T", "fit s", "predict s", "q storage"]
    rows = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    keys = (["rmse", "nll"] if reg else ["accuracy", "nll", "ece", "brier"]) + [
        f"auroc_{o}" for o in oods
    ]
    for m in methods(task):
        recs = [r.get(m) for r in task["runs"].values()]
        bad = [r for r in recs if not ok(r)]
        if bad and len(bad) == len(recs):
            why = bad[0].get("skipped") or bad[0].get("error", "")
            rows.append(f"| {m} | " + " | ".join(["–"] * len(cols)) + f" |  <!-- {why[:80]} -->")
            rows[-1] = f"| {m} | {'not run: ' + why[:90]} |" + " |" * (len(cols) - 1)
            continue
        cells = []
        for k in keys:
            scale = 100.0 if k == "accuracy" else 1.0
            cells.append(
                fmt(summary(list(values(task, m, k).values())), scale, 1 if scale == 100 else 3)
            )
        cells.append(fmt(summary(list(values(task, m, "temperature").values())), 1, 2))
        cells.append(fmt(summary(list(values(task, m, "fit_s").values())), 1, 1))
        cells.append(fmt(summary(list(values(task, m, "predict_s").values())), 1, 2))
        st = values(task, m, "storage")
        cells.append(str(int(statistics.fmean(st.values()))) if st else "–")
        note = f" ({len(bad)} failed)" if bad else ""
        rows.append(f"| {m}{note} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def paired_table(task: dict[str, Any]) -> str:
    reg = task["kind"] == "regression"
    oods = ood_sets(task)
    cols = ["ΔNLL vs " + a for a in ANCHORS]
    cols += [f"ΔAUROC {o} vs map" for o in oods] + [f"ΔAUROC {o} vs laplace-torch" for o in oods]
    cols += ["ΔRMSE vs map" if reg else "Δacc (pp) vs map"]
    rows = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in methods(task):
        if m in ("map",) or not values(task, m, "nll"):
            continue
        cells = []
        for a in ANCHORS:
            d = paired(task, m, a, "nll")
            mark = " ✓" if beats(d) else ""
            cells.append("·" if m == a else fmt(d, sign=True) + mark)
        for a in ("map", "laplace-torch"):
            for o in oods:
                d = paired(task, m, a, f"auroc_{o}")
                cells.append(
                    "·" if m == a else fmt(d, sign=True) + (" ✗" if level(d) is False else "")
                )
        if reg:
            cells.append(fmt(paired(task, m, "map", "rmse"), sign=True))
        else:
            cells.append(fmt(paired(task, m, "map", "accuracy"), 100, 1, sign=True))
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _fit_rule(fit: dict[str, Any]) -> str:
    """The run's fit settings in words (a family's own settings, listed below its tables,
    replace them): epoch cap, learning rate and the early-stopping patience on the calibration
    split, or fixed epochs."""
    if not fit:
        return ""
    words = f"; fits: {fit.get('epochs')} epochs at most, lr {fit.get('lr')}"
    patience = fit.get("patience")
    if patience:
        return words + (
            f", early stopping after {patience} epoch{'s' * (patience != 1)} without a better "
            "calibration NLL, keeping the best"
        )
    return words + ", no early stopping"


def timing_comparable(task: dict[str, Any]) -> bool:
    """Whether a task's fit times compare across its methods: ``False`` where the result file
    marks them otherwise (``"timing": {"comparable": false, "why": ...}``, e.g. other jobs
    shared the cores for part of the run, so the ratios to the MAP's time would mislead)."""
    return bool((task.get("timing") or {}).get("comparable", True))


def _timing_note(task: dict[str, Any]) -> str:
    if timing_comparable(task):
        return ""
    return f"; fit times not comparable across methods ({task['timing'].get('why', '')})"


def task_markdown(name: str, task: dict[str, Any]) -> str:
    seeds = ", ".join(task["runs"])
    head = f"### {TASK_TITLES.get(name, name)}\n\nSeeds {seeds} ({len(task['runs'])}); "
    info = task.get("info", {})
    head += ", ".join(f"{k} {v}" for k, v in info.items() if isinstance(v, (int, float)))
    head += _fit_rule(task.get("fit") or {}) + _timing_note(task)
    return (
        head
        + ".\n\nValidation-split metrics, mean ± sd over seeds (every temperature, grid search "
        "and early stop was fitted on the calibration split; nothing on this one):\n\n"
        + absolute_table(task)
        + "\n\nPaired differences (method − anchor, per seed; mean ± sd). ✓: beats the anchor "
        "on NLL by more than the paired spread; ✗: AUROC below the anchor by more than it.\n\n"
        + paired_table(task)
        + "\n"
    )


def write_report(results: dict[str, Any], path: Path) -> None:
    parts = [f"# Suite results ({results.get('date', '')})\n"]
    for name, task in results["tasks"].items():
        parts.append(task_markdown(name, task))
    path.write_text("\n".join(parts))


# ------------------------------------------------------------------------------------ plot
def plot(
    tasks: dict[str, dict[str, Any]], path: Path, metric: str = "nll", anchor: str = "map"
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [t for t in TASK_ORDER if t in tasks] + [t for t in tasks if t not in TASK_ORDER]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        task = tasks[name]
        ms = [m for m in methods(task) if m != anchor and values(task, m, metric)]
        stats = [paired(task, m, anchor, metric) for m in ms]
        ys = list(range(len(ms)))
        means = [s[0] for s in stats]
        errs = [s[1] or 0.0 for s in stats]
        colors = [
            "tab:gray"
            if m in ANCHORS or m.startswith(("ensemble", "laplace-torch"))
            else "tab:blue"
            for m in ms
        ]
        ax.barh(ys, means, xerr=errs, color=colors, alpha=0.8)
        ax.axvline(0, color="k", lw=0.8)
        mts = paired(task, "map+ts", anchor, metric)
        if mts[2] and anchor != "map+ts":
            ax.axvline(mts[0], color="tab:red", ls="--", lw=1, label="map+ts")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_yticks(ys)
        ax.set_yticklabels(ms, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{name}: Δ{metric} vs {anchor}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_curves(
    tasks: dict[str, dict[str, Any]],
    path: Path,
    family: str = "meanfield",
    curves: tuple[str, ...] = ("loss", "kl"),
) -> bool:
    """``family``'s recorded curves (``<name>_curve``: [first step, last step, window mean]
    triples), one panel per task and curve, one line per seed. The loss is divided by its first
    window's mean; a term (``kl`` = KL(q ‖ p)/N) is drawn as recorded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        (n, c)
        for n in tasks
        for c in curves
        if any(f"{c}_curve" in r.get(family, {}) for r in tasks[n]["runs"].values())
    ]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
    for ax, (name, curve_name) in zip(axes[0], panels, strict=True):
        for seed, run in tasks[name]["runs"].items():
            curve = run.get(family, {}).get(f"{curve_name}_curve")
            if not curve:
                continue
            steps = [(a + b) / 2 for a, b, _ in curve]
            ys = [v for _, _, v in curve]
            if curve_name == "loss":
                ys = [v / ys[0] for v in ys]
            ax.plot(steps, ys, marker=".", label=f"seed {seed}")
        ax.set_xlabel("step (window centre)")
        ax.set_ylabel(
            "loss / first window" if curve_name == "loss" else f"{curve_name} (per example)"
        )
        ax.set_title(f"{name}: {family} {curve_name}", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------ merge
def latest_tasks(folder: Path = RESULTS) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each task's latest non-quick result among the JSON files of ``folder``."""
    found: dict[str, tuple[str, dict[str, Any], str]] = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("quick") or "tasks" not in data:  # (diagnostics.json: not a suite run)
            continue
        for name, task in data.get("tasks", {}).items():
            task.setdefault("members", data.get("members"))
            task.setdefault(
                "source",
                {
                    "file": path.name,
                    "date": data.get("date"),
                    "command": data.get("command"),
                    "updates": data.get("updates", {}),
                    "fit_of_updates": data.get("fit_of_updates", {}),
                },
            )
            task["source"].setdefault("git", data.get("git"))
            # runs before 2026-12-07 did not record it: they ran laplace-torch 0.3
            task["source"].setdefault("laplace_torch", data.get("laplace_torch", "0.3"))
            # results written before the pooled form tempered every draw (pool=False)
            task["source"].setdefault("temperature", data.get("temperature", "per draw"))
            if name not in found or data["date"] >= found[name][0]:
                found[name] = (data["date"], task, f"{path.name} ({data['date']})")
    return {k: v[1] for k, v in found.items()}, {k: v[2] for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--choosing", action="store_true", help="write docs/choosing.md")
    parser.add_argument("--folder", type=Path, default=RESULTS)
    args = parser.parse_args()
    tasks, sources = latest_tasks(args.folder)
    if not tasks:
        raise SystemExit(f"report: no suite JSON in {args.folder}; run `make bench-suite` first.")
    plot(tasks, DOCS / "img" / "suite_nll_vs_map.png", "nll", "map")
    plot(tasks, DOCS / "img" / "suite_nll_vs_map_ts.png", "nll", "map+ts")
    plot_curves(tasks, DOCS / "img" / "suite_meanfield_loss.png", "meanfield")
    if args.choosing:
        import choosing

        diag_path = args.folder / "diagnostics.json"
        diagnostics = json.loads(diag_path.read_text()) if diag_path.exists() else None
        shift_path = args.folder.parent / "shift_tweets.json"  # benchmarks/shift.py
        shift = json.loads(shift_path.read_text()) if shift_path.exists() else None
        (DOCS / "choosing.md").write_text(choosing.page(tasks, sources, diagnostics, shift))
        print(f"wrote {DOCS / 'choosing.md'}")


if __name__ == "__main__":
    main()
