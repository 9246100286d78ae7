r"""Reading multiple-choice examples from the formats users have.

* **lm-evaluation-harness-style JSON / JSONL** (Gao et al. 2021): one record per question with a
  question, a list of choices and the answer (an index, or the right choice's text), rendered by
  a ``str.format`` template over the record's fields (default ``"Question: {question}\nAnswer:"``,
  lm-eval's ARC / SciQ prompt) — :func:`read_json_examples`.
* **BIG-bench** ``task.json`` (Srivastava et al. 2023, "Beyond the imitation game"): ``examples``
  with ``input`` and ``target_scores`` (choice → score); the answer is the first choice of the
  highest score, the prompt ``task_prefix + "Q: " + input + "\nA:"`` (BIG-bench's default
  ``example_input_prefix`` / ``example_output_prefix``, overridden by the file's own), with
  the choices listed after the input only on request (``append_choices``; BIG-bench's prompts
  list them unless the file sets ``append_choices_to_input`` false) — :func:`read_bigbench`.
* **Hugging Face datasets** rows through small adapters (field mappings, :data:`ADAPTERS`):
  ``arc`` (``allenai/ai2_arc``), ``openbookqa``, ``winogrande`` and ``boolq``, read from a folder
  saved with ``save_to_disk`` or a hub id (``datasets.load_dataset``, which needs the hub or its
  cache) — :func:`read_hf_dataset`. An adapter takes one row (a dict) and returns an
  :class:`MCExample`, so it works on a ``datasets.Dataset`` and on a list of dicts alike.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
import string
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .example import MCExample

logger = logging.getLogger(__name__)

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


def _read_text(path: Path) -> str:
    """A task file's text: UTF-8, a leading byte-order mark (as Windows tools write) dropped.

    Raises
    ------
    ValueError
        The file is not UTF-8, naming the file, the line and the byte.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{path} is not UTF-8 text: line {line} holds the byte "
            f"{data[err.start : err.start + 1]!r} ({err.reason}), as a file saved in another "
            "encoding (e.g. Windows-1252 or Latin-1) does. Save it as UTF-8 (e.g. `iconv -f "
            "cp1252 -t utf-8`) and read it again."
        ) from None


