"""A causal LM on multiple-choice questions, each choice scored as a continuation of the prompt.

``python examples/causal_lm_multiple_choice.py --model PATH`` loads a local Hugging Face causal LM
(e.g. a SmolLM2 or LLaMA checkpoint folder) and its tokenizer; ``--smoke`` builds a tiny
randomly initialised LLaMA from a config and a word-level tokenizer instead (no download).

Each choice k of a question is scored by ``s_k = Σ_t log p(c_t | prompt, c_<t)`` over its tokens
(``--normalize length``: divided by its token count; ``chars``: by its characters, as
lm-evaluation-harness's acc_norm), and ``p(answer = k) = softmax_k s_k``; all choices and all
posterior draws run in one batched forward, the LM head only at the continuation positions.
The MAP is fitted once; Laplace and SWAG are built at its point; mean-field VI is fitted on its
own. Prints accuracy / NLL / ECE per posterior, and the base model's (adapters at zero).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Any

import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRAXS, MultipleChoice

# (premise, connective, right continuation, wrong continuation), in the manner of COPA
ITEMS = [
    ("The ground was wet", "because", "it had rained overnight", "the sun was shining"),
    ("The water started to boil", "because", "she put the pan on the stove", "she froze it"),
    ("He put on his coat", "because", "it was cold outside", "it was a hot day"),
    ("The glass broke", "because", "it fell on the floor", "it was full of water"),
    ("She turned on the lamp", "because", "the room was dark", "the room was bright"),
    ("The baby cried", "because", "it was hungry", "it was asleep"),
    ("The plant died", "because", "nobody watered it", "it got enough water"),
    ("He went to the doctor", "because", "he felt sick", "he felt great"),
    ("The ice cream melted", "because", "it was left in the sun", "it was in the freezer"),
    ("The car would not start", "because", "the battery was dead", "the tank was full"),
    ("She opened the umbrella", "because", "it started to rain", "the sky was clear"),
    ("The dog barked", "because", "a stranger came to the door", "the house was empty"),
    ("He drank a glass of water", "because", "he was thirsty", "he was not thirsty"),
    ("The students cheered", "because", "the exam was cancelled", "the exam was hard"),
    ("The lights went out", "because", "there was a power cut", "the bulbs were new"),
    ("She laughed", "because", "the joke was funny", "the news was sad"),
    ("It started to rain", "so", "we went inside", "we sunbathed in the garden"),
    ("The shop was closed", "so", "we came back the next day", "we bought bread there"),
    ("He missed the bus", "so", "he was late for work", "he arrived early"),
    ("The soup was too hot", "so", "she waited for it to cool", "she put it in the oven"),
    ("The road was icy", "so", "he drove slowly", "he drove faster"),
    ("She was tired", "so", "she went to bed early", "she ran a marathon"),
    ("The phone battery was low", "so", "he charged it", "he threw it away"),
    ("The room was messy", "so", "they cleaned it", "they made it messier"),
    ("The river flooded", "so", "the village was evacuated", "the fields were dry"),
    ("He forgot his keys", "so", "he could not open the door", "he opened the door"),
    ("The bread was stale", "so", "she bought a fresh loaf", "she sold it as fresh"),
    ("The music was loud", "so", "he covered his ears", "he could not hear it"),
    ("The milk smelled sour", "so", "she poured it away", "she drank it happily"),
    ("The movie was boring", "so", "they left early", "they watched it twice"),
    ("It was her birthday", "so", "her friends threw a party", "nobody remembered anything"),
    ("The printer ran out of paper", "so", "he refilled the tray", "he unplugged the phone"),
]

SMOKE_CONFIG = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=37,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


class WordTokenizer:
    """Lower-case words to ids (BOS = 1 with special tokens, pad = 0): the smoke run's tokenizer."""

    pad_token_id = 0

    def __init__(self, texts: list[str]) -> None:
        words = sorted({w for t in texts for w in t.lower().split()})
        self.ids = {w: 3 + i for i, w in enumerate(words)}
        self.vocab_size = 3 + len(words)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [self.ids[w] for w in text.lower().split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local causal-LM folder (from_pretrained)")
    parser.add_argument("--smoke", action="store_true", help="tiny config-built LLaMA, fast")
    parser.add_argument("--targets", default="q_proj,v_proj", help="modules given LoRA-XS cores")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--normalize", default="none", choices=["none", "length", "chars"])
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.model is None and not args.smoke:
        parser.error("pass --model PATH (a local causal LM) or --smoke")
    return args


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The network and its tokenizer: a local checkpoint, or the smoke run's tiny LLaMA."""
    if args.model is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        net = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        return net.eval(), tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [" ".join(item) for item in ITEMS]
    tokenizer = WordTokenizer(texts)
    torch.manual_seed(args.seed)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.vocab_size, **SMOKE_CONFIG))
    return net.eval(), tokenizer


