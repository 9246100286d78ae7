"""Standard vs symmetrized mean-field VI on a Bayesian MLP (Gelberg et al., 2024), issue 19.

Task: sklearn digits (all 10 classes, bundled), a fully Bayesian MLP ``64-w-w-10``
(``latent_modules`` = every layer, prior iid N(0, s²)), widths w in {16, 64, 256}. Two arms at an
equal budget (same epochs, batches, lr, init and seed):

* ``meanfield``   - ``pb.posterior(model, "meanfield")`` fitted with the ELBO (analytic KL);
* ``symmetrized`` - ``pb.posterior(model, "symmetrized", base="meanfield")`` fitted under
  ``pb.infer.Symmetrized(num_permutations=K)`` with its default objective ``L_K = ELBO + I_K`` (the same analytic KL).

Reported per arm (median over seeds): ``L_K`` and the plain ``ELBO`` of the fitted q on the whole
training set (``S`` draws, dataset-sum nats; ``L_K`` with K group elements per draw, for both
arms: it bounds ``ELBO(q_G)`` of the arm's q), test accuracy, NLL and ECE of the predictive.

Timing: one optimisation step of each arm (forward, backward, Adam) at K = 16, interleaved
round-robin on the same batches; the ratio symmetrized / meanfield is the median over rounds of
the per-round ratio (target <= 1.15); ``--clock cpu`` times the thread's CPU time instead of
the wall clock (one thread: the same on an idle machine, and unaffected by other processes on a
busy one). Also on the LoRA rank symmetry: a config-built BERT
(4 layers, hidden 128) with LoRA r = 8 on query/value, batch 32 x 64 tokens (timing only).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/symmetrized.py            # ~3 min, 1 thread
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/symmetrized.py --quick    # seconds
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pyro  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402

import pyrobayes as pb  # noqa: E402
from pyrobayes.infer.objectives import scaled_log_likelihood  # noqa: E402


def data(seed: int = 0, num_train: int = 1200):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


def build(width: int, num_data: int, seed: int, prior_scale: float) -> pb.models.FineTuneModel:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    return pb.models.FineTuneModel(
        net,
        None,
        latent_modules=["0", "2", "4"],
        num_data=num_data,
        prior_scale=prior_scale,
        trainable_modules=[],
    )


def guide_for(arm: str, model, args):
    pyro.clear_param_store()
    if arm == "meanfield":
        return pb.posterior(model, "meanfield", init_scale=args.init_scale)
    guide = pb.posterior(model, "symmetrized", base="meanfield", init_scale=args.init_scale)
    guide.num_permutations = args.num_permutations  # K of direct infonce calls (bounds())
    return guide


def settings_for(arm: str, args):
    """The fit's settings of ``arm``: K for the symmetrized objective (None: the defaults)."""
    if arm == "symmetrized":
        return pb.infer.Symmetrized(num_permutations=args.num_permutations)
    return None


@torch.no_grad()
def bounds(model, guide, sym, train, num_samples: int) -> tuple[float, float]:
    """(ELBO, L_K) of q on the whole training set: S draws, analytic KL, I_K of the same draws.

    ``sym`` is a symmetrized guide sharing q's parameters (for the meanfield arm: a wrapper
    whose base holds the fitted state), so both arms' L_K use the same estimator.
    """
    x, y = train
    values = guide.rsample(num_samples)
    log_lik = scaled_log_likelihood(model, values, (x, y))
    elbo = float(log_lik - guide.kl_to_prior(model))
    info = float(sym.infonce(values).mean())
    return elbo, elbo + info


