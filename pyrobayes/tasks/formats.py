r"""Reading multiple-choice examples from the formats users have.

* **lm-evaluation-harness-style JSON / JSONL** (Gao et al. 2021): one record per question with a
  question, a list of choices and the answer (an index, or the right choice's text), rendered by
  a ``str.format`` template over the record's fields (default ``"Question: {question}\nAnswer:"``,
  lm-eval's ARC / SciQ prompt) — :func:`read_json_examples`.
* **BIG-bench** ``task.json`` (Srivastava et al. 2023, "Beyond the imitation game"): ``examples``
  with ``input`` and ``target_scores`` (choice → score); the answer is the first choice of the
  highest score, the prompt ``task_prefix + "Q: " + input + "\nA:"`` (BIG-bench's default
  ``example_input_prefix`` / ``example_output_prefix``, overridden by the file's own) —
  :func:`read_bigbench`.
* **Hugging Face datasets** rows through small adapters (field mappings, :data:`ADAPTERS`):
  ``arc`` (``allenai/ai2_arc``), ``openbookqa``, ``winogrande`` and ``boolq``, read from a folder
  saved with ``save_to_disk`` or a hub id (``datasets.load_dataset``, which needs the hub or its
  cache) — :func:`read_hf_dataset`. An adapter takes one row (a dict) and returns an
  :class:`MCExample`, so it works on a ``datasets.Dataset`` and on a list of dicts alike.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .example import MCExample

__all__ = [
    "read_json_examples",
    "read_bigbench",
    "read_hf_dataset",
    "adapt_rows",
    "ADAPTERS",
    "DEFAULT_TEMPLATE",
]

#: lm-evaluation-harness's ARC / SciQ prompt.
DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"multiple-choice task file {path} does not exist.")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON{'L' * (path.suffix == '.jsonl')}: {err}"
        ) from None
    if isinstance(data, Mapping) and isinstance(data.get("examples"), list):
        data = data["examples"]
    if not isinstance(data, list):
        raise ValueError(
            f"{path}: expected a list of records (or {{'examples': [...]}}), got "
            f"{type(data).__name__}."
        )
    return data


def _answer_index(answer: Any, choices: list[str], where: str) -> int:
    if isinstance(answer, bool):
        raise ValueError(f"{where}: answer {answer!r} is a boolean; give an index or the text.")
    if isinstance(answer, int):
        return answer
    if isinstance(answer, str):
        if answer in choices:
            return choices.index(answer)
        if answer.strip().isdigit():
            return int(answer)
    raise ValueError(
        f"{where}: answer {answer!r} is neither a choice index nor one of the choices {choices!r}."
    )


def read_json_examples(
    path: str | Path,
    *,
    template: str = DEFAULT_TEMPLATE,
    question_key: str = "question",
    choices_key: str = "choices",
    answer_key: str = "answer",
) -> list[MCExample]:
    """Examples from an lm-evaluation-harness-style JSON or JSONL file.

    Parameters
    ----------
    path : str or Path
        ``.jsonl`` (one record a line) or ``.json`` (a list of records, or ``{"examples": [...]}``).
    template : str
        ``str.format`` template over the record's fields; ``{question}`` names ``question_key``.
    question_key, choices_key, answer_key : str
        The record's fields: the question text, the list of choices, the answer (an integer
        index, a digit string, or the right choice's text).

    Returns
    -------
    list of MCExample
    """
    path = Path(path)
    out = []
    for i, record in enumerate(_records(path)):
        where = f"{path} record {i}"
        missing = [k for k in (question_key, choices_key, answer_key) if k not in record]
        if missing:
            raise ValueError(
                f"{where} lacks field(s) {missing} (has {sorted(record)}); set question_key / "
                "choices_key / answer_key to the file's names."
            )
        choices = record[choices_key]
        if not isinstance(choices, list):
            raise ValueError(f"{where}: {choices_key!r} must be a list, got {choices!r}.")
        fields = {**record, "question": record[question_key]}
        try:
            prompt = template.format(**fields)
        except (KeyError, IndexError) as err:
            raise ValueError(
                f"{where}: template {template!r} names a missing field {err}."
            ) from None
        answer = _answer_index(record[answer_key], choices, where)
        out.append(MCExample(prompt, tuple(choices), answer, {"source": where}))
    return out


def read_bigbench(path: str | Path) -> list[MCExample]:
    """Examples of a BIG-bench multiple-choice ``task.json`` (see the module docstring).

    Parameters
    ----------
    path : str or Path
        A ``task.json`` whose examples carry ``target_scores``.

    Returns
    -------
    list of MCExample
        Choices in the file's order; the answer is the first choice of the highest score.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"BIG-bench task file {path} does not exist.")
    try:
        task = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(task, Mapping) or not isinstance(task.get("examples"), list):
        raise ValueError(f"{path}: a BIG-bench task.json holds an 'examples' list.")
    prefix = str(task.get("task_prefix", ""))
    q_prefix = str(task.get("example_input_prefix", "Q: ")).lstrip("\n")
    a_prefix = str(task.get("example_output_prefix", "\nA: ")).rstrip(" ")
    out = []
    for i, example in enumerate(task["examples"]):
        where = f"{path} example {i}"
        scores = example.get("target_scores")
        if not isinstance(scores, Mapping) or len(scores) < 2:
            raise ValueError(
                f"{where} has no 'target_scores' with >= 2 choices; it is not a multiple-choice "
                "task (generative BIG-bench tasks are not supported)."
            )
        choices = [str(c) for c in scores]
        values = [float(v) for v in scores.values()]
        answer = values.index(max(values))
        prompt = f"{prefix}{q_prefix}{example['input']}{a_prefix}"
        out.append(MCExample(prompt, tuple(choices), answer, {"source": where}))
    return out


