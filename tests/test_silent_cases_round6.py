"""Silent failure cases, round 6: the demo's data cache and loaders, the BIG-bench cache, the
join of causal-LM runs, the metrics report's MI AUROC, and the draws' evaluation (memory, sites).

Each test reproduces a bad input that gave a wrong result or a confusing error and asserts the
clear error or warning that replaced it. Nothing here touches the real ``~/.cache/pyrobayes``:
every cache is a ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from pyrobayes.demo import data as D
from pyrobayes.demo.join_runs import join_runs
from pyrobayes.demo.vader_task import write_vader_multiple_choice
from pyrobayes.diagnostics import draw_evaluation
from pyrobayes.diagnostics.draw_evaluation import evaluate_draws
from pyrobayes.diagnostics.sites import select_sites
from pyrobayes.guides import MeanFieldGuide
from pyrobayes.metrics.reporting import report
from pyrobayes.models import LoRAXS
from pyrobayes.tasks.cache import bigbench_task_path, extract_bigbench

from .common import mlp_problem
from .tasks.test_bigbench_cache import fake_sdist as fake_bigbench_sdist
from .test_data import toy_dataset, write_fake_vader

# --------------------------------------------------------------------------------------------------
# VADER cache and loaders (pyrobayes/demo/data.py, pyrobayes/demo/vader_task.py)
# --------------------------------------------------------------------------------------------------


def _write_tweets(cache: Path, rows: list[tuple[str, str, str]]) -> None:
    """Fake VADER files in ``cache/vader`` whose tweets file holds ``rows``."""
    write_fake_vader(cache / "vader")
    body = "\r\n".join("\t".join(r) for r in rows)
    (cache / "vader" / "tweets_GroundTruth.txt").write_bytes(body.encode())


def test_vader_non_finite_or_off_scale_rating_is_skipped_not_labelled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rating of "nan" parsed as a float and fell in no bucket: task="fine" labelled the
    sentence neutral (class 2), "inf" and an off-scale 7.5 "very positive"; now such lines are
    skipped as malformed, with the logged count."""
    rows = [("1", "2.5", "good"), ("2", "nan", "what"), ("3", "inf", "huh"), ("4", "7.5", "wow")]
    _write_tweets(tmp_path, rows)
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.data"):
        fine = D.load_vader("tweets", task="fine", cache=tmp_path)
    assert fine.texts == ["good"] and fine.labels.tolist() == [4]
    assert "skipped 3 malformed line(s)" in caplog.text


def test_vader_cached_file_without_a_snippet_is_refused_naming_it(tmp_path: Path) -> None:
    """An emptied (or other-format) cached ground-truth file gave an empty data set with a
    logged warning only; the fit then failed far from the cause."""
    _write_tweets(tmp_path, [])
    path = tmp_path / "vader" / "tweets_GroundTruth.txt"
    with pytest.raises(RuntimeError, match="holds no rated snippet") as info:
        D.load_vader("tweets", cache=tmp_path)
    message = str(info.value)
    assert str(path) in message and f"Delete {path.parent}" in message
    _write_tweets(tmp_path, [("1", "positive", "a text"), ("2", "1.0")])  # another format
    with pytest.raises(RuntimeError, match="damaged or of another format"):
        D.load_vader("tweets", task="fine", cache=tmp_path)


def test_split_fraction_that_leaves_a_part_empty_is_refused() -> None:
    """split([0.99, 0.01]) of 20 items gave an empty second part silently (int(0.2) = 0)."""
    ds = toy_dataset(20)
    with pytest.raises(ValueError, match=r"fraction\(s\) \[0.01\] of part\(s\) \[1\] leave them"):
        ds.split([0.98, 0.01])
    assert [len(p) for p in ds.split([0.5, 0.0])] == [10, 0]  # an explicit 0 is kept
    with pytest.raises(ValueError, match="fractions"):
        ds.split([float("nan"), 0.5])  # ("cannot convert float NaN to integer")


