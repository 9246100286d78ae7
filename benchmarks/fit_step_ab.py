"""Two versions of ``pb.fit``'s step timed in one process (issue 29, item 7b).

A cross-process comparison of two library versions cannot resolve a few percent on a loaded
2-core VM (each run's ratio to the plain step moves by +-5 %). Here both versions are imported in
one process (the second tree's package under another name), and ``pb.fit(num_steps=50)`` of each,
the plain ``functional_call`` step and the hand-inlined one of ``benchmarks/overhead.py`` run
interleaved over the rounds (order reversed every other round); the medians of within-round ratios
of wall and CPU time are printed with their interquartile range.

Run::

    git archive <old commit> | tar -x -C /tmp/old     # the version to compare against
    .venv/bin/python benchmarks/fit_step_ab.py --old /tmp/old --rounds 40
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="root of the other tree")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(args.old / "pyrobayes", tmp / "pyrobayes_old")  # relative imports only
    sys.path[:0] = [str(HERE), str(tmp)]
    import pyro
    import torch

    torch.set_num_threads(1)
    import overhead as bench

    import pyrobayes as new

    old = importlib.import_module("pyrobayes_old")

    def build(pb):  # noqa: ANN001, ANN202 - either version's package
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )
        model = pb.models.FineTuneModel(
            net,
            pb.models.LoRAXS(rank=8, target_modules=["0", "2"]),
            likelihood="gaussian",
            obs_scale=1.0,
            prior_scale=bench.PRIOR_SCALE,
            num_data=6400,
            trainable_modules=["4"],
        )
        return model, pb.guides.MeanFieldGuide(model, init_scale=bench.INIT_SCALE)

    torch.manual_seed(1)
    batches = [(torch.randn(64, 64), torch.randn(64, 10)) for _ in range(4)]
    pyro.clear_param_store()
    (m_old, g_old), (m_new, g_new) = build(old), build(new)
    plain = bench.PlainMeanField(m_new, 6400)
    inlined = bench.PlainMeanField(m_new, 6400, manual_forward=True)
    n = args.steps
    b_old, b_new = old.Optimization(num_steps=n), new.Optimization(num_steps=n)
    fns = {
        "old pb.fit": lambda: old.fit(
            m_old, g_old, batches, lr=bench.LR, optim=b_old, progress=False
        ),
        "new pb.fit": lambda: new.fit(
            m_new, g_new, batches, lr=bench.LR, optim=b_new, progress=False
        ),
        "plain fc": lambda: plain.fit(batches, n),
        "plain inlined": lambda: inlined.fit(batches, n),
    }
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(args.rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            c0, t0 = time.thread_time(), time.perf_counter()
            fns[k]()
            wall[k].append((time.perf_counter() - t0) / n)
            cpu[k].append((time.thread_time() - c0) / n)
    out: dict[str, object] = {"load_average_at_end": os.getloadavg(), "rounds": args.rounds}
    for k in fns:
        print(
            f"{k:<14} wall {1e3 * statistics.median(wall[k]):.3f} ms/step, CPU "
            f"{1e3 * statistics.median(cpu[k]):.3f}"
        )
    for a, b in [
        ("old pb.fit", "plain fc"),
        ("new pb.fit", "plain fc"),
        ("old pb.fit", "plain inlined"),
        ("new pb.fit", "plain inlined"),
        ("new pb.fit", "old pb.fit"),
    ]:
        row = {}
        for name, d in (("wall", wall), ("cpu", cpu)):
            ratios = [x / y for x, y in zip(d[a], d[b], strict=True)]
            q = statistics.quantiles(ratios, n=4)
            row[name] = [statistics.median(ratios), q[0], q[2]]
        out[f"{a} / {b}"] = row
        w, c = row["wall"], row["cpu"]
        print(
            f"{a} / {b}: paired wall {w[0]:.3f} [{w[1]:.3f}, {w[2]:.3f}], CPU {c[0]:.3f} "
            f"[{c[1]:.3f}, {c[2]:.3f}]"
        )
    print("load average", os.getloadavg())
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
