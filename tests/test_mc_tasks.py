"""Multiple-choice tasks (pyrobayes.tasks): every format loads to the batch a hand-built
``encode_multiple_choice`` gives, splits and few-shot prompts are deterministic, and ragged
batches (questions with different numbers of choices) score as each question alone."""

from __future__ import annotations

import json
import math

import pytest
import torch

import pyrobayes as pb
from pyrobayes.metrics import nll
from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.tasks import (
    MCExample,
    MultipleChoiceTask,
    adapt_rows,
    read_bigbench,
    read_json_examples,
)
from tests.common import tiny_llama


class CharTokenizer:
    """Characters to ids 3..97 of the tiny models' 99-token vocabulary; BOS = 1, pad = 0."""

    pad_token_id = 0
    eos_token_id = 2

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [3 + ord(c) % 95 for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


QUESTIONS = ["Why is the ground wet?", "How do you boil water?", "What do red and blue make?"]
CHOICES = [["rain", "sun", "nobody knows"], ["a stove", "a freezer", "a fan"], ["purple", "x", "y"]]
ANSWERS = [0, 0, 0]


def assert_same_batch(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def all_test_task(examples, **kwargs) -> MultipleChoiceTask:
    return MultipleChoiceTask({"test": examples}, **kwargs)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_formats_load_to_the_hand_built_batch(tmp_path, suffix):
    records = [
        {"question": q, "choices": c, "answer": a if i else c[a]}  # an index or the text
        for i, (q, c, a) in enumerate(zip(QUESTIONS, CHOICES, ANSWERS, strict=True))
    ]
    path = tmp_path / f"task{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    else:
        path.write_text(json.dumps(records))
    task = all_test_task(read_json_examples(path))
    (batch,) = task.encode(CharTokenizer(), "test", batch_size=8)
    prompts = [f"Question: {q}\nAnswer:" for q in QUESTIONS]
    assert_same_batch(batch, encode_multiple_choice(CharTokenizer(), prompts, CHOICES, ANSWERS))


def test_json_template_and_field_names(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"q": "2+2?", "opts": ["3", "4"], "gold": 1, "topic": "sums"}))
    (ex,) = read_json_examples(
        path,
        template="[{topic}] {question} =",
        question_key="q",
        choices_key="opts",
        answer_key="gold",
    )
    assert (ex.prompt, ex.choices, ex.answer) == ("[sums] 2+2? =", ("3", "4"), 1)
    with pytest.raises(ValueError, match=r"t.jsonl record 0 lacks field\(s\) \['question'"):
        read_json_examples(path)


def test_bigbench_task_json_loads_to_the_hand_built_batch(tmp_path):
    task_json = {
        "name": "toy",
        "examples": [
            {"input": q, "target_scores": {c: float(k == a) for k, c in enumerate(cs)}}
            for q, cs, a in zip(QUESTIONS, CHOICES, [0, 2, 1], strict=True)
        ],
    }
    path = tmp_path / "task.json"
    path.write_text(json.dumps(task_json))
    (batch,) = all_test_task(read_bigbench(path)).encode(CharTokenizer(), "test")
    prompts = [f"Q: {q}\nA:" for q in QUESTIONS]
    want = encode_multiple_choice(CharTokenizer(), prompts, CHOICES, [0, 2, 1])
    assert_same_batch(batch, want)
    task_json["examples"][0]["target_scores"] = {"only": 1}
    path.write_text(json.dumps(task_json))
    with pytest.raises(ValueError, match="task.json example 0 has no 'target_scores'"):
        read_bigbench(path)


# one row per adapter, in its dataset's field layout, and the prompt/choices/answer it maps to
HF_ROWS = {
    "arc": (
        {
            "question": "Q1",
            "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]},
            "answerKey": "C",
        },
        ("Question: Q1\nAnswer:", ["a", "b", "c"], 2),
    ),
    "openbookqa": (
        {
            "question_stem": "Q2",
            "choices": {"text": ["d", "e"], "label": ["1", "2"]},
            "answerKey": "2",
        },
        ("Question: Q2\nAnswer:", ["d", "e"], 1),
    ),
    "winogrande": (
        {
            "sentence": "Tom gave Ann a gift because _ was kind.",
            "option1": "Tom",
            "option2": "Ann",
            "answer": "1",
        },
        ("Tom gave Ann a gift because", ["Tom was kind.", "Ann was kind."], 0),
    ),
    "boolq": (
        {
            "passage": "Water boils at 100 C.",
            "question": "does water boil at 100 c",
            "answer": True,
        },
        ("Water boils at 100 C.\nQuestion: does water boil at 100 c?\nAnswer:", ["no", "yes"], 1),
    ),
}


