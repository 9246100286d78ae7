"""σN-ensembles over a τ grid against a deep ensemble of M MAP fits and a single MAP fit (digits).

Task (a CPU proxy of Lopez-Gonzalez et al., 2025): sklearn digits split by class (0-4 in
distribution, 5-9 the OOD set). A body MLP 64-128-LN-ReLU-128-LN-ReLU is "pretrained" on the
in-distribution training split; every method then fine-tunes, from that body, LoRA-XS r=4 cores
on both hidden layers and a NEW 5-class head (re-initialised) on ``--num-train`` images.

Methods, same body, same batches, same epochs:

* ``map``      - one MAP fit (``pb.posterior(model, "map")``; the head is a latent site).
* ``ensemble`` - M independent MAP fits (own head init each), probabilities averaged.
* ``signorm``  - ``SigmaNormEnsemble(body, LoRAXS, num_members=M)`` with the ``"signorm"`` guide
  at each τ of the grid: M members (own γ, β per LayerNorm, own head, own cores) in ONE
  sample-batched forward per step.

Metrics on the test split: accuracy, NLL, ECE (15 bins) of the averaged predictive, OOD AUROC of
the predictive entropy (ID test vs digits 5-9), member disagreement, stored parameters (the
frozen body plus what the method stores, relative to one fine-tuned model), and the fit step
time of σN against M plain MAP steps at the same batch (target <= 1.1x). Mean ± standard error
over the seeds; a frontier plot (accuracy against ECE) is written with ``--plot``.

``python benchmarks/signorm.py [--seeds 3] [--smoke] [--plot docs/img/signorm_frontier.png]``
(one thread; about a minute per seed).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import pyro
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.demo.data import load_digits_split

WIDTH = 128


def body(split, seed: int, epochs: int) -> nn.Sequential:
    """The pretrained body (with its pretraining head at index 6)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(64, WIDTH), nn.LayerNorm(WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, 5),
    )  # fmt: skip
    optim = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = split.x_train, split.y_train
    for _ in range(epochs):
        for i in range(0, len(x), 64):
            loss = nn.functional.cross_entropy(net(x[i : i + 64]), y[i : i + 64])
            optim.zero_grad()
            loss.backward()
            optim.step()
    return net


