"""What the readers say about the source they read: BIG-bench examples with several right
answers, BIG-bench's listed choices (``append_choices``), a JSON template ending in a space, and
Hugging Face datasets whose split names are not ``train`` / ``validation`` / ``test``."""

from __future__ import annotations

import json
import logging

import pytest

from pyrobayes.tasks import read_bigbench, read_hf_dataset, read_json_examples

QUESTION = "Which of the options below is a colour?"


def bigbench(tmp_path, examples, **fields):
    path = tmp_path / "task.json"
    path.write_text(json.dumps({**fields, "examples": examples}))
    return path


def test_bigbench_examples_with_several_right_answers_are_counted_in_one_warning(tmp_path, caplog):
    examples = [
        {"input": "Which are prime?", "target_scores": {"4": 0, "3": 1, "5": 1}},
        {"input": "Which is even?", "target_scores": {"4": 1, "3": 0, "5": 0}},
        {"input": "Which are odd?", "target_scores": {"4": 0, "3": 1, "5": 1}},
    ]
    path = bigbench(tmp_path, examples, append_choices_to_input=False)
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.formats"):
        read = read_bigbench(path)
    assert [e.answer for e in read] == [1, 0, 1]  # the first of the highest scores
    (record,) = caplog.records
    assert "2 of 3 examples give several choices the highest score" in record.getMessage()
    assert "only the first of them is scored as right" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.formats"):
        read_bigbench(bigbench(tmp_path, examples[1:2], append_choices_to_input=False))
    assert not caplog.records


@pytest.mark.parametrize(
    "fields, append, listed",
    [
        ({}, None, "\n  choice: red\n  choice: dog"),  # BIG-bench's default: listed
        ({"append_choices_to_input": True}, None, "\n  choice: red\n  choice: dog"),
        ({"choice_prefix": "\n  option: "}, None, "\n  option: red\n  option: dog"),
        ({"append_choices_to_input": False}, None, ""),
        ({"append_choices_to_input": False}, True, "\n  choice: red\n  choice: dog"),
        ({}, True, "\n  choice: red\n  choice: dog"),
        ({}, False, ""),
    ],
)
def test_bigbench_lists_the_choices_as_asked(tmp_path, caplog, fields, append, listed):
    examples = [{"input": QUESTION, "target_scores": {"red": 1, "dog": 0}}]
    path = bigbench(tmp_path, examples, **fields)
    with caplog.at_level(logging.INFO, logger="pyrobayes.tasks.formats"):
        (example,) = read_bigbench(path, append_choices=append)
    assert example.prompt == f"Q: {QUESTION}{listed}\nA:"
    assert example.choices == ("red", "dog")
    # the file asks for the choices and they are left out: said once, with how to list them
    said = [r.getMessage() for r in caplog.records if "asks for the choices" in r.getMessage()]
    if append is False and fields.get("append_choices_to_input", True):
        (message,) = said
        assert "append_choices=None" in message and "causal_lm.task.append_choices" in message
    else:
        assert not said


def test_bigbench_default_lists_no_choices_and_says_so_once(tmp_path, caplog):
    examples = [
        {"input": f"{QUESTION} {i}", "target_scores": {"red": 1, "dog": 0}} for i in range(3)
    ]
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.formats"):
        read = read_bigbench(bigbench(tmp_path, examples))
    assert [e.prompt for e in read] == [f"Q: {QUESTION} {i}\nA:" for i in range(3)]
    assert len(caplog.records) == 1
    assert "these prompts leave them out" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "fields, append, error, match",
    [
        ({"append_choices_to_input": "yes"}, False, ValueError, "'append_choices_to_input' ="),
        ({"choice_prefix": 3}, None, ValueError, "'choice_prefix' = 3 is not a string"),
        ({}, "yes", TypeError, "append_choices must be True, False or None"),
    ],
)
def test_bigbench_choice_fields_of_the_wrong_type_are_refused(
    tmp_path, fields, append, error, match
):
    examples = [{"input": QUESTION, "target_scores": {"red": 1, "dog": 0}}]
    with pytest.raises(error, match=match):
        read_bigbench(bigbench(tmp_path, examples, **fields), append_choices=append)


def test_a_template_ending_in_a_space_gets_one_space_before_the_choices(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"question": "Capital of France?", "choices": ["Paris", "Rome"], "answer": 0})
    )
    for template in ("Question: {question}\nAnswer: ", "Question: {question}\nAnswer:"):
        (example,) = read_json_examples(path, template=template)
        assert example.prompt == "Question: Capital of France?\nAnswer:"


def arc_rows(datasets, start, stop):
    return datasets.Dataset.from_list(
        [
            {
                "question": f"q{i}",
                "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                "answerKey": "A",
            }
            for i in range(start, stop)
        ]
    )


def test_hf_split_aliases_are_read_and_other_splits_are_named(tmp_path, caplog):
    datasets = pytest.importorskip("datasets")
    folder = str(tmp_path / "arc")
    splits = {"train": (0, 6), "dev": (6, 9), "test": (9, 12), "extra": (12, 14)}
    datasets.DatasetDict({k: arc_rows(datasets, *v) for k, v in splits.items()}).save_to_disk(
        folder
    )
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.formats"):
        read = read_hf_dataset(folder, "arc")
    assert {k: len(v) for k, v in read.items()} == {"train": 6, "validation": 3, "test": 3}
    assert read["validation"][0].prompt == "Question: q6\nAnswer:"
    assert "split(s) ['extra'] are left out" in caplog.text
    # a dataset with no split of a name read, or two read as one, is refused naming them
    for names, match in (
        (["training", "eval"], r"has the split\(s\) \['training', 'eval'\], none of which is read"),
        (["train", "dev", "validation"], "splits 'dev' and 'validation' both read as"),
    ):
        other = str(tmp_path / "_".join(names))
        datasets.DatasetDict({n: arc_rows(datasets, 0, 2) for n in names}).save_to_disk(other)
        with pytest.raises(ValueError, match=match):
            read_hf_dataset(other, "arc")


def test_hf_lone_dataset_and_config_with_a_folder(tmp_path, caplog):
    datasets = pytest.importorskip("datasets")
    named = str(tmp_path / "named")
    datasets.Dataset.from_list(list(arc_rows(datasets, 0, 4)), split="train").save_to_disk(named)
    assert {k: len(v) for k, v in read_hf_dataset(named, "arc").items()} == {"train": 4}
    alone = str(tmp_path / "alone")
    arc_rows(datasets, 0, 4).save_to_disk(alone)
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.formats"):
        assert {k: len(v) for k, v in read_hf_dataset(alone, "arc").items()} == {"test": 4}
    assert "holds one Dataset, not a DatasetDict" in caplog.text
    with pytest.raises(ValueError, match="config 'ARC-Challenge' cannot apply to .*Remove config"):
        read_hf_dataset(named, "arc", config="ARC-Challenge")
