"""Silent failure cases in the job flows (round 8): interrupted and partly failed runs, their
run folders edited, evaluated and joined.

* join: a recorded fit whose posterior file is missing was joined without it; an interrupted
  first input's ArviZ export (of a fit left out of the join) was copied into the joined folder.
* the causal-LM job: a job that failed or was interrupted after its first result said nothing
  of what its folder held and what it never fitted.
* classifier evaluate: the families of config.json without a saved posterior went unmentioned
  under "no drift".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pyrobayes.demo import causal_lm, pipeline
from pyrobayes.demo.causal_lm_config import resolve_config as lm_resolve_config
from pyrobayes.demo.config import resolve_config
from pyrobayes.demo.join_runs import join_runs
from tests.test_causal_lm_job import write_task

# --------------------------------------------------------------------------------------------
# join_runs (pyrobayes/demo/join_runs.py)
# --------------------------------------------------------------------------------------------

_FAMILIES = ["map", "laplace", "ivon"]


def _record(family: str, seed: int | None, acc: float = 0.8) -> dict[str, Any]:
    return {"family": family, "seed": seed, "accuracy": acc, "ece": 0.1, "nll": 0.5, "brier": 0.2}


def _run(folder: Path, seeds: list[int], records: list[dict[str, Any]]) -> Path:
    """A causal-LM run folder listing ``seeds`` whose metrics.json holds ``records``, each
    with its posterior file."""
    (folder / "guides").mkdir(parents=True)
    config = {"causal_lm": {"task": "t"}, "families": _FAMILIES, "seeds": seeds}
    (folder / "config.json").write_text(json.dumps({**config, "training": {"device": "cpu"}}))
    zero = _record("zero-shot", None, 0.3)
    (folder / "metrics.json").write_text(json.dumps([zero, *records]))
    for r in records:
        (folder / "guides" / f"{r['family']}-seed{r['seed']}.safetensors").write_bytes(b"x")
    return folder


def _full(seed: int) -> list[dict[str, Any]]:
    return [_record(f, seed) for f in _FAMILIES]


def test_join_leaves_out_a_seed_whose_recorded_posterior_file_is_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fit recorded in metrics.json whose guides/ file was deleted was joined anyway: the
    joined metrics.json held its record with no posterior behind it (the copy skipped the
    missing file without a word)."""
    a = _run(tmp_path / "a", [1, 2], [*_full(1), *_full(2)])
    (a / "guides" / "laplace-seed2.safetensors").unlink()
    b = _run(tmp_path / "b", [3], _full(3))
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.join_runs"):
        joined = join_runs([a, b], tmp_path / "j")
    assert sorted({r["seed"] for r in joined if r["seed"] is not None}) == [1, 3]
    assert "laplace@seed2" in caplog.text
    assert "guides/laplace-seed2.safetensors are missing" in caplog.text
    assert json.loads((tmp_path / "j" / "config.json").read_text())["seeds"] == [1, 3]
    guides = sorted(p.name for p in (tmp_path / "j" / "guides").iterdir())
    assert guides == sorted(f"{f}-seed{s}.safetensors" for f in _FAMILIES for s in (1, 3))