def test_split_numpy_integer_sizes_are_sizes_not_fractions() -> None:
    """NumPy integer sizes (np.array([10, 5]), a config read by NumPy) were taken as the
    fractions [10.0, 5.0] and refused as summing over 1."""
    ds = toy_dataset(20)
    a, b = ds.split(np.array([10, 5]), seed=1)
    assert (len(a), len(b)) == (10, 5)
    assert [len(p) for p in ds.split([torch.tensor(4), np.int32(6)])] == [4, 6]


@pytest.mark.parametrize("per_class", [0, -1, 1.5])
def test_vader_multiple_choice_refuses_per_class_below_one(tmp_path: Path, per_class) -> None:
    """per_class=0 wrote an empty task file (no error); -1 failed in random.sample with
    "Sample larger than population or is negative"."""
    write_fake_vader(tmp_path / "vader")
    out = tmp_path / "task.jsonl"
    with pytest.raises(ValueError, match=r"per_class must be an integer >= 1"):
        write_vader_multiple_choice(out, domain="tweets", per_class=per_class, cache=tmp_path)
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# BIG-bench cache (pyrobayes/tasks/cache.py)
# --------------------------------------------------------------------------------------------------


def test_extract_bigbench_takes_one_task_given_as_a_string(tmp_path: Path) -> None:
    """extract_bigbench(sdist, "timedial") read the string as the tasks 't', 'i', 'm', ... and
    refused them all ("has no task.json for ['t', 'i', ...]")."""
    sdist = tmp_path / "bigbench-1.0.0.tar.gz"
    digest = fake_bigbench_sdist(sdist)
    paths = extract_bigbench(sdist, "timedial", tmp_path / "c", sha256=digest)
    assert paths == [bigbench_task_path("timedial", tmp_path / "c")] and paths[0].is_file()


# --------------------------------------------------------------------------------------------------
# join_runs (pyrobayes/demo/join_runs.py)
# --------------------------------------------------------------------------------------------------

_CONFIG = {"causal_lm": {"task": "t"}, "families": ["map", "ivon"], "training": {"device": "cpu"}}


def _record(family: str, seed: int | None, acc: float) -> dict:
    return {"family": family, "seed": seed, "accuracy": acc, "ece": 0.1, "nll": 0.5, "brier": 0.2}


def _run(folder: Path, seeds: list[int], records: list[dict]) -> Path:
    """A causal-LM run folder listing ``seeds`` whose metrics.json holds ``records``."""
    (folder / "guides").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**_CONFIG, "seeds": seeds}))
    zero = _record("zero-shot", None, 0.3)
    (folder / "metrics.json").write_text(json.dumps([zero, *records]))
    for r in records:
        (folder / "guides" / f"{r['family']}-seed{r['seed']}.safetensors").write_bytes(b"x")
    return folder


