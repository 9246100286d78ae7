"""Silent cases of the task splits and readers, now reported or refused by name: a split whose
positive share rounds to no example, a split of share 0 that takes the rounding remainder,
and an ARC-layout row whose labels do not name its choices one each."""

from __future__ import annotations

import logging

import pytest

from pyrobayes.tasks import MCExample, MultipleChoiceTask
from pyrobayes.tasks.formats import adapt_rows


def _examples(n: int) -> list[MCExample]:
    return [MCExample(f"Question {i}?", ("yes", "no"), i % 2) for i in range(n)]


def _sizes(task: MultipleChoiceTask) -> dict[str, int]:
    return {split: len(examples) for split, examples in task.splits.items()}


def test_a_positive_share_that_rounds_to_no_example_is_warned_about(caplog):
    # a 0.05 validation share of 10 examples: round(0.5) = 0, an empty split in silence
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.task"):
        task = MultipleChoiceTask.from_examples(
            _examples(10), fractions=(0.9, 0.05, 0.05), name="tiny"
        )
    assert _sizes(task) == {"train": 9, "validation": 0, "test": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "'tiny'" in messages[0]
    assert "give the validation split(s) a share > 0 but none of the 10 examples" in messages[0]


def test_a_test_share_that_rounds_to_no_example_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.task"):
        task = MultipleChoiceTask.from_examples(_examples(10), fractions=(0.95, 0.0, 0.05))
    assert _sizes(task) == {"train": 10, "validation": 0, "test": 0}
    assert any("give the test split(s) a share > 0" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="split 'test' is empty"):  # and refused where used
        task.encode(None, "test")


def test_a_zero_share_split_that_takes_the_rounding_remainder_is_warned_about(caplog):
    # 15 examples at (0.7, 0.3, 0): round(10.49...) + round(4.5) = 14, the test split took 1
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.task"):
        task = MultipleChoiceTask.from_examples(_examples(15), fractions=(0.7, 0.3, 0.0))
    assert _sizes(task) == {"train": 10, "validation": 4, "test": 1}
    assert any(
        "give the test split a share of 0, but it takes 1 of the 15 examples" in r.getMessage()
        for r in caplog.records
    )


def test_splits_that_match_their_shares_log_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.task"):
        task = MultipleChoiceTask.from_examples(_examples(20), fractions=(0.5, 0.0, 0.5))
    assert _sizes(task) == {"train": 10, "validation": 0, "test": 10}
    assert not caplog.records


@pytest.mark.parametrize(
    ("choices", "key", "match"),
    [
        # two labels for four choices: answerKey 'B' read as the second of four in silence
        ({"text": ["a", "b", "c", "d"], "label": ["A", "B"]}, "B", r"2 labels \['A', 'B'\] for 4"),
        # a repeated label: answerKey 'A' read as the first of the two in silence
        (
            {"text": ["a", "b", "c"], "label": ["A", "A", "B"]},
            "A",
            r"the labels .*, of which \[.A.\] repeat",
        ),
        ({"text": ["a", "b"], "label": ["A", "B", "C"]}, "B", r"3 labels .* for 2 choices"),
    ],
    ids=["fewer-labels", "repeated-label", "more-labels"],
)
def test_arc_rows_whose_labels_do_not_name_one_choice_each_are_refused(choices, key, match):
    row = {"question": "q", "choices": choices, "answerKey": key}
    with pytest.raises(ValueError, match=r"data row 0: 'choices' has " + match):
        adapt_rows([row], "arc", name="data")


def test_an_unlabelled_arc_row_is_still_skipped_whatever_its_labels():
    rows = [
        {"question": "q", "choices": {"text": ["a", "b"], "label": ["A"]}, "answerKey": ""},
        {"question": "r", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"},
    ]
    examples = adapt_rows(rows, "arc", skip_unlabelled=True)
    assert [e.answer for e in examples] == [1]