@pytest.mark.parametrize("adapter", sorted(HF_ROWS))
def test_dataset_adapters_load_to_the_hand_built_batch(adapter):
    row, (prompt, choices, answer) = HF_ROWS[adapter]
    (batch,) = all_test_task(adapt_rows([row], adapter)).encode(CharTokenizer(), "test")
    assert_same_batch(batch, encode_multiple_choice(CharTokenizer(), [prompt], [choices], [answer]))
    broken = {k: v for k, v in row.items() if k != sorted(row)[0]}
    with pytest.raises(ValueError, match=f"the '{adapter}' adapter needs field"):
        adapt_rows([broken], adapter)


@pytest.mark.parametrize("adapter", sorted(HF_ROWS))
def test_dataset_adapters_on_a_datasets_dataset(adapter):
    datasets = pytest.importorskip("datasets")
    row, (prompt, choices, answer) = HF_ROWS[adapter]
    (ex,) = adapt_rows(datasets.Dataset.from_list([row]), adapter)
    assert (ex.prompt, list(ex.choices), ex.answer) == (prompt, choices, answer)


def numbered(n: int, k: int = 2) -> list[MCExample]:
    return [MCExample(f"q{i}", tuple(f"c{i}.{j}" for j in range(k)), i % k) for i in range(n)]


def test_splits_are_seeded_disjoint_and_cover():
    examples = numbered(50)
    a = MultipleChoiceTask.from_examples(examples, fractions=(0.6, 0.2, 0.2), split_seed=3)
    b = MultipleChoiceTask.from_examples(examples, fractions=(0.6, 0.2, 0.2), split_seed=3)
    c = MultipleChoiceTask.from_examples(examples, fractions=(0.6, 0.2, 0.2), split_seed=4)
    assert a.splits == b.splits
    assert a.splits["train"] != c.splits["train"]
    assert [len(a.splits[s]) for s in ("train", "validation", "test")] == [30, 10, 10]
    prompts = [e.prompt for s in a.splits.values() for e in s]
    assert sorted(prompts) == sorted(e.prompt for e in examples)
    with pytest.raises(ValueError, match="fractions must be three numbers"):
        MultipleChoiceTask.from_examples(examples, fractions=(0.5, 0.5, 0.5))


def test_fewshot_prompts_are_deterministic_and_exclude_the_example():
    task = MultipleChoiceTask.from_examples(numbered(20), num_fewshot=3, seed=7)
    again = MultipleChoiceTask.from_examples(numbered(20), num_fewshot=3, seed=7)
    for split in ("train", "test"):
        for i, example in enumerate(task.splits[split]):
            shots = task.shots(split, i)
            assert len(shots) == 3 and len(set(shots)) == 3
            assert all(s in task.splits["train"] for s in shots)
            assert example not in shots
            want = "\n\n".join([*(f"{s.prompt} {s.target}" for s in shots), example.prompt])
            assert task.prompt(split, i) == want == again.prompt(split, i)
    other = MultipleChoiceTask.from_examples(numbered(20), num_fewshot=3, seed=8)
    n_test = len(task.splits["test"])
    assert any(task.prompt("test", i) != other.prompt("test", i) for i in range(n_test))
    (batch,) = task.encode(CharTokenizer(), "test", batch_size=n_test)
    prompts = [task.prompt("test", i) for i in range(n_test)]
    choices = [list(e.choices) for e in task.splits["test"]]
    answers = [e.answer for e in task.splits["test"]]
    assert_same_batch(batch, encode_multiple_choice(CharTokenizer(), prompts, choices, answers))


