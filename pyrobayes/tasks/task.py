r"""A multiple-choice task: its examples, deterministic splits, few-shot prompts and batches.

Splits. A task read from one file (a BIG-bench ``task.json``, a JSON/JSONL file) is split by a
seeded permutation: ``numpy.random.default_rng(seed).permutation(N)``, whose first
``round(N·f_train)`` indices are the training split, the next ``round(N·f_val)`` the validation
split and the rest the test split, each kept in file order. The same file, fractions and seed
give the same splits on every machine. A task whose source already has splits (a Hugging Face
dataset's ``train`` / ``validation`` / ``test``) keeps them (:meth:`MultipleChoiceTask.from_splits`).

Few-shot prompts. With ``num_fewshot = k > 0`` each example's prompt is preceded by ``k``
training examples, each rendered as ``prompt + delimiter + right choice``, joined by
``fewshot_separator`` (lm-evaluation-harness's convention; Gao et al. 2021; Brown et al. 2020,
"Language models are few-shot learners", Sec. 2). The ``k`` shots of the example at index ``i`` of
split ``s`` are drawn without replacement from the training split by
``random.Random(f"{seed}:{s}:{i}")``, leaving out the example itself and every training example
with the same prompt (a question repeated in the data would otherwise show its own answer): they
depend on nothing but the seed, the split and the position, so re-reading the task or encoding
another batch first changes nothing. Questions that appear in two splits (the same prompt and
choices) are counted and reported by a logged warning when the task is built.

Truncation. :meth:`MultipleChoiceTask.encode` with ``max_length`` cuts a row longer than
``max_length`` tokens (few-shot prompt, question and choice) from the left, as lm-evaluation-harness
does, but keeps the tokens the tokenizer puts before the text (the BOS token of a LLaMA or
SmolLM2 tokenizer): the row is the BOS token, then the last ``max_length - 1`` tokens, the start
of sequence a model trained with BOS always saw first. It counts the questions whose longest row
is cut, and by how many tokens, in :attr:`MultipleChoiceTask.truncation` (and a logged message).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch import Tensor

from ..models.adapters import check_int
from ..models.multiple_choice import encode_multiple_choice, prompt_ids
from .example import MCExample

__all__ = ["MultipleChoiceTask", "SPLITS", "check_fractions"]

logger = logging.getLogger(__name__)

#: The split names, in order.
SPLITS = ("train", "validation", "test")


def check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    """``(train, validation, test)`` fractions as floats, or a ``ValueError`` unless they are
    three numbers in [0, 1] summing to 1 (in that order: a dict or a string is refused)."""
    message = (
        "MultipleChoiceTask: fractions must be three numbers in [0, 1] summing to 1 (train, "
        f"validation, test), e.g. (0.5, 0.1, 0.4); got {fractions!r}."
    )
    if isinstance(fractions, (str, bytes, Mapping)):
        raise ValueError(message)
    try:
        values = tuple(float(f) for f in fractions)
    except (TypeError, ValueError):
        raise ValueError(message) from None
    if len(values) != 3 or any(not 0 <= f <= 1 for f in values) or abs(sum(values) - 1) > 1e-9:
        raise ValueError(message)
    return values[0], values[1], values[2]


def _split_seed(split_seed: Any) -> int:
    """``split_seed`` as an int >= 0 (NumPy integers too), or an error saying why: ``None``
    would seed ``default_rng`` from the OS, a new split on every run."""
    hint = " None would draw a different split on every run." if split_seed is None else ""
    try:
        return check_int("split_seed", split_seed, ge=0, owner="MultipleChoiceTask: ")
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"{err}{hint} The split is numpy.random.default_rng(split_seed).permutation(N): "
            "pass an integer >= 0, e.g. split_seed=0."
        ) from None


def _warn_rounded_splits(
    name: str, shares: dict[str, float], splits: dict[str, list[MCExample]]
) -> None:
    """Log a warning for the splits whose rounded size disagrees with their share: a positive
    share that got no example (a 0.05 test share of 10 examples), or a share of 0 that got the
    rounding remainder (the test split takes what train and validation leave)."""
    n = sum(len(v) for v in splits.values())
    empty = [s for s in SPLITS if shares[s] > 0 and not splits[s]]
    unasked = [s for s in SPLITS if shares[s] == 0 and splits[s]]
    if empty:
        logger.warning(
            "MultipleChoiceTask %r: fractions %s give the %s split(s) a share > 0 but none of "
            "the %d examples (each size is round(N * share)): %s empty. Give more examples or "
            "a larger share, or a share of 0 to ask for no such split.",
            name,
            tuple(shares.values()),
            " and ".join(empty),
            n,
            "it is" if len(empty) == 1 else "they are",
        )
    for split in unasked:
        logger.warning(
            "MultipleChoiceTask %r: fractions %s give the %s split a share of 0, but it takes "
            "%d of the %d examples, the rounding remainder of the other splits (each rounded to "
            "round(N * share)). Leave it out (task.splits[%r] = []) or adjust the shares.",
            name,
            tuple(shares.values()),
            split,
            len(splits[split]),
            n,
            split,
        )


class MultipleChoiceTask:
    """Multiple-choice examples split into train / validation / test.

    Parameters
    ----------
    splits : dict of str to list of MCExample
        ``"train"``, ``"validation"`` and ``"test"`` (missing splits are empty).
    name : str
        Used in reports.
    num_fewshot : int
        Training examples put before each prompt (0: zero-shot).
    fewshot_separator : str
        Between few-shot examples and before the question.
    delimiter : str
        Between a prompt and a choice (lm-evaluation-harness's ``target_delimiter``).
    seed : int
        Seeds the few-shot draws (an integer, NumPy's too; a float or None is refused).
    """

    def __init__(
        self,
        splits: dict[str, list[MCExample]],
        *,
        name: str = "task",
        num_fewshot: int = 0,
        fewshot_separator: str = "\n\n",
        delimiter: str = " ",
        seed: int = 0,
    ) -> None:
        unknown = sorted(set(splits) - set(SPLITS))
        if unknown:
            raise ValueError(
                f"MultipleChoiceTask {name!r}: unknown split(s) {unknown}; use {list(SPLITS)}."
            )
        try:  # NumPy integers too (a count read from an array)
            num_fewshot = check_int("num_fewshot", num_fewshot, ge=0)
        except (TypeError, ValueError):
            raise ValueError(
                f"MultipleChoiceTask {name!r}: num_fewshot must be an integer >= 0, got "
                f"{num_fewshot!r}."
            ) from None
        self.splits = {s: list(splits.get(s, [])) for s in SPLITS}
        for s, examples in self.splits.items():
            bad = [e for e in examples if not isinstance(e, MCExample)]
            if bad:
                raise TypeError(
                    f"MultipleChoiceTask {name!r}: split {s!r} holds {type(bad[0]).__name__}; "
                    "examples are pyrobayes.tasks.MCExample."
                )
        if num_fewshot and len(self.splits["train"]) <= num_fewshot:
            raise ValueError(
                f"MultipleChoiceTask {name!r}: num_fewshot={num_fewshot} needs more than "
                f"{num_fewshot} training examples; the training split has "
                f"{len(self.splits['train'])}. Lower num_fewshot or give more training data."
            )
        self.name = name
        self.num_fewshot = num_fewshot
        self.fewshot_separator = fewshot_separator
        self.delimiter = delimiter
        # an integer: int() would make 1.5 and 1.9 one seed, and None no seed at all
        self.seed = check_int("seed", seed, owner=f"MultipleChoiceTask {name!r}: ")
        #: per encoded split: ``{"questions", "truncated", "max_tokens", "mean_tokens"}`` — how
        #: many of the encoded questions lost prompt tokens to ``max_length``, and how many
        #: (the most and the mean over the truncated ones), from the last :meth:`encode`
        self.truncation: dict[str, dict[str, float]] = {}
        self.duplicates = self._count_duplicates()
        if any(self.duplicates.values()):
            logger.warning(
                "MultipleChoiceTask %r: the same question (prompt and choices) appears in two "
                "splits: %s; their scores are not held out. Few-shot prompts leave out training "
                "examples with the target's prompt.",
                name,
                ", ".join(f"{n} {pair}" for pair, n in self.duplicates.items() if n),
            )

    def _count_duplicates(self) -> dict[str, int]:
        """Questions of a later split that an earlier split also holds (same prompt and choice
        set), per pair ``"validation in train"``, ``"test in train"``, ``"test in validation"``."""

        def keys(split: str) -> set[tuple[str, frozenset[str]]]:
            return {(e.prompt, frozenset(e.choices)) for e in self.splits[split]}

        out = {}
        for later, earlier in (("validation", "train"), ("test", "train"), ("test", "validation")):
            seen = keys(earlier)
            out[f"{later} in {earlier}"] = sum(
                (e.prompt, frozenset(e.choices)) in seen for e in self.splits[later]
            )
        return out

    @classmethod
    def from_examples(
        cls,
        examples: Sequence[MCExample],
        *,
        fractions: Sequence[float] = (0.5, 0.1, 0.4),
        split_seed: int = 0,
        **kwargs: Any,
    ) -> MultipleChoiceTask:
        """Split ``examples`` by a seeded permutation (see the module docstring).

        Parameters
        ----------
        examples : list of MCExample
        fractions : (train, validation, test)
            Shares of the examples, summing to 1 (a sequence in that order, not a dict).
        split_seed : int
            Seeds ``numpy.random.default_rng`` for the permutation: an integer >= 0 (NumPy's
            too); ``None``, which would draw a new split on every run, is refused.
        **kwargs
            As for :class:`MultipleChoiceTask`.

        Notes
        -----
        Each split's size is rounded (``round(N·f)``; the test split takes the rest), so a
        small share of few examples can round to none, and the test split can take a rounding
        remainder of one example although its share is 0: both are reported by a logged
        warning naming the split, its share and its size. An empty split is refused where it
        is used (:meth:`encode`).
        """
        f_train, f_val, f_test = check_fractions(fractions)
        examples = list(examples)
        n = len(examples)
        order = np.random.default_rng(_split_seed(split_seed)).permutation(n)
        n_train = int(round(n * f_train))
        n_val = min(int(round(n * f_val)), n - n_train)
        parts = (order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :])
        splits = {
            s: [examples[i] for i in sorted(part.tolist())]
            for s, part in zip(SPLITS, parts, strict=True)
        }
        shares = dict(zip(SPLITS, (f_train, f_val, f_test), strict=True))
        _warn_rounded_splits(str(kwargs.get("name", "task")), shares, splits)
        return cls(splits, **kwargs)

    @classmethod
    def from_splits(cls, splits: dict[str, list[MCExample]], **kwargs: Any) -> MultipleChoiceTask:
        """Keep the source's own splits."""
        return cls(splits, **kwargs)

    def __len__(self) -> int:
        return sum(len(v) for v in self.splits.values())

    def _split(self, split: str) -> list[MCExample]:
        if split not in self.splits:
            raise ValueError(
                f"MultipleChoiceTask {self.name!r}: unknown split {split!r}; use {list(SPLITS)}."
            )
        return self.splits[split]

    def shots(self, split: str, index: int) -> list[MCExample]:
        """The few-shot training examples put before example ``index`` of ``split``."""
        if not self.num_fewshot:
            return []
        pool = self.splits["train"]
        target = self._split(split)[index].prompt
        candidates = [
            j
            for j in range(len(pool))
            if not (split == "train" and j == index) and pool[j].prompt != target
        ]
        count = min(self.num_fewshot, len(candidates))
        if count < self.num_fewshot:
            logger.warning(
                "MultipleChoiceTask %r: %s example %d gets %d few-shot examples, not %d: the "
                "other training examples repeat its question.",
                self.name,
                split,
                index,
                count,
                self.num_fewshot,
            )
        rng = random.Random(f"{self.seed}:{split}:{index}")
        return [pool[j] for j in rng.sample(candidates, count)]

    def prompt(self, split: str, index: int) -> str:
        """Example ``index`` of ``split``'s prompt, few-shot examples first."""
        example = self._split(split)[index]
        parts = [s.prompt + self.delimiter + s.target for s in self.shots(split, index)]
        return self.fewshot_separator.join([*parts, example.prompt])

    def encode(
        self,
        tokenizer: Any,
        split: str,
        *,
        batch_size: int = 8,
        limit: int | None = None,
        max_length: int | None = None,
        **encode_kwargs: Any,
    ) -> list[dict[str, Tensor]]:
        """Batches of ``split`` for :class:`~pyrobayes.models.MultipleChoice`.

        Each batch is :func:`~pyrobayes.models.encode_multiple_choice` of its examples'
        (few-shot) prompts, choices and answers, with ``ragged=True`` when their numbers of
        choices differ (then ``choice_mask`` marks the real choices).

        Parameters
        ----------
        tokenizer : transformers tokenizer
        split : {"train", "validation", "test"}
        batch_size : int
            Questions per batch.
        limit : int, optional
            Use the first ``limit`` examples only (an integer >= 1; None: every example).
        max_length : int, optional
            Longest row in tokens (None: no limit). A longer row loses prompt tokens from the
            left (lm-evaluation-harness's truncation), the few-shot examples first, but keeps the
            tokens the tokenizer puts before the text: with a tokenizer that adds a BOS token
            (LLaMA, SmolLM2: ``add_bos_token``) the row is BOS followed by its last
            ``max_length - 1`` tokens, so the model sees the start of sequence it was trained
            with. The choice itself is never cut (a choice that does not fit is refused).
            :attr:`truncation` counts the questions cut.
        **encode_kwargs
            ``padding_side``, ``position_ids`` for ``encode_multiple_choice``.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"MultipleChoiceTask.encode: batch_size must be an integer >= 1, got "
                f"{batch_size!r}."
            )
        examples = self._split(split)
        if limit is not None:  # -1 is no "all" sentinel: it would encode nothing
            try:
                limit = check_int("limit", limit, ge=1, owner="MultipleChoiceTask.encode: ")
            except (TypeError, ValueError) as err:
                raise type(err)(f"{err} Pass limit=None to encode every example.") from None
        count = len(examples) if limit is None else min(limit, len(examples))
        if count == 0:
            raise ValueError(
                f"MultipleChoiceTask {self.name!r}: split {split!r} is empty; change the split "
                "fractions or give that split data."
            )
        cuts: list[int] = []
        batches = []
        for start in range(0, count, batch_size):
            idx = range(start, min(start + batch_size, count))
            chunk = [examples[i] for i in idx]
            prompts = [self.prompt(split, i) for i in idx]
            ragged = len({len(e.choices) for e in chunk}) > 1
            batch = encode_multiple_choice(
                tokenizer,
                prompts,
                [list(e.choices) for e in chunk],
                [e.answer for e in chunk],
                delimiter=self.delimiter,
                ragged=ragged,
                max_length=max_length,
                **encode_kwargs,
            )
            batches.append(batch)
            if max_length is not None:
                cuts += [
                    self._overflow(tokenizer, p, e.choices, int(max_length))
                    for p, e in zip(prompts, chunk, strict=True)
                ]
        cut = [c for c in cuts if c > 0]
        self.truncation[split] = {
            "questions": count,
            "truncated": len(cut),
            "max_tokens": max(cut, default=0),
            "mean_tokens": sum(cut) / len(cut) if cut else 0.0,
        }
        if cut:
            logger.info(
                "MultipleChoiceTask %r: %d of %d %s questions are longer than max_length=%s "
                "tokens and lose prompt tokens from the left, after the tokenizer's BOS token if it "
                "adds one (up to %d, mean %.1f).",
                self.name,
                len(cut),
                count,
                split,
                max_length,
                max(cut),
                sum(cut) / len(cut),
            )
        return batches

    def _overflow(self, tokenizer: Any, prompt: str, choices: Sequence[str], limit: int) -> int:
        """Tokens the question's longest row (prompt, delimiter and choice) exceeds ``limit`` by:
        the prompt tokens ``encode_multiple_choice`` cuts from its left (0: none)."""
        context = len(prompt_ids(tokenizer, prompt))
        longest = max(
            len(tokenizer(self.delimiter + c, add_special_tokens=False)["input_ids"])
            for c in choices
        )
        return max(0, context + longest - limit)
