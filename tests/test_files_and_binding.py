"""Posterior files tied to their base model (a fingerprint of the frozen base weights) and, on
request, to their author (an HMAC-SHA256 under a user key); guides bound to the model they were
built on (``fit``, ``make_fitter``, ``posterior(init=...)``)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import pyrobayes as pb
from pyrobayes.io import (
    PosteriorFileError,
    PosteriorMismatchError,
    UnverifiedSignatureWarning,
    _digest,
    base_fingerprint,
    load_state,
)
from pyrobayes.models import LoRA, LoRAXS
from tests.common import mlp_problem, split_batches

KEY = b"a key of the user's own"


def _problem(seed: int = 0, adapter=None):
    return mlp_problem(
        [4, 6, 3],
        adapter or LoRAXS(rank=2, target_modules=["0"]),
        num_data=32,
        seed=seed,
        data_seed=1,
        trainable_modules=["2"],
    )


def _fitted(family: str = "ivon", seed: int = 0, **options):
    p = _problem(seed)
    guide = pb.posterior(p.model, family, **options)
    pb.fit(p.model, guide, split_batches(p.x, p.y, 16), epochs=1, lr=0.05, seed=0)
    return p, guide


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return json.loads(meta["pyrobayes"]), tensors


def _rewrite(path, header, tensors):
    """What anyone can do: edit the file and recompute its SHA-256."""
    header["sha256"] = _digest(header, tensors)
    save_file(tensors, str(path), metadata={"pyrobayes": json.dumps(header)})


def _base(model) -> torch.nn.Module:
    return model.net.get_submodule("0").base


# ------------------------------------------------------------------ the base-model fingerprint
def test_a_posterior_is_refused_on_other_base_weights_of_the_same_shapes(tmp_path):
    p, guide = _fitted()
    path = pb.save(guide, tmp_path / "post.safetensors")
    header, _ = _read(path)
    saved = header["base_fingerprint"]
    # LoRA-XS layer "0": base.weight, base.bias and the fixed projections down, up
    assert saved == base_fingerprint(p.model) and (saved["scope"], saved["tensors"]) == (
        "adapted_modules",
        4,
    )
    other = _problem(seed=1).model  # same shapes, other frozen base weights
    here = base_fingerprint(other)
    assert here is not None and here["sha256"] != saved["sha256"]
    with pytest.raises(PosteriorMismatchError, match="fitted on another base model") as err:
        pb.load(path, other)
    message = str(err.value)
    assert str(path) in message and saved["sha256"][:16] in message
    assert here["sha256"][:16] in message and "check_base=False" in message
    loaded = pb.load(path, other, check_base=False)  # the explicit opt-out
    torch.testing.assert_close(loaded.scale("0.core"), guide.scale("0.core"), rtol=0, atol=0)
    # resume (load_state) refuses it too, and changes nothing
    fresh = pb.posterior(other, "ivon")
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(PosteriorMismatchError, match="fitted on another base model"):
        load_state(fresh, path, model=other)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_one_changed_base_weight_is_refused_and_the_head_is_not_part_of_it(tmp_path):
    p, guide = _fitted("meanfield")
    path = pb.save(guide, tmp_path / "post.safetensors")
    model = _problem().model
    with torch.no_grad():  # the head is point-estimated: stored in the file, loaded with it
        model.point_params["2.weight"].add_(1.0)
    pb.load(path, model)
    assert torch.equal(model.point_params["2.weight"], p.model.point_params["2.weight"])
    with torch.no_grad():  # one frozen base weight of the adapted layer
        _base(model).weight[0, 0] += 0.1
    with pytest.raises(PosteriorMismatchError, match="fitted on another base model"):
        pb.load(path, model)


def test_the_fingerprint_covers_a_lora_layers_base_and_ignores_the_dtype():
    model = _problem(adapter=LoRA(rank=2, target_modules=["0"])).model
    fp = base_fingerprint(model)
    assert fp is not None and (fp["scope"], fp["tensors"]) == ("adapted_modules", 2)  # W, b
    model.net.to(torch.float32)  # a float32 copy of the same (float64) base weights
    assert base_fingerprint(model) == fp
    with torch.no_grad():
        _base(model).bias[0] += 0.1
    assert base_fingerprint(model) != fp


def test_a_file_from_before_fingerprints_loads_with_a_logged_warning(tmp_path, caplog):
    _, guide = _fitted("map")
    path = pb.save(guide, tmp_path / "post.safetensors")
    header, tensors = _read(path)
    del header["base_fingerprint"]
    _rewrite(path, header, tensors)
    with caplog.at_level(logging.WARNING, logger="pyrobayes.io"):
        pb.load(path, _problem(seed=1).model)
    assert "has no base-model fingerprint" in caplog.text and "Re-save it" in caplog.text


# ------------------------------------------------------------------ the keyed signature
def test_a_signed_file_loads_with_its_key_and_warns_without_it(tmp_path):
    _, guide = _fitted()
    path = pb.save(guide, tmp_path / "post.safetensors", key=KEY)
    header, _ = _read(path)
    assert len(header["hmac_sha256"]) == 64
    pb.load(path, _problem().model, key=KEY)
    with pytest.warns(UnverifiedSignatureWarning, match="signed .* loaded without key="):
        pb.load(path, _problem().model)
    with pytest.raises(PosteriorFileError, match="failed its signature check"):
        pb.load(path, _problem().model, key=b"another key")
    with pytest.raises(TypeError, match=r"takes bytes, got a str; pass key.encode\(\)"):
        pb.save(guide, tmp_path / "other.safetensors", key="text")


def test_an_edited_and_rehashed_header_is_refused_with_the_key(tmp_path):
    """The reported case: IVON ess 64 -> 1e-3 and the SHA-256 recomputed. The SHA-256 (integrity)
    passes; the HMAC (authenticity) does not."""
    _, guide = _fitted("ivon", ess=64.0)
    path = pb.save(guide, tmp_path / "post.safetensors", key=KEY)
    header, tensors = _read(path)
    header["config"]["ess"] = 1e-3
    _rewrite(path, header, tensors)
    with pytest.raises(PosteriorFileError, match="failed its signature check") as err:
        pb.load(path, _problem().model, key=KEY)
    assert str(path) in str(err.value) and "edited after it was signed" in str(err.value)
    with pytest.warns(UnverifiedSignatureWarning):  # without the key: loads, but says so
        edited = pb.load(path, _problem().model)
    assert edited.config()["ess"] == 1e-3
    # an edited tensor, re-hashed
    path = pb.save(guide, tmp_path / "post.safetensors", key=KEY)
    header, tensors = _read(path)
    name = next(k for k in tensors if k.startswith("guide."))
    tensors[name] = tensors[name] + 1.0
    _rewrite(path, header, tensors)
    with pytest.raises(PosteriorFileError, match="failed its signature check"):
        pb.load(path, _problem().model, key=KEY)


def test_a_stripped_signature_or_an_unsigned_file_is_refused_with_a_key(tmp_path):
    _, guide = _fitted("map")
    path = pb.save(guide, tmp_path / "post.safetensors", key=KEY)
    header, tensors = _read(path)
    del header["hmac_sha256"]
    _rewrite(path, header, tensors)
    with pytest.raises(PosteriorFileError, match="is not signed, so key= cannot authenticate"):
        pb.load(path, _problem().model, key=KEY)
    pb.load(path, _problem().model)  # unsigned, without a key: as any unsigned file


# ------------------------------------------------------------------ guides bound to their model
def test_fitting_a_guide_with_another_model_is_refused_naming_both():
    """The reported case: pb.fit(model_B, guide_built_on_model_A) trained, and pb.save(guide)
    then wrote A's head."""
    a, b = _problem(seed=0), _problem(seed=1)  # the same sites and shapes
    guide = pb.posterior(a.model, "meanfield")
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    heads = {k: v.clone() for k, v in b.model.point_params.items()}
    for call in (
        lambda: pb.fit(b.model, guide, split_batches(b.x, b.y, 16), epochs=1),
        lambda: pb.infer.make_fitter(b.model, guide, lr=1e-2),
    ):
        with pytest.raises(ValueError, match="was built on another model") as err:
            call()
        message = str(err.value)
        assert f"guide.model: FineTuneModel at {id(a.model):#x}" in message
        assert f"model passed (FineTuneModel at {id(b.model):#x}" in message
        assert "same sites and shapes, but are different objects" in message
        assert "pb.posterior(model, ...)" in message
    for k, v in guide.state_dict().items():  # nothing trained
        assert torch.equal(v, before[k]), k
    for k, v in b.model.point_params.items():
        assert torch.equal(v, heads[k]), k
    pb.infer.make_fitter(a.model, guide, lr=1e-2)  # its own model: fine


