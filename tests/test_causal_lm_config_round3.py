"""The causal-LM job refuses, when its config is read, settings that the config alone shows
cannot run: fractions that leave the train or test split empty, a LoRA-XS option under
``adapter.kind = "lora"``, an empty ``causal_lm.model``, ``adapter.target_modules`` that is
empty or not a regex, and a json template with a positional field. Before this, each was
refused (or crashed) only after the model was loaded, or was let through."""

from __future__ import annotations

from typing import Any

import pytest

from pyrobayes.cli import main
from pyrobayes.demo import causal_lm
from pyrobayes.demo.causal_lm_config import resolve_config
from pyrobayes.demo.config import ConfigError
from tests.test_causal_lm_job import write_task


def user(**sections: Any) -> dict[str, Any]:
    """A one-family config on ``task.json`` (bigbench) with ``sections`` merged over it."""
    base: dict[str, Any] = {"families": ["map"], "causal_lm": {"task": {"path": "task.json"}}}
    for key, value in sections.items():
        if key == "task":
            base["causal_lm"]["task"].update(value)
        elif key == "causal_lm":
            base["causal_lm"].update(value)
        else:
            base[key] = value
    return base


JSON_TASK = {"path": "t.jsonl", "format": "json"}

# (the config, the words the message must hold: the key, the value, what to write instead)
REFUSED: list[tuple[dict[str, Any], list[str]]] = [
    # 1. a share of 0 for the train or the test split
    (
        user(task={"fractions": [0.9, 0.1, 0.0]}),
        ["'causal_lm.task.fractions' = [0.9, 0.1, 0.0]", "test split no questions", "[0.5, 0.1"],
    ),
    (
        user(task={"fractions": [0.0, 0.5, 0.5]}),
        ["'causal_lm.task.fractions' = [0.0, 0.5, 0.5]", "train split no questions"],
    ),
    (
        user(task={"fractions": [0, 0, 1]}),
        ["'causal_lm.task.fractions' = [0, 0, 1]", "train split no questions"],
    ),
    (
        user(task={"fractions": [0.0, 0.1, 0.9], "num_fewshot": 2}),
        ["'causal_lm.task.fractions'", "train split no questions", "num_fewshot = 2 draws"],
    ),
    (
        user(task={**JSON_TASK, "fractions": [1.0, 0.0, 0.0]}),
        ["'causal_lm.task.fractions' = [1.0, 0.0, 0.0]", "test split no questions"],
    ),
    # 2. LoRA-XS options under plain LoRA (the default kind too)
    (
        user(adapter={"kind": "lora", "projection": "svd"}),
        ["'adapter.projection' = 'svd'", "adapter.kind = 'lora_xs'", 'kind = "lora_xs"', "remove"],
    ),
    (
        user(adapter={"projection": "dct"}),
        ["'adapter.projection' = 'dct'", "LoRA-XS option", 'kind = "lora_xs"'],
    ),
    (
        user(adapter={"init_scale": 1e-5}),
        ["'adapter.init_scale' = 1e-05", "LoRA-XS option", 'kind = "lora_xs"'],
    ),
    (
        user(adapter={"kind": "lora_xs", "projection": "wsvd"}),
        ["'adapter.projection' = 'wsvd'", "does not collect", 'projection = "svd"'],
    ),
    # 3. no model
    (
        user(causal_lm={"model": ""}),
        ["'causal_lm.model' = ''", "names no model", "'tiny-llama'"],
    ),
    (user(causal_lm={"model": "  "}), ["'causal_lm.model' = '  '", "names no model"]),
    # 4. target modules that name nothing or are not a regex
    (
        user(adapter={"target_modules": []}),
        ["'adapter.target_modules' = []", "names no module", '["q_proj", "v_proj"]'],
    ),
    (
        user(adapter={"target_modules": ["q_proj", " "]}),
        ["'adapter.target_modules' = ['q_proj', ' ']", "names no module"],
    ),
    (
        user(adapter={"target_modules": "q_proj("}),
        ["'adapter.target_modules' = 'q_proj('", "not a valid regular expression", "q_proj|"],
    ),
    (user(adapter={"target_modules": ""}), ["'adapter.target_modules' = ''", "names no module"]),
    # 5. positional template fields, which no record fills
    (
        user(task={**JSON_TASK, "template": "{} Answer:"}),
        ["'causal_lm.task.template' = '{} Answer:'", "positional field '{}'", "{question}"],
    ),
    (
        user(task={**JSON_TASK, "template": "Q: {0}\nA:"}),
        ["'causal_lm.task.template'", "positional field '{0}'", "{question}"],
    ),
    (
        user(task={**JSON_TASK, "template": "{question} {0.x}"}),
        ["positional field '{0.x}'"],
    ),
    (user(task={**JSON_TASK, "template": "{[1]} A:"}), ["positional field '{[1]}'"]),
    (user(task={**JSON_TASK, "template": "{question:{}} A:"}), ["positional field '{}'"]),
]