def fresh(net: nn.Sequential, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    net = copy.deepcopy(net)
    net[6] = nn.Linear(WIDTH, 5)  # a new head
    return net


ADAPTER = pb.models.LoRAXS(rank=4, target_modules=["0", "3"])


def map_model(net, num_data: int, seed: int):
    return pb.models.FineTuneModel(
        fresh(net, seed), ADAPTER, latent_modules=["6"], trainable_modules=[], num_data=num_data
    )


def signorm_model(net, num_data: int, seed: int, members: int):
    return pb.models.SigmaNormEnsemble(
        fresh(net, seed), ADAPTER, num_members=members, heads=["6"], trainable_modules=[],
        num_data=num_data,
    )  # fmt: skip


def scores(probs: torch.Tensor, labels: torch.Tensor, ood_probs: torch.Tensor) -> dict:
    mean = probs.mean(0)
    ood_mean = ood_probs.mean(0)
    return {
        "accuracy": pb.metrics.accuracy(probs, labels),
        "nll": pb.metrics.nll(probs, labels),
        "ece": pb.metrics.ece(probs, labels),
        "ood_auroc": pb.metrics.ood_auroc(
            pb.metrics.predictive_entropy(mean[None]), pb.metrics.predictive_entropy(ood_mean[None])
        ),
        "disagreement": pb.metrics.disagreement(probs) if probs.shape[0] > 1 else 0.0,
    }


def probs_of(model, guide, x, num_samples: int) -> torch.Tensor:
    return pb.predict(model, guide, [(x,)], num_samples=num_samples).probs


def step_ratio(signorm_fitter, plain_fitter, batch, members: int, repeats: int) -> float:
    """Median over rounds of (one σN step) / (M plain MAP steps), the two timed back to back in
    every round so that a load change on a shared machine hits both alike."""
    for _ in range(3):
        signorm_fitter.step(batch)
        plain_fitter.step(batch)
    ratios = []
    for _ in range(repeats):
        start = time.perf_counter()
        signorm_fitter.step(batch)
        middle = time.perf_counter()
        for _ in range(members):
            plain_fitter.step(batch)
        end = time.perf_counter()
        ratios.append((middle - start) / (end - middle))
    return statistics.median(ratios)


def run_seed(args, seed: int) -> dict:
    split = load_digits_split(seed=seed, dtype=torch.float32)
    net = body(split, seed, 1 if args.smoke else args.body_epochs)
    n = min(args.num_train, len(split.x_train))
    x, y = split.x_train[:n], split.y_train[:n]
    train = [(x[i : i + args.batch], y[i : i + args.batch]) for i in range(0, n, args.batch)]
    xt, yt, xo = split.x_test, split.y_test, split.x_ood
    epochs, members = args.epochs, args.members
    one_model = sum(p.numel() for p in net.parameters())  # the body with its (new) head
    out: dict = {}

    pyro.clear_param_store()
    model = map_model(net, n, seed)
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, train, epochs=epochs, lr=args.lr, seed=seed)
    out["map"] = scores(probs_of(model, guide, xt, 1), yt, probs_of(model, guide, xo, 1))
    out["map"]["stored"] = 1.0 + guide.num_posterior_parameters() / one_model
    plain = pb.infer.make_fitter(model, copy.deepcopy(guide), lr=args.lr)

    parts, parts_ood, stored = [], [], 0
    for m in range(members):
        pyro.clear_param_store()
        model = map_model(net, n, 1000 * seed + m)
        guide = pb.posterior(model, "map")
        pb.fit(model, guide, train, epochs=epochs, lr=args.lr, seed=1000 * seed + m)
        parts.append(probs_of(model, guide, xt, 1))
        parts_ood.append(probs_of(model, guide, xo, 1))
        stored += guide.num_posterior_parameters()
    out["ensemble"] = scores(torch.cat(parts), yt, torch.cat(parts_ood))
    out["ensemble"]["stored"] = 1.0 + stored / one_model  # the body once + M adapters/heads
    out["ensemble"]["stored_full_copies"] = float(members)

    for tau in args.taus:
        pyro.clear_param_store()
        model = signorm_model(net, n, seed, members)
        guide = pb.posterior(model, "signorm")
        optim = pb.Optimization(optimizer=pb.infer.SigmaNormDiversity(tau, args.strength))
        pb.fit(model, guide, train, epochs=epochs, lr=args.lr, seed=seed, optim=optim)
        probs = probs_of(model, guide, xt, members)
        row = scores(probs, yt, probs_of(model, guide, xo, members))
        member_nll = float(-torch.log(probs.gather(-1, yt.expand(members, -1)[..., None])).mean())
        row["jensen"] = float(row["nll"] <= member_nll + 1e-9)
        fixed = sum(b.numel() for name, b in model.net.named_buffers() if "fixed_scale" in name)
        row["stored"] = 1.0 + (guide.num_posterior_parameters() + fixed) / one_model
        owners = torch.sigmoid(guide.loc("1.gamma").detach()) > 0.5
        row["owners"] = float(owners.sum(0).double().mean())
        fitter = pb.infer.make_fitter(model, copy.deepcopy(guide), lr=args.lr)
        row["step_vs_M_plain"] = step_ratio(fitter, plain, train[0], members, args.repeats)
        out[f"signorm_tau{tau:g}"] = row
    return out


