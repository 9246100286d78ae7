"""What the multiple-choice readers and tasks refuse or report: BIG-bench examples without a
right answer or with malformed fields, identical choices, rows of the wrong layout, unlabelled
dataset rows, few-shot shots that repeat the target question, and truncated prompts."""

from __future__ import annotations

import json
import logging
import random

import pytest
from transformers import ByT5Tokenizer

from pyrobayes.tasks import (
    MCExample,
    MultipleChoiceTask,
    adapt_rows,
    read_bigbench,
    read_json_examples,
)


@pytest.mark.parametrize(
    "example, match",
    [
        ({"input": "x", "target_scores": {"a": 0, "b": 0}}, "has no right answer"),
        ({"input": "x", "target_scores": {"a": 1, "b": 1}}, "has no right answer"),
        ('{"input": "x", "target_scores": {"a": NaN, "b": 0}}', r"\['a'\] = nan is not a finite"),
        ({"input": "x", "target_scores": {"a": "yes", "b": 0}}, r"\['a'\] = 'yes' is not a fin"),
        ('{"input": "x", "target_scores": {"a": 1, "b": 0, "a": 0}}', r"\['a'\] more than once"),
        ({"target_scores": {"a": 1, "b": 0}}, "lacks the key 'input'"),
        ("x", "is str 'x', not an object"),
    ],
    ids=["all-zero", "all-equal", "nan", "string", "duplicate-key", "no-input", "not-object"],
)
def test_bigbench_refuses_bad_examples_naming_the_file_and_example(tmp_path, example, match):
    good = {"input": "fine", "target_scores": {"a": 1, "b": 0}}
    text = example if isinstance(example, str) and example.startswith("{") else json.dumps(example)
    path = tmp_path / "task.json"
    path.write_text('{"examples": [' + json.dumps(good) + ", " + text + "]}")
    with pytest.raises(ValueError, match=match) as err:
        read_bigbench(path)
    assert f"{path} example 1" in str(err.value)


def test_identical_choices_are_refused_naming_the_question(tmp_path):
    with pytest.raises(ValueError, match=r"'Question: Is it\?\\nAnswer:' lists the choice\(s\)"):
        MCExample("Question: Is it?\nAnswer:", ("same", "same", "other"), 2)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "Q?", "choices": ["b", "b"], "answer": 0}))
    with pytest.raises(ValueError, match=r"t.jsonl record 0\).*\['b'\] more than once"):
        read_json_examples(path)


def test_template_with_a_stray_brace_is_a_value_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "Q?", "choices": ["a", "b"], "answer": 0}))
    with pytest.raises(ValueError, match="not a valid str.format template"):
        read_json_examples(path, template="Q: {question} {")


def test_rows_of_the_wrong_layout_and_unlabelled_rows(caplog):
    arc = {"question": "Q?", "choices": ["a", "b"], "answerKey": "A"}
    with pytest.raises(ValueError, match="data row 0: 'choices' must be an object"):
        adapt_rows([arc], "arc", name="data")
    with pytest.raises(ValueError, match="data row 0 is list"):
        adapt_rows([["x"]], "arc", name="data")
    wino = {"sentence": "Sam thanked Pat because _ helped.", "option1": "Sam", "option2": "Pat"}
    rows = [{**wino, "answer": "2"}, {**wino, "answer": ""}]
    with pytest.raises(ValueError, match=r"data\[test\] row 1: answer '' is empty"):
        adapt_rows(rows, "winogrande", name="data[test]")
    with caplog.at_level(logging.WARNING):
        kept = adapt_rows(rows, "winogrande", name="data[test]", skip_unlabelled=True)
    assert [e.answer for e in kept] == [1]
    assert "data[test]: skipped 1 of 2 rows without an answer" in caplog.text


def test_fewshot_never_shows_the_target_question_and_duplicates_are_counted(caplog):
    unique = [MCExample(f"Question: q{i}\nAnswer:", ("a", "b"), 0) for i in range(6)]
    repeated = MCExample("Question: What is 7*6?\nAnswer:", ("41", "42"), 1)
    train = [*unique, repeated, repeated]
    with caplog.at_level(logging.WARNING):
        task = MultipleChoiceTask({"train": train, "test": [repeated] * 3}, num_fewshot=5)
    assert task.duplicates == {
        "validation in train": 0,
        "test in train": 3,
        "test in validation": 0,
    }
    assert "3 test in train" in caplog.text
    for split, count in (("test", 3), ("train", len(train))):
        for i in range(count):
            target = task.splits[split][i].prompt
            shots = task.shots(split, i)
            assert len(shots) == 5 and all(s.prompt != target for s in shots), (split, i)
    # without repeats the shots are the draws they always were (same seed, same pool)
    plain = MultipleChoiceTask({"train": unique, "test": [repeated]}, num_fewshot=2, seed=3)
    draw = random.Random("3:test:0").sample(range(len(unique)), 2)
    assert plain.shots("test", 0) == [unique[j] for j in draw]


