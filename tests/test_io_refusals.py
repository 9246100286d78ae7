"""What a refused ``pb.load`` / ``pb.save`` leaves behind and says: a refused load leaves the
model exactly as it was (also where the file's layers had been made latent first), and a path
that cannot be a posterior file gets an error naming the user's path and the fix, not an
internal temporary file or a raw OS message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import pyrobayes as pb
from pyrobayes.io import PosteriorFileError, PosteriorMismatchError, _digest, read_header
from pyrobayes.models import LoRAXS
from tests.common import mlp_problem, split_batches

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")


def _problem(num_data: int = 32, seed: int = 0, classes: int = 3):
    """MLP 4 -> 6 -> classes, LoRA-XS cores (rank 2) on layer 0, the head "2" a point estimate."""
    return mlp_problem(
        [4, 6, classes],
        LoRAXS(rank=2, target_modules=["0"]),
        num_data=num_data,
        seed=seed,
        data_seed=1,
        trainable_modules=["2"],
    )


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return json.loads(meta["pyrobayes"]), tensors


def _rewrite(path, edit) -> None:
    """Apply ``edit(header, tensors)`` and re-hash: a consistent file that says something else."""
    header, tensors = _read(path)
    edit(header, tensors)
    header["sha256"] = _digest(header, tensors)
    save_file(tensors, str(path), metadata={"pyrobayes": json.dumps(header)})


@pytest.fixture(scope="module")
def head_latent_file(tmp_path_factory):
    """A mean-field posterior over the adapter and the head, saved after ``make_latent``."""
    p = _problem()
    p.model.make_latent(["2"])
    guide = pb.posterior(p.model, "meanfield")
    pb.fit(p.model, guide, split_batches(p.x, p.y, 16), epochs=1, lr=0.05, seed=0)
    path = tmp_path_factory.mktemp("io") / "head.safetensors"
    pb.save(guide, path)
    assert sorted(read_header(path)["sites"]) == ["0.core", "2.bias", "2.weight"]
    return path


def _state(model) -> dict:
    """Everything a load could change on ``model``: sites, point parameters (objects, values and
    requires_grad), the network's module types and tensors, the cached slots."""
    net = model.net
    return {
        "sites": {s: tuple(spec.shape) for s, spec in model.latent_sites.items()},
        "point": {
            n: (id(p), p.detach().clone(), p.requires_grad) for n, p in model.point_params.items()
        },
        "modules": [(n, type(m).__name__, id(m)) for n, m in net.named_modules()],
        "tensors": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "params": [(n, p.requires_grad) for n, p in net.named_parameters()],
        "dict": sorted(model.__dict__),
    }


