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
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
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
    # LoRA-XS layer "0": base.weight, base.bias and the fixed projections down, up (the head
    # "2" is a point parameter, stored in the file: no other frozen tensor)
    assert saved == base_fingerprint(p.model) and (saved["scope"], saved["tensors"]) == (
        "adapted_modules+network",
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
    assert fp is not None and (fp["scope"], fp["tensors"]) == ("adapted_modules+network", 2)
    model.net.to(torch.float32)  # a float32 copy of the same (float64) base weights
    assert base_fingerprint(model) == fp
    with torch.no_grad():
        _base(model).bias[0] += 0.1
    assert base_fingerprint(model) != fp


def _deep(seed: int = 0, act=torch.nn.Tanh, lower_seed: int | None = None) -> FineTuneModel:
    """``Linear(4, 6) - act - Linear(6, 6) - act - Linear(6, 3)``: the adapter on "2" only, so
    "0" is frozen and un-adapted (a lower block), "4" the point head."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 6), act(), torch.nn.Linear(6, 6), act(), torch.nn.Linear(6, 3)
    )
    if lower_seed is not None:
        torch.manual_seed(lower_seed)
        net[0] = torch.nn.Linear(4, 6)
    return FineTuneModel(
        net, LoRAXS(rank=2, target_modules=["2"]), num_data=32, trainable_modules=["4"]
    )


@pytest.mark.parametrize(
    ("change", "differs"),
    [
        ({"lower_seed": 5}, "a lower layer's frozen weights (outside the adapted ones)"),
        ({"act": torch.nn.ReLU}, "a layer type (no weights)"),
    ],
)
def test_the_fingerprint_covers_the_frozen_network_outside_the_adapted_layers(
    tmp_path, change, differs
):
    """Version 1 hashed the adapted layers only: a model whose lower, un-adapted layer held other
    weights (or whose activations differ) loaded, and predicted 0.5-0.9 nats off."""
    model = _deep()
    guide = pb.posterior(model, "meanfield")
    path = pb.save(guide, tmp_path / "post.safetensors")
    other = _deep(**change)
    v1 = base_fingerprint(model, version=1)
    assert v1 == base_fingerprint(other, version=1), differs  # what version 1 could not see
    with pytest.raises(PosteriorMismatchError, match="fitted on another base model"):
        pb.load(path, other)
    pb.load(path, _deep())  # the same network rebuilt: loads
    # a float64 copy of it too (values rounded to bfloat16 in the hash, sampled or not)
    pb.load(path, _deep().to(torch.float64))


def test_a_version_1_file_is_checked_by_its_own_fingerprint(tmp_path):
    """Files saved before version 2 record the adapted layers' fingerprint: they still load into
    the same model, and another base is still refused by that fingerprint."""
    _, guide = _fitted("map")
    path = pb.save(guide, tmp_path / "post.safetensors")
    header, tensors = _read(path)
    header["base_fingerprint"] = base_fingerprint(guide.model, version=1)
    assert "version" not in header["base_fingerprint"]
    _rewrite(path, header, tensors)
    pb.load(path, _problem().model)
    with pytest.raises(PosteriorMismatchError, match="fitted on another base model"):
        pb.load(path, _problem(seed=1).model)


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
    base = r"\(the head\) and the frozen network \(base weights, fixed projections or layer types\)"
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


# ------------------------------------------------------------------ what the header records
def test_a_swag_scale_set_after_fitting_is_saved(tmp_path):
    p, guide = _fitted("swag")
    guide.scale = 2.0  # documented: may be set after fitting (the file recorded 0.5)
    loaded = pb.load(pb.save(guide, tmp_path / "post.safetensors"), _problem().model)
    assert loaded.scale == 2.0


def test_saving_with_another_model_than_the_fits_is_refused(tmp_path):
    """``model=`` other than ``guide.model``: the header would record its base and settings,
    so the file refused the true model and loaded into the wrong one."""
    p, guide = _fitted("map")
    for other in (_problem(seed=1).model, _problem().model):
        if other.net[0].base.weight.equal(p.model.net[0].base.weight):
            other.num_data = 999  # the same base, other settings
        with torch.no_grad():  # the same head, so that only the base or the settings differ
            for k, v in p.model.point_params.items():
                other.point_params[k].copy_(v)
        with pytest.raises(PosteriorMismatchError, match="model differs from the model the guide"):
            pb.save(guide, tmp_path / "post.safetensors", model=other)
    assert not (tmp_path / "post.safetensors").exists()


class _TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = (
            torch.nn.Linear(4, 4),
            torch.nn.Linear(4, 3),
            torch.nn.Linear(4, 3),
        )

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.a(h), self.b(h)


def _two_outputs(output_key):
    torch.manual_seed(0)
    return FineTuneModel(
        _TwoOutputs(),
        LoRAXS(rank=2, target_modules=["body"]),
        num_data=32,
        trainable_modules=["a", "b"],
        output_key=output_key,
    )


def test_the_output_key_is_recorded_and_checked_on_load(tmp_path):
    guide = pb.posterior(_two_outputs(0), "map")
    path = pb.save(guide, tmp_path / "post.safetensors")
    assert _read(path)[0]["model"]["output_key"] == 0
    pb.load(path, _two_outputs(0))
    pb.load(path, _two_outputs(lambda out: out[0]))  # a callable: cannot be compared
    for other in (1, None):
        with pytest.raises(PosteriorMismatchError, match=r"output_key is 0 in the file but"):
            pb.load(path, _two_outputs(other))


def test_a_nested_adapters_init_scale_is_ignored_as_a_plain_ones(tmp_path):
    """sigma-N wraps LoRA-XS: its adapter's init_scale (the cores' initial draw) does not change
    the posterior's sites or bases, as for plain LoRA-XS; its projection does."""

    def build(**lora):
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
        )
        adapter = pb.models.SigmaNorm(num_members=2, adapter=LoRAXS(target_modules=["0"], **lora))
        return FineTuneModel(net, adapter, num_data=32, trainable_modules=["3"])

    guide = pb.posterior(build(rank=2), "signorm")
    path = pb.save(guide, tmp_path / "post.safetensors")
    pb.load(path, build(rank=2, init_scale=0.1))
    with pytest.raises(PosteriorMismatchError, match=r"adapter adapter.projection is 'svd' in"):
        pb.load(path, build(rank=2, projection="dct"))