RAGGED_PROMPTS = ["The ground is wet because", "To boil water you", "Red and blue make"]
RAGGED_CHOICES = [
    ["it rained", "the sun"],
    ["use a stove", "freeze it", "wait", "fan"],
    ["a", "b", "c"],
]
RAGGED_ANSWERS = [1, 3, 2]


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("normalize", ["none", "length", "chars"])
def test_ragged_batch_equals_per_question_scoring(padding_side, normalize):
    torch.manual_seed(0)
    net = tiny_llama().double().eval()
    lik = MultipleChoice(normalize=normalize)
    tok = CharTokenizer()

    def scores(batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return lik.params(net(**lik.network_inputs(inputs, net)).logits, inputs)

    def log_probs(batch):
        with torch.no_grad():
            return torch.log_softmax(scores(batch), -1)

    ragged = encode_multiple_choice(
        tok, RAGGED_PROMPTS, RAGGED_CHOICES, RAGGED_ANSWERS, ragged=True, padding_side=padding_side
    )
    assert ragged["choice_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    got = log_probs(ragged)
    for b, (prompt, choices) in enumerate(zip(RAGGED_PROMPTS, RAGGED_CHOICES, strict=True)):
        alone = encode_multiple_choice(tok, [prompt], [choices], padding_side=padding_side)
        want = log_probs(alone)[0]
        k = len(choices)
        torch.testing.assert_close(got[b, :k], want, rtol=0, atol=1e-6)
        assert bool((got[b, k:] == -math.inf).all())  # padded choices: probability 0
    targets = ragged["labels"]
    nll = -lik.log_prob(scores(ragged), targets)
    assert bool(torch.isfinite(nll).all())


def _ragged_examples() -> list[MCExample]:
    return [
        MCExample(p, tuple(c), a)
        for p, c, a in zip(RAGGED_PROMPTS, RAGGED_CHOICES, RAGGED_ANSWERS, strict=True)
    ]


def _ragged_model(num_data: int) -> FineTuneModel:
    """LoRA r = 2 on q/v of the tiny LLaMA, initialised under seed 0."""
    torch.manual_seed(0)
    return FineTuneModel(
        tiny_llama(),
        LoRA(rank=2, target_modules=["q_proj", "v_proj"]),
        likelihood=MultipleChoice(normalize="length"),
        num_data=num_data,
    )


def test_ragged_batches_fit_and_predict_through_a_task():
    examples = _ragged_examples()
    batches = all_test_task(examples).encode(CharTokenizer(), "test")
    assert "choice_mask" in batches[0]
    model = _ragged_model(num_data=3)
    guide = pb.posterior(model, "meanfield")
    result = pb.fit(model, guide, batches, epochs=2, lr=1e-2, progress=False)
    assert all(math.isfinite(v) for v in result.losses)
    pred = pb.predict(model, guide, batches, num_samples=2)
    assert (
        float(pred.probs[..., 0, 2:].abs().max()) == 0.0
        and float(pred.probs[..., 2, 3].abs().max()) == 0.0
    )
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(2, 3), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["meanfield", "laplace"])
def test_batches_with_different_numbers_of_choices_predict_together(family):
    # one batch of 2-choice questions, one of 4-choice ones: predict pads the narrower batch's
    # classes with probability 0 and equals each batch predicted alone
    examples = _ragged_examples()
    narrow = all_test_task(examples[:1]).encode(CharTokenizer(), "test")
    wide = all_test_task(examples[1:2]).encode(CharTokenizer(), "test")
    assert narrow[0]["input_ids"].shape[1] == 2 and wide[0]["input_ids"].shape[1] == 4
    model = _ragged_model(num_data=2)
    guide = pb.posterior(model, family)
    pb.fit(model, guide, narrow + wide, epochs=1, lr=1e-2, progress=False)
    both = pb.predict(model, guide, narrow + wide, num_samples=2)
    alone = [pb.predict(model, guide, b, num_samples=2) for b in (narrow, wide)]
    assert both.probs.shape[1:] == (2, 4)
    torch.testing.assert_close(both.probs[:, 0, :2], alone[0].probs[:, 0], rtol=0, atol=1e-6)
    assert float(both.probs[:, 0, 2:].abs().max()) == 0.0
    torch.testing.assert_close(both.probs[:, 1], alone[1].probs[:, 0], rtol=0, atol=1e-6)
    assert math.isfinite(nll(both.mean_probs, both.targets))  # padded classes are never targets
    idata = pb.to_inference_data(model, guide, narrow + wide, num_samples=4)
    assert idata.log_likelihood["obs"].shape[-1] == 2  # one value per question


def test_ragged_needs_the_flag_and_answers_in_range():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="Pass ragged=True"):
        encode_multiple_choice(tok, RAGGED_PROMPTS, RAGGED_CHOICES, RAGGED_ANSWERS)
    with pytest.raises(ValueError, match="answer 3 of prompt 0 indexes past its 2 choices"):
        encode_multiple_choice(tok, RAGGED_PROMPTS, RAGGED_CHOICES, [3, 0, 0], ragged=True)