def test_predicting_with_a_guide_on_another_model_that_differs_is_refused(tmp_path):
    """The reported case: a notebook rebuilds the model after the fit and predicts with the
    old guide: the posterior's sites fit, but the model's head is untrained (the guide does
    not hold it), and the prediction was silently another model's."""
    a, guide = _fitted("meanfield")
    data = split_batches(a.x, a.y, 16)
    reference = pb.predict(a.model, guide, data, num_samples=2, seed=0).probs
    rebuilt = _problem(seed=0).model  # the same base weights, its own (unfitted) head
    other_base = _problem(seed=1).model  # other base weights (and head)
    calls = [
        ("predict", lambda m: pb.predict(m, guide, data, num_samples=2, seed=0)),
        ("predict", lambda m: pb.calibrate(m, guide, data, num_samples=2)),  # through predict
        ("to_inference_data", lambda m: pb.to_inference_data(m, guide, data, num_samples=2)),
    ]
    for where, call in calls:
        pattern = rf"{where}: the MeanFieldGuide was fitted with another model .* differ in "
        head = r"the point parameters \['2\.bias', '2\.weight'\] \(the head\), which"
        with pytest.raises(ValueError, match=pattern + head) as err:
            call(rebuilt)
        assert "base weights" not in str(err.value)  # the rebuilt model's base is the same
    base = r"\(the head\) and the frozen base weights of the adapted layers, which"
    with pytest.raises(ValueError, match=base):
        pb.predict(other_base, guide, data, num_samples=2, seed=0)
    # a copy with equal weights predicts the same; so does the file loaded into the rebuilt model
    copy = _problem(seed=0).model
    copy.load_state_dict(a.model.state_dict())
    assert torch.equal(pb.predict(copy, guide, data, num_samples=2, seed=0).probs, reference)
    pb.predict(copy.to(torch.float64), guide, data, num_samples=2)  # a cast copy: accepted
    pb.save(guide, tmp_path / "q.safetensors")
    loaded = pb.load(tmp_path / "q.safetensors", rebuilt)
    assert torch.equal(pb.predict(rebuilt, loaded, data, num_samples=2, seed=0).probs, reference)


