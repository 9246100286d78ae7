"""Cost of Laplace's linearised (GLM) predictive against MAP prediction on a causal LM.

A config-built LLaMA of the SmolLM2-135M shape class (hidden 576, 9 heads / 3 KV heads, MLP
1536, vocabulary 49,152, tied embeddings) with a few layers (``--layers``, default 4 of 30),
LoRA-XS r = 8 on q_proj and v_proj, and the multiple-choice likelihood with continuations
(``pb.models.encode_multiple_choice``: K choices per item, each scored by its continuation
tokens; the head runs only at the read positions). For K = 2, 3, 4:

* **map** - ``pb.predict(model, map_guide, batch)``: one no-grad forward at B·K rows;
* **glm** - ``pb.predict(model, laplace, batch, num_samples=S)`` with the Laplace guide put at
  the MAP (``pb.posterior(model, "laplace", init=map_guide)``) and its default
  ``pred_type="glm"``: per-example Jacobians of the K choice scores
  (:mod:`pyrobayes.linearized`), then S draws of the linearised scores.

The Laplace curvature is set to a synthetic KRON factorisation (its values do not change the
cost of prediction; fitting it is not timed). Per-item time: wall time of one ``pb.predict``
call over the batch divided by B, median over ``--repeats`` interleaved rounds (first round
dropped as warm-up). Peak memory: the peak of the live bytes of the tensors torch ops create during
one call (a dispatch-mode tracker: forward and backward ops; the transient), and the total =
that + the model's parameters and buffers (what the process holds besides Python).

Run::

    .venv/bin/python benchmarks/glm_predictive.py --threads 1           # ~1 minute
    .venv/bin/python benchmarks/glm_predictive.py --smoke               # seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRAXS
from pyrobayes.models.multiple_choice import encode_multiple_choice

WORDS = (
    "the a of to and in is was for on that with as by at from it an be this which or are have "
    "had not but were his her their they one all there been has more when will would who so if "
    "out no up what can about into than them only other new some could time these two may first "
    "then do any like my now over such our man me even most made after also did many before must"
).split()


class WordTokenizer:
    """Words to ids (BOS = 1 with special tokens, pad = 0)."""

    pad_token_id = 0

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [self.ids.setdefault(w, 3 + len(self.ids)) for w in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def build(args: argparse.Namespace, choice_token_ids: list[int] | None = None) -> FineTuneModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    net = LlamaForCausalLM(cfg).eval()
    return FineTuneModel(
        net,
        LoRAXS(rank=8, target_modules=["q_proj", "v_proj"]),
        likelihood=pb.models.MultipleChoice(choice_token_ids),
        trainable_modules=[],
        num_data=100,
    )


def batch_for(
    num_items: int, num_choices: int, seed: int = 0, single_token: bool = False
) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    if single_token:  # the prompt alone, (B, L); the answer is read at its last position
        tokenizer = WordTokenizer()
        rows = [tokenizer(words(15, 25))["input_ids"] for _ in range(num_items)]
        length = max(len(r) for r in rows)
        ids = torch.zeros(num_items, length, dtype=torch.long)
        mask = torch.zeros(num_items, length, dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            ids[i, length - len(r) :] = torch.tensor(r)
            mask[i, length - len(r) :] = 1
        labels = torch.zeros(num_items, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    prompts = [words(15, 25) for _ in range(num_items)]
    choices = [[words(2, 8) for _ in range(num_choices)] for _ in range(num_items)]
    return encode_multiple_choice(
        WordTokenizer(), prompts, choices, answers=[0] * num_items, padding_side="left"
    )


def _storage_key(t: torch.Tensor) -> int | None:
    """The data pointer of ``t``'s storage (``None`` for a wrapper without storage of its own)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops create while the mode is active and that are
    still alive (forward and backward ops; frees noticed at the next op, so it errs high)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        # outputs that alias an input (views, in-place ops) allocate nothing
        inputs = {
            _storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = _storage_key(t)
                if key is None or key in inputs:
                    continue
                if storage.nbytes() and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of the bytes torch ops allocate (and have not freed) while ``fn`` runs."""
    with PeakLiveBytes() as tracker:
        fn()
    return tracker.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--items", type=int, default=4, help="B, items per batch")
    parser.add_argument("--samples", type=int, default=16, help="S, draws of the GLM predictive")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--choices", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one repeat")
    parser.add_argument(
        "--single-token",
        action="store_true",
        help="the single-token likelihood (choice_token_ids: K outputs read from one row) "
        "instead of continuations",
    )
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.heads, args.kv_heads = 1, 64, 2, 1
        args.intermediate, args.vocab, args.repeats, args.items = 128, 500, 2, 2
    torch.set_num_threads(args.threads)
    for k in args.choices:
        ids = list(range(5, 5 + k)) if args.single_token else None
        run_case(args, build(args, ids), k, header=k == args.choices[0])


def run_case(args: argparse.Namespace, model: FineTuneModel, k: int, header: bool) -> None:
    """One row of the table: MAP and GLM prediction at K choices."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    map_guide = pb.posterior(model, "map")
    with torch.no_grad():  # a MAP away from the init (the values do not change the cost)
        for s in map_guide.sites:
            map_guide.loc(s).normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    laplace = pb.posterior(model, "laplace", init=map_guide, structure="kron")
    laplace.link_samples = None  # the Monte Carlo draws are predict's S, as MAP's rows compare
    for s, shape in laplace.sites.items():  # synthetic KRON curvature: cost only
        m, n = shape
        laplace.set_curvature(s, torch.full(shape, 10.0), torch.eye(m), torch.eye(n))
    laplace.set_prior_precision(1.0)
    laplace.mark_fitted(True)
    assert laplace.pred_type == "glm"
    if header:
        print(
            f"LLaMA {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, LoRA-XS r=8 q/v "
            f"({len(map_guide.sites)} cores), {torch.get_num_threads()} thread(s), B = {args.items}, "
            f"S = {args.samples}; weights {weights / 2**20:.0f} MiB; "
            + ("single-token answers" if args.single_token else "continuations")
        )
        print(
            "| K | rows x tokens | map ms/item | glm ms/item | time ratio | map peak MiB | "
            "glm peak MiB | total-memory ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
    batch = batch_for(args.items, k, single_token=args.single_token)
    runs = {
        "map": lambda b=batch: pb.predict(model, map_guide, [b]),
        "glm": lambda b=batch: pb.predict(model, laplace, [b], num_samples=args.samples),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats + 1):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            runs[name]()
            if r:  # round 0 is warm-up
                times[name].append(time.perf_counter() - start)
    t = {name: statistics.median(v) / args.items * 1e3 for name, v in times.items()}
    peak = {name: peak_bytes(fn) for name, fn in runs.items()}
    total = {name: weights + p for name, p in peak.items()}
    shape = tuple(batch["input_ids"].shape)
    rows = f"{shape[0] * shape[1]} x {shape[2]}" if len(shape) == 3 else f"{shape[0]} x {shape[1]}"
    print(
        f"| {k} | {rows} | {t['map']:.1f} | {t['glm']:.1f} | "
        f"{t['glm'] / t['map']:.2f} | {peak['map'] / 2**20:.1f} | {peak['glm'] / 2**20:.1f} "
        f"| {total['glm'] / total['map']:.2f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
