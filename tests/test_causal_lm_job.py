"""The causal-LM multiple-choice job end to end: ``pyrobayes fit CONFIG --quick`` on a
config-built tiny LLaMA and a BIG-bench-style task file, then ``pyrobayes evaluate RUN``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pyrobayes.cli import main
from pyrobayes.demo import causal_lm
from pyrobayes.models import sharing as causal_lm_sharing
from pyrobayes.models.sharing import unshared


def write_task(path, num=40):
    """A BIG-bench task.json with multi-token answers and 3 or 4 choices (ragged batches)."""
    colours = ["red", "green", "blue", "yellow"]
    examples = []
    for i in range(num):
        k = 3 + i % 2
        right = colours[i % k]
        examples.append(
            {
                "input": f"The {i}th ball is painted {right}. Its colour is",
                "target_scores": {f"bright {c}": float(c == right) for c in colours[:k]},
            }
        )
    path.write_text(json.dumps({"name": "toy", "examples": examples}))


def write_config(path, task, families='["map", "laplace"]', extra=""):
    path.write_text(
        f"""
families = {families}
seeds = [0, 1]
[causal_lm]
model = "tiny-llama"
[causal_lm.task]
path = "{task}"
format = "bigbench"
batch_size = 4
[adapter]
kind = "lora"
rank = 2
target_modules = ["q_proj", "v_proj"]
[training]
lr = 0.01
{extra}
"""
    )


def test_quick_job_writes_the_table_and_evaluates_without_drift(tmp_path, capsys):
    write_task(tmp_path / "task.json")
    write_config(tmp_path / "job.toml", tmp_path / "task.json")
    out = tmp_path / "run"
    args = ["fit", str(tmp_path / "job.toml"), "--quick", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    records = json.loads((out / "metrics.json").read_text())
    # the zero-shot row, then every family under both seeds
    assert [(r["family"], r["seed"]) for r in records] == [("zero-shot", None)] + [
        (f, s) for s in (0, 1) for f in ("map", "laplace")
    ]
    for r in records:
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["ece"] <= 1 and math.isfinite(r["nll"])
    # comparable loss reports: MAP's per-example NLL and prior term over its last epoch (no
    # constants: the raw final_loss carries the prior's normaliser); a post-hoc family's own
    # pass reports none
    for r in records[1:]:
        if r["family"] == "map":
            assert sorted(r["terms"]) == ["nll", "prior"], r["terms"]
            assert all(math.isfinite(v) for v in r["terms"].values())
            assert r["terms"]["nll"] > 0
        else:
            assert r["terms"] == {}, r
    table = (out / "table.md").read_text()
    lines = table.splitlines()
    assert lines[0].startswith("| method | acc ↑ | ECE ↓ | ECE floor | NLL ↓")
    # the floor of a calibrated predictor on 16 questions: positive, below the largest possible
    assert all(0 < r["ece_floor"] < 1 for r in records)
    assert [line.split("|")[1].strip() for line in lines[2:]] == [
        "zero-shot",
        "map",
        "laplace (from map)",
    ]
    # mean ± spread over the two seeds; the zero-shot row has no seeds
    map_rows = [r for r in records if r["family"] == "map"]
    mean_acc = sum(r["accuracy"] for r in map_rows) / 2
    assert f"| map | {mean_acc:.3f} ± " in table
    assert "| – |" in lines[2]
    assert (out / "posterior.nc").is_file()  # ArviZ export of the first Bayesian family
    assert (out / "plots" / "reliability_laplace-seed0.png").is_file()
    assert (out / "plots" / "reliability_zero-shot.png").is_file()
    assert sorted(p.name for p in (out / "guides").iterdir()) == sorted(
        f"{f}-seed{s}.safetensors" for f in ("map", "laplace") for s in (0, 1)
    )
    capsys.readouterr()
    assert main(["evaluate", str(out)]) == 0
    assert "no drift" in capsys.readouterr().out


@pytest.mark.parametrize("keep", [None, "best", "last"])
def test_training_keep_chooses_last_iterate_or_the_validation_selected_epoch(tmp_path, keep):
    """The causal-LM job keeps each fit's last iterate by default (``training.keep = "last"``,
    no validation read by training); ``"best"`` selects the epoch of least validation NLL."""
    write_task(tmp_path / "task.json", num=24)
    user = {
        "families": ["map"],
        "causal_lm": {"task": {"path": str(tmp_path / "task.json")}},
        "training": {"lr": 0.01} | ({"keep": keep} if keep else {}),
    }
    config = causal_lm.resolve_config(user, quick=True)
    config["training"]["epochs"] = 2  # --quick runs one
    (_, record) = causal_lm.run(config, tmp_path / "run", progress_bar=False)
    assert record["family"] == "map" and record["epochs_run"] == 2
    if keep == "best":
        assert record["best_epoch"] in (1, 2)
    else:
        assert record["best_epoch"] is None and not record["stopped_early"]


def test_training_keep_refuses_other_values(tmp_path, capsys):
    write_task(tmp_path / "task.json", num=8)
    write_config(tmp_path / "job.toml", tmp_path / "task.json", extra='keep = "first"')
    assert main(["fit", str(tmp_path / "job.toml"), "--quick", "--out", str(tmp_path / "r")]) != 0
    err = capsys.readouterr().err
    assert "training.keep" in err and "'best', 'last'" in err


def test_zero_shot_row_is_the_base_network(tmp_path):
    """The zero-shot metrics equal those of the map run's adapter at its initialisation
    (LoRA's B = 0: ΔW = 0), computed by pb.predict through the likelihood."""
    import pyrobayes as pb

    write_task(tmp_path / "task.json", num=16)
    config = causal_lm.resolve_config(
        {"causal_lm": {"task": {"path": str(tmp_path / "task.json")}}}, quick=True
    )
    base, tokenizer = causal_lm.load_base(config)
    data = causal_lm.build_data(config, tokenizer)
    metrics, _ = causal_lm.zero_shot(config, base, data)
    model = causal_lm.build_model(config, base, data["num_train"], seed=0)
    guide = pb.posterior(model, "map")
    with unshared():  # the K full rows per question: an independent computation
        pred = pb.predict(  # the initial values on purpose: the zero-shot network
            model, guide, data["test"], num_samples=1, values=model.init_values()
        )
    want = causal_lm._metrics(pred)
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


def test_config_errors_name_the_key(tmp_path, capsys):
    write_task(tmp_path / "task.json", num=8)
    write_config(tmp_path / "bad.toml", tmp_path / "task.json", extra="lrr = 0.1")
    assert main(["fit", str(tmp_path / "bad.toml"), "--quick", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "'training.lrr'" in err and "did you mean 'training.lr'" in err
    with pytest.raises(causal_lm.ConfigError, match="causal_lm.task.path' is empty"):
        causal_lm.resolve_config({"causal_lm": {}})
    with pytest.raises(causal_lm.ConfigError, match="'causal_lm.normalize' must be one of"):
        causal_lm.resolve_config({"causal_lm": {"normalize": "len", "task": {"path": "x"}}})


def test_compare_normalize_equals_each_normalize_through_the_likelihood(tmp_path, monkeypatch):
    """One forward gives every normalize's zero-shot metrics: each equals pb.predict with the
    map adapter at its initialisation (ΔW = 0) under MultipleChoice(normalize=n), computed on
    the K full rows; the zero-shot forward scored every batch from shared prompt states."""
    import pyrobayes as pb

    shared = []

    def spy(*args, **kwargs):
        out = causal_lm_sharing.prefix_shared_logits(*args, **kwargs)
        shared.append(out is not None)
        return out

    monkeypatch.setattr(causal_lm, "prefix_shared_logits", spy)

    write_task(tmp_path / "task.json", num=16)
    config = causal_lm.resolve_config(
        {"causal_lm": {"task": {"path": str(tmp_path / "task.json")}}}, quick=True
    )
    base, tokenizer = causal_lm.load_base(config)
    data = causal_lm.build_data(config, tokenizer)
    compared = causal_lm.compare_normalize(config, base, data["test"])
    assert shared == [True] * len(data["test"])
    assert sorted(compared) == ["chars", "length", "none"]
    for normalize, got in compared.items():
        config["causal_lm"]["normalize"] = normalize
        model = causal_lm.build_model(config, base, data["num_train"], seed=0)
        with unshared():
            pred = pb.predict(
                model,
                pb.posterior(model, "map"),
                data["test"],
                num_samples=1,
                values=model.init_values(),  # on purpose: the zero-shot network
            )
        for key, value in causal_lm._metrics(pred).items():
            # pb.predict's log-probabilities are float32 (relative rounding 6e-8 per value):
            # 1e-6 relative holds a mean over 16 questions of an NLL up to ~10 nats
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), (normalize, key)
        # the fitted temperature never raises the NLL (fit_temperature keeps T = 1 otherwise)
        assert got["nll_at_temperature"] <= got["nll"] + 1e-12
        assert got["temperature"] > 0
    # the three differ on this task (choices of different lengths), so the test can fail
    assert compared["none"]["nll"] != pytest.approx(compared["length"]["nll"], abs=1e-6)


def test_last_epoch_terms_average_the_last_epochs_steps():
    import torch

    from pyrobayes.demo.pipeline import last_epoch_terms
    from pyrobayes.infer.loop import FitResult

    terms = {"nll": torch.tensor([4.0, 3.0, 2.0, 1.0, 0.5, 0.25]), "kl": torch.arange(6.0)}
    result = FitResult(None, torch.zeros(6), {"epoch": 3, "terms": terms})  # 2 steps an epoch
    assert last_epoch_terms(result) == {"nll": 0.375, "kl": 4.5}
    assert last_epoch_terms(FitResult(None, torch.zeros(0), {"epoch": 0})) == {}


def test_seeds_run_apart_and_joined_equal_the_one_process_job(tmp_path, capsys):
    """`pyrobayes fit --seeds S` per seed, then `pyrobayes join`, writes the run folder the
    one-process job writes: the same records (a seed's fit depends on its seed alone), every
    posterior, and a folder `pyrobayes evaluate` reproduces."""
    write_task(tmp_path / "task.json", num=24)
    write_config(tmp_path / "job.toml", tmp_path / "task.json", families='["map", "laplace"]')
    job = ["fit", str(tmp_path / "job.toml"), "--quick", "--no-progress"]
    assert main([*job, "--out", str(tmp_path / "both")]) == 0
    assert main([*job, "--seeds", "0", "--out", str(tmp_path / "s0")]) == 0
    assert main([*job, "--seeds", "1", "--out", str(tmp_path / "s1")]) == 0
    joined = tmp_path / "joined"
    assert main(["join", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(joined)]) == 0

    def comparable(path):
        records = json.loads((path / "metrics.json").read_text())
        return [{k: v for k, v in r.items() if k != "fit_seconds"} for r in records]

    want, got = comparable(tmp_path / "both"), comparable(joined)
    assert [(r["family"], r["seed"]) for r in got] == [(r["family"], r["seed"]) for r in want]
    for w, g in zip(want, got, strict=True):
        assert g.keys() == w.keys()
        for key, value in w.items():
            if isinstance(value, float):
                # the same fit in the same process type: equal up to float summation order
                # (NaN: a post-hoc family's final_loss, it runs no loss of its own)
                assert g[key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (
                    w["family"],
                    key,
                )
            else:
                assert g[key] == value, (w["family"], key)
    config = json.loads((joined / "config.json").read_text())
    assert config["seeds"] == [0, 1]
    assert sorted(p.name for p in (joined / "guides").iterdir()) == sorted(
        p.name for p in (tmp_path / "both" / "guides").iterdir()
    )
    table = (joined / "table.md").read_text()
    assert "| map |" in table and " ± " in table and "| 2 |" in table
    capsys.readouterr()
    assert main(["evaluate", str(joined)]) == 0
    assert "no drift" in capsys.readouterr().out

    # a seed in two inputs, another job, a folder that is not a run: refused, naming the input
    assert (
        main(["join", str(tmp_path / "s0"), str(tmp_path / "both"), "--out", str(tmp_path / "x")])
        == 2
    )
    assert "seed(s) [0]" in capsys.readouterr().err
    write_config(tmp_path / "other.toml", tmp_path / "task.json", families='["map"]')
    other = ["fit", str(tmp_path / "other.toml"), "--quick", "--no-progress", "--seeds", "2"]
    assert main([*other, "--out", str(tmp_path / "s2")]) == 0
    capsys.readouterr()
    assert (
        main(["join", str(tmp_path / "s0"), str(tmp_path / "s2"), "--out", str(tmp_path / "x")])
        == 2
    )
    assert "ran another job" in capsys.readouterr().err
    assert main(["join", str(tmp_path / "s0"), str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_fit_seeds_is_refused_for_a_one_seed_config(tmp_path, capsys):
    (tmp_path / "demo.toml").write_text("[training]\nepochs = 1\n")
    assert main(["fit", str(tmp_path / "demo.toml"), "--seeds", "1"]) == 2
    assert "--seeds applies to causal-LM configs" in capsys.readouterr().err


def test_lm_epochs_scores_every_epoch_without_changing_the_fit(tmp_path):
    """benchmarks/lm_epochs.py scores the predictive after each epoch inside the fit: the fit's
    losses equal those of the same fit without the scoring (pb.predict draws from its own generator), one curve
    point per epoch, and the selected epoch is the one of least validation NLL."""
    import importlib.util
    from pathlib import Path

    import pyrobayes as pb

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_epochs.py"
    spec = importlib.util.spec_from_file_location("bench_lm_epochs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    write_task(tmp_path / "task.json", num=24)
    config = causal_lm.resolve_config(
        {"causal_lm": {"task": {"path": str(tmp_path / "task.json")}}, "training": {"lr": 0.01}},
        quick=True,
    )
    out = module.epoch_curve(config, "meanfield", seed=1, epochs=2, num_samples=2)
    assert [r["epoch"] for r in out["curve"]] == [1, 2]
    nll = [r["val"]["nll"] for r in out["curve"]]
    assert out["selected_epoch"] == 1 + nll.index(min(nll))
    assert all(0.0 <= r["test"]["accuracy"] <= 1.0 for r in out["curve"])

    base, tokenizer = causal_lm.load_base(config)
    data = causal_lm.build_data(config, tokenizer)
    model = causal_lm.build_model(config, base, data["num_train"], seed=1)
    settings = causal_lm._settings("meanfield")
    guide = pb.posterior(model, "meanfield", **settings["options"])
    result = pb.fit(
        model, guide, data["train"], epochs=2, lr=0.01, seed=1, progress=pb.Progress(bar=False)
    )
    assert out["losses"] == list(result.losses)
    with pytest.raises(ValueError, match="'laplace' is built post hoc"):
        module.epoch_curve(config, "laplace", epochs=1)


# the toy task's 4 validation questions are too few to pin T, as pb.calibrate rightly warns
@pytest.mark.filterwarnings("ignore:calibrate.*fewer than 30:UserWarning")
def test_lm_posthoc_reproduces_the_run_and_tunes_on_the_validation_split(tmp_path, capsys):
    """benchmarks/lm_posthoc.py: the saved posteriors re-scored equal the run's table; a
    temperature keeps the accuracy (it keeps every argmax); Laplace's τ chosen on the validation
    split is the saved τ times a factor of the default grid."""
    import importlib.util
    from pathlib import Path

    from pyrobayes.infer.prior_precision import DEFAULT_FACTORS

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_posthoc.py"
    spec = importlib.util.spec_from_file_location("bench_lm_posthoc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    write_task(tmp_path / "task.json")
    write_config(tmp_path / "job.toml", tmp_path / "task.json")
    out = tmp_path / "run"
    assert (
        main(["fit", str(tmp_path / "job.toml"), "--quick", "--out", str(out), "--no-progress"])
        == 0
    )
    capsys.readouterr()
    saved = {(r["family"], r["seed"]): r for r in json.loads((out / "metrics.json").read_text())}
    rows = {(r["family"], r["seed"]): r for r in module.posthoc_rows(out)}
    assert sorted(rows) == sorted(
        (f, s) for s in (0, 1) for f in ("map", "map+ts", "laplace", "laplace+ts", "laplace-gs")
    )
    for seed in (0, 1):
        for family in ("map", "laplace"):
            again, before = rows[(family, seed)], saved[(family, seed)]
            assert again["accuracy"] == before["accuracy"]
            assert again["nll"] == pytest.approx(before["nll"], rel=1e-5)
            tempered = rows[(f"{family}+ts", seed)]
            assert tempered["temperature"] > 0 and tempered["accuracy"] == again["accuracy"]
        gs = rows[("laplace-gs", seed)]
        factor = gs["tau"] / gs["tau_evidence"]
        assert min(abs(factor / f - 1) for f in DEFAULT_FACTORS) < 1e-4, factor


def test_signorm_members_sit_in_the_adapted_blocks_and_evaluate_without_drift(tmp_path, capsys):
    """σN in the job: member RMSNorms in exactly the blocks that hold an adapted module (the
    lower blocks and the final norm keep the pretrained ones), fitted, saved and re-scored by
    ``pyrobayes evaluate`` to the saved metrics."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pyrobayes.models.signorm import MemberNorm

    net = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    upper = r"model\.layers\.[12]\.self_attn\.(q_proj|v_proj)"
    assert causal_lm.member_norm_paths(net, upper) == [
        f"model.layers.{i}.{n}"
        for i in (1, 2)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    with pytest.raises(ValueError, match="no stack of decoder blocks"):
        causal_lm.member_norm_paths(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0"])

    write_task(tmp_path / "task.json", num=16)
    config = causal_lm.resolve_config(
        {
            "families": ["signorm"],
            "seeds": [0],
            "causal_lm": {"task": {"path": str(tmp_path / "task.json")}},
        },
        quick=True,
    )
    records = causal_lm.run(config, tmp_path / "run", progress_bar=False)
    assert [r["family"] for r in records] == ["zero-shot", "signorm"]
    assert math.isfinite(records[1]["nll"])
    base, _ = causal_lm.load_base(config)
    model = causal_lm.build_model(config, base, 16, 0, "signorm")
    members = sorted(n for n, m in model.net.named_modules() if isinstance(m, MemberNorm))
    blocks = len(causal_lm_sharing.block_stack(base))
    assert members == sorted(
        f"model.layers.{i}.{n}"
        for i in range(blocks)
        for n in ("input_layernorm", "post_attention_layernorm")
    )
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run")]) == 0
    assert "no drift" in capsys.readouterr().out


def test_lm_ivon_recipes_runs_a_variant_and_restores_the_job_settings(tmp_path, monkeypatch):
    """benchmarks/lm_ivon_recipes.py fits IVON with the variant's options (the earlier recipe's
    h0 = 10 here, not the job's IVON-LoRA h0 and ess) and leaves the job's settings as they
    were."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_ivon_recipes.py"
    spec = importlib.util.spec_from_file_location("bench_lm_ivon_recipes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    seen: list[dict] = []
    built = causal_lm.posterior

    def posterior(model, family, init=None, **options):
        seen.append({"family": family, "init": init, **options})
        options["init"] = init
        return built(model, family, **options)

    monkeypatch.setattr(causal_lm, "posterior", posterior)
    before = dict(causal_lm.LM_FAMILY_SETTINGS)
    write_task(tmp_path / "task.json", num=24)
    extra = 'keep = "best"\npatience = 0'
    write_config(tmp_path / "job.toml", tmp_path / "task.json", families='["ivon"]', extra=extra)
    out = tmp_path / "run"
    argv = ["recipe", str(tmp_path / "job.toml"), "--out", str(out), "--quick"]
    assert module.main(argv) == 0
    assert seen == [{"family": "ivon", "init": None, "hess_init": 10.0}]
    rows = json.loads((out / "metrics.json").read_text())
    assert [r["family"] for r in rows] == ["zero-shot", "ivon"]
    assert causal_lm.LM_FAMILY_SETTINGS == before  # the variant is taken back


def test_the_jobs_ivon_recipe_takes_unrescaled_clip_bound_steps(tmp_path):
    """The job's IVON (h0 = 1e-3, ess = 1e7, clip 1e-3, α = 0.3) without ``rescale_lr``: each
    step moves a coordinate by at most α · clip = 3e-4, and LoRA's B (0 at the start) gets there
    on the tiny LLaMA's few steps. With ivon-opt's default rescaling the step is α (h0 + δ)
    times the clipped one, ~3e-7, and the network stayed at its start (SmolLM2: validation NLL
    2.0946 → 2.0932 in four epochs)."""
    from safetensors import safe_open

    write_task(tmp_path / "task.json", num=24)
    write_config(tmp_path / "job.toml", tmp_path / "task.json", families='["ivon"]')
    out = tmp_path / "run"
    args = ["fit", str(tmp_path / "job.toml"), "--quick", "--out", str(out), "--no-progress"]
    assert main([*args, "--seeds", "0"]) == 0
    steps = math.ceil(12 / 4)  # the quick task's 12 training questions, batches of 4, one epoch
    with safe_open(str(out / "guides" / "ivon-seed0.safetensors"), "pt") as f:
        moved = [f.get_tensor(k).abs().max().item() for k in f.keys() if "lora_B" in k]
    assert moved and min(moved) > 1e-4
    assert max(moved) <= 0.3 * 1e-3 * steps * (1 + 1e-5)
