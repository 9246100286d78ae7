"""Silent failure cases, round 7: the command line (``pyrobayes fit``'s config path, ``--quick``
under a config's own sizes, ``--seeds`` given twice, ``evaluate``'s saved metrics), the
linearised predictive's chunking and data, the dense GLM predictive (``glm_predict``,
``glm_moments``) and ``pyrobayes.posterior``'s model argument.

Each test reproduces a bad input that gave a wrong result or a confusing error and asserts the
clear error or warning that replaced it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes import cli
from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer.glm import glm_moments, glm_predict
from pyrobayes.linearized import linearize, linearized_predict
from pyrobayes.models import FineTuneModel, LoRAXS

from .common import conjugate_core, small_lora_xs_classifier, tensor_loader

pytest.importorskip("laplace")

# --------------------------------------------------------------------------------------------------
# the command line (pyrobayes/cli.py)
# --------------------------------------------------------------------------------------------------


def _no_run(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the pipeline's run (and table) in the CLI: the configs it would run, recorded."""
    seen: list[dict[str, Any]] = []

    def fake_run(config: dict[str, Any], out: Path, **_: Any) -> list[dict[str, Any]]:
        seen.append(config)
        return []

    monkeypatch.setattr(cli, "run", fake_run)
    monkeypatch.setattr(cli, "format_table", lambda records: "table")
    return seen