def run(width: int, arm: str, seed: int, args, train, test) -> dict[str, float]:
    model = build(width, len(train[0]), seed, args.prior_scale)
    guide = guide_for(arm, model, args)
    batches = [
        (train[0][i : i + args.batch_size], train[1][i : i + args.batch_size])
        for i in range(0, len(train[0]), args.batch_size)
    ]
    start = time.perf_counter()
    # the fit's seed differs from the init's: the same seed would make the first draws' noise
    # a function of the very random numbers that initialised μ (an atypical first step)
    optim = pb.Optimization(optimizer=settings_for(arm, args))
    pb.fit(model, guide, batches, epochs=args.epochs, lr=args.lr, seed=seed + 1000, optim=optim)
    fit_s = time.perf_counter() - start
    sym = guide_for("symmetrized", model, args)
    sym.base.load_state_dict(guide.state_dict() if arm == "meanfield" else guide.base.state_dict())
    torch.manual_seed(seed + 1)
    elbo, l_k = bounds(model, sym, sym, train, args.eval_samples)
    pred = pb.predict(model, guide, [test], num_samples=args.eval_samples, seed=seed)
    metrics = pb.metrics.report(pred, pred.targets)
    return {
        "L_K": l_k,
        "elbo": elbo,
        "accuracy": metrics["accuracy"],
        "nll": metrics["nll"],
        "ece": metrics["ece"],
        "fit_s": fit_s,
    }


def _clock(args):
    """The timer of ``--clock``: wall time, or this thread's CPU time."""
    return time.thread_time if args.clock == "cpu" else time.perf_counter


def step_times(width: int, args, train, rounds: int) -> float:
    """Median over rounds of (symmetrized step time / meanfield step time) at K = 16."""
    clock = _clock(args)
    arms = {}
    for arm in ("meanfield", "symmetrized"):
        model = build(width, len(train[0]), 0, args.prior_scale)
        guide = guide_for(arm, model, args)
        model.train(True)
        fitter = pb.infer.make_fitter(model, guide, lr=args.lr, optimizer=settings_for(arm, args))
        arms[arm] = fitter
    batch = (train[0][: args.batch_size], train[1][: args.batch_size])
    ratios = []
    for r in range(rounds + 1):
        times = {}
        order = ("meanfield", "symmetrized") if r % 2 else ("symmetrized", "meanfield")
        for arm in order:
            t0 = clock()
            for _ in range(5):
                arms[arm].step(batch)
            times[arm] = clock() - t0
        if r:  # round 0 is a warm-up
            ratios.append(times["symmetrized"] / times["meanfield"])
    return statistics.median(ratios)