def test_join_takes_the_arviz_export_of_a_joined_fit_not_of_an_interrupted_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first input, interrupted after laplace@seed1 (its export written) but before
    ivon@seed1, adds no seed; seed 1 comes from its refit. Its posterior.nc (the dropped
    laplace@seed1's) was still copied into the joined folder, next to the refit's records."""
    a = _run(tmp_path / "a", [1], [_record("map", 1), _record("laplace", 1)])
    (a / "posterior.nc").write_text("interrupted laplace@seed1")
    refit = _run(tmp_path / "b", [1], _full(1))
    (refit / "posterior.nc").write_text("refit laplace@seed1")
    (refit / "plots").mkdir()
    (refit / "plots" / "compare.png").write_text("refit compare")
    c = _run(tmp_path / "c", [2], _full(2))
    (c / "posterior.nc").write_text("seed 2")
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.join_runs"):
        join_runs([a, refit, c], tmp_path / "j")
    assert (tmp_path / "j" / "posterior.nc").read_text() == "refit laplace@seed1"
    assert (tmp_path / "j" / "plots" / "compare.png").read_text() == "refit compare"


def test_join_copies_no_export_of_a_seed_it_leaves_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The input giving the joined run its first seed has lost its own first seed (a deleted
    posterior file): its export is of that seed, so none is copied, with a warning."""
    a = _run(tmp_path / "a", [1, 2], [*_full(1), *_full(2)])
    (a / "posterior.nc").write_text("seed 1")
    (a / "guides" / "map-seed1.safetensors").unlink()
    b = _run(tmp_path / "b", [3], _full(3))
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.join_runs"):
        join_runs([a, b], tmp_path / "j")
    assert not (tmp_path / "j" / "posterior.nc").exists()
    assert "posterior.nc and plots/compare.png are of seed 1, which is not joined" in caplog.text


# --------------------------------------------------------------------------------------------
# the causal-LM job stopped (pyrobayes/demo/causal_lm.py)
# --------------------------------------------------------------------------------------------


def _lm_config(tmp_path: Path, families: list[str]) -> dict[str, Any]:
    write_task(tmp_path / "task.json")
    user = {
        "families": families,
        "seeds": [0],
        "causal_lm": {"model": "tiny-llama", "task": {"path": str(tmp_path / "task.json")}},
        "adapter": {"kind": "lora", "rank": 2, "target_modules": ["q_proj", "v_proj"]},
    }
    return lm_resolve_config(user, quick=True)


@pytest.mark.parametrize(
    ("error", "named"),
    [
        (ValueError("curvature pass failed"), "ValueError: curvature pass failed"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
    ],
    ids=["failure", "interrupt"],
)
def test_a_job_stopping_mid_way_names_what_the_folder_holds_and_lacks(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: BaseException,
    named: str,
) -> None:
    """laplace@seed0 raising (or Ctrl-C) after map@seed0 was recorded: the error named
    neither, and nothing said the folder's metrics.json held map@seed0 alone (config.json
    lists both)."""
    config = _lm_config(tmp_path, ["map", "laplace"])
    real = causal_lm._fit_one

    def failing(config: dict[str, Any], family: str, *args: Any, **kwargs: Any) -> Any:
        if family == "laplace":
            raise error
        return real(config, family, *args, **kwargs)

    monkeypatch.setattr(causal_lm, "_fit_one", failing)
    out = tmp_path / "run"
    with (
        caplog.at_level(logging.WARNING, logger="pyrobayes.demo.causal_lm"),
        pytest.raises(type(error)),
    ):
        causal_lm.run(config, out, progress_bar=False)
    records = json.loads((out / "metrics.json").read_text())
    assert [(r["family"], r["seed"]) for r in records] == [("zero-shot", None), ("map", 0)]
    assert f"stopped at laplace@seed0 ({named})" in caplog.text
    assert "metrics.json holds map@seed0; not fitted: laplace@seed0" in caplog.text


# --------------------------------------------------------------------------------------------
# classifier evaluate on an interrupted run (pyrobayes/demo/pipeline.py)
# --------------------------------------------------------------------------------------------


def test_classifier_evaluate_names_the_families_an_interrupted_run_never_fitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A run interrupted after its MAP (config.json listing map, meanfield, laplace) evaluated
    to "no drift" with no word of the two families it never fitted."""
    config = resolve_config({"families": ["map", "meanfield", "laplace"]}, quick=True)
    run = tmp_path / "run"
    (run / "guides").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.json").write_text(json.dumps([{"family": "map", "accuracy": 0.5}]))
    (run / "guides" / "map.safetensors").write_bytes(b"")

    class Loaded(Exception):
        pass

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise Loaded

    monkeypatch.setattr(pipeline, "check_inputs", lambda config: None)
    monkeypatch.setattr(pipeline, "_load_tokenizer", stop)
    with (
        caplog.at_level(logging.WARNING, logger="pyrobayes.demo.pipeline"),
        pytest.raises(Loaded),
    ):
        pipeline.evaluate(run)
    assert "lists meanfield, laplace in config.json's families" in caplog.text
    assert "guides/meanfield.safetensors, guides/laplace.safetensors" in caplog.text
    assert "--overwrite" in caplog.text


def test_a_run_file_rewrite_that_fails_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """The jobs rewrite metrics.json after every fit; written in place, an interrupt or a full
    disk mid-write truncated it and every record was lost. Now a temporary file is moved into
    place, so a failure before the move leaves the previous file whole and no temporary file."""
    from pyrobayes.demo import run_folder

    path = tmp_path / "metrics.json"
    run_folder.write_json(path, [{"family": "map", "seed": 0}])

    def fail(src, dst):
        raise OSError("No space left on device")

    monkeypatch.setattr(run_folder.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        run_folder.write_json(path, [{"family": "map", "seed": 0}, {"family": "ivon", "seed": 0}])
    assert json.loads(path.read_text()) == [{"family": "map", "seed": 0}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