def test_a_config_path_that_is_a_folder_is_named_not_errno_21(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pyrobayes fit configs/`` printed ``[Errno 21] Is a directory: 'configs'`` and the
    traceback hint of a library error; now a config error naming the folder and its TOML files."""
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "job.toml").write_text("[training]\nepochs = 1\n")
    assert cli.main(["fit", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"config file {folder} is a folder" in err
    assert "job.toml" in err and "Errno" not in err and "PYROBAYES_TRACEBACK" not in err


def test_a_config_that_is_not_utf8_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A binary file passed as the config gave ``'utf-8' codec can't decode byte 0xff ...``
    with no path; now the message names the file and says it is not a TOML config."""
    path = tmp_path / "model.bin"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert cli.main(["fit", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is not a UTF-8 text file" in err and "TOML" in err
    assert "codec can't decode" not in err


def test_quick_under_a_config_that_sets_its_own_budget_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``pyrobayes fit job.toml --quick`` with ``epochs = 50`` in the config ran 50 epochs
    (--quick applies under the config's values) without a word; now the keys that keep the
    config's size are logged, and a key equal to --quick's size is not named."""
    seen = _no_run(monkeypatch)
    path = tmp_path / "job.toml"
    path.write_text("[training]\nepochs = 50\n[data]\nnum_train = 256\n")
    with caplog.at_level(logging.WARNING, logger="pyrobayes.cli"):
        code = cli.main(["fit", str(path), "--quick", "--out", str(tmp_path / "run")])
    assert code == 0 and seen[0]["training"]["epochs"] == 50  # the config's value is kept
    assert "--quick does not shrink training.epochs = 50 (--quick: 1)" in caplog.text
    assert "num_train" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pyrobayes.cli"):  # without --quick: no word
        cli.main(["fit", str(path), "--out", str(tmp_path / "run2")])
    assert "--quick" not in caplog.text


def test_seeds_given_twice_is_a_usage_error_not_the_last_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--seeds 1 --seeds 2,3`` parsed as ``[2, 3]`` (argparse keeps the last), so seed 1
    was dropped without a word; now a usage error (exit 2) that gives the joined list."""
    parser = cli.build_parser()
    assert parser.parse_args(["fit", "c.toml", "--seeds", "1,2"]).seeds == [1, 2]
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["fit", "c.toml", "--seeds", "1", "--seeds", "2,3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and "given twice" in err and "--seeds 1,2,3" in err


def test_evaluate_reads_a_broken_metrics_json_before_recomputing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose metrics.json is not JSON was recomputed in full (every posterior reloaded
    and predicted, minutes) before the error; now it is refused before the recomputation."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"families": ["map"]}')
    (run_dir / "metrics.json").write_text("{")
    recomputed: list[Path] = []
    monkeypatch.setattr(cli, "evaluate", lambda path, device=None: recomputed.append(path) or [])
    assert cli.main(["evaluate", str(run_dir)]) == 2
    assert "metrics.json is not valid JSON" in capsys.readouterr().err
    assert recomputed == []


# --------------------------------------------------------------------------------------------------
# the linearised predictive (pyrobayes/linearized.py) and the dense GLM one (infer/glm.py)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier() -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """A fitted kron Laplace over the small LoRA-XS MLP classifier (float64)."""
    prob = small_lora_xs_classifier()
    model = prob.model.double()
    x, y = prob.x.double(), prob.y
    guide = LaplaceGuide(model, structure="kron")
    settings = pb.infer.Laplace(evidence="posterior_mode")
    pb.fit(
        model,
        guide,
        tensor_loader(x, y, 20),
        epochs=2,
        lr=0.05,
        seed=0,
        optim=pb.Optimization(optimizer=settings),
    )
    return model, guide, x, y


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (2.5, TypeError)])
def test_linearized_examples_per_forward_is_checked(
    classifier: tuple[Any, Any, torch.Tensor, torch.Tensor], value: Any, error: type
) -> None:
    """``linearized_predict(examples_per_forward=0)`` silently used the default chunk, ``-1``
    formed no chunk and reported "data yielded no batches", and ``2.5`` failed inside ``range``;
    now each names the argument (``linearize`` too)."""
    model, guide, x, y = classifier
    data = [(x[:20], y[:20])]
    with pytest.raises(error, match="predict: examples_per_forward must be an integer >= 1"):
        linearized_predict(model, guide, data, examples_per_forward=value)
    with pytest.raises(error, match="linearize: examples_per_forward must be an integer >= 1"):
        linearize(model, guide, data, examples_per_forward=value)
    pred = linearized_predict(model, guide, data, examples_per_forward=1000)  # > the batch: fine
    assert pred.log_probs is not None and pred.log_probs.shape[1:] == (20, 3)


def test_one_batch_tuple_is_refused_by_the_linearized_and_glm_predictives(
    classifier: tuple[Any, Any, torch.Tensor, torch.Tensor],
) -> None:
    """``linearized_predict(model, guide, (x, y))`` and ``glm_predict`` iterated the pair as
    two batches and failed on the labels as a batch of integer inputs ("Cast them
    (x.float())"); now both say the data is one (inputs, targets) batch."""
    model, guide, x, y = classifier
    with pytest.raises(TypeError, match=r"predict: data is a tuple of two items .* one \(inputs"):
        linearized_predict(model, guide, (x, y))
    with pytest.raises(TypeError, match=r"glm_predict: data is a tuple of two items"):
        glm_predict(model, guide, (x, y))


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError)])
def test_glm_predict_monte_carlo_needs_at_least_one_draw(
    classifier: tuple[Any, Any, torch.Tensor, torch.Tensor], value: Any, error: type
) -> None:
    """``glm_predict(link="mc", num_samples=0)`` returned a prediction of 0 draws (its
    probabilities a 0/0 mean), ``-1`` failed in ``torch.randn``; now refused by name."""
    model, guide, x, y = classifier
    with pytest.raises(error, match="glm_predict: num_samples must be an integer >= 1"):
        glm_predict(model, guide, [(x, y)], link="mc", num_samples=value)


def test_glm_predict_on_no_batches_says_so(
    classifier: tuple[Any, Any, torch.Tensor, torch.Tensor],
) -> None:
    """An empty ``data`` failed in ``torch.cat(): expected a non-empty list of Tensors``."""
    model, guide, _, _ = classifier
    with pytest.raises(ValueError, match="glm_predict: data yielded no batches"):
        glm_predict(model, guide, [])