def test_join_leaves_out_a_partly_recorded_seed_so_its_refit_joins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An input interrupted after map@seed2's record but before ivon@seed2's joined seed 2
    with map only: the joined config listed seed 2 (its ivon posterior missing), and fitting
    seed 2 in its own folder, as the warning advises, was refused ("seed(s) [2] are already
    in an earlier run folder")."""
    s1 = [_record("map", 1, 0.8), _record("ivon", 1, 0.81)]
    a = _run(tmp_path / "a", [1, 2], [*s1, _record("map", 2, 0.7)])
    refit = _run(tmp_path / "b", [2], [_record("map", 2, 0.75), _record("ivon", 2, 0.76)])
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.join_runs"):
        joined = join_runs([a, refit], tmp_path / "j")
    assert "has no metrics.json record of ivon@seed2" in caplog.text
    assert "not the recorded families of seed(s) [2]" in caplog.text
    assert [(r["family"], r["seed"]) for r in joined] == [
        ("zero-shot", None),
        ("map", 1),
        ("ivon", 1),
        ("map", 2),
        ("ivon", 2),
    ]
    assert [r["accuracy"] for r in joined if r["seed"] == 2] == [0.75, 0.76]  # the refit's
    assert json.loads((tmp_path / "j" / "config.json").read_text())["seeds"] == [1, 2]


# --------------------------------------------------------------------------------------------------
# metrics.report (pyrobayes/metrics/reporting.py)
# --------------------------------------------------------------------------------------------------


def test_report_auroc_mi_is_nan_when_a_side_is_one_draw() -> None:
    """An OOD prediction of one draw (a point estimate) has mutual information 0 everywhere,
    so auroc_mi came out 0.0 against an ID prediction with draws (1.0 the other way, 0.5 for
    two point predictions): a number that measured only which side had draws."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, 30, 3, generator=gen), -1)
    ood = torch.softmax(torch.randn(8, 20, 3, generator=gen), -1)
    labels = torch.arange(30) % 3
    full = report(probs, labels, ood_probs=ood)
    assert 0.0 < full["auroc_mi"] < 1.0  # draws on both sides: no warning
    with pytest.warns(UserWarning, match=r"has 8 draw\(s\) and ood_probs 1: a one-draw"):
        result = report(probs, labels, ood_probs=ood[:1])
    assert math.isnan(result["auroc_mi"]) and 0.0 <= result["auroc_entropy"] <= 1.0
    # two point predictions (a MAP's): NaN without a warning (no epistemic part to score)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(report(probs[0], labels, ood_probs=ood[0])["auroc_mi"])


# --------------------------------------------------------------------------------------------------
# evaluate_draws (pyrobayes/diagnostics/draw_evaluation.py) and select_sites (sites.py)
# --------------------------------------------------------------------------------------------------

_NEVER_FITTED_OK = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")


def _classifier():
    prob = mlp_problem(
        (6, 10, 3),
        LoRAXS(rank=2, target_modules=["0", "2"]),
        num_data=48,
        data_seed=0,
        trainable_modules=[],
    )
    guide = MeanFieldGuide(prob.model, init_scale=0.3)
    data = [(prob.x[:20], prob.y[:20]), (prob.x[20:], prob.y[20:])]
    return prob.model, guide, data


class _Reiterable:
    """Batches that can be iterated again, with no length and no data set."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@_NEVER_FITTED_OK
@pytest.mark.parametrize("sized", [True, False])
def test_evaluate_draws_warns_of_the_memory_it_will_hold(monkeypatch, sized: bool) -> None:
    """S draws x N examples of pointwise log-likelihoods and predictive draws (S = 10,000 on
    1e5 examples: 16 GB) were gathered without a word; now a warning gives the size, before
    the passes for a list of batches and after the first pass for other data."""
    monkeypatch.setattr(draw_evaluation, "MEMORY_WARNING_BYTES", 10_000, raising=False)
    model, guide, data = _classifier()
    batches = data if sized else _Reiterable(data)
    # 40 draws x 48 examples x (8 + 8) bytes + 40 x 8 kept scalars x 8 bytes = 33,280 bytes
    with pytest.warns(UserWarning, match=r"num_samples=40 draws on 48 examples will hold about"):
        ev = evaluate_draws(model, guide, batches, num_samples=40, seed=0)
    assert ev.pointwise.shape == (40, 48)
    # without pointwise and predictive, the same draws stay under the bound: no warning
    evaluate_draws(model, guide, batches, num_samples=40, seed=0, pointwise=False, predictive=False)


def test_select_sites_reads_a_generator_of_names_once() -> None:
    """A generator of site names was consumed by the unknown-name check, so no site was
    exported in full and every one was summarised by its norm, silently."""
    shapes = {"a": torch.Size([2, 2]), "b": torch.Size([3])}
    chosen, omitted = select_sites(shapes, (s for s in ["b"]))
    assert (chosen, omitted) == (["b"], ["a"])
