"""A multiple-choice sentiment task for causal LMs from the VADER corpora (offline).

VADER's ground-truth sentences (Hutto & Gilbert, ICWSM 2014) carry the mean of about ten human
ratings on ``[-4, 4]``; :func:`~pyrobayes.demo.data.load_vader` cuts them into five ordered
classes. :func:`write_vader_multiple_choice` turns a class-balanced sample into an
lm-evaluation-harness-style JSONL file (``question``, ``choices``, ``answer``) whose five choices
are the classes' names ("very negative" and "very positive" are two tokens long for SmolLM2). The job reads it with
``format = "json"`` (``examples/configs/smollm2_vader_sentiment.toml``). The corpus ships in the
``vaderSentiment`` sdist that ``make data`` puts in the cache, so this task needs no model hub
and no BIG-bench archive. ``make lm-data`` runs::

    python -m pyrobayes.demo.vader_task OUT.jsonl
"""

from __future__ import annotations

import json
import logging
import numbers
import random
import sys
from pathlib import Path

from .data import load_vader

logger = logging.getLogger(__name__)

__all__ = ["VADER_CHOICES", "write_vader_multiple_choice"]

#: The five choices, in the order of :func:`~pyrobayes.demo.data.load_vader`'s fine classes.
VADER_CHOICES = ("very negative", "negative", "neutral", "positive", "very positive")


def write_vader_multiple_choice(
    out: str | Path,
    *,
    domain: str = "movieReviewSnippets",
    per_class: int = 90,
    seed: int = 0,
    cache: str | Path | None = None,
) -> Path:
    """Write ``per_class`` sentences of each fine-grained VADER class as a JSONL task.

    Parameters
    ----------
    out : path
        The ``.jsonl`` file to write (its folder is created).
    domain : str
        The VADER corpus (:func:`~pyrobayes.demo.data.load_vader`).
    per_class : int
        Sentences drawn per class, without replacement (the rarest movie class has 1,086).
    seed : int
        Seeds the draw and the order of the records.
    cache : path, optional
        The pyrobayes cache holding the VADER archive (default: ``$PYROBAYES_CACHE``).

    Returns
    -------
    Path
        ``out``.

    Raises
    ------
    ValueError
        When a class has fewer than ``per_class`` sentences, or ``per_class`` is not an integer
        >= 1.
    """
    if isinstance(per_class, bool) or not isinstance(per_class, numbers.Integral) or per_class < 1:
        # 0 wrote an empty task file; a negative one failed in random.sample
        raise ValueError(
            f"write_vader_multiple_choice: per_class must be an integer >= 1, the sentences "
            f"drawn per class; got {per_class!r}."
        )
    per_class = int(per_class)
    data = load_vader(domain, task="fine", cache=cache)
    labels = [] if data.labels is None else data.labels.tolist()
    rng = random.Random(seed)
    records = []
    for label, name in enumerate(VADER_CHOICES):
        members = [i for i, y in enumerate(labels) if y == label]
        if len(members) < per_class:
            raise ValueError(
                f"write_vader_multiple_choice: {domain} has {len(members)} {name!r} sentences, "
                f"fewer than per_class={per_class}; lower per_class."
            )
        for i in rng.sample(members, per_class):
            records.append(
                {"question": data.texts[i], "choices": list(VADER_CHOICES), "answer": label}
            )
    rng.shuffle(records)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(sys.argv) != 2:
        logger.error("usage: python -m pyrobayes.demo.vader_task OUT.jsonl")
        sys.exit(2)
    logger.info("wrote %s", write_vader_multiple_choice(sys.argv[1]))
