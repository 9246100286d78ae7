"""Round 4 of silent cases in the command line and its configs.

* The causal-LM job's ``[adapter]`` lacked the LoRA-XS options the classifier job's config
  offers: ``adapter.seed`` (the random projection's seed) was refused as an unknown key, and
  ``adapter.moment`` (W-SVD's statistics, which this job cannot collect) was refused as an
  unknown key without saying why. ``seed`` now reaches the adapter; ``moment``, and ``seed``
  where no projection reads it, are refused with the reason.
* The classifier job's config took ``adapter.moment`` under a projection other than W-SVD's
  (the default ``"svd"`` among them), which reads none: the option was ignored silently.
* ``pyrobayes evaluate`` of a causal-LM run whose model folder or task file had moved (or whose
  hub model is not in the local cache) failed in the loader with a message about Hugging Face
  repo ids or the internet, or after the model loaded; it now names the key of the run's
  ``config.json`` and where to write the new place, before anything loads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pyrobayes.cli import main
from pyrobayes.demo import causal_lm
from pyrobayes.demo.causal_lm_config import resolve_config
from pyrobayes.demo.config import ConfigError
from pyrobayes.models.layers import LoRAXSLinear
from tests.test_causal_lm_job import write_task


def lm_user(**adapter: Any) -> dict[str, Any]:
    """A one-family causal-LM config on ``task.json`` with ``adapter`` as its [adapter]."""
    return {"families": ["map"], "causal_lm": {"task": {"path": "task.json"}}, "adapter": adapter}


def _downs(config: dict[str, Any], seed: int = 0) -> list[torch.Tensor]:
    """The frozen ``down`` bases of every LoRA-XS layer of the job's model at ``seed``."""
    base, _ = causal_lm.load_base(config)
    model = causal_lm.build_model(config, base, num_data=8, seed=seed, family="map")
    layers = [m for m in model.net.modules() if isinstance(m, LoRAXSLinear)]
    assert layers, "the config built no LoRA-XS layer"
    return [m.down.clone() for m in layers]


