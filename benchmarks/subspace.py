"""SWAG and Laplace over LoRA-XS cores against LoRA-SWAG and LoRA-Laplace on text (issue 5).

Task (the demo's, ``pyrobayes.demo.pipeline.DEFAULT_CONFIG``): ``all-MiniLM-L6-v2`` with a new 2-class
head (a point estimate), VADER movieReviewSnippets binary (``--num-train`` training sentences,
``--num-test`` test sentences, max_length 48), OOD = ``--num-ood`` VADER tweets. Adapters on
``query``/``value`` of the top half of the layers (``--targets``; 6 adapted maps), α = 16
(PEFT's ``lora_alpha``; Bałazy et al., 2024, LoRA-XS), so the scaling α/r is 4, 2, 1 at r = 4, 8, 16.

Cells (one MAP training run per cell, shared by the three methods):

* ``loraxs-<projection>-r<r>``: LoRA-XS cores (``r×r``, projection svd/wsvd/dct/random):

  - ``map``: ``LaplaceGuide`` trained by ``pb.fit`` (MAP objective, Adam, ``--map-steps``
    steps), evaluated at its point;
  - ``laplace_kron``: the same run's post-hoc Laplace-KRON over the cores (head fixed at its
    MAP, τ by marginal likelihood), GLM predictive with an MC link over the logits
    (``--glm-samples``);
  - ``swag``: ``SWAGGuide`` (K = 5, s = 0.5) started at that MAP (cores and head) and run for
    ``--swag-steps`` more Adam steps at the same learning rate, collecting every
    ``--collect-every`` steps; S = 15 samples.

* ``lora-r<r>``: the same three methods over a rank-r LoRA (``lora_A`` and ``lora_B`` latent):
  LoRA-SWAG and laplace-torch Laplace over the full LoRA adapter (``--lora-structure``, KRON by
  default: ``LoRALinear`` calls its ``lora_A``/``lora_B`` modules, so K-FAC sees them).

Every cell sees the same training batches in the same order (a fresh loader per cell, seeded by
``--seed``); tokenisation happens once and is cached on disk (``--token-cache``). W-SVD takes
its input statistics from the training set (unshuffled, padding masked).

Metrics (``pyrobayes.metrics.report``, ECE with 15 bins): accuracy, NLL, ECE, OOD AUROC of the
predictive entropy, posterior storage (``pb.count_parameters(guide)["posterior_storage"]``; 0 for
MAP, which stores only its point) and fit time: MAP = training; Laplace = training + curvature
+ τ search; SWAG = MAP training + SWAG steps. Prediction times are recorded separately.

The grid is resumable: results go into ``--out`` cell by cell (atomically); a cell already
there with the same settings is skipped, so an interrupted run continues where it stopped
(``--fresh`` starts over). The plot is regenerated from whatever cells exist.

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/subspace.py --ranks 8 4 16   # the grid
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/subspace.py --cells loraxs-svd-r8 lora-r8
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/subspace.py --table            # print only
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime as _dt  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pyro  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.demo import data as pbdata  # noqa: E402
from pyrobayes.guides import LaplaceGuide, SWAGGuide  # noqa: E402
from pyrobayes.infer.laplace import glm_predict  # noqa: E402
from pyrobayes.models import LoRA, LoRAXS  # noqa: E402
from pyrobayes.models.finetune import FineTuneModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("accuracy", "nll", "ece", "auroc_entropy")
PROJECTIONS = ("svd", "wsvd", "dct", "random")
CELL_RE = re.compile(r"^(?:loraxs-(svd|wsvd|dct|random)|lora)-r(\d+)$")
#: settings that change a cell's numbers: a stored cell is reused only if these match
RESULT_KEYS = (
    "num_train",
    "num_test",
    "num_ood",
    "max_length",
    "batch",
    "map_steps",
    "lr",
    "alpha",
    "targets",
    "swag_steps",
    "collect_every",
    "glm_samples",
    "lora_structure",
    "seed",
)


# ---------------------------------------------------------------------------------------- cells
def cell_name(kind: str, projection: str, rank: int) -> str:
    return f"lora-r{rank}" if kind == "lora" else f"loraxs-{projection}-r{rank}"


def parse_cell(name: str) -> tuple[str, str, int]:
    m = CELL_RE.match(name)
    if m is None:
        raise SystemExit(
            f"bad cell name {name!r}: use loraxs-<svd|wsvd|dct|random>-r<rank> or lora-r<rank>"
        )
    proj, rank = m.group(1), int(m.group(2))
    return ("lora", "-", rank) if proj is None else ("loraxs", proj, rank)


def selected_cells(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """``--cells`` as given, else rank by rank (``--ranks`` order): the projections, then LoRA."""
    if args.cells:
        return [parse_cell(c) for c in args.cells]
    cells: list[tuple[str, str, int]] = []
    for i, rank in enumerate(args.ranks):
        cells += [("loraxs", p, rank) for p in args.projections]
        if i == 0 and not args.no_lora:
            cells += [("lora", "-", r) for r in args.lora_ranks]
    return cells


# ---------------------------------------------------------------------------------------- data
def _encode(dataset: Any, tok: Any, max_length: int) -> dict[str, Any]:
    enc = tok(list(dataset.texts), truncation=True, max_length=max_length, padding=False)
    cols = {k: [list(x) for x in enc[k]] for k in ("input_ids", "attention_mask", "token_type_ids")}
    return {"columns": cols, "labels": dataset.labels}


def load_data(args: argparse.Namespace) -> dict[str, Any]:
    """Network (with its fresh head) and tokenised sets; tokenisation is cached on disk."""
    torch.manual_seed(args.seed)  # the fresh head's init is then a function of --seed
    net, tok = pbdata.load_minilm_classifier(2)
    key = json.dumps([args.num_train, args.num_test, args.num_ood, args.max_length, args.seed])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = args.token_cache / f"subspace-tokens-{digest}.pt"
    if cache.exists():
        sets = torch.load(cache, weights_only=False)
        logging.info("tokenised sets from %s", cache)
    else:
        ds = pbdata.load_vader("movieReviewSnippets")
        train_ds, test_ds = ds.split([args.num_train, args.num_test], seed=args.seed)[:2]
        ood_ds = pbdata.load_vader("tweets").subset(args.num_ood, seed=args.seed)
        ood_ds.labels = None
        sets = {
            name: _encode(d, tok, args.max_length)
            for name, d in (("train", train_ds), ("test", test_ds), ("ood", ood_ds))
        }
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(sets, cache)
    collate = pbdata._PadCollate(int(tok.pad_token_id), tok.padding_side)

    def dataset(name: str) -> Any:
        return pbdata._Encoded(sets[name]["columns"], sets[name]["labels"])

    def by_length(name: str) -> list[int]:
        # evaluation sets in length order: batches of similar lengths carry little padding
        ids = sets[name]["columns"]["input_ids"]
        return sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))

    def batches(name: str, size: int, order: list[int] | None = None) -> list[dict[str, Any]]:
        ds: Any = dataset(name)
        if order is not None:
            ds = torch.utils.data.Subset(ds, order)
        return list(DataLoader(ds, batch_size=size, collate_fn=collate))

    def train_loader() -> DataLoader:
        # a fresh loader per cell: every cell sees the same batches in the same order
        return DataLoader(
            dataset("train"),
            batch_size=args.batch,
            shuffle=True,
            generator=torch.Generator().manual_seed(args.seed),
            collate_fn=collate,
        )

    test_order, ood_order = by_length("test"), by_length("ood")
    return {
        "net": net,
        "num_train": len(sets["train"]["labels"]),
        "train_loader": train_loader,
        "calibration": batches("train", args.batch),  # unshuffled, for W-SVD's Σ_xx
        "test": batches("test", 64, test_order),
        "ood": batches("ood", 64, ood_order),
        # the GLM predictive's reverse-mode Jacobian costs O(batch) per example: small batches
        "test_glm": batches("test", args.glm_batch, test_order),
        "ood_glm": batches("ood", args.glm_batch, ood_order),
        "y_test": sets["test"]["labels"][torch.tensor(test_order)],
    }


# ---------------------------------------------------------------------------------------- one cell
def _model(kind: str, projection: str, rank: int, data: dict[str, Any], args: Any) -> Any:
    net = copy.deepcopy(data["net"])  # the same pretrained weights and head init in every cell
    targets = args.targets
    if kind == "lora":
        adapter: Any = LoRA(rank=rank, alpha=args.alpha, target_modules=targets)
    else:
        adapter = LoRAXS(rank=rank, alpha=args.alpha, projection=projection, target_modules=targets)
    return FineTuneModel(
        net,
        adapter,
        num_data=data["num_train"],
        calibration_data=data["calibration"] if projection == "wsvd" else None,
    )


def _metrics(pred: Any, ood: Any, y: torch.Tensor) -> dict[str, float]:
    r = pb.metrics.report(pred, y, ood_probs=ood)
    return {k: float(r[k]) for k in KEYS}


def run_cell(kind: str, projection: str, rank: int, data: dict[str, Any], args: Any) -> dict:
    out: dict[str, Any] = {}
    y = data["y_test"]
    tag = cell_name(kind, projection, rank)
    # ---- MAP, then Laplace at its end (LaplaceGuide.fit_end: curvature + τ)
    pyro.clear_param_store()
    torch.manual_seed(args.seed)
    model = _model(kind, projection, rank, data, args)
    structure = args.lora_structure if kind == "lora" else "kron"
    lap = LaplaceGuide(model, structure=structure)
    last_step = [0.0]
    t0 = time.perf_counter()
    pb.fit(
        model,
        lap,
        data["train_loader"](),
        optim=pb.Optimization(num_steps=args.map_steps),
        lr=args.lr,
        seed=args.seed,
        progress=pb.Progress(
            callback=lambda step, loss: last_step.__setitem__(0, time.perf_counter())
        ),
    )
    t_end = time.perf_counter()
    t_map, t_curv = last_step[0] - t0, t_end - last_step[0]
    point = {s: v[None] for s, v in lap.mean().items()}
    t0 = time.perf_counter()
    m_test = pb.predict(model, lap, data["test"], values=point)
    m_ood = pb.predict(model, lap, data["ood"], values=point)
    counts = pb.count_parameters(lap)
    out["map"] = {
        **_metrics(m_test, m_ood, y),
        "posterior_params": 0,
        "trainable": counts["latent"],
        "fit_s": t_map,
        "predict_s": time.perf_counter() - t0,
    }
    logging.info("%s map %s", tag, out["map"])
    t0 = time.perf_counter()
    glm = dict(link="mc", num_samples=args.glm_samples, seed=args.seed)
    l_test = glm_predict(model, lap, data["test_glm"], **glm)
    l_ood = glm_predict(model, lap, data["ood_glm"], **glm)
    out[f"laplace_{structure}"] = {
        **_metrics(l_test, l_ood, y),
        "posterior_params": counts["posterior_storage"],
        "tau": lap.prior_precision,
        "fit_s": t_map + t_curv,
        "curvature_s": t_curv,
        "predict_s": time.perf_counter() - t0,
    }
    logging.info("%s laplace %s", tag, out[f"laplace_{structure}"])
    # ---- SWAG: continue from the MAP (cores copied into the network, head as trained)
    with torch.no_grad():
        for s, v in lap.mean().items():
            model.net.get_parameter(model.latent_sites[s].param_name).copy_(v)
    swag = SWAGGuide(model, rank=5, scale=0.5)
    collect = pb.infer.SWAG(start_epoch=0, collect_every_steps=args.collect_every)
    t0 = time.perf_counter()
    pb.fit(
        model,
        swag,
        data["train_loader"](),
        optim=pb.Optimization(optimizer=collect, num_steps=args.swag_steps),
        lr=args.lr,
        seed=args.seed + 1,
    )
    t_swag = time.perf_counter() - t0
    kw = dict(num_samples=15, seed=args.seed)
    t0 = time.perf_counter()
    s_test = pb.predict(model, swag, data["test"], **kw)
    s_ood = pb.predict(model, swag, data["ood"], **kw)
    out["swag"] = {
        **_metrics(s_test, s_ood, y),
        "posterior_params": pb.count_parameters(swag)["posterior_storage"],
        "collected": int(swag.swag_num_collected),
        "fit_s": t_map + t_swag,
        "swag_s": t_swag,
        "predict_s": time.perf_counter() - t0,
    }
    logging.info("%s swag %s", tag, out["swag"])
    return out


# ---------------------------------------------------------------------------------------- report
def _label(name: str, method: str) -> str:
    tags = {
        "map": "MAP",
        "swag": "SWAG",
        "laplace_kron": "Laplace-KRON",
        "laplace_diag": "Laplace-DIAG",
    }
    kind, proj, rank = parse_cell(name)
    if kind == "lora":
        return f"LoRA r={rank} {tags[method]}"
    return f"LoRA-XS {proj} r={rank} {tags[method]}"


def table(results: dict[str, Any]) -> str:
    rows = [
        "| adapter / method | acc | NLL | ECE | OOD AUROC (entropy) | posterior params | fit s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, cell in results["cells"].items():
        for method, m in cell.items():
            extra = f" (τ = {m['tau']:.3g})" if "tau" in m else ""
            rows.append(
                f"| {_label(name, method)}{extra} | {m['accuracy']:.3f} | {m['nll']:.3f} | "
                f"{m['ece']:.3f} | {m['auroc_entropy']:.3f} | {m['posterior_params']:,} | "
                f"{m['fit_s']:.0f} |"
            )
    return "\n".join(rows)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.0, 4.8))
    marker = {"swag": "o", "laplace_kron": "s", "laplace_diag": "D"}
    color = {"svd": "C0", "wsvd": "C1", "dct": "C2", "random": "C3", "-": "k"}
    size = {4: 25, 8: 45, 16: 75}
    tag = {"swag": "SWAG", "laplace_kron": "Laplace-KRON", "laplace_diag": "Laplace-DIAG"}
    seen: set[str] = set()
    maps = []
    for name, cell in results["cells"].items():
        kind, proj, rank = parse_cell(name)
        for method, m in cell.items():
            if method == "map":
                maps.append(m["ece"])
                continue
            group = "LoRA" if kind == "lora" else f"LoRA-XS {proj}"
            label = f"{tag[method]}, {group}"
            ax.scatter(
                m["posterior_params"],
                m["ece"],
                marker=marker[method],
                s=size.get(rank, 45),
                edgecolors=color[proj],
                facecolors="none" if method == "swag" else color[proj],
                label=None if label in seen else label,
            )
            seen.add(label)
            ax.annotate(f"r{rank}", (m["posterior_params"], m["ece"]), fontsize=6, alpha=0.7)
    if maps:
        ax.axhspan(min(maps), max(maps), color="0.5", alpha=0.15, label="MAP ECE range")
    ax.set_xscale("log")
    ax.set_xlabel("posterior parameters (numbers stored)")
    ax.set_ylabel("ECE (15 bins)")
    ax.set_title("MiniLM / VADER movie reviews: ECE vs posterior size (marker size = rank)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)  # an interrupted run never leaves a half-written file


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="+", help="e.g. loraxs-svd-r8 lora-r8 (overrides the grid)")
    p.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=PROJECTIONS)
    p.add_argument("--ranks", nargs="+", type=int, default=[8, 4, 16])
    p.add_argument("--lora-ranks", nargs="+", type=int, default=[8])
    p.add_argument("--no-lora", action="store_true")
    p.add_argument("--lora-structure", choices=("kron", "diag"), default="kron")
    p.add_argument("--num-train", type=int, default=256)
    p.add_argument("--num-test", type=int, default=256)
    p.add_argument("--num-ood", type=int, default=256)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--map-steps", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument(
        "--targets",
        default=r"bert\.encoder\.layer\.[345]\.attention\.self\.(query|value)",
        help="regex over module paths (the demo's top-half query/value)",
    )
    p.add_argument("--swag-steps", type=int, default=16)
    p.add_argument("--collect-every", type=int, default=2, help="SWAG: collect every N steps")
    p.add_argument("--glm-samples", type=int, default=1000)
    p.add_argument("--glm-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fresh", action="store_true", help="discard stored cells")
    p.add_argument("--table", action="store_true", help="print the stored table and plot; no runs")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/subspace.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs/img/ece_vs_posterior_params.png")
    p.add_argument("--token-cache", type=Path, default=pbdata.cache_dir() / "benchmarks")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    settings = {k: getattr(args, k) for k in RESULT_KEYS}
    results: dict[str, Any] = {"cells": {}}
    if args.out.exists() and not args.fresh:
        stored = json.loads(args.out.read_text())
        if stored.get("settings") == settings or args.table:
            results = stored
        else:
            logging.warning("%s holds cells for other settings; starting over", args.out)
    if args.table:
        plot(results, args.plot)
        print(table(results))
        return
    results.update(
        date=_dt.datetime.now().isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} thread(s)",
        torch=torch.__version__,
        settings=settings,
    )
    results.setdefault("cells", {})
    results.setdefault("cell_wall_s", {})
    todo = [c for c in selected_cells(args) if cell_name(*c) not in results["cells"]]
    logging.info("cells to run: %s", [cell_name(*c) for c in todo])
    if not todo:
        print(table(results))
        return
    data = load_data(args)
    for kind, proj, rank in todo:
        name = cell_name(kind, proj, rank)
        t0 = time.perf_counter()
        try:
            results["cells"][name] = run_cell(kind, proj, rank, data, args)
        except Exception:  # one failing cell must not lose the rest of a long grid
            logging.exception("cell %s failed; continuing with the next one", name)
            continue
        results["cell_wall_s"][name] = time.perf_counter() - t0
        _write(results, args.out)
        plot(results, args.plot)
        logging.info("cell %s done in %.0f s", name, results["cell_wall_s"][name])
    print(table(results))


if __name__ == "__main__":
    main()