def _labelled(row: Mapping[str, Any], question: str, where: str) -> MCExample:
    """ARC / OpenBookQA: ``choices = {"text": [...], "label": [...]}``, ``answerKey`` a label."""
    texts = list(row["choices"]["text"])
    labels = [str(label) for label in row["choices"]["label"]]
    key = str(row["answerKey"])
    if key not in labels:
        raise ValueError(f"{where}: answerKey {key!r} is not among the labels {labels}.")
    return MCExample(
        f"Question: {question}\nAnswer:", tuple(texts), labels.index(key), {"source": where}
    )


def arc_adapter(row: Mapping[str, Any], where: str = "arc row") -> MCExample:
    """``allenai/ai2_arc`` (ARC-Easy / ARC-Challenge): ``question``, ``choices``, ``answerKey``."""
    return _labelled(row, str(row["question"]), where)


def openbookqa_adapter(row: Mapping[str, Any], where: str = "openbookqa row") -> MCExample:
    """``allenai/openbookqa`` (main): ``question_stem``, ``choices``, ``answerKey``."""
    return _labelled(row, str(row["question_stem"]), where)


def winogrande_adapter(row: Mapping[str, Any], where: str = "winogrande row") -> MCExample:
    """``allenai/winogrande``: ``sentence`` with one ``_``, ``option1``, ``option2``, ``answer``
    (``"1"`` or ``"2"``). The prompt is the sentence before the blank; choice k is option k
    followed by the rest of the sentence (full-sentence scoring; lm-evaluation-harness scores the
    shared rest given each filled-in start instead)."""
    sentence = str(row["sentence"])
    if sentence.count("_") != 1:
        raise ValueError(f"{where}: a Winogrande sentence holds one '_', got {sentence!r}.")
    before, after = sentence.split("_")
    choices = (str(row["option1"]) + after, str(row["option2"]) + after)
    return MCExample(before.rstrip(), choices, int(row["answer"]) - 1, {"source": where})


def boolq_adapter(row: Mapping[str, Any], where: str = "boolq row") -> MCExample:
    """``google/boolq``: ``passage``, ``question``, ``answer`` (bool); choices ``no`` / ``yes``
    (lm-evaluation-harness's prompt)."""
    prompt = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
    return MCExample(prompt, ("no", "yes"), int(bool(row["answer"])), {"source": where})


#: Adapter per dataset family: a row (dict) → MCExample.
ADAPTERS: dict[str, Callable[..., MCExample]] = {
    "arc": arc_adapter,
    "openbookqa": openbookqa_adapter,
    "winogrande": winogrande_adapter,
    "boolq": boolq_adapter,
}


def adapt_rows(
    rows: Iterable[Mapping[str, Any]], adapter: str, *, name: str = "rows"
) -> list[MCExample]:
    """Rows (a ``datasets.Dataset`` or a list of dicts) as examples through ``ADAPTERS[adapter]``."""
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown dataset adapter {adapter!r}; use one of {sorted(ADAPTERS)}.")
    convert = ADAPTERS[adapter]
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(convert(row, f"{name} row {i}"))
        except KeyError as err:
            raise ValueError(
                f"{name} row {i}: the {adapter!r} adapter needs field {err} (row has "
                f"{sorted(row)}); is this a {adapter} dataset?"
            ) from None
    return out


def read_hf_dataset(
    source: str, adapter: str, *, config: str | None = None
) -> dict[str, list[MCExample]]:
    """A Hugging Face dataset's splits as examples.

    Parameters
    ----------
    source : str
        A folder written by ``DatasetDict.save_to_disk`` (read with ``datasets.load_from_disk``),
        else a hub id for ``datasets.load_dataset`` (offline: only from its local cache).
    adapter : {"arc", "openbookqa", "winogrande", "boolq"}
    config : str, optional
        The dataset configuration, e.g. ``"ARC-Challenge"`` or ``"winogrande_m"``.

    Returns
    -------
    dict of str to list of MCExample
        Keyed ``train`` / ``validation`` / ``test`` (splits the dataset lacks are absent).
    """
    try:
        datasets: Any = importlib.import_module("datasets")  # optional dependency
    except ImportError:
        raise ImportError(
            "reading a Hugging Face dataset needs the 'datasets' package: pip install datasets"
        ) from None
    if Path(source).is_dir():
        data = datasets.load_from_disk(source)
    else:
        data = datasets.load_dataset(source, config)
    if isinstance(data, datasets.Dataset):
        data = datasets.DatasetDict({"test": data})
    return {
        split: adapt_rows(data[split], adapter, name=f"{source}[{split}]")
        for split in ("train", "validation", "test")
        if split in data
    }