def _assert_same(before: dict, after: dict) -> None:
    assert after["sites"] == before["sites"]
    assert list(after["point"]) == list(before["point"])
    for name, (ident, value, grad) in before["point"].items():
        ident2, value2, grad2 = after["point"][name]
        assert ident2 == ident and grad2 == grad and torch.equal(value2, value), name
    assert after["modules"] == before["modules"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for key, value in before["tensors"].items():
        assert torch.equal(after["tensors"][key], value), key
    assert after["params"] == before["params"]
    assert after["dict"] == before["dict"]


def _bogus_option(header, tensors):
    header["config"]["bogus_option"] = 1


def _unknown_tensor(header, tensors):
    tensors["guide.not_a_parameter"] = torch.ones(2)


def _unregistered_family(header, tensors):
    header["family"] = "no-such-family"


# (model kwargs, file edit, error, match): before and after the head is made latent
REFUSALS = {
    "num_data": ({"num_data": 64}, None, PosteriorMismatchError, "model num_data is 32"),
    "head_shape": ({"classes": 4}, None, PosteriorMismatchError, "different sites"),
    "base_weights": ({"seed": 5}, None, PosteriorMismatchError, "another base model"),
    "options": ({}, _bogus_option, PosteriorMismatchError, "does not take the file's options"),
    "guide_tensors": ({}, _unknown_tensor, PosteriorMismatchError, "do not fit MeanFieldGuide"),
    "family": ({}, _unregistered_family, ValueError, "no-such-family"),
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_refused_load_leaves_the_model_as_it_was(head_latent_file, tmp_path, kind):
    kwargs, edit, error, match = REFUSALS[kind]
    path = tmp_path / "head.safetensors"
    path.write_bytes(head_latent_file.read_bytes())
    if edit is not None:
        _rewrite(path, edit)
    model = _problem(**kwargs).model
    assert sorted(model.point_params) == ["2.bias", "2.weight"]  # the head: a point estimate
    before = _state(model)
    with pytest.raises(error, match=match):
        pb.load(path, model)
    _assert_same(before, _state(model))
    # the model still works as built: a guide built on it predicts
    guide = pb.posterior(model, "map")
    pb.predict(model, guide, [(torch.randn(5, 4), torch.zeros(5, dtype=torch.long))])


def test_an_edited_file_leaves_the_model_as_it_was(head_latent_file, tmp_path):
    path = tmp_path / "head.safetensors"
    header, tensors = _read(head_latent_file)
    tensors[sorted(tensors)[0]] *= 2.0  # not re-hashed: an integrity failure
    save_file(tensors, str(path), metadata={"pyrobayes": json.dumps(header)})
    model = _problem().model
    before = _state(model)
    with pytest.raises(PosteriorFileError, match="integrity check"):
        pb.load(path, model)
    _assert_same(before, _state(model))


def test_after_a_refused_load_the_right_file_still_loads(head_latent_file, tmp_path):
    path = tmp_path / "head.safetensors"
    path.write_bytes(head_latent_file.read_bytes())
    _rewrite(path, _unknown_tensor)
    model = _problem().model
    with pytest.raises(PosteriorMismatchError):
        pb.load(path, model)
    guide = pb.load(head_latent_file, model)
    assert sorted(model.latent_sites) == ["0.core", "2.bias", "2.weight"]
    assert model.point_params == {}
    assert type(model.net.get_submodule("2")).__name__ == "BatchedLinear"
    assert sorted(guide.sites) == ["0.core", "2.bias", "2.weight"]


# ------------------------------------------------------------------------------ bad paths
@pytest.fixture
def fitted():
    p = _problem()
    guide = pb.posterior(p.model, "map")
    pb.fit(p.model, guide, split_batches(p.x, p.y, 16), epochs=1, lr=0.05, seed=0)
    return p, guide


def test_saving_to_a_folder_names_it_and_leaves_it_alone(fitted, tmp_path):
    _, guide = fitted
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(IsADirectoryError, match="is a folder, not a file name") as err:
        pb.save(guide, tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and str(tmp_path / "posterior.safetensors") in message
    assert ".tmp" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_saving_below_a_file_names_the_file(fitted, tmp_path):
    _, guide = fitted
    blocker = tmp_path / "post.safetensors"
    blocker.write_bytes(b"a file")
    for target in (blocker / "sub.safetensors", blocker / "a" / "b" / "sub.safetensors"):
        with pytest.raises(NotADirectoryError, match="is a file, not a folder") as err:
            pb.save(guide, target)
        assert str(target) in str(err.value) and str(blocker) in str(err.value)
    assert blocker.read_bytes() == b"a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["post.safetensors"]


def test_saving_creates_missing_folders(fitted, tmp_path):
    p, guide = fitted
    target = tmp_path / "a" / "b" / "post.safetensors"
    assert pb.save(guide, target) == target
    pb.load(target, _problem().model)


def test_an_unwritable_folder_keeps_the_error_type_and_names_the_path(
    fitted, tmp_path, monkeypatch
):
    _, guide = fitted

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pb.io.files.tempfile, "mkstemp", refuse)
    target = tmp_path / "post.safetensors"
    with pytest.raises(PermissionError, match="Save to a folder you can write to") as err:
        pb.save(guide, target)
    assert str(target) in str(err.value) and err.value.errno == 13
    assert list(tmp_path.iterdir()) == []


def test_a_failed_replace_names_the_path_and_leaves_no_temporary_file(
    fitted, tmp_path, monkeypatch
):
    _, guide = fitted

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src), None, str(dst))

    monkeypatch.setattr(pb.io.files.os, "replace", refuse)
    target = tmp_path / "post.safetensors"
    with pytest.raises(PermissionError, match="cannot move the written posterior") as err:
        pb.save(guide, target)
    assert str(target) in str(err.value) and ".tmp" not in str(err.value)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_loading_a_missing_file_is_a_file_not_found_error_naming_it(tmp_path):
    model = _problem().model
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match="No posterior file at") as err:
        pb.load(missing, model)
    assert str(missing) in str(err.value) and "holds no such file" in str(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_header(tmp_path / "nowhere" / "missing.safetensors")
    with pytest.raises(FileNotFoundError):
        pb.io.load_state(pb.posterior(model, "map"), missing)


def test_loading_a_folder_names_it_and_lists_its_posterior_files(fitted, tmp_path):
    _, guide = fitted
    pb.save(guide, tmp_path / "a.safetensors")
    pb.save(guide, tmp_path / "b.safetensors")
    with pytest.raises(IsADirectoryError, match="is a folder, not a posterior file") as err:
        pb.load(tmp_path, _problem().model)
    assert str(tmp_path) in str(err.value)
    assert "['a.safetensors', 'b.safetensors']" in str(err.value)
    with pytest.raises(IsADirectoryError):
        read_header(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(IsADirectoryError) as err:
        pb.load(empty, _problem().model)
    assert "posterior files in it" not in str(err.value)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads all")
def test_an_unreadable_file_keeps_the_permission_error_and_names_it(fitted, tmp_path):
    _, guide = fitted
    path = pb.save(guide, tmp_path / "post.safetensors")
    Path(path).chmod(0)
    try:
        with pytest.raises(PermissionError) as err:
            pb.load(path, _problem().model)
        assert str(path) in str(err.value)
    finally:
        Path(path).chmod(0o644)


def test_save_after_make_latent_says_the_model_changed_since_the_guide(tmp_path) -> None:
    # the same model object: "pass the model the guide was fitted on" would send the user in a
    # circle; the refusal names make_latent and what to save instead
    p = _problem()
    guide = pb.posterior(p.model, "map")
    pb.fit(p.model, guide, split_batches(p.x, p.y, 16), epochs=1, lr=0.05, seed=0)
    p.model.make_latent(["2"])
    with pytest.raises(PosteriorMismatchError, match=r"no longer its model's: only in the model"):
        pb.save(guide, tmp_path / "map.safetensors")
    with pytest.raises(PosteriorMismatchError, match=r"make_latent"):
        pb.save(guide, tmp_path / "map.safetensors")
    assert not (tmp_path / "map.safetensors").exists()


def test_read_header_with_a_key_checks_the_signature(fitted, tmp_path):
    # read_header(path, key=wrong) ignored the key (it was used only with verify=True) and
    # returned the header as if it were signed under it
    _, guide = fitted
    path = pb.save(guide, tmp_path / "signed.safetensors", key=b"right key")
    assert read_header(path, key=b"right key")["family"] == "map"
    with pytest.raises(PosteriorFileError, match="failed its signature check"):
        read_header(path, key=b"wrong key")
    unsigned = pb.save(guide, tmp_path / "unsigned.safetensors")
    with pytest.raises(PosteriorFileError):
        read_header(unsigned, key=b"right key")
    with pytest.raises(ValueError, match=r"read_header: key= is given with verify=False.*"):
        read_header(path, key=b"right key", verify=False)
    assert read_header(path)["family"] == "map"  # no key: the header alone, as before