def test_init_from_a_guide_fitted_on_another_model_is_refused():
    """pb.posterior(model_B, "laplace", init=map_guide_of_model_A): other base weights, or the
    same base but another head, are refused; a rebuilt copy with the head copied is accepted
    (what the demo pipeline does)."""
    a, map_guide = _fitted("map")
    other = _problem(seed=1).model  # other frozen base weights
    with pytest.raises(ValueError, match="fitted on another model: the frozen base weights"):
        pb.posterior(other, "laplace", init=map_guide)
    rebuilt = _problem(seed=0).model  # the same base weights, its own (unfitted) head
    with pytest.raises(ValueError, match=r"point parameters differ from this model's \(\['2"):
        pb.posterior(rebuilt, "laplace", init=map_guide)
    with torch.no_grad():
        for k, p in rebuilt.point_params.items():
            p.copy_(a.model.point_params[k])
    laplace = pb.posterior(rebuilt, "laplace", init=map_guide)
    for site, value in map_guide.mean().items():
        assert torch.equal(laplace.loc(site), value), site


def test_init_from_an_unfitted_guide_is_refused():
    p = _problem()
    map_guide = pb.posterior(p.model, "map")
    with pytest.raises(
        ValueError, match="the DeltaGuide was never fitted: its point equals"
    ) as err:
        pb.posterior(p.model, "laplace", init=map_guide)
    assert "Fit it first" in str(err.value) and "without init=" in str(err.value)
    pb.fit(p.model, map_guide, split_batches(p.x, p.y, 16), epochs=1, lr=0.05, seed=0)
    assert not pb.posterior(p.model, "laplace", init=map_guide).is_fitted  # fitted: accepted