def test_encode_counts_the_questions_max_length_truncates(caplog):
    tokenizer = ByT5Tokenizer()
    examples = [
        MCExample("short?", ("yes", "no"), 0),
        MCExample("x" * 40 + "?", ("yes", "no way"), 1),
        MCExample("y" * 30 + "?", ("a", "b"), 0),
    ]
    task = MultipleChoiceTask({"test": examples})
    with caplog.at_level(logging.INFO, logger="pyrobayes.tasks.task"):
        task.encode(tokenizer, "test", batch_size=2, max_length=32)
    # ByT5: one id a byte (the EOS it appends to the prompt is left out, as the rows leave it
    # out); the longest row is prompt + " no way"
    over = [max(0, 41 + 7 - 32), max(0, 31 + 2 - 32)]
    assert task.truncation["test"] == {
        "questions": 3,
        "truncated": 2,
        "max_tokens": max(over),
        "mean_tokens": sum(over) / 2,
    }
    assert "2 of 3 test questions are longer than max_length=32" in caplog.text
    task.encode(tokenizer, "test", batch_size=2, max_length=64)
    assert task.truncation["test"]["truncated"] == 0


def test_boolq_answers_read_as_text_or_0_1_and_others_are_refused():
    # bool("false") is True: a string answer must be read as what it says, not by truthiness
    row = {"passage": "p", "question": "is it"}
    answers = [False, True, 0, 1, "false", "False", " no ", "0", "TRUE", "Yes", "1"]
    got = [e.answer for e in adapt_rows([{**row, "answer": a} for a in answers], "boolq")]
    assert got == [0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1]
    for bad in ("maybe", 2, 0.5):
        rows = [{**row, "answer": True}, {**row, "answer": bad}]
        with pytest.raises(ValueError, match=r"data row 1: field 'answer' = .* true/false, yes/no"):
            adapt_rows(rows, "boolq", name="data")


def test_json_digit_answer_that_is_one_choices_text_and_anothers_index_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    fine = [
        {"question": "2+2?", "choices": ["3", "4", "5"], "answer": "1"},  # no choice "1": index
        {"question": "1+0?", "choices": ["0", "1", "2"], "answer": "1"},  # both read choice 1
        {"question": "3-1?", "choices": ["1", "2", "3"], "answer": 2},  # an int: an index only
        {"question": "Is it?", "choices": ["no", "yes"], "answer": "yes"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in fine))
    assert [e.answer for e in read_json_examples(path)] == [1, 1, 2, 1]
    bad = {"question": "0+1?", "choices": ["2", "0", "1"], "answer": "1"}
    path.write_text("\n".join(json.dumps(r) for r in [*fine, bad]))
    with pytest.raises(ValueError, match=r"record 4: answer '1' reads two ways") as err:
        read_json_examples(path)
    assert "choice 2 ('1')" in str(err.value) and "choice 1 ('0')" in str(err.value)
    assert "JSON integer" in str(err.value)


@pytest.mark.parametrize(
    "limit, error, match",
    [
        (-1, ValueError, "limit must be an integer >= 1; got -1"),
        (0, ValueError, "limit must be an integer >= 1; got 0"),
        (2.0, TypeError, r"limit must be an integer >= 1; got 2.0 .*\(pass limit=2\)"),
        ("3", TypeError, "limit must be an integer >= 1; got '3'"),
    ],
)
def test_encode_refuses_a_limit_that_is_not_a_positive_int(limit, error, match):
    task = MultipleChoiceTask({"test": [MCExample(f"q{i}", ("a", "b"), i % 2) for i in range(4)]})
    with pytest.raises(error, match=match) as err:
        task.encode(ByT5Tokenizer(), "test", limit=limit)
    assert "MultipleChoiceTask.encode" in str(err.value) and "limit=None" in str(err.value)
    assert "test" not in task.truncation  # nothing was recorded for the refused call
    assert len(task.encode(ByT5Tokenizer(), "test", batch_size=1, limit=3)) == 3