def test_a_saved_file_gets_the_mode_a_plain_write_gives(tmp_path):
    import os
    import stat

    _, guide = _fitted("map")
    mask = os.umask(0o022)
    try:
        path = pb.save(guide, tmp_path / "post.safetensors")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # was 0600 (mkstemp's)
        path.chmod(0o640)
        pb.save(guide, path)  # an overwrite keeps the file's mode
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        os.umask(mask)


def test_swapped_save_and_load_arguments_are_named(tmp_path):
    p, guide = _fitted("map")
    with pytest.raises(TypeError, match=r"other way round.*pb.save\(guide, path\)"):
        pb.save(tmp_path / "post.safetensors", guide)
    path = pb.save(guide, tmp_path / "post.safetensors")
    with pytest.raises(TypeError, match=r"pb.load\(path, model\)"):
        pb.load(p.model, path)


def test_a_file_refused_for_a_network_of_another_dtype_names_both_and_the_remedy(tmp_path):
    """A LoRA-XS posterior fitted on a float32 network, loaded into a model built on a bfloat16
    copy of that network: the SVD bases computed from the rounded weights differ, so the base
    check refuses; the message names both dtypes and the remedy (build on the float32 network,
    load, cast), which loads."""

    def model(dtype: torch.dtype) -> FineTuneModel:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        adapter = LoRAXS(rank=2, target_modules=["0"])
        return FineTuneModel(net.to(dtype), adapter, num_data=32, trainable_modules=["2"])

    fitted = model(torch.float32)
    guide = pb.posterior(fitted, "meanfield")
    x, y = torch.randn(32, 4, dtype=torch.float32), torch.arange(32) % 3
    pb.fit(fitted, guide, [(x, y)], epochs=1, progress=False)
    pb.save(guide, tmp_path / "q.safetensors")
    with pytest.raises(PosteriorMismatchError, match=r"a float32 network and this one is bfloat16"):
        pb.load(tmp_path / "q.safetensors", model(torch.bfloat16))
    remedy = model(torch.float32)
    loaded = pb.load(tmp_path / "q.safetensors", remedy)
    remedy.to(torch.bfloat16)
    assert torch.equal(loaded.mean()["0.core"], guide.mean()["0.core"])
