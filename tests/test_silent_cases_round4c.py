"""Silent failure cases, round 4c.

* Tied weights named twice in ``trainable_modules`` (``["emb", "head"]`` with the head tied to
  the embeddings, ``tie_word_embeddings=True``) listed the one tensor twice in
  ``model.point_params``: the optimizer stepped it twice per iteration (torch's "duplicate
  parameters" warning). It is now one point parameter, under its first name in network order.
* A LoRA / LoRA-XS adapter on a layer whose weight is tied to a point parameter (the head
  adapted, the embeddings trained) had its "frozen" base weight trained by the optimizer (and
  LoRA-XS's bases went stale). Refused, naming both modules and what to do.
* The classifier config took a LoRA-XS option (``adapter.init_scale``) without ``adapter.kind``,
  whose default is ``"lora"``: ``LoRA(init_scale=...)`` failed with a TypeError at model build,
  after the data had loaded.
* ``pyrobayes evaluate`` of a classifier run whose model folder has moved failed in the
  tokenizer's loader with a message about Hugging Face repo ids; the run's config.json key is
  now named before anything loads.
* ``pb.predict`` on a loader whose input width changes between batches gave torch's "mat1 and
  mat2 shapes cannot be multiplied" with no batch named.
* A SWAG posterior from 0 or 1 collected iterates (no spread) was only a log line.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.cli import main
from pyrobayes.demo import pipeline
from pyrobayes.demo.config import DEFAULT_CONFIG, ConfigError, resolve_config
from pyrobayes.guides import SWAGGuide
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.adapters import adapter_from_dict
from tests.common import TiedNet, mlp_problem, tensor_loader, tied_data

# ------------------------------------------------------------------------------------------------
# Tied weights: point parameters, adapters
# ------------------------------------------------------------------------------------------------


def _tied_model(trainable: list[str]) -> FineTuneModel:
    return FineTuneModel(
        TiedNet(), LoRA(rank=2, target_modules=["mid"]), num_data=40, trainable_modules=trainable
    )


@pytest.mark.parametrize("trainable", [["emb", "head"], ["head", "emb"]])
def test_a_tied_weight_named_twice_is_one_point_parameter_under_its_first_name(trainable):
    model = _tied_model(trainable)
    # before: ['emb.weight', 'head.weight'], one tensor twice
    assert list(model.point_params) == ["emb.weight"]  # first in network order, either way
    assert model.point_params["emb.weight"] is model.net.head.weight


def test_a_tied_weight_named_twice_takes_one_optimizer_step_per_iteration(tmp_path):
    def fitted(trainable: list[str]) -> tuple[FineTuneModel, Any]:
        model = _tied_model(trainable)
        torch.manual_seed(1)
        guide = pb.posterior(model, "map")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "duplicate parameters" before the fix
            pb.fit(model, guide, tied_data(), epochs=2, lr=0.05)
        return model, guide

    model, guide = fitted(["emb", "head"])
    once, _ = fitted(["emb"])  # the same tensor, named once
    assert not torch.equal(model.net.emb.weight, TiedNet().emb.weight)  # it was trained
    # before: stepped twice per iteration, so it moved away from the one-name fit
    torch.testing.assert_close(model.net.emb.weight, once.net.emb.weight)
    x, _ = tied_data()[0]
    # a posterior file of it loads into a model built the same way
    pb.save(guide, tmp_path / "tied.safetensors")
    other = _tied_model(["head", "emb"])
    loaded = pb.load(tmp_path / "tied.safetensors", other)
    assert torch.equal(other.net.emb.weight, model.net.emb.weight)
    assert other.net.head.weight is other.net.emb.weight
    with torch.no_grad():
        torch.testing.assert_close(other.output(x, loaded.mean()), model.output(x, guide.mean()))


@pytest.mark.parametrize(
    "adapter",
    [LoRA(rank=2, target_modules=["head"]), LoRAXS(rank=2, target_modules=["head"])],
    ids=["lora", "lora_xs"],
)
def test_an_adapter_on_a_layer_tied_to_a_point_parameter_is_refused(adapter):
    # before: built, and the optimizer trained the adapter's frozen base weight (emb.weight)
    with pytest.raises(
        ValueError,
        match=r"adapted module 'head' \(target_modules\) is built on the frozen weight "
        r"'head\.weight', which is the same tensor as 'emb\.weight' of module 'emb', a point "
        r"parameter \(trainable_modules\).*Freeze 'emb'.*leave 'head' out of target_modules.*"
        r"untie the weights",
    ):
        FineTuneModel(TiedNet(), adapter, num_data=40, trainable_modules=["emb"])


def test_an_adapter_on_a_layer_tied_to_frozen_embeddings_keeps_them_frozen():
    net = TiedNet()
    emb = net.emb.weight.detach().clone()
    model = FineTuneModel(
        net, LoRA(rank=2, target_modules=["head"]), num_data=40, trainable_modules=["mid"]
    )
    pb.fit(model, pb.posterior(model, "map"), tied_data(), epochs=2)
    assert torch.equal(net.emb.weight, emb)


# ------------------------------------------------------------------------------------------------
# The classifier config: a LoRA-XS option under the default kind
# ------------------------------------------------------------------------------------------------


def test_a_lora_xs_option_without_a_kind_is_refused_under_the_default_kind():
    assert DEFAULT_CONFIG["adapter"]["kind"] == "lora"
    # before: passed, and LoRA(init_scale=0.0) raised a TypeError at model build
    with pytest.raises(
        ConfigError,
        match=r"'adapter\.init_scale' is a LoRA-XS option.*'lora' \(the default: the config "
        r"sets no adapter\.kind\).*Set kind = \"lora_xs\"",
    ):
        resolve_config({"adapter": {"init_scale": 0.0}})
    config = resolve_config({"adapter": {"kind": "lora_xs", "init_scale": 0.0}})
    adapter = adapter_from_dict(dict(config["adapter"]))
    assert isinstance(adapter, LoRAXS) and adapter.init_scale == 0.0


# ------------------------------------------------------------------------------------------------
# evaluate: a classifier run whose model has moved
# ------------------------------------------------------------------------------------------------


def _run_folder(tmp_path: Any, model_name: str) -> Any:
    config = resolve_config({"families": ["map"]}, quick=True)
    config["model"]["name"] = model_name
    run = tmp_path / "run"
    (run / "guides").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.json").write_text("[]")
    (run / "guides" / "map.safetensors").write_bytes(b"")
    return run


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("/nowhere/moved-model", ["'model.name'", "/nowhere/moved-model"]),
        ("some-org/never-downloaded", ["'model.name'", "not in the local cache"]),
    ],
    ids=["moved-folder", "uncached-hub-id"],
)
def test_evaluate_names_the_classifier_runs_moved_model_before_loading(
    tmp_path, capsys, monkeypatch, name: str, words: list[str]
) -> None:
    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run's data or model was loaded before its inputs were checked")

    monkeypatch.setattr(pipeline, "_load_tokenizer", no_load)
    monkeypatch.setattr(pipeline, "build_model", no_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = _run_folder(tmp_path, name)
    assert main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run / "config.json") in err, err
    assert all(w in err for w in words), err
    assert "write its new place into config.json" in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------------
# predict: a batch the network's forward fails on is named
# ------------------------------------------------------------------------------------------------


def _mlp_model() -> FineTuneModel:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return FineTuneModel(net, latent_modules=["2"], trainable_modules=[], num_data=4)


def test_predict_names_the_batch_whose_forward_fails():
    model = _mlp_model()
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, [(torch.randn(4, 5), torch.randint(0, 3, (4,)))], epochs=1)
    data = [
        (torch.randn(4, 5), torch.randint(0, 3, (4,))),
        (torch.randn(4, 5), torch.randint(0, 3, (4,))),
        (torch.randn(4, 6), torch.randint(0, 3, (4,))),  # a wider batch
    ]
    with pytest.raises(
        RuntimeError,
        match=r"predict: batch 2 \(input shape \(4, 6\)\): the network's forward failed: "
        r"mat1 and mat2 shapes cannot be multiplied.*Check that batch against the earlier ones",
    ) as caught:
        pb.predict(model, guide, data, num_samples=2)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "mat1 and mat2" in str(caught.value.__cause__)


def test_predict_passes_a_forward_error_subclass_through_unchanged(monkeypatch):
    model = _mlp_model()
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, [(torch.randn(4, 5), torch.randint(0, 3, (4,)))], epochs=1)

    class OutOfMemory(RuntimeError):
        pass

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OutOfMemory("out of memory")

    monkeypatch.setattr(model, "batched_output", fail)
    with pytest.raises(OutOfMemory, match=r"^out of memory$"):
        pb.predict(model, guide, [torch.randn(4, 5)], num_samples=2)


# ------------------------------------------------------------------------------------------------
# SWAG from fewer than two iterates
# ------------------------------------------------------------------------------------------------


def test_a_swag_posterior_from_one_iterate_warns_what_to_do():
    prob = mlp_problem(
        (6, 5, 3),
        LoRAXS(rank=2, target_modules=["0", "2"]),
        num_data=48,
        seed=1,
        trainable_modules=[],
    )
    loader = tensor_loader(prob.x, prob.y, 12)
    guide = SWAGGuide(prob.model, rank=3)
    pb.fit(prob.model, guide, loader, epochs=1, lr=0.05)
    assert int(guide.swag_num_collected) == 1
    # before: a log line only, and a posterior with no spread
    with pytest.warns(
        UserWarning,
        match=r"SWAG posterior from 1 collected iterate\(s\) has no spread.*more epochs after "
        r"start_epoch.*smaller start_epoch, collect_every or collect_every_steps",
    ) as caught:
        post = guide.posterior()
    from pyrobayes.guides.lowrank import DegenerateSWAGWarning  # its own class, to filter by

    assert [w.category for w in caught] == [DegenerateSWAGWarning]
    assert float(post.variance.max()) < 1e-20
