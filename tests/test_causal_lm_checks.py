"""The causal-LM job's refusals and reports: config mistakes named by their key before a run
folder is written, a run that fails before its first result leaves the folder free, small or
truncated tasks are reported, ``--quick`` says what it replaced, and ``pyrobayes evaluate``
names the posterior file it misses."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from pyrobayes.cli import main
from pyrobayes.demo import causal_lm
from pyrobayes.demo.join_runs import join_runs
from pyrobayes.demo.pipeline import ConfigError
from pyrobayes.demo.run_folder import RunFolderError, claim_run_folder
from tests.test_causal_lm_job import write_config, write_task


def user(task="task.json", **sections):
    base = {"families": ["map"], "causal_lm": {"task": {"path": str(task)}}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def task_section(**keys):
    return {"task": {"path": "task.json", **keys}}


@pytest.mark.parametrize(
    "sections, match",
    [
        ({"training": {"device": "gpu"}}, r"'training.device' .* got 'gpu' \(did you mean 'cuda'"),
        ({"training": {"device": "cuda:99"}}, r"'training.device' = 'cuda:99', but this machine"),
        ({"causal_lm": {"dtype": "float16", **task_section()}}, "'causal_lm.dtype' = 'float16'"),
        ({"causal_lm": task_section(split_seed=-1)}, "'causal_lm.task.split_seed'.* >= 0"),
        ({"causal_lm": task_section(num_train=-1)}, "'causal_lm.task.num_train'.* >= 0"),
        ({"causal_lm": task_section(num_test=-2)}, "'causal_lm.task.num_test'.* >= 0"),
        ({"causal_lm": task_section(num_fewshot=-1)}, "'causal_lm.task.num_fewshot'.* >= 0"),
        ({"training": {"epochs": 0}}, "'training.epochs'.* >= 1"),
        ({"training": {"lr": 0.0}}, "'training.lr'.* > 0"),
        ({"training": {"lr": -1.0}}, "'training.lr'.* > 0"),
        ({"prior_scale": 0.0}, "'prior_scale'.* > 0"),
        ({"predict": {"samples_per_forward": -1}}, "'predict.samples_per_forward'.* >= 0"),
        ({"export": {"num_batches": 0}}, "'export.num_batches'.* >= 1"),
        ({"training": {"scheduler": "cosinee"}}, "'training.scheduler'.*did you mean 'cosine'"),
        (
            {"causal_lm": {"task": {"path": "t.jsonl", "format": "json", "template": "Q {"}}},
            "'causal_lm.task.template' = 'Q {' is not a str.format template",
        ),
        ({"seeds": [0, 0]}, r"'seeds' = \[0, 0\] lists seed\(s\) \[0\] more than once"),
        ({"seeds": [0, "1"]}, r"'seeds' must be a list of int .* seeds\[1\] = '1' is a str"),
        (
            {"causal_lm": task_section(fractions=[0.6, 0.0, 0.4]), "training": {"keep": "best"}},
            "'training.keep' = 'best' .* gives it no questions",
        ),
        (
            {"causal_lm": task_section(fractions=[0.5, 0.5])},
            "'causal_lm.task.fractions' must be three numbers",
        ),
        ({"causal_lm": {"gguf_file": "m.gguf", **task_section()}}, "'causal_lm.gguf_file'"),
        # keep = "last" (the default) reads no validation split: a patience would be ignored
        ({"training": {"patience": 2}}, "'training.patience' = 2 is ignored under"),
        # the job fits each seed of `seeds` (the demo's training.seed would be ignored)
        (
            {"training": {"seed": 7}},
            r"'training.seed' = 7 is ignored by a causal-LM job.*seeds = \[7\].*--seeds",
        ),
    ],
)
def test_config_mistakes_are_refused_naming_the_key(sections, match):
    with pytest.raises(ConfigError, match=match):
        causal_lm.resolve_config(user(**sections))


# task keys another format reads: the format, the key the user set, and the task keys the
# message lists as read by that format
FORMAT_MISMATCH = [
    ("bigbench", {"template": "Solve: {question}\nResult:"}, "'json'", "append_choices"),
    ("bigbench", {"answer_key": "label"}, "'json'", "fractions"),
    ("bigbench", {"adapter": "arc"}, "'hf'", "split_seed"),
    ("json", {"config": "ARC-Easy"}, "'hf'", "template"),
    ("json", {"append_choices": True}, "'bigbench'", "question_key"),
    ("hf", {"adapter": "arc", "fractions": [0.8, 0.1, 0.1]}, "'bigbench' or 'json'", "config"),
    ("hf", {"adapter": "arc", "question_key": "q"}, "'json'", "adapter"),
]


@pytest.mark.parametrize("fmt, keys, owner, listed", FORMAT_MISMATCH)
def test_a_task_key_the_format_does_not_read_is_refused(fmt, keys, owner, listed):
    key = next(k for k in keys if k != "adapter" or fmt != "hf")
    spec = {"path": "task.json", "format": fmt, **keys}
    with pytest.raises(ConfigError) as err:
        causal_lm.resolve_config(user(causal_lm={"task": spec}))
    message = str(err.value)
    assert f"'causal_lm.task.{key}' = {keys[key]!r} is not read with" in message
    assert f"format = {fmt!r} (only with format {owner})" in message
    assert f"Format {fmt!r} reads the task keys" in message and listed in message
    assert f"Remove {key}" in message


def test_task_keys_of_the_chosen_format_and_unset_ones_pass():
    for spec in (
        {"format": "bigbench", "append_choices": True, "fractions": [0.6, 0.1, 0.3]},
        {"format": "bigbench", "adapter": "", "config": ""},  # "" is unset
        {"format": "json", "template": "Q: {question}\nA:", "answer_key": "label"},
        {"format": "hf", "adapter": "arc", "config": "ARC-Easy", "num_fewshot": 2},
    ):
        causal_lm.resolve_config(user(causal_lm={"task": {"path": "task.json", **spec}}))
    # the defaults of other formats' keys are no user's: the saved config lists them all
    config = causal_lm.resolve_config(user())
    assert config["causal_lm"]["task"]["template"] and not config["causal_lm"]["task"]["adapter"]


@pytest.mark.parametrize(
    "adapter, match",
    [("arcc", r"= 'arcc' \(did you mean 'arc'\?\)"), ("", "= '': format = 'hf' reads")],
)
def test_an_hf_task_needs_a_known_dataset_adapter(adapter, match):
    spec = {"path": "data", "format": "hf", "adapter": adapter}
    with pytest.raises(ConfigError, match=r"'causal_lm.task.adapter' " + match):
        causal_lm.resolve_config(user(causal_lm={"task": spec}))


def test_fit_refuses_a_task_key_of_another_format_before_the_run(tmp_path, capsys):
    write_task(tmp_path / "task.json", num=8)
    write_config(tmp_path / "job.toml", tmp_path / "task.json", families='["map"]')
    text = (tmp_path / "job.toml").read_text()
    (tmp_path / "job.toml").write_text(
        text.replace('format = "bigbench"', 'format = "bigbench"\ntemplate = "Solve: {question}"')
    )
    out = tmp_path / "run"
    assert main(["fit", str(tmp_path / "job.toml"), "--quick", "--out", str(out)]) == 2
    assert "'causal_lm.task.template'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("append", [None, False, True])
def test_task_append_choices_lists_the_choices_as_bigbench_does(tmp_path, caplog, append):
    examples = [{"input": f"Colour {i}?", "target_scores": {"red": 1, "dog": 0}} for i in range(8)]
    (tmp_path / "task.json").write_text(json.dumps({"examples": examples}))
    spec = {"path": str(tmp_path / "task.json")}
    if append is not None:
        spec["append_choices"] = append
    with pytest.raises(ConfigError, match=r"'causal_lm.task.append_choices' must be like False"):
        causal_lm.resolve_config(user(causal_lm={"task": {**spec, "append_choices": "yes"}}))
    config = causal_lm.resolve_config(user(causal_lm={"task": spec}))
    with caplog.at_level(logging.WARNING, logger="pyrobayes.tasks.formats"):
        task = causal_lm.load_task(config)
    prompt = task.prompt("test", 0)
    listed = prompt.endswith("?\n  choice: red\n  choice: dog\nA:")
    assert listed == bool(append) and prompt.startswith("Q: Colour ")
    said = caplog.text.count("these prompts leave them out")
    assert said == (0 if append else 1)
    if not append:
        assert "causal_lm.task.append_choices = true" in caplog.text


def test_machine_checks_come_before_the_run_folder(tmp_path):
    write_task(tmp_path / "task.json", num=8)
    out = tmp_path / "run"
    config = causal_lm.resolve_config(
        user(tmp_path / "task.json", adapter={"target_modules": ["query", "value"]}), quick=True
    )
    with pytest.raises(ConfigError, match="'adapter.target_modules'.* matched no linear module"):
        causal_lm.run(config, out, progress_bar=False)
    assert not out.exists()
    config = causal_lm.resolve_config(user(tmp_path / "task.json"))
    config["causal_lm"]["model"] = str(tmp_path / "no_such_model")
    with pytest.raises(ConfigError, match=r"'causal_lm.model' = .*no_such_model.*does not exist"):
        causal_lm.run(config, out, progress_bar=False)
    assert not out.exists()


def test_a_run_that_fails_before_a_result_leaves_the_folder_for_the_corrected_run(tmp_path, capsys):
    write_task(tmp_path / "task.json", num=8)
    write_config(tmp_path / "bad.toml", tmp_path / "missing.json", families='["map"]')
    write_config(tmp_path / "good.toml", tmp_path / "task.json", families='["map"]')
    out = tmp_path / "run"
    job = ["--quick", "--no-progress", "--out", str(out)]
    assert main(["fit", str(tmp_path / "bad.toml"), *job]) == 2
    err = capsys.readouterr().err
    assert "'causal_lm.task.path'" in err and "missing.json does not exist" in err
    assert not out.exists()
    assert main(["fit", str(tmp_path / "good.toml"), *job]) == 0
    assert [r["family"] for r in json.loads((out / "metrics.json").read_text())][-1] == "map"


def test_keep_best_without_a_validation_split_and_small_tasks(tmp_path, caplog):
    write_task(tmp_path / "task.json", num=3)  # train 2, validation 0, test 1
    config = causal_lm.resolve_config(user(tmp_path / "task.json"), quick=True)
    _, tokenizer = causal_lm._tiny_llama()
    with caplog.at_level(logging.WARNING):
        data = causal_lm.build_data(config, tokenizer)
    assert data["val"] is None and data["num_train"] == 2
    assert "num_train = 16 but the train split has 2" in caplog.text
    assert "num_test = 16 but the test split has 1" in caplog.text
    config["training"]["keep"] = "best"
    with pytest.raises(ConfigError, match="'training.keep' = 'best' .* empty validation split"):
        causal_lm.run(config, tmp_path / "run", progress_bar=False)
    assert not (tmp_path / "run").exists()
    config["causal_lm"]["task"]["fractions"] = [0.5, 0.5, 0.0]
    with pytest.raises(ConfigError, match=r"the test split\(s\) would be empty"):
        causal_lm.build_data(config, tokenizer)


def test_truncation_and_quick_replacements_are_logged(tmp_path, caplog):
    write_task(tmp_path / "task.json", num=8)
    spec = {"task": {"path": str(tmp_path / "task.json"), "num_test": 100}, "max_length": 512}
    with caplog.at_level(logging.WARNING):
        config = causal_lm.resolve_config(
            user(causal_lm=spec, training={"epochs": 5}, predict={"num_samples": 2}), quick=True
        )
    assert "--quick replaces" in caplog.text
    for said in ("causal_lm.max_length = 512 -> 128", "task.num_test = 100 -> 16", "epochs = 5"):
        assert said in caplog.text
    assert "num_samples" not in caplog.text  # the user's value equals --quick's
    caplog.clear()
    config["causal_lm"]["max_length"] = 40
    _, tokenizer = causal_lm._tiny_llama()
    with caplog.at_level(logging.WARNING):
        causal_lm.build_data(config, tokenizer)
    assert "longer than causal_lm.max_length = 40 tokens lose prompt tokens" in caplog.text
    assert "test 3 of 3 (up to" in caplog.text  # the 8 questions' 3 test ones: ~47 bytes each


def test_evaluate_names_the_missing_posterior_file():
    saved = [
        {"family": "zero-shot", "seed": None, "accuracy": 0.5},
        {"family": "map", "seed": 0, "accuracy": 0.5},
        {"family": "swag", "seed": 0, "accuracy": 0.5},
    ]
    drifts = causal_lm.compare(saved, saved[:2], tolerance=1e-6)
    assert drifts == [
        "swag@seed0: in metrics.json but not recomputed: no saved posterior "
        "(guides/swag-seed0.safetensors), or not among config.json's families and seeds"
    ]


def test_evaluate_checks_a_hand_edited_config_and_names_a_listed_family_without_a_file(
    tmp_path, caplog
):
    """``evaluate`` of a run folder whose config.json was edited by hand: an unknown key is
    refused naming it and the file (it was accepted), and a listed family with no saved
    posterior is named in a warning (it was skipped silently)."""
    write_task(tmp_path / "task.json")
    config = causal_lm.resolve_config(user(task=tmp_path / "task.json"), quick=True)
    run = tmp_path / "run"
    (run / "guides").mkdir(parents=True)
    (run / "guides" / "map-seed0.safetensors").write_bytes(b"")
    (run / "config.json").write_text(
        json.dumps({**config, "training": {**config["training"], "epoch": 5}})
    )
    with pytest.raises(ConfigError, match=r"config.json: .*'training.epoch'"):
        causal_lm.evaluate(run)
    (run / "config.json").write_text(json.dumps({**config, "families": ["ivon"]}))
    with caplog.at_level(logging.WARNING):
        records = causal_lm.evaluate(run)
    assert "ivon@seed0 is in config.json's families and seeds but has no saved" in caplog.text
    assert [r["family"] for r in records] == ["zero-shot"]


def test_unlabelled_hf_test_split_is_refused_naming_the_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    wino = {"sentence": ["Sam thanked Pat because _ helped."] * 4, "option1": ["Sam"] * 4}
    wino["option2"] = ["Pat"] * 4

    def split(answer):
        return datasets.Dataset.from_dict({**wino, "answer": [answer] * 4})

    folder = tmp_path / "wino"
    datasets.DatasetDict({"train": split("1"), "test": split("")}).save_to_disk(str(folder))
    config = causal_lm.resolve_config(
        {"causal_lm": {"task": {"path": str(folder), "format": "hf", "adapter": "winogrande"}}}
    )
    with pytest.raises(ConfigError, match="the dataset's 'test' split is empty or unlabelled"):
        causal_lm.load_task(config)


def test_overwrite_keeps_the_old_run_when_the_new_config_names_what_is_not_here(tmp_path, capsys):
    # --overwrite removes the old run's files, so the machine checks (model, target modules,
    # device) come first: a config whose target_modules match nothing leaves the old run intact
    write_task(tmp_path / "task.json", num=8)
    write_config(tmp_path / "good.toml", tmp_path / "task.json", families='["map"]')
    out = tmp_path / "run"
    job = ["--quick", "--no-progress", "--out", str(out)]
    assert main(["fit", str(tmp_path / "good.toml"), *job]) == 0
    before = (out / "metrics.json").read_text()
    bad = (tmp_path / "good.toml").read_text().replace('["q_proj", "v_proj"]', '["qeury"]')
    (tmp_path / "bad.toml").write_text(bad)
    assert main(["fit", str(tmp_path / "bad.toml"), *job, "--overwrite"]) == 2
    assert "'adapter.target_modules'" in capsys.readouterr().err
    assert (out / "metrics.json").read_text() == before


def test_overwrite_removes_the_old_runs_normalize_json(tmp_path):
    # compare_normalize's normalize.json is a run file: a replacing run that does not compare
    # must not leave the old comparison next to its own metrics
    out = tmp_path / "run"
    (out / "guides").mkdir(parents=True)
    for name in ("metrics.json", "normalize.json"):
        (out / name).write_text("{}")
    (out / "config.json").write_text('{"families": ["map"]}')  # a run's
    claim_run_folder(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["guides"]
    (out / "normalize.json").write_text("{}")  # an interrupted run's only result
    with pytest.raises(RunFolderError, match=r"already holds a run \(normalize.json\)"):
        claim_run_folder(out, overwrite=False)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_whose_config_json_is_not_a_runs_is_refused(tmp_path, overwrite):
    """--out at a Hugging Face model folder: its config.json counted as a run's file, so
    --overwrite deleted it (and a new run would have written over it)."""
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (model / "metrics.json").write_text("{}")
    with pytest.raises(RunFolderError, match=r"config.json is a model's .*another --out"):
        claim_run_folder(model, overwrite=overwrite, folder="--out")
    assert (model / "config.json").is_file() and (model / "metrics.json").is_file()
    (model / "config.json").write_text("not json")
    with pytest.raises(RunFolderError, match="not a pyrobayes run's"):
        claim_run_folder(model, overwrite=overwrite)


def test_join_of_an_interrupted_run_lists_only_its_recorded_seeds(tmp_path, caplog):
    """A run folder whose config lists seed 2 but whose metrics.json (written after every
    family) has no record of it joins as seed 1 alone, with a warning naming map@seed2; seed 2
    fitted in its own folder then joins in."""
    write_task(tmp_path / "task.json", num=8)
    write_config(tmp_path / "job.toml", tmp_path / "task.json", families='["map"]')
    full = tmp_path / "full"
    job = ["fit", str(tmp_path / "job.toml"), "--quick", "--no-progress", "--seeds", "0,1,2"]
    assert main([*job, "--out", str(full)]) == 0
    config = json.loads((full / "config.json").read_text())
    records = json.loads((full / "metrics.json").read_text())

    def part(name, listed, recorded, files):
        folder = tmp_path / name
        (folder / "guides").mkdir(parents=True)
        (folder / "plots").mkdir()
        (folder / "config.json").write_text(json.dumps({**config, "seeds": listed}))
        kept = [r for r in records if r["seed"] is None or r["seed"] in recorded]
        (folder / "metrics.json").write_text(json.dumps(kept))
        for seed in files:
            for file in (
                f"guides/map-seed{seed}.safetensors",
                f"plots/reliability_map-seed{seed}.png",
            ):
                shutil.copy2(full / file, folder / file)
        return str(folder)

    s0 = part("s0", [0], [0], [0])
    # interrupted after seed 2's posterior was saved, before its record was written
    s12 = part("s12", [1, 2], [1], [1, 2])
    s2 = part("s2", [2], [2], [2])
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.join_runs"):
        joined = join_runs([s0, s12], tmp_path / "j")
    assert json.loads((tmp_path / "j" / "config.json").read_text())["seeds"] == [0, 1]
    assert [r["seed"] for r in joined] == [None, 0, 1]
    assert sorted(p.name for p in (tmp_path / "j" / "guides").iterdir()) == [
        "map-seed0.safetensors",
        "map-seed1.safetensors",
    ]
    assert f"{s12} has no metrics.json record of map@seed2" in caplog.text
    assert "takes seeds [1] from it" in caplog.text and "--seeds S" in caplog.text
    join_runs([s0, s12, s2], tmp_path / "j", overwrite=True)
    assert json.loads((tmp_path / "j" / "config.json").read_text())["seeds"] == [0, 1, 2]