@pytest.mark.parametrize(("config", "words"), REFUSED, ids=lambda v: str(v)[-60:])
def test_a_setting_the_config_shows_cannot_run_is_refused_naming_it(config, words):
    with pytest.raises(ConfigError) as err:
        resolve_config(config)
    for word in words:
        assert word in str(err.value), str(err.value)
    with pytest.raises(ConfigError):  # --quick changes none of these keys' meaning
        resolve_config(config, quick=True)


PASSING: list[dict[str, Any]] = [
    # a validation share of 0 under keep = "last"; small shares (their sizes are the file's)
    user(task={"fractions": [0.5, 0.0, 0.5]}),
    user(task={"fractions": [0.98, 0.01, 0.01], "num_fewshot": 3}),
    # an hf dataset keeps its own splits (the default fractions are not read)
    user(task={"path": "data/arc", "format": "hf", "adapter": "arc"}),
    user(adapter={"kind": "lora_xs", "projection": "svd", "init_scale": 1e-5}),
    user(causal_lm={"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}),
    user(adapter={"target_modules": r"model\.layers\.\d+\.self_attn\.(q_proj|v_proj)"}),
    user(adapter={"target_modules": ["q_proj"]}),
    user(task={**JSON_TASK, "template": "Q: {question!r:>10}\n{{literal}} A:"}),
    user(task={**JSON_TASK, "template": "{question[text]} {context.title}"}),
]


@pytest.mark.parametrize("config", PASSING, ids=lambda v: str(v)[-60:])
def test_settings_that_can_run_pass(config):
    resolve_config(config)


def test_fit_refuses_each_before_the_model_is_loaded(tmp_path, capsys, monkeypatch):
    """``pyrobayes fit --quick``: exit 2 naming the key, no run folder, no model loaded."""

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded for a config the check should refuse")

    monkeypatch.setattr(causal_lm, "load_base", no_load)
    write_task(tmp_path / "task.json", num=8)
    (tmp_path / "t.jsonl").write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n')
    cases = {
        "causal_lm.task.fractions": "[causal_lm.task]\nfractions = [0.9, 0.1, 0.0]\nnum_test = 1",
        "adapter.projection": '[adapter]\nkind = "lora"\nprojection = "svd"',
        "adapter.target_modules": '[adapter]\ntarget_modules = "q_proj("',
        "causal_lm.task.template": (
            f'[causal_lm.task]\npath = "{tmp_path / "t.jsonl"}"\nformat = "json"\n'
            'template = "{} Answer:"'
        ),
    }
    for key, body in cases.items():
        if "path =" not in body:
            body = body.replace(
                "[causal_lm.task]", f'[causal_lm.task]\npath = "{tmp_path / "task.json"}"'
            )
            if "[causal_lm.task]" not in body:
                body = f'[causal_lm.task]\npath = "{tmp_path / "task.json"}"\n{body}'
        config = tmp_path / "job.toml"
        config.write_text(f'families = ["map"]\n[causal_lm]\nmodel = "tiny-llama"\n{body}\n')
        out = tmp_path / "run"
        assert main(["fit", str(config), "--quick", "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"Config key '{key}'" in err and "Traceback" not in err, err
        assert not out.exists()