def test_glm_predict_regression_keeps_the_linearized_variance() -> None:
    """The dense GLM predictive of a regression (``link="probit"``, the default) returned the
    mean alone: ``loc_var`` was ``None``, so its NLL and intervals were the MAP's, with no
    epistemic spread. Now it reports ``diag(J Σ Jᵀ)``, equal to the chunked linearised
    predictive's (a five-output head)."""
    prob = conjugate_core(num_data=40, prior_scale=0.8)
    model = prob.model.double()
    x, y = prob.x.double(), prob.y.double()
    guide = LaplaceGuide(model, structure="kron", prior_precision="model")
    loader = tensor_loader(x, y, 16)
    pb.fit(model, guide, loader, epochs=0)
    dense = glm_predict(model, guide, loader)
    chunked = linearized_predict(model, guide, loader)
    assert dense.loc is not None and dense.loc.shape == (1, 40, 5)
    assert dense.loc_var is not None and chunked.loc_var is not None
    torch.testing.assert_close(dense.loc, chunked.loc, rtol=0, atol=1e-10)
    torch.testing.assert_close(dense.loc_var, chunked.loc_var, rtol=1e-8, atol=1e-12)
    assert float(dense.loc_var.min()) > 1e-4  # the epistemic term is there
    report = pb.metrics.report(dense, dense.targets)
    assert abs(report["nll"] - pb.metrics.report(chunked, chunked.targets)["nll"]) < 1e-10


def test_glm_moments_of_a_network_in_train_mode_switch_dropout_off() -> None:
    """``glm_moments`` on a model left in train mode whose backbone trains with dropout
    (``train_backbone_mode=True``) evaluated ``f`` and ``J`` with dropout on and failed inside
    ``torch.func`` ("vmap: called random operation while in randomness error mode"); its
    moments would have been a random sub-network's. Now they are the eval-mode moments, and the
    model is put back in train mode."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3)).double()
    adapter = LoRAXS(rank=2, target_modules=["0"])
    model = FineTuneModel(net, adapter, num_data=40, train_backbone_mode=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=g)
    guide = LaplaceGuide(model, structure="kron")
    pb.fit(model, guide, tensor_loader(x, y, 20), epochs=1, lr=0.05, seed=0)
    model.train(False)
    ref_mean, ref_cov = glm_moments(model, guide, x[:6])
    model.train(True)
    assert net[1].training  # dropout on
    mean, cov = glm_moments(model, guide, x[:6])
    assert model.training and net[1].training  # restored
    torch.testing.assert_close(mean, ref_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(cov, ref_cov, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# pyrobayes.posterior's model argument (pyrobayes/api.py)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda model, guide: None, "model is None"),
        (lambda model, guide: "meanfield", "wrong order"),
        (lambda model, guide: type(model), "model is the class FineTuneModel"),
        (lambda model, guide: guide, "model is a posterior (LaplaceGuide)"),
        (lambda model, guide: {"net": model}, "model is a dict, not a model"),
    ],
    ids=["none", "swapped", "class", "guide", "dict"],
)
def test_posterior_refuses_what_is_not_a_model(
    classifier: tuple[Any, Any, torch.Tensor, torch.Tensor], make: Any, words: str
) -> None:
    """``pb.posterior(None, "map")``, ``pb.posterior("meanfield", model)``, the model's class,
    a guide or a dict each built a guide, and the fit failed on it later with
    ``'NoneType' object has no attribute 'train'`` or a tensor printed as the message; now
    ``posterior`` refuses, naming what was passed."""
    model, guide, _, _ = classifier
    bad = make(model, guide)
    family = model if isinstance(bad, str) else "map"
    with pytest.raises(TypeError, match="posterior: ") as info:
        pb.posterior(bad, family)
    assert words in str(info.value)
