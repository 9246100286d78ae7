"""Task files and configs that were read as something the user did not mean, or refused with an
error that did not say where or why: a template written as lm-evaluation-harness's Jinja
(``{{question}}``), a null template field, JSONL lines (their numbers, U+2028 inside a string, an
upper-case suffix), a byte-order mark or another encoding, seeds and counts of the wrong type, a
misspelt ``[causal_lm]`` section and a task path written relative to the config file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyrobayes.cli import main
from pyrobayes.demo.config import ConfigError, resolve_config
from pyrobayes.tasks import MCExample, MultipleChoiceTask, read_bigbench, read_json_examples

RECORDS = [
    {"question": "Is it?", "choices": ["no", "yes"], "answer": 1, "context": "Sky."},
    {"question": "Was it?", "choices": ["no", "yes"], "answer": 0, "context": None},
]


def _jsonl(path, records=RECORDS, **dump):
    path.write_text("\n".join(json.dumps(r, **dump) for r in records) + "\n", encoding="utf-8")
    return path


def test_a_jinja_template_is_refused_with_the_str_format_one(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl")
    for jinja in ("Question: {{question}}\nAnswer:", "Question: {{ question }}\nAnswer:"):
        with pytest.raises(ValueError, match="as Jinja does") as err:
            read_json_examples(path, template=jinja)  # every prompt was "Question: {question}"
        assert "template = 'Question: {question}\\nAnswer:'" in str(err.value)
    # a literal brace around a real field, and a literal {name} that is no field, still read
    prompts = [e.prompt for e in read_json_examples(path, template="{{{question}}} {{x}}")]
    assert prompts == ["{Is it?} {x}", "{Was it?} {x}"]


def test_a_null_field_of_the_template_is_refused_naming_the_record(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match=r"t.jsonl record 1: field\(s\) \['context'\].*'None'"):
        read_json_examples(path, template="{context}\nQuestion: {question}\nAnswer:")
    # a null field the template does not name is not read
    assert [e.answer for e in read_json_examples(path)] == [1, 0]


def test_jsonl_lines_are_named_by_their_number_and_read_whole(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n\n" + '{"question": "x",\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 3 is not valid JSON"):
        read_json_examples(bad)  # was "line 1 column ...", whatever line was bad
    # ensure_ascii=False writes U+2028 / U+0085 unescaped: str.splitlines cut the record there
    odd = {"question": "a\u2028b\x85c", "choices": ["no", "yes"], "answer": 0}
    path = _jsonl(tmp_path / "u.jsonl", [odd, RECORDS[0]], ensure_ascii=False)
    assert [e.prompt for e in read_json_examples(path)][0] == "Question: a\u2028b\x85c\nAnswer:"
    upper = _jsonl(tmp_path / "T.JSONL")
    assert len(read_json_examples(upper)) == 2
    lines_in_json = _jsonl(tmp_path / "t.json")
    with pytest.raises(ValueError, match=r"t.json is not valid JSON.*name the file .jsonl"):
        read_json_examples(lines_in_json)


def test_a_byte_order_mark_is_read_and_another_encoding_is_named(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_text("\ufeff" + "\n".join(json.dumps(r) for r in RECORDS), encoding="utf-8")
    assert [e.answer for e in read_json_examples(bom)] == [1, 0]
    task = tmp_path / "task.json"
    examples = [{"input": "x", "target_scores": {"a": 1, "b": 0}}]
    task.write_text(
        "\ufeff" + json.dumps({"examples": examples, "append_choices_to_input": False}),
        encoding="utf-8",
    )
    assert [e.answer for e in read_bigbench(task)] == [0]
    latin = tmp_path / "latin.jsonl"
    text = (
        json.dumps(RECORDS[0])
        + "\n"
        + json.dumps({**RECORDS[0], "question": "Café?"}, ensure_ascii=False)
    )
    latin.write_text(text, encoding="latin-1")
    with pytest.raises(
        ValueError, match=r"latin.jsonl is not UTF-8 text: line 2 .*Save it as UTF-8"
    ):
        read_json_examples(latin)  # was UnicodeDecodeError without the file's name


def test_split_and_fewshot_arguments_are_integers_numpy_ones_included():
    examples = [MCExample(f"q{i}", ("a", "b"), i % 2) for i in range(10)]
    with pytest.raises(TypeError, match="split_seed must be an integer.*different split on every"):
        MultipleChoiceTask.from_examples(examples, split_seed=None)  # was a fresh split each run
    with pytest.raises(TypeError, match="'task': seed must be an integer; got 1.7"):
        MultipleChoiceTask.from_examples(examples, seed=1.7)  # was seed 1
    with pytest.raises(ValueError, match=r"split_seed must be an integer >= 0; got -1"):
        MultipleChoiceTask.from_examples(examples, split_seed=-1)
    with pytest.raises(ValueError, match=r"fractions must be three numbers.*\(0.5, 0.1, 0.4\)"):
        MultipleChoiceTask.from_examples(examples, fractions={"train": 0.5, "test": 0.5})
    numpy = MultipleChoiceTask.from_examples(
        examples, split_seed=np.int64(3), seed=np.int32(4), num_fewshot=np.int64(2)
    )
    plain = MultipleChoiceTask.from_examples(examples, split_seed=3, seed=4, num_fewshot=2)
    assert numpy.splits == plain.splits
    assert numpy.prompt("test", 0) == plain.prompt("test", 0) and numpy.num_fewshot == 2


@pytest.mark.parametrize("section", ["causal-lm", "causal_LM", "causallm", "causal_llm"])
def test_a_misspelt_causal_lm_section_says_how_the_job_is_recognised(section):
    with pytest.raises(ConfigError, match=r"section named exactly \[causal_lm\]"):
        resolve_config({section: {"model": "tiny-llama"}})
    with pytest.raises(ConfigError, match=r"'seeds' is a causal-LM job's key.*\[training\] seed"):
        resolve_config({"seeds": [0, 1]})
    with pytest.raises(ConfigError) as err:
        resolve_config({"modle": {}})
    assert "causal_lm" not in str(err.value)


def test_a_task_path_written_relative_to_the_config_is_named(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "jobs"
    folder.mkdir()
    examples = [{"input": f"{i}+1", "target_scores": {str(i + 1): 1, str(i): 0}} for i in range(9)]
    (folder / "task.json").write_text(json.dumps({"examples": examples}))
    config = folder / "job.toml"
    config.write_text('[causal_lm]\nmodel = "tiny-llama"\n[causal_lm.task]\npath = "task.json"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("pyrobayes.demo.causal_lm.run", lambda *a, **k: pytest.fail("the job ran"))
    assert main(["fit", "jobs/job.toml", "--quick", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "'causal_lm.task.path' = 'task.json' is read from the current folder" in err
    assert "Write 'jobs/task.json'" in err and not (tmp_path / "run").exists()