def run_text_seed(args, seed: int) -> dict:
    """The demo's text task (MiniLM, LayerNorm; VADER movie reviews, OOD tweets): MAP, a deep
    ensemble of M MAP fits and σN, all with the demo's LoRA on layers 3-5 and a new head."""
    from pyrobayes.demo import data as pbdata
    from pyrobayes.demo.pipeline import build_data, resolve_config
    from pyrobayes.models.adapters import adapter_from_dict

    cfg = resolve_config({"data": {"seed": seed}, "training": {"seed": seed}}, quick=True)
    cfg["data"]["num_train"] = args.text_train
    _, tokenizer = pbdata.load_minilm_classifier(2)
    loaders = build_data(cfg, tokenizer)
    train, test, ood = loaders["train"], loaders["test"], loaders["ood/tweets"]
    n = int(loaders["num_train"])

    def network(init_seed: int):
        torch.manual_seed(init_seed)  # the new head's init
        net, _ = pbdata.load_minilm_classifier(2)
        return net

    def probs(model, guide, loader, samples):
        return pb.predict(model, guide, loader, num_samples=samples)

    inner = adapter_from_dict(cfg["adapter"])
    lr, epochs, members = cfg["training"]["lr"], args.text_epochs, args.members
    out: dict = {}
    one_model = None
    plain = None
    parts, parts_ood, stored = [], [], 0
    for m in range(members):
        pyro.clear_param_store()
        model = pb.models.FineTuneModel(network(1000 * seed + m), inner, num_data=n)
        guide = pb.posterior(model, "map")
        pb.fit(model, guide, train, epochs=epochs, lr=lr, seed=seed, progress=False)
        pred, pred_ood = probs(model, guide, test, 1), probs(model, guide, ood, 1)
        parts.append(pred.probs)
        parts_ood.append(pred_ood.probs)
        stored += guide.num_posterior_parameters() + sum(
            p.numel() for p in model.point_params.values()
        )
        if m == 0:
            one_model = sum(p.numel() for p in model.net.parameters())
            out["map"] = scores(pred.probs, pred.targets, pred_ood.probs)
            out["map"]["stored"] = 1.0
            plain = pb.infer.make_fitter(model, copy.deepcopy(guide), lr=lr)
            batch = next(iter(train))
    assert one_model is not None and plain is not None
    labels = pred.targets
    out["ensemble"] = scores(torch.cat(parts), labels, torch.cat(parts_ood))
    out["ensemble"]["stored"] = 1.0 + (stored - stored / members) / one_model
    for tau in args.taus:
        pyro.clear_param_store()
        model = pb.models.SigmaNormEnsemble(network(seed), inner, num_members=members, num_data=n)
        guide = pb.posterior(model, "signorm")
        optim = pb.Optimization(optimizer=pb.infer.SigmaNormDiversity(tau, args.strength))
        pb.fit(model, guide, train, epochs=epochs, lr=lr, seed=seed, progress=False, optim=optim)
        pred, pred_ood = probs(model, guide, test, members), probs(model, guide, ood, members)
        row = scores(pred.probs, labels, pred_ood.probs)
        fixed = sum(b.numel() for name, b in model.net.named_buffers() if "fixed_scale" in name)
        frozen = sum(p.numel() for p in model.net.parameters()) - sum(
            int(torch.Size(spec.shape).numel()) for spec in model.latent_sites.values()
        )
        row["stored"] = (frozen + fixed + guide.num_posterior_parameters()) / one_model
        fitter = pb.infer.make_fitter(model, copy.deepcopy(guide), lr=lr)
        row["step_vs_M_plain"] = step_ratio(fitter, plain, batch, members, args.repeats)
        out[f"signorm_tau{tau:g}"] = row
    return out


def summarize(results: list[dict]) -> dict:
    table: dict = {}
    for method in results[0]:
        table[method] = {}
        for key in results[0][method]:
            values = [r[method][key] for r in results]
            mean = statistics.fmean(values)
            se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
            table[method][key] = (mean, se)
    return table


def plot(table: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    for method, row in table.items():
        (acc, acc_se), (ece, ece_se) = row["accuracy"], row["ece"]
        colour = "tab:blue" if method.startswith("signorm") else "tab:red"
        ax.errorbar(ece, acc, xerr=ece_se, yerr=acc_se, fmt="o", color=colour, capsize=2)
        label = method.replace("signorm_tau", "σN τ=")
        ax.annotate(label, (ece, acc), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("ECE (lower is better)")
    ax.set_ylabel("accuracy")
    ax.set_title("digits 0-4: σN over τ vs deep ensemble and MAP")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-train", type=int, default=150)
    parser.add_argument("--body-epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--strength", type=float, default=1e-2)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.1, 0.5, 2.0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--text", action="store_true", help="the demo's text task (MiniLM) instead of digits"
    )
    parser.add_argument("--text-train", type=int, default=256)
    parser.add_argument("--text-epochs", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.num_train, args.epochs, args.repeats = 1, 64, 2, 3
    torch.set_num_threads(1)
    run = run_text_seed if args.text else run_seed
    results = [run(args, seed) for seed in range(args.seeds)]
    table = summarize(results)
    keys = ["accuracy", "nll", "ece", "ood_auroc", "disagreement", "stored"]
    print("| method | " + " | ".join(keys) + " | step / M plain |")
    print("|---" * (len(keys) + 2) + "|")
    for method, row in table.items():
        cells = [f"{row[k][0]:.4f} ± {row[k][1]:.4f}" for k in keys]
        step = row.get("step_vs_M_plain")
        cells.append(f"{step[0]:.2f} ± {step[1]:.2f}" if step else "")
        print(f"| {method} | " + " | ".join(cells) + " |")
    for method, row in table.items():
        if "owners" in row and "jensen" in row:
            print(f"{method}: owners/feature {row['owners'][0]:.2f}, Jensen on every run: "
                  f"{row['jensen'][0] == 1.0}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"plot": str(args.plot),
                                         "json": str(args.json)}, "runs": results}, indent=1))  # fmt: skip
    if args.plot:
        plot(table, args.plot)


if __name__ == "__main__":
    main()