def _jsonl_records(path: Path, text: str) -> list[Any]:
    """One record per line of a JSON Lines file, blank lines skipped; a line that is not JSON
    is named by its line number in the file. Lines end at ``\\n`` only: U+2028 and the other
    characters ``str.splitlines`` also splits at may sit unescaped inside a JSON string."""
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path} line {number} is not valid JSON ({err.msg}, column {err.colno}); a "
                "JSONL file holds one JSON record per line. Fix or remove that line."
            ) from None
    return out


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"multiple-choice task file {path} does not exist.")
    text = _read_text(path)
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return _jsonl_records(path, text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        lines = " (one JSON record per line is JSON Lines: name the file .jsonl)"
        raise ValueError(
            f"{path} is not valid JSON: {err}{lines if err.msg == 'Extra data' else ''}"
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
        as_index = int(answer) if answer.strip().isdigit() else None
        if answer in choices:
            as_text = choices.index(answer)
            if as_index is not None and as_index != as_text and as_index < len(choices):
                raise ValueError(
                    f"{where}: answer {answer!r} reads two ways: the text of choice {as_text} "
                    f"({choices[as_text]!r}) and the index of choice {as_index} "
                    f"({choices[as_index]!r}). Write it as a JSON integer, which is read as "
                    f"an index only: {as_text} for {choices[as_text]!r}, {as_index} for "
                    f"{choices[as_index]!r}."
                )
            return as_text
        if as_index is not None:
            return as_index
    raise ValueError(
        f"{where}: answer {answer!r} is neither a choice index nor one of the choices {choices!r}."
    )


#: ``{name}`` in a template's literal text: a field written as Jinja's ``{{name}}``
#: (lm-evaluation-harness's ``doc_to_text``), which ``str.format`` prints as the text ``{name}``
_LITERAL_FIELD = re.compile(r"\{\s*([A-Za-z_]\w*)[^{}\0]*\}")
_JINJA_FIELD = re.compile(r"(?<!\{)\{\{\s*([A-Za-z_]\w*)\s*\}\}(?!\})")


def _template_fields(template: str, names: set[str]) -> set[str]:
    """The record fields ``template`` names (the part of each replacement field before ``.``
    or ``[``).

    Raises
    ------
    ValueError
        A template that is not ``str.format``'s (a stray brace), or one that writes a field of
        the records (``names``) as Jinja's ``{{question}}``: ``str.format`` reads ``{{`` as a
        literal brace, so every prompt would hold the same text ``{question}``.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(
            f"template {template!r} is not a valid str.format template ({err}); write a "
            "literal brace as '{{' or '}}'."
        ) from None
    literal = "".join(text + ("\0" if name is not None else "") for text, name, _, _ in parsed)
    jinja = [m.group(1) for m in _LITERAL_FIELD.finditer(literal) if m.group(1) in names]
    if jinja:
        fixed = _JINJA_FIELD.sub(lambda m: "{" + m.group(1) + "}", template)
        raise ValueError(
            f"template {template!r} writes the field {jinja[0]!r} as Jinja does "
            f"({{{{{jinja[0]}}}}}, lm-evaluation-harness's doc_to_text), but it is a str.format "
            f"template, where '{{{{' is a literal brace: every prompt would hold the text "
            f"{{{jinja[0]}}} instead of the record's {jinja[0]}. Write one brace per side: "
            f"template = {fixed!r}."
        )
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for _, name, _, _ in parsed if name}


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
        ``.jsonl`` (one record a line; ``.ndjson`` too, any case) or ``.json`` (a list of
        records, or ``{"examples": [...]}``), UTF-8 (a leading byte-order mark is dropped).
    template : str
        ``str.format`` template over the record's fields; ``{question}`` names ``question_key``.
        Trailing spaces of the rendered prompt are dropped (as :func:`read_bigbench` drops
        those of its output prefix ``"\\nA: "``): the task's delimiter (``" "``) goes between
        the prompt and each choice, so a template ending in ``"Answer: "`` would otherwise put
        two spaces before every choice. A field written as Jinja's ``{{question}}``
        (lm-evaluation-harness's ``doc_to_text``; ``str.format`` prints it as the text
        ``{question}``) and a field the template names that is null in a record (it would
        print ``None``) are refused.
    question_key, choices_key, answer_key : str
        The record's fields: the question text, the list of choices, the answer (an integer
        index, a digit string, or the right choice's text). A digit string that is one choice's
        text and another choice's index (``"1"`` of ``["2", "0", "1"]``) is refused: write the
        answer as an integer.

    Returns
    -------
    list of MCExample
    """
    path = Path(path)
    records = _records(path)
    names = {question_key, "question"}.union(*(r for r in records if isinstance(r, Mapping)))
    used = _template_fields(template, names)
    out = []
    for i, record in enumerate(records):
        where = f"{path} record {i}"
        if not isinstance(record, Mapping):
            raise ValueError(
                f"{where} is {type(record).__name__} {record!r}, not an object with the fields "
                f"{[question_key, choices_key, answer_key]}."
            )
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
        null = sorted(k for k in used if k in fields and fields[k] is None)
        if null:
            raise ValueError(
                f"{where}: field(s) {null} of template {template!r} are null, which the prompt "
                "would read as the text 'None'. Give them a value, or leave the record out."
            )
        out.append(_json_example(record, fields, template, choices, answer_key, where))
    return out


def _json_example(
    record: Mapping[str, Any],
    fields: dict[str, Any],
    template: str,
    choices: list[Any],
    answer_key: str,
    where: str,
) -> MCExample:
    """One JSON record rendered by ``template`` (trailing spaces dropped) as an example."""
    try:
        prompt = template.format(**fields).rstrip(" ")
    except (KeyError, IndexError, AttributeError) as err:
        raise ValueError(
            f"{where}: template {template!r} names a missing field {err}; the record has "
            f"{sorted(record)}."
        ) from None
    except ValueError as err:  # a bad format spec
        raise ValueError(
            f"template {template!r} is not a valid str.format template ({err}); write a "
            "literal brace as '{{' or '}}'."
        ) from None
    answer = _answer_index(record[answer_key], choices, where)
    return MCExample(prompt, tuple(choices), answer, {"source": where})


class _Pairs(dict):
    """A JSON object that remembers the keys it held more than once (``json`` keeps the last)."""

    repeated: list[str]


def _object_pairs(pairs: list[tuple[str, Any]]) -> _Pairs:
    out = _Pairs(pairs)
    seen: set[str] = set()
    repeated: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            repeated.add(key)
        seen.add(key)
    out.repeated = sorted(repeated)
    return out


def _score(value: Any, choice: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"{where}: target_scores[{choice!r}] = {value!r} is not a finite number; BIG-bench "
            "scores each choice with a number (1 for a right answer, 0 for a wrong one)."
        )
    return float(value)


#: BIG-bench's ``choice_prefix`` when a task file gives none (its ``json_task`` default).
BIGBENCH_CHOICE_PREFIX = "\n  choice: "


def _choice_prefix(task: Mapping[str, Any], path: Path, append_choices: bool | None) -> str | None:
    """The text put before each listed choice, or None when the prompts list no choices.

    ``append_choices`` True lists them, False does not, None follows the file's
    ``append_choices_to_input`` (BIG-bench's default: true). A file that asks for them under
    ``append_choices=False`` gets one logged warning saying how to list them."""
    if append_choices is not None and not isinstance(append_choices, bool):
        raise TypeError(
            f"read_bigbench: append_choices must be True, False or None (follow the task "
            f"file), got {append_choices!r} ({type(append_choices).__name__})."
        )
    asked = task.get("append_choices_to_input", True)
    if not isinstance(asked, bool):
        raise ValueError(
            f"{path}: 'append_choices_to_input' = {asked!r} is not a JSON boolean (true or "
            "false); fix the task file."
        )
    prefix = task.get("choice_prefix", BIGBENCH_CHOICE_PREFIX)
    if not isinstance(prefix, str):
        raise ValueError(f"{path}: 'choice_prefix' = {prefix!r} is not a string; fix the file.")
    if append_choices is False and asked:
        logger.warning(
            "%s: the task file asks for the choices in the prompt (append_choices_to_input is "
            "%s), as BIG-bench's own prompts list them; these prompts leave them out. Pass "
            "read_bigbench(..., append_choices=None) (causal_lm.task.append_choices = true in a "
            "job config) to list them.",
            path,
            "true" if "append_choices_to_input" in task else "absent, BIG-bench's default true",
        )
    return prefix if (asked if append_choices is None else append_choices) else None


def _bigbench_example(example: Any, where: str) -> tuple[str, list[str], list[float]]:
    """One example's question, choices (file order) and scores, or a ``ValueError``."""
    if not isinstance(example, Mapping):
        raise ValueError(
            f"{where} is {type(example).__name__} {example!r}, not an object with 'input' "
            "and 'target_scores'."
        )
    scores = example.get("target_scores")
    if not isinstance(scores, Mapping) or len(scores) < 2:
        raise ValueError(
            f"{where} has no 'target_scores' with >= 2 choices; it is not a multiple-choice "
            "task (generative BIG-bench tasks are not supported)."
        )
    repeated = getattr(scores, "repeated", None)
    if repeated:
        raise ValueError(
            f"{where}: target_scores lists the choice(s) {repeated!r} more than once (JSON "
            "keeps only the last score); give each choice once."
        )
    if "input" not in example:
        raise ValueError(f"{where} lacks the key 'input' (the question; has {sorted(example)}).")
    question = example["input"]
    if isinstance(question, bool) or not isinstance(question, (str, int, float)):
        raise ValueError(f"{where}: 'input' must be a string (the question), got {question!r}.")
    choices = [str(c) for c in scores]
    values = [_score(v, c, where) for c, v in scores.items()]
    best = max(values)
    if best <= 0 or min(values) == best:
        raise ValueError(
            f"{where} has no right answer: target_scores {dict(scores)!r} give no choice a "
            "score above 0 and above the others. Fix the example's scores (1 for the right "
            "answer) or remove it."
        )
    return str(question), choices, values


def read_bigbench(path: str | Path, *, append_choices: bool | None = False) -> list[MCExample]:
    """Examples of a BIG-bench multiple-choice ``task.json`` (see the module docstring).

    Parameters
    ----------
    path : str or Path
        A ``task.json`` whose examples carry ``input`` (a string) and ``target_scores`` (each
        choice's score, a finite number).
    append_choices : bool or None
        List the choices in the prompt, after the question, as BIG-bench's ``json_task``
        formats an example (as we understand its source): ``input + choice_prefix +
        choice_prefix.join(choices)``, with the file's ``choice_prefix`` (default
        ``"\\n  choice: "``), before the output prefix. ``False`` (the default, with which
        the measured tables of docs/causal_lm.md were made) never lists them, ``True``
        always does, ``None`` follows the file's ``append_choices_to_input`` (BIG-bench's
        default: true). The choices are listed in the file's order (BIG-bench may show them
        in a seeded shuffled order, which is not reproduced). Under ``False``, a file that
        asks for the choices (``append_choices_to_input`` true or absent) gets one logged
        warning saying so.

    Returns
    -------
    list of MCExample
        Choices in the file's order; the answer is the first choice of the highest score.
        Examples that give several choices the highest score (several right answers) are
        counted in one logged warning: only the first of them is scored as right, so the
        accuracy under-counts against BIG-bench's ``multiple_choice_grade``, which credits any.

    Raises
    ------
    ValueError
        Naming the file and the example: an example that is not an object or lacks ``input``,
        ``target_scores`` that are not an object of >= 2 choices, a choice listed twice, a
        score that is not a finite number, or no right answer (no choice scores above 0, or
        every choice scores the same); an ``append_choices_to_input`` that is not a boolean or
        a ``choice_prefix`` that is not a string.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"BIG-bench task file {path} does not exist.")
    try:
        task = json.loads(_read_text(path), object_pairs_hook=_object_pairs)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(task, Mapping) or not isinstance(task.get("examples"), list):
        raise ValueError(f"{path}: a BIG-bench task.json holds an 'examples' list.")
    prefix = str(task.get("task_prefix", ""))
    q_prefix = str(task.get("example_input_prefix", "Q: ")).lstrip("\n")
    a_prefix = str(task.get("example_output_prefix", "\nA: ")).rstrip(" ")
    choice_prefix = _choice_prefix(task, path, append_choices)
    out = []
    several = 0
    for i, example in enumerate(task["examples"]):
        where = f"{path} example {i}"
        question, choices, values = _bigbench_example(example, where)
        several += values.count(max(values)) > 1
        if choice_prefix is not None:
            question += choice_prefix + choice_prefix.join(choices)
        prompt = f"{prefix}{q_prefix}{question}{a_prefix}"
        answer = values.index(max(values))
        out.append(MCExample(prompt, tuple(choices), answer, {"source": where}))
    if several:
        logger.warning(
            "%s: %d of %d examples give several choices the highest score (several right "
            "answers); only the first of them is scored as right, so accuracy under-counts "
            "against BIG-bench's multiple_choice_grade, which credits any of them.",
            path,
            several,
            len(out),
        )
    return out


class _Unlabelled(ValueError):
    """A dataset row without an answer (e.g. Winogrande's test split: ``answer = ""``)."""


def _unlabelled(answer: Any) -> bool:
    return answer is None or (isinstance(answer, str) and not answer.strip())


def _labelled(row: Mapping[str, Any], question: str, where: str) -> MCExample:
    """ARC / OpenBookQA: ``choices = {"text": [...], "label": [...]}``, ``answerKey`` a label."""
    choices = row["choices"]
    if not isinstance(choices, Mapping) or not {"text", "label"} <= set(choices):
        raise ValueError(
            f"{where}: 'choices' must be an object with lists 'text' and 'label' (the "
            f"allenai/ai2_arc layout), got {choices!r}."
        )
    texts = list(choices["text"])
    labels = [str(label) for label in choices["label"]]
    if _unlabelled(row["answerKey"]):
        raise _Unlabelled(f"{where}: answerKey {row['answerKey']!r} is empty (an unlabelled row).")
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if len(labels) != len(texts) or repeated:
        why = (
            f"{len(labels)} labels {labels} for {len(texts)} choices"
            if len(labels) != len(texts)
            else f"the labels {labels}, of which {repeated} repeat"
        )
        raise ValueError(
            f"{where}: 'choices' has {why}, so answerKey cannot name one choice: each choice "
            "needs one label of its own (the allenai/ai2_arc layout, 'text' and 'label' of the "
            "same length). Fix the row or leave it out."
        )
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
    (``"1"`` or ``"2"``; ``""`` in the unlabelled test split). The prompt is the sentence before
    the blank; choice k is option k followed by the rest of the sentence (full-sentence scoring;
    lm-evaluation-harness scores the shared rest given each filled-in start instead)."""
    sentence = str(row["sentence"])
    if sentence.count("_") != 1:
        raise ValueError(f"{where}: a Winogrande sentence holds one '_', got {sentence!r}.")
    answer = row["answer"]
    if _unlabelled(answer):
        raise _Unlabelled(f"{where}: answer {answer!r} is empty (an unlabelled row).")
    if str(answer).strip() not in ("1", "2"):
        raise ValueError(f"{where}: a Winogrande answer is '1' or '2', got {answer!r}.")
    before, after = sentence.split("_")
    choices = (str(row["option1"]) + after, str(row["option2"]) + after)
    return MCExample(before.rstrip(), choices, int(str(answer)) - 1, {"source": where})


#: BoolQ answers given as text (case-insensitive, stripped), and the choice each one means
_BOOL_TEXT = {"false": 0, "no": 0, "0": 0, "true": 1, "yes": 1, "1": 1}


def _bool_answer(answer: Any, where: str) -> int:
    """A BoolQ answer as the index of ``no`` (0) or ``yes`` (1): a bool, the integer 0 or 1, or
    one of :data:`_BOOL_TEXT`; anything else is refused (``bool("false")`` would read yes)."""
    if isinstance(answer, bool):
        return int(answer)
    if isinstance(answer, int) and answer in (0, 1):
        return answer
    if isinstance(answer, str) and answer.strip().lower() in _BOOL_TEXT:
        return _BOOL_TEXT[answer.strip().lower()]
    raise ValueError(
        f"{where}: field 'answer' = {answer!r} ({type(answer).__name__}) is not a yes/no answer; "
        "give a bool, the integer 0 or 1, or one of the strings true/false, yes/no, 1/0 (any "
        "case)."
    )


def boolq_adapter(row: Mapping[str, Any], where: str = "boolq row") -> MCExample:
    """``google/boolq``: ``passage``, ``question``, ``answer`` (a bool; also 0/1 or the strings
    true/false, yes/no, 1/0 in any case); choices ``no`` / ``yes`` (lm-evaluation-harness's
    prompt)."""
    prompt = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
    if _unlabelled(row["answer"]):
        raise _Unlabelled(f"{where}: answer {row['answer']!r} is empty (an unlabelled row).")
    return MCExample(prompt, ("no", "yes"), _bool_answer(row["answer"], where), {"source": where})


#: Adapter per dataset family: a row (dict) → MCExample.
ADAPTERS: dict[str, Callable[..., MCExample]] = {
    "arc": arc_adapter,
    "openbookqa": openbookqa_adapter,
    "winogrande": winogrande_adapter,
    "boolq": boolq_adapter,
}


def adapt_rows(
    rows: Iterable[Mapping[str, Any]],
    adapter: str,
    *,
    name: str = "rows",
    skip_unlabelled: bool = False,
) -> list[MCExample]:
    """Rows (a ``datasets.Dataset`` or a list of dicts) as examples through ``ADAPTERS[adapter]``.

    Parameters
    ----------
    rows : iterable of dict
    adapter : str
        A key of :data:`ADAPTERS`.
    name : str
        Names the rows in error messages (e.g. ``"data[test]"``).
    skip_unlabelled : bool
        Leave out rows without an answer (Winogrande's test split has ``answer = ""``), with a
        logged warning that counts them; without it such a row is an error.

    Raises
    ------
    ValueError
        Naming the row: a field the adapter needs is missing or has the wrong shape, or (without
        ``skip_unlabelled``) the row has no answer.
    """
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown dataset adapter {adapter!r}; use one of {sorted(ADAPTERS)}.")
    convert = ADAPTERS[adapter]
    out = []
    skipped = 0
    for i, row in enumerate(rows):
        where = f"{name} row {i}"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where} is {type(row).__name__} {row!r}, not a record (a dict).")
        try:
            out.append(convert(row, where))
        except _Unlabelled as err:
            if not skip_unlabelled:
                raise ValueError(
                    f"{err} The {adapter!r} adapter needs labelled rows; leave this split out "
                    "(or pass skip_unlabelled=True)."
                ) from None
            skipped += 1
        except KeyError as err:
            raise ValueError(
                f"{where}: the {adapter!r} adapter needs field {err} (row has "
                f"{sorted(row)}); is this a {adapter} dataset?"
            ) from None
        except (TypeError, AttributeError, IndexError) as err:
            raise ValueError(
                f"{where}: a field does not have the {adapter!r} dataset's layout ({err}; row "
                f"has {sorted(row)}); is this a {adapter} dataset?"
            ) from None
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows without an answer (unlabelled)%s.",
            name,
            skipped,
            skipped + len(out),
            "; the split is empty" if not out else "",
        )
    return out


#: Split names :func:`read_hf_dataset` reads (case-insensitive), and the split each one is.
_SPLIT_NAMES = {
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
}
_KNOWN_SPLITS = "'train', 'validation' (or 'valid', 'val', 'dev') and 'test'"
_SPLIT_ORDER = {"train": 0, "validation": 1, "test": 2}


def _named_splits(data: Any, source: str, datasets: Any) -> dict[str, Any]:
    """``{"train" | "validation" | "test": dataset}`` of a loaded dataset (see
    :func:`read_hf_dataset`); a split of another name is refused or reported, never dropped
    silently."""
    if isinstance(data, datasets.Dataset):
        split = _SPLIT_NAMES.get(str(getattr(data, "split", None) or "").lower())
        if split is None:
            logger.warning(
                "%s holds one Dataset, not a DatasetDict of named splits; it is read as the "
                "'test' split. Save a DatasetDict (e.g. DatasetDict({'train': ..., 'test': "
                "...})) to name its splits.",
                source,
            )
        return {split or "test": data}
    found = list(data)
    out: dict[str, Any] = {}
    names: dict[str, str] = {}
    for name in found:
        split = _SPLIT_NAMES.get(str(name).lower())
        if split is None:
            continue
        if split in out:
            raise ValueError(
                f"{source}: splits {names[split]!r} and {name!r} both read as the {split!r} "
                "split; save the dataset with one of them (or rename the other)."
            )
        out[split], names[split] = data[name], name
    left = [name for name in found if name not in names.values()]
    if not out:
        raise ValueError(
            f"{source} has the split(s) {found!r}, none of which is read: read_hf_dataset reads "
            f"the splits named {_KNOWN_SPLITS}. Save the dataset with those names."
        )
    if left:
        logger.warning(
            "%s: split(s) %r are left out (read: %r); read_hf_dataset reads the splits named "
            "%s. Rename a split to use it.",
            source,
            left,
            [names[s] for s in out],
            _KNOWN_SPLITS,
        )
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
        The dataset configuration of a hub id, e.g. ``"ARC-Challenge"`` or ``"winogrande_m"``.
        A folder holds the one configuration it was saved from: a ``config`` with a folder is
        refused.

    Returns
    -------
    dict of str to list of MCExample
        Keyed ``train`` / ``validation`` / ``test`` (splits the dataset lacks are absent); a
        split named ``dev``, ``valid`` or ``val`` (any case) is the validation split. Other
        splits are left out with a logged warning naming them (a dataset with none of these
        names is refused). A lone ``Dataset`` saved without a ``DatasetDict`` is the split its
        ``split`` attribute names, else the test split (with a logged warning). Rows without an
        answer (Winogrande's test split) are left out with a logged warning, so an unlabelled
        split is an empty list.

    Raises
    ------
    ValueError
        A ``config`` with a folder, two splits read as one (``dev`` and ``validation``), or no
        split of a name read.
    """
    try:
        datasets: Any = importlib.import_module("datasets")  # optional dependency
    except ImportError:
        raise ImportError(
            "reading a Hugging Face dataset needs the 'datasets' package: pip install datasets"
        ) from None
    if Path(source).is_dir():
        if config:
            raise ValueError(
                f"config {config!r} cannot apply to {source}: a folder written by save_to_disk "
                "holds the one configuration it was saved from, and load_from_disk reads that. "
                "Remove config (causal_lm.task.config in a job config), or name the hub id to "
                "load that configuration."
            )
        data = datasets.load_from_disk(source)
    else:
        data = datasets.load_dataset(source, config)
    return {
        split: adapt_rows(rows, adapter, name=f"{source}[{split}]", skip_unlabelled=True)
        for split, rows in sorted(
            _named_splits(data, source, datasets).items(), key=lambda kv: _SPLIT_ORDER[kv[0]]
        )
    }
