"""Multiple-choice tasks for causal LMs: examples read from lm-evaluation-harness JSON/JSONL,
BIG-bench ``task.json`` or Hugging Face datasets, deterministic splits, few-shot prompts, and
batches for :class:`~pyrobayes.models.MultipleChoice`."""

from .example import MCExample
from .formats import (
    ADAPTERS,
    DEFAULT_TEMPLATE,
    adapt_rows,
    read_bigbench,
    read_hf_dataset,
    read_json_examples,
)
from .task import SPLITS, MultipleChoiceTask

__all__ = [
    "ADAPTERS",
    "DEFAULT_TEMPLATE",
    "MCExample",
    "MultipleChoiceTask",
    "SPLITS",
    "adapt_rows",
    "read_bigbench",
    "read_hf_dataset",
    "read_json_examples",
]
