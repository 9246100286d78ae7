"""Files that cannot lie: ``pb.save`` / ``pb.load`` / ``load_state`` refuse edited, corrupt,
non-finite and mismatching posterior files with errors that name the field and the fix, and a
write is atomic (no partial files on any error; a kill leaves the previous file intact)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import pyrobayes as pb
from pyrobayes.io import PosteriorFileError, PosteriorMismatchError, _digest, read_header
from pyrobayes.models import LoRAXS
from tests.common import mlp_problem, split_batches

ROOT = Path(__file__).resolve().parents[1]


def _problem(num_data: int = 32, rank: int = 2, seed: int = 0, **kw):
    return mlp_problem(
        [4, 6, 3],
        LoRAXS(rank=rank, target_modules=["0"]),
        num_data=num_data,
        seed=seed,
        data_seed=1,
        trainable_modules=["2"],
        **kw,
    )


def _fitted(family: str = "ivon", **options):
    p = _problem()
    guide = pb.posterior(p.model, family, **options)
    pb.fit(p.model, guide, split_batches(p.x, p.y, 16), epochs=1, lr=0.05, seed=0)
    return p, guide


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return json.loads(meta["pyrobayes"]), tensors


def _write(path, header, tensors):
    save_file(tensors, str(path), metadata={"pyrobayes": json.dumps(header)})


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def saved(tmp_path):
    p, guide = _fitted("ivon")
    path = pb.save(guide, tmp_path / "post.safetensors")
    return p, guide, path


# ------------------------------------------------------------------------------ round trip
def test_header_carries_hash_and_model_settings(saved):
    p, guide, path = saved
    header = read_header(path, verify=True)
    assert header["format_version"] == 2 and len(header["sha256"]) == 64
    assert header["model"] == {"num_data": 32, "prior_scale": 1.0}
    loaded = pb.load(path, _problem().model)
    torch.testing.assert_close(loaded.scale("0.core"), guide.scale("0.core"), rtol=0, atol=0)


# ------------------------------------------------------------------------------ edits
def test_an_edited_header_is_refused(saved):
    p, guide, path = saved
    header, tensors = _read(path)
    header["config"]["ess"] = 1.0  # was None: N = 32; would make the posterior sd much wider
    _write(path, header, tensors)
    with pytest.raises(PosteriorFileError, match="failed its integrity check") as err:
        pb.load(path, _problem().model)
    assert "header or a tensor was edited" in str(err.value)
    with pytest.raises(PosteriorFileError, match="integrity check"):
        pb.io.load_state(guide, path)


def test_an_edited_tensor_is_refused(saved):
    p, guide, path = saved
    header, tensors = _read(path)
    key = next(k for k in tensors if k.startswith("guide.hess"))
    tensors[key] = tensors[key] * 1e-3
    _write(path, header, tensors)
    before = guide.hess("0.core").clone()
    with pytest.raises(PosteriorFileError, match="SHA-256 over header and tensors"):
        pb.io.load_state(guide, path)
    assert torch.equal(guide.hess("0.core"), before)  # nothing loaded


def test_a_removed_hash_is_refused(saved):
    _, _, path = saved
    header, tensors = _read(path)
    del header["sha256"]
    _write(path, header, tensors)
    with pytest.raises(PosteriorFileError, match="no 'sha256' field although its format_version"):
        pb.load(path, _problem().model)


def test_a_file_without_hash_from_before_loads_with_a_warning(saved, caplog):
    p, guide, path = saved
    header, tensors = _read(path)
    del header["sha256"], header["model"]
    header["format_version"] = 1
    _write(path, header, tensors)
    with caplog.at_level(logging.WARNING, logger="pyrobayes.io"):
        loaded = pb.load(path, _problem().model)
    assert "written before posterior files carried a hash" in caplog.text
    assert "Re-save it with pb.save" in caplog.text
    torch.testing.assert_close(loaded.scale("0.core"), guide.scale("0.core"), rtol=0, atol=0)


def test_a_newer_format_is_refused(saved):
    _, _, path = saved
    header, tensors = _read(path)
    header["format_version"] = 99
    header["sha256"] = _digest(header, tensors)
    _write(path, header, tensors)
    with pytest.raises(PosteriorFileError, match="format_version 99, newer than"):
        read_header(path)


@pytest.mark.parametrize("content", [b"", b"abc", b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json"])
def test_a_truncated_or_foreign_file_is_refused(tmp_path, content):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    with pytest.raises(PosteriorFileError, match="cannot be read as a pyrobayes posterior file"):
        pb.load(path, _problem().model)


def test_a_truncated_copy_of_a_real_file_is_refused(saved, tmp_path):
    _, _, path = saved
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(PosteriorFileError, match="truncated"):
        pb.load(cut, _problem().model)


def test_a_file_without_pyrobayes_header_is_refused(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(PosteriorFileError, match="not a pyrobayes posterior file"):
        read_header(path)


# ------------------------------------------------------------------------------ non-finite
def test_save_refuses_nan_naming_the_key_and_leaves_no_file(tmp_path):
    p, guide = _fitted("meanfield")
    with torch.no_grad():
        guide.loc_param("0.core")[0, 0] = float("nan")
    target = tmp_path / "sub" / "post.safetensors"
    with pytest.raises(ValueError, match="tensor 'guide.locs.0.core_unconstrained' holds 1 non"):
        pb.save(guide, target)
    assert not target.parent.exists()


def test_save_refuses_inf_in_the_head(tmp_path):
    p, guide = _fitted("map")
    with torch.no_grad():
        p.model.point_params["2.bias"][1] = float("inf")
    with pytest.raises(ValueError, match="'model.2.bias' holds 1 non-finite value.*NaN/inf"):
        pb.save(guide, tmp_path / "post.safetensors")
    assert _files(tmp_path) == []


@pytest.mark.parametrize("with_hash", [True, False])
def test_load_refuses_nan_naming_the_key(saved, with_hash):
    p, guide, path = saved
    header, tensors = _read(path)
    tensors["model.2.weight"][0, 0] = float("nan")
    if with_hash:
        header["sha256"] = _digest(header, tensors)
    else:
        del header["sha256"]
        header["format_version"] = 1
    _write(path, header, tensors)
    with pytest.raises(PosteriorFileError, match="tensor 'model.2.weight' holds 1 non-finite"):
        pb.load(path, _problem().model)


# ------------------------------------------------------------------------------ mismatches
def test_load_state_refuses_another_family(saved):
    _, _, path = saved
    other = pb.posterior(_problem().model, "meanfield")
    with pytest.raises(PosteriorMismatchError, match="holds a 'ivon' posterior") as err:
        pb.io.load_state(other, path)
    assert "the guide is 'meanfield' (MeanFieldGuide)" in str(err.value)
    assert "pb.posterior(model, 'ivon'" in str(err.value)


def test_resume_with_another_ess_is_refused(saved):
    p, _, path = saved
    model = _problem().model
    other = pb.posterior(model, "ivon", ess=1000.0)
    with pytest.raises(PosteriorMismatchError, match="options differ: ess=None in the file") as e:
        pb.io.load_state(other, path)
    assert "ess=1000.0 in the guide" in str(e.value)
    assert "Build the guide with the options it was saved with" in str(e.value)


def test_resume_with_another_ess_is_refused_by_fit(tmp_path):
    p = _problem()
    data = split_batches(p.x, p.y, 16)
    guide = pb.posterior(p.model, "ivon", ess=32.0)
    pb.fit(p.model, guide, data, epochs=1, lr=0.05, seed=0, checkpoint=pb.Checkpointing(tmp_path))
    q = _problem()
    other = pb.posterior(q.model, "ivon", ess=64.0)
    with pytest.raises(PosteriorMismatchError, match="ess=32.0 in the file but ess=64.0"):
        pb.fit(
            q.model,
            other,
            data,
            epochs=1,  # the run's length: IVON's cosine over another would be refused first
            lr=0.05,
            seed=0,
            checkpoint=pb.Checkpointing(tmp_path, resume=True),
        )


def test_load_refuses_a_model_with_another_num_data(saved):
    _, _, path = saved
    with pytest.raises(
        PosteriorMismatchError, match="model num_data is 32 in the file but 64"
    ) as e:
        pb.load(path, _problem(num_data=64).model)
    assert "build the model with num_data=32" in str(e.value)


def test_load_refuses_other_site_shapes(saved):
    _, _, path = saved
    with pytest.raises(PosteriorMismatchError, match="different sites") as err:
        pb.load(path, _problem(rank=3).model)
    assert "site '0.core' has shape [2, 2] in the file but [3, 3] in the model" in str(err.value)


def test_load_refuses_another_adapter_projection(saved):
    _, _, path = saved
    p = mlp_problem(
        [4, 6, 3],
        LoRAXS(rank=2, target_modules=["0"], projection="random"),
        num_data=32,
        seed=0,
        trainable_modules=["2"],
    )
    with pytest.raises(PosteriorMismatchError, match="adapter projection is 'svd' in the file"):
        pb.load(path, p.model)


def test_load_refuses_another_head(saved):
    _, _, path = saved
    p = mlp_problem(
        [4, 6, 3],
        LoRAXS(rank=2, target_modules=["0"]),
        num_data=32,
        seed=0,
        trainable_modules=[],
    )
    with pytest.raises(PosteriorMismatchError, match="point parameters do not match") as err:
        pb.load(path, p.model)
    assert "not in the model: ['2.bias', '2.weight']" in str(err.value)


def test_unknown_guide_tensors_are_refused_and_nothing_is_loaded(saved):
    p, guide, path = saved
    header, tensors = _read(path)
    tensors["guide.hess_0"] = tensors["guide.hess_0"] * 2.0
    tensors["guide.hess_9"] = torch.ones(2, 2)  # a tensor the guide does not have
    header["sha256"] = _digest(header, tensors)
    _write(path, header, tensors)
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with pytest.raises(PosteriorMismatchError, match="guide tensors do not fit IVONGuide") as err:
        pb.io.load_state(guide, path)
    assert "hess_9" in str(err.value) and "Re-save it from the fitted guide" in str(err.value)
    for k, v in guide.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_failed_load_state_changes_nothing(saved):
    p, guide, path = saved
    q = _problem(num_data=64)
    other = pb.posterior(q.model, "ivon", ess=32.0)
    head = {k: v.detach().clone() for k, v in q.model.point_params.items()}
    with pytest.raises(PosteriorMismatchError):
        pb.io.load_state(other, path)
    for k, v in q.model.point_params.items():
        assert torch.equal(v, head[k])


# ------------------------------------------------------------------------------ save checks
def test_save_refuses_a_guide_of_another_models_sites(tmp_path):
    _, guide = _fitted("meanfield")
    other = _problem(rank=3).model
    with pytest.raises(PosteriorMismatchError, match="guide's sites do not belong to model") as e:
        pb.save(guide, tmp_path / "post.safetensors", model=other)
    assert "site '0.core' has shape [2, 2] in the guide but [3, 3] in the model" in str(e.value)
    assert _files(tmp_path) == []


def test_save_refuses_another_models_head(tmp_path):
    p, guide = _fitted("meanfield")
    fresh = _problem().model  # the same network rebuilt: same sites, an unfitted head
    with pytest.raises(PosteriorMismatchError, match="point parameter '2.*' \\(the head\\)") as e:
        pb.save(guide, tmp_path / "post.safetensors", model=fresh)
    assert "Pass the model the guide was fitted with as model=" in str(e.value)
    assert _files(tmp_path) == []
    # a copy of the fitted head is the same head: accepted
    with torch.no_grad():
        for name, v in fresh.point_params.items():
            v.copy_(p.model.point_params[name])
    pb.save(guide, tmp_path / "post.safetensors", model=fresh)
    assert _files(tmp_path) == ["post.safetensors"]
    # other base weights with the fitted head copied: refused (the header would record them)
    other = _problem(seed=5).model
    with torch.no_grad():
        for name, v in other.point_params.items():
            v.copy_(p.model.point_params[name])
    with pytest.raises(PosteriorMismatchError, match=r"frozen network \(base_fingerprint\)"):
        pb.save(guide, tmp_path / "other.safetensors", model=other)


# ------------------------------------------------------------------------------ atomic writes
def test_a_failing_write_leaves_the_old_file_and_no_partial_files(saved, monkeypatch):
    p, guide, path = saved
    before = path.read_bytes()

    def half_write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pb.io.files, "save_file", half_write)
    with pytest.raises(OSError, match="disk full"):
        pb.save(guide, path)
    assert path.read_bytes() == before
    assert _files(path.parent) == ["post.safetensors"]


def test_an_unjsonable_extra_is_refused_without_files(tmp_path):
    _, guide = _fitted("map")
    with pytest.raises(ValueError, match="the header is not JSON-able"):
        pb.save(guide, tmp_path / "post.safetensors", extra={"x": object()})
    assert _files(tmp_path) == []


@pytest.mark.integration
def test_a_kill_during_a_write_leaves_the_previous_posterior(tmp_path):
    # a child saves once, then is SIGKILLed inside its second write (half a file on disk)
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        torch.set_default_dtype(torch.float64)  # as tests/conftest.py: the same base weights
        import pyrobayes as pb
        from tests.test_io_integrity import _fitted
        p, guide = _fitted("meanfield")
        path = Path({str(tmp_path)!r}) / "post.safetensors"
        pb.save(guide, path)
        def dying_write(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"half a posterior")
            os.kill(os.getpid(), signal.SIGKILL)
        pb.io.files.save_file = dying_write
        pb.save(guide, path)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    path = tmp_path / "post.safetensors"
    pb.load(path, _problem().model)  # complete and verified
    leftovers = [n for n in _files(tmp_path) if n != "post.safetensors"]
    assert all(n.startswith(".post.safetensors.") and n.endswith(".tmp") for n in leftovers)
    assert os.path.getsize(path) > 100