def batches(tokenizer: Any, items: list[tuple[str, ...]], size: int, rng: random.Random) -> list:
    """Encoded batches: prompt "<premise> <connective>", choices in a shuffled order."""
    out = []
    for start in range(0, len(items), size):
        prompts, choices, answers = [], [], []
        for premise, connective, right, wrong in items[start : start + size]:
            flip = rng.random() < 0.5
            prompts.append(f"{premise} {connective}")
            choices.append([wrong, right] if flip else [right, wrong])
            answers.append(int(flip))
        out.append(
            pb.models.encode_multiple_choice(
                tokenizer, prompts, choices, answers=answers, padding_side="left"
            )
        )
    return out


def report(name: str, prediction: pb.Prediction, seconds: float) -> dict[str, float]:
    probs, labels = prediction.probs, prediction.targets
    assert labels is not None
    row = {
        "accuracy": pb.metrics.accuracy(probs, labels),
        "nll": pb.metrics.nll(probs, labels),
        "ece": pb.metrics.ece(probs, labels),
    }
    print(
        f"{name:<26} {row['accuracy']:>8.3f} {row['nll']:>8.3f} {row['ece']:>8.3f} {seconds:>8.1f}"
    )
    return row


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    net, tokenizer = load(args)
    items = list(ITEMS)
    rng.shuffle(items)
    num_test = 8
    train = batches(tokenizer, items[num_test:], 8, rng)
    test = batches(tokenizer, items[:num_test], 8, rng)
    model = FineTuneModel(
        net,
        LoRAXS(rank=args.rank, target_modules=args.targets.split(",")),
        likelihood=MultipleChoice(normalize=args.normalize),
        trainable_modules=[],
        num_data=len(items) - num_test,
        prior_scale=1.0,
    )
    epochs = args.epochs or (3 if args.smoke else 20)
    num_samples = args.num_samples or (4 if args.smoke else 16)
    print(f"{'posterior':<26} {'accuracy':>8} {'nll':>8} {'ece':>8} {'fit s':>8}")

    map_guide = pb.posterior(model, "map")
    zeros = {s: torch.zeros(1, *v.shape) for s, v in model.init_values().items()}
    report("base model (no adapter)", pb.predict(model, map_guide, test, values=zeros), 0.0)

    t0 = time.perf_counter()
    pb.fit(model, map_guide, train, epochs=epochs, lr=1e-2, seed=args.seed)
    map_row = report("MAP", pb.predict(model, map_guide, test), time.perf_counter() - t0)

    t0 = time.perf_counter()
    laplace = pb.posterior(model, "laplace", init=map_guide)
    pb.fit(model, laplace, train, epochs=0)  # curvature and prior precision at the MAP
    prediction = pb.predict(model, laplace, test, num_samples=num_samples)
    report("Laplace at the MAP", prediction, time.perf_counter() - t0)

    t0 = time.perf_counter()
    swag = pb.posterior(model, "swag", init=map_guide, rank=4)
    pb.fit(model, swag, train, epochs=max(2, epochs // 4), lr=1e-3, seed=args.seed)
    prediction = pb.predict(model, swag, test, num_samples=num_samples)
    report("SWAG from the MAP", prediction, time.perf_counter() - t0)

    t0 = time.perf_counter()
    meanfield = pb.posterior(model, "meanfield")
    pb.fit(model, meanfield, train, epochs=epochs, lr=1e-2, seed=args.seed)
    prediction = pb.predict(model, meanfield, test, num_samples=num_samples)
    report("mean-field VI", prediction, time.perf_counter() - t0)
    assert math.isfinite(map_row["nll"])


if __name__ == "__main__":
    main()