def lora_step_ratio(args, rounds: int) -> tuple[float, int]:
    """Step-time ratio on the LoRA rank symmetry: a config-built BERT (4 layers, hidden 128, no
    download) with LoRA r = 8 on query/value, a batch of 32 sequences of 64 random tokens."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=128,
        num_labels=2,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (32, 64), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(0, 2, (32,), generator=g),
    }
    fitters = {}
    for arm in ("meanfield", "symmetrized"):
        torch.manual_seed(0)
        model = pb.models.FineTuneModel(
            BertForSequenceClassification(config),
            pb.models.LoRA(rank=8, target_modules=["query", "value"]),
            num_data=1000,
        )
        guide = guide_for(arm, model, args)
        model.train(True)
        fitters[arm] = pb.infer.make_fitter(
            model, guide, lr=args.lr, optimizer=settings_for(arm, args)
        )
    clock = _clock(args)
    ratios = []
    for r in range(rounds + 1):
        times = {}
        for arm in ("meanfield", "symmetrized") if r % 2 else ("symmetrized", "meanfield"):
            t0 = clock()
            for _ in range(3):
                fitters[arm].step(batch)
            times[arm] = clock() - t0
        if r:
            ratios.append(times["symmetrized"] / times["meanfield"])
    num_latent = sum(int(torch.Size(s).numel()) for s in fitters["meanfield"].guide.sites.values())
    return statistics.median(ratios), num_latent


def paired_lora(args) -> None:
    """Symmetrized vs mean-field on the SAME adapter (issue 27): the digits transfer task of
    ``benchmarks/ibdr.py`` (body pretrained on 0-4, new latent 10-class head) with plain LoRA
    r = 8 on both hidden layers (LoRA-XS has no rank symmetry), the guides' default options, the
    same init, batches, seed and budget; paired differences over the seeds."""
    import copy
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ibdr import data as transfer_data
    from ibdr import pretrain

    rows = []
    for seed in range(args.seeds):
        train, test = transfer_data(seed, 1000)
        body = pretrain(train, seed, 30)
        out = {}
        for arm in ("meanfield", "symmetrized"):
            pyro.clear_param_store()
            torch.manual_seed(seed)
            net = copy.deepcopy(body)
            net[4] = nn.Linear(128, 10)
            model = pb.models.FineTuneModel(
                net,
                pb.models.LoRA(rank=8, alpha=8.0, target_modules=["0", "2"]),
                latent_modules=["4"],
                trainable_modules=[],
                num_data=1000,
            )
            guide = pb.posterior(model, arm)
            batches = [(train[0][i : i + 50], train[1][i : i + 50]) for i in range(0, 1000, 50)]
            result = pb.fit(model, guide, batches, epochs=args.epochs, lr=args.lr, seed=seed)
            pred = pb.predict(model, guide, [test], num_samples=args.eval_samples, seed=seed)
            metrics = pb.metrics.report(pred, pred.targets)
            out[arm] = {k: float(metrics[k]) for k in ("accuracy", "nll", "ece")}
            terms = (result.state or {}).get("terms")
            if terms is not None and "I_K" in terms:
                out[arm]["I_K_last"] = float(terms["I_K"][-1])
        rows.append(out)
        print(seed, out, flush=True)
    for key in ("accuracy", "nll", "ece"):
        diffs = [r["symmetrized"][key] - r["meanfield"][key] for r in rows]
        sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        print(f"symmetrized − meanfield {key}: {statistics.mean(diffs):+.5f} ± {sd:.5f} (sd)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"paired_lora": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--paired-lora",
        action="store_true",
        help="symmetrized vs mean-field on the same LoRA r=8 adapter (digits transfer)",
    )
    parser.add_argument("--quick", action="store_true", help="one seed, 2 epochs, w=16 only")
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--prior-scale", type=float, default=0.5)
    parser.add_argument("--init-scale", type=float, default=0.1)
    parser.add_argument("--num-permutations", type=int, default=16)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--timing-rounds", type=int, default=20)
    parser.add_argument("--lora-rounds", type=int, default=10, help="0: skip the LoRA timing")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="step timer: wall clock, or this thread's CPU time (robust on a shared machine)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/symmetrized.json"))
    args = parser.parse_args()
    if args.quick:
        args.widths, args.seeds, args.epochs, args.timing_rounds = [16], 1, 2, 3
        args.lora_rounds = min(args.lora_rounds, 2)
    torch.set_num_threads(1)
    if args.paired_lora:
        paired_lora(args)
        return
    train, test = data()
    rows = []
    for width in args.widths:
        for arm in ("meanfield", "symmetrized"):
            runs = [run(width, arm, seed, args, train, test) for seed in range(args.seeds)]
            row = {"width": width, "arm": arm}
            row.update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
            row["I_K"] = row["L_K"] - row["elbo"]
            row["elbo_range"] = [min(r["elbo"] for r in runs), max(r["elbo"] for r in runs)]
            row["acc_range"] = [min(r["accuracy"] for r in runs), max(r["accuracy"] for r in runs)]
            rows.append(row)
            print(
                f"w={width:4d} {arm:12s} L_K={row['L_K']:10.1f} ELBO={row['elbo']:10.1f} "
                f"acc={row['accuracy']:.4f} nll={row['nll']:.4f} ece={row['ece']:.4f} "
                f"fit={row['fit_s']:.1f}s ELBO range {row['elbo_range'][0]:.1f}.."
                f"{row['elbo_range'][1]:.1f} acc range {row['acc_range'][0]:.4f}.."
                f"{row['acc_range'][1]:.4f}",
                flush=True,
            )
        ratio = step_times(width, args, train, args.timing_rounds)
        rows.append({"width": width, "arm": "step_ratio", "ratio": ratio})
        print(
            f"w={width:4d} step time symmetrized/meanfield (K={args.num_permutations}): "
            f"{ratio:.3f}",
            flush=True,
        )
    if args.lora_rounds:
        ratio, num_latent = lora_step_ratio(args, args.lora_rounds)
        rows.append({"width": None, "arm": "lora_step_ratio", "ratio": ratio, "D": num_latent})
        print(
            f"LoRA r=8 (BERT 4x128, batch 32x64, D={num_latent}) step time "
            f"symmetrized/meanfield: {ratio:.3f}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"args": setup, "rows": rows}, indent=1))
    print(
        f"wrote {args.out} (torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"log K = {math.log(args.num_permutations):.3f})"
    )


if __name__ == "__main__":
    main()