def test_causal_lm_adapter_seed_reaches_the_random_projection() -> None:
    xs = {"kind": "lora_xs", "rank": 2, "projection": "random"}
    seeded = resolve_config(lm_user(**xs, seed=7))
    assert seeded["adapter"]["seed"] == 7
    again = _downs(seeded, seed=0)
    other_job_seed = _downs(seeded, seed=1)
    default = _downs(resolve_config(lm_user(**xs)), seed=0)
    # the configured seed fixes the bases (whatever the job's seed), and differs from seed 0's
    assert all(torch.equal(a, b) for a, b in zip(again, other_job_seed, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(again, default, strict=True))
    manual = _downs(resolve_config(lm_user(**xs, seed=0)), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(manual, default, strict=True))


@pytest.mark.parametrize(
    ("adapter", "words"),
    [
        (
            {"kind": "lora_xs", "moment": "second"},
            ["'adapter.moment' = 'second'", "W-SVD", "does not offer", "Remove adapter.moment"],
        ),
        (
            {"kind": "lora_xs", "projection": "svd", "moment": "centered"},
            ["'adapter.moment' = 'centered'", "collects no input statistics"],
        ),
        (
            {"kind": "lora_xs", "seed": 3},
            ["'adapter.seed' = 3", "adapter.projection = 'svd'", 'projection = "random"'],
        ),
        (
            {"kind": "lora_xs", "projection": "dct", "seed": 3},
            ["'adapter.seed' = 3", "'dct' draws nothing"],
        ),
        ({"kind": "lora", "seed": 3}, ["'adapter.seed' = 3", "LoRA-XS option", "lora_xs"]),
        ({"kind": "lora", "moment": "second"}, ["'adapter.moment' = 'second'", "LoRA-XS option"]),
        ({"kind": "lora_xs", "projection": "random", "seed": -1}, ["'adapter.seed'", ">= 0"]),
        ({"kind": "lora_xs", "projection": "random", "seed": 1.5}, ["'adapter.seed'", "int"]),
        ({"kind": "lora_xs", "moment": "third"}, ["'adapter.moment'", "'centered'", "'second'"]),
    ],
    ids=lambda v: str(v)[:60],
)
def test_causal_lm_lora_xs_options_that_would_be_ignored_are_refused(
    adapter: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(lm_user(**adapter))
    message = str(info.value)
    assert all(w in message for w in words), message
    assert "Unknown causal-LM config key" not in message


def test_fit_with_a_causal_lm_adapter_moment_exits_2_naming_the_reason(tmp_path, capsys) -> None:
    """``pyrobayes fit``: the refusal reaches the user before the run folder is written."""
    write_task(tmp_path / "task.json", num=8)
    config = tmp_path / "job.toml"
    config.write_text(
        'families = ["map"]\n[causal_lm]\nmodel = "tiny-llama"\n[causal_lm.task]\n'
        f'path = "{tmp_path / "task.json"}"\n[adapter]\nkind = "lora_xs"\nmoment = "second"\n'
    )
    out = tmp_path / "run"
    assert main(["fit", str(config), "--quick", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'adapter.moment'" in err and "W-SVD" in err and "Traceback" not in err, err
    assert not out.exists()


# ------------------------------------------- the classifier job's LoRA-XS options (no [causal_lm])


@pytest.mark.parametrize(
    ("adapter", "words"),
    [
        # moment is read by the W-SVD projection only
        (
            {"kind": "lora_xs", "moment": "second"},
            ["'adapter.moment' = 'second'", "adapter.projection = 'svd'", 'projection = "wsvd"'],
        ),
        (
            {"kind": "lora_xs", "projection": "random", "moment": "centered"},
            ["'adapter.moment' = 'centered'", "'random' reads none"],
        ),
        ({"kind": "lora_xs", "projection": "dct", "moment": "second"}, ["'dct' reads none"]),
    ],
    ids=lambda v: str(v)[:60],
)
def test_demo_adapter_moment_that_would_be_ignored_is_refused(
    adapter: dict[str, Any], words: list[str]
) -> None:
    from pyrobayes.demo.config import resolve_config as demo_resolve

    with pytest.raises(ConfigError) as info:
        demo_resolve({"adapter": adapter})
    message = str(info.value)
    assert all(w in message for w in words), message


def test_demo_lora_xs_options_that_are_read_still_pass() -> None:
    from pyrobayes.demo.config import resolve_config as demo_resolve

    wsvd = {"kind": "lora_xs", "projection": "wsvd", "moment": "second", "seed": 2}
    assert demo_resolve({"adapter": wsvd})["adapter"]["moment"] == "second"
    assert (
        demo_resolve({"adapter": {"kind": "lora_xs", "projection": "random", "seed": 5}})[
            "adapter"
        ]["seed"]
        == 5
    )


# ------------------------------------- evaluate: a causal-LM run whose model or task has moved


def _lm_run_folder(tmp_path: Any, **lm: Any) -> Any:
    """A causal-LM run folder (config.json, metrics.json, one posterior file) whose config
    names ``lm`` over the quick tiny-LLaMA job on a task file beside it."""
    import json

    write_task(tmp_path / "task.json", num=8)
    config = resolve_config(
        {"families": ["map"], "causal_lm": {"task": {"path": str(tmp_path / "task.json")}}},
        quick=True,
    )
    config["causal_lm"].update({k: v for k, v in lm.items() if k != "task_path"})
    if "task_path" in lm:
        config["causal_lm"]["task"]["path"] = lm["task_path"]
    run = tmp_path / "run"
    (run / "guides").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.json").write_text("[]")
    (run / "guides" / "map-seed0.safetensors").write_bytes(b"")
    return run


@pytest.mark.parametrize(
    ("lm", "words"),
    [
        ({"model": "/nowhere/moved-model"}, ["'causal_lm.model'", "/nowhere/moved-model"]),
        ({"model": "some-org/never-downloaded"}, ["'causal_lm.model'", "not in the local cache"]),
        ({"task_path": "/nowhere/task.json"}, ["'causal_lm.task.path'", "does not exist"]),
    ],
    ids=["moved-folder", "uncached-hub-id", "moved-task"],
)
def test_evaluate_names_the_run_configs_moved_model_or_task_before_loading(
    tmp_path, capsys, monkeypatch, lm: dict[str, Any], words: list[str]
) -> None:
    """``pyrobayes evaluate``: a run's model or task moved since the run was a loader's message
    (a Hugging Face repo-id rule, the internet) or came after the model loaded; it is named by
    its key in the run's config.json, with where to fix it, before anything loads."""

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded for a run whose inputs the check refuses")

    monkeypatch.setattr(causal_lm, "load_base", no_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = _lm_run_folder(tmp_path, **lm)
    assert main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run / "config.json") in err, err
    assert all(w in err for w in words), err
    assert "write its new place into config.json" in err and "Traceback" not in err, err
