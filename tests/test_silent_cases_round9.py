"""Silent cases of the jobs and the fit loop, round 9.

1. ``pyrobayes fit`` interrupted (Ctrl-C) before its first result left ``config.json`` in its
   folder, so the same command was then refused ("already holds a run") until ``--overwrite``,
   although nothing had been computed.
2. Under ``torch.distributed``, an error raised on one rank before the ranks' agreement (a bad
   shard of data, a checkpoint folder refused on rank 0 alone) left the other ranks waiting in
   the first collective until gloo's timeout (30 minutes).
3. ``fit(optim=Optimization(warmup=fraction))`` whose fraction of the run rounds to 0 steps ran
   with no warm-up, in silence.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

import pyrobayes as pb
from pyrobayes.cli import main
from tests.common import init_gloo_rank


# ---------------------------------------------------------------- 1. an interrupted job
def _job_config(tmp_path: Path, job: str) -> Path:
    """A one-family TOML config of ``job`` ("pipeline": the main job; "causal_lm")."""
    text = 'families = ["map"]\n'
    if job == "causal_lm":
        text += f"[causal_lm.task]\npath = {json.dumps(str(tmp_path / 'task.json'))}\n"
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("job", ["pipeline", "causal_lm"])
def test_the_same_command_runs_again_after_an_interrupt_before_the_first_result(
    tmp_path, monkeypatch, caplog, capsys, job
):
    """The job's first loading step interrupted (Ctrl-C): exit 130, and the folder holds no run
    (the config it wrote is removed), so the same command starts the run again instead of
    being refused until --overwrite. Before, the second command exited 2 ("already holds a
    run (config.json)") without reaching the loader."""
    from pyrobayes.demo import causal_lm, pipeline

    module = pipeline if job == "pipeline" else causal_lm
    loader = "build_data" if job == "pipeline" else "load_base"
    out = tmp_path / "run"
    seen: list[list[str]] = []

    def interrupt(*args, **kwargs):  # Ctrl-C at the first loading step, folder recorded
        seen.append(sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()))
        raise KeyboardInterrupt

    monkeypatch.setattr(module, loader, interrupt)
    command = ["fit", str(_job_config(tmp_path, job)), "--quick", "--out", str(out)]
    command += ["--no-progress"]
    with caplog.at_level(logging.WARNING, logger=module.__name__):
        assert main(command) == 130
    assert seen == [["config.json"]]  # the run had written its config when interrupted
    assert not out.exists()  # the folder (made by this run) is gone with its files
    assert "interrupted before its first result" in caplog.text
    assert "removed its files" in caplog.text
    capsys.readouterr()
    assert main(command) == 130  # the same command: not refused, it reaches the loader again
    assert seen == [["config.json"]] * 2
    assert "already holds a run" not in capsys.readouterr().err


@pytest.mark.parametrize("job", ["pipeline", "causal_lm"])
def test_an_interrupt_after_the_first_result_keeps_the_run(tmp_path, monkeypatch, job):
    """The records a job wrote stay when it is interrupted later (only a run with no result is
    removed): the second command is refused, naming metrics.json."""
    from pyrobayes.demo import causal_lm, pipeline

    module = pipeline if job == "pipeline" else causal_lm
    loader = "build_data" if job == "pipeline" else "load_base"
    out = tmp_path / "run"

    def interrupt(*args, **kwargs):  # as if a family had finished: its record is written
        (out / "metrics.json").write_text('[{"family": "map", "seed": 0, "nll": 0.5}]')
        raise KeyboardInterrupt

    monkeypatch.setattr(module, loader, interrupt)
    config = module.resolve_config(
        {"families": ["map"]}
        | (
            {"causal_lm": {"task": {"path": str(tmp_path / "t.json")}}} if job != "pipeline" else {}
        ),
        quick=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyboardInterrupt):
            module.run(config, out, progress_bar=False)
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["config.json", "metrics.json"]
    from pyrobayes.demo.run_folder import RunFolderError

    with pytest.raises(RunFolderError, match="already holds a run"):
        module.run(config, out, progress_bar=False)


# ---------------------------------------------------------------- 2. one rank's early error
#: each case's error, raised on one rank only before the ranks' agreement
_RANK_CASES = {
    "data": 1,  # rank 1's data is one (x, y) batch, not a list of batches: fit()'s argument check
    "guide": 1,  # rank 1's guide was built on another model: _Loop.__init__ (its _prepare)
    "folder": 0,  # the checkpoint folder is a file: rank 0 alone claims (and checks) it
}


def _rank_case(rank: int, case: str, folder: Path) -> str:
    """This rank's fit of ``case`` (:data:`_RANK_CASES`; "ok": every rank's data good): what
    it raised, ``"<type>: <message>"``, or the fitted head's first value."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    data = [(x[rank::2], y[rank::2]) for x, y in data]  # this rank's share of every batch
    guide = pb.posterior(model, "map")
    run: dict = {"epochs": 1, "lr": 0.01, "seed": 0, "progress": False}
    bad = _RANK_CASES.get(case) == rank
    if case == "data" and bad:
        data = data[0]  # type: ignore[assignment]
    if case == "guide" and bad:
        guide = pb.posterior(tiny_problem(seed=1)[0], "map")
    if case == "folder":
        run["checkpoint"] = pb.Checkpointing(folder / "a-file")
    try:
        pb.fit(model, guide, data, **run)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return f"{float(model.point_params['4.weight'].flatten()[0]):.12g}"


def _early_error_worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running every case of :func:`_rank_case` (a short timeout: a rank left
    waiting fails the test in seconds instead of hanging it for gloo's 30 minutes)."""
    import os

    import torch.distributed as torch_dist

    init_gloo_rank(rank, init_file, dtype, seconds=15)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a guide of another model's warnings, say)
            # a good fit first (it pays the first fit's imports on both ranks at once), then
            # each case, then a good fit again: the ranks are still in step
            cases = ["ok", *_RANK_CASES, "ok again"]
            results = {case: _rank_case(rank, case, Path(folder)) for case in cases}
        torch.save(results, os.path.join(folder, f"early{rank}.pt"))
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()
    os._exit(0)  # without gloo's interpreter teardown (see tests/infer/test_distributed.py)


@pytest.mark.integration
def test_an_error_on_one_rank_before_the_agreement_stops_every_rank(tmp_path):
    """The failing rank raises its own error, every other rank a RuntimeError naming that rank
    and its message, and the next fit runs on both. Before, the other rank waited in the shards'
    all-reduce (the first collective) until gloo's timeout (here 15 s: a RuntimeError from gloo
    instead of the message; 30 minutes by default)."""
    import torch.distributed as torch_dist
    import torch.multiprocessing as mp

    if not torch_dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    (tmp_path / "a-file").write_text("not a folder")
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    args = (str(tmp_path / "init"), str(tmp_path), dtype)
    mp.spawn(_early_error_worker, args=args, nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"early{r}.pt", weights_only=True) for r in range(2)]
    own = {
        "data": "TypeError: fit(): data is a tuple of two items that reads as one",
        "guide": "ValueError: fit(model, guide): the DeltaGuide was built on another model",
        "folder": "NotADirectoryError: fit(checkpoint=Checkpointing(dir=",
    }
    for case, bad in _RANK_CASES.items():
        mine, other = ranks[bad][case], ranks[1 - bad][case]
        assert mine.startswith(own[case]), (case, mine)
        stopped = f"RuntimeError: fit(): rank {bad} of 2 refused the fit ({mine})"
        assert other.startswith(stopped), (case, other)
    for case in ("ok", "ok again"):  # a number (no error), the same on both ranks
        float(ranks[0][case])
        assert ranks[0][case] == ranks[1][case] == ranks[0]["ok"], (case, ranks[0][case])


# ---------------------------------------------------------------- 3. a warm-up of 0 steps
def _warnings_of(family: str, optim: pb.Optimization) -> list[str]:
    """The warnings a one-epoch fit of ``family`` on the kit's problem (3 batches: 3 steps)
    raises about its warm-up."""
    from pyrobayes.testing import tiny_problem

    model, data = tiny_problem()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pb.fit(model, pb.posterior(model, family), data, epochs=1, optim=optim, progress=False)
    return [str(w.message) for w in caught if "warm-up" in str(w.message)]


def test_a_warmup_fraction_that_rounds_to_no_step_warns():
    """warmup=0.1 of a 3-step run is round(0.3) = 0 steps: the cosine schedule's first step
    ran at the full rate (measured below), with no word that the asked-for warm-up was lost."""
    from pyrobayes.infer.schedule import make_scheduler
    from pyrobayes.testing import tiny_problem

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    make_scheduler("cosine", optimizer, 3, 0.1)
    assert optimizer.param_groups[0]["lr"] == 0.5  # step 0 at the full rate: no warm-up
    model, data = tiny_problem()
    optim = pb.Optimization(scheduler="cosine", warmup=0.1)
    with pytest.warns(UserWarning, match=r"rounds to 0 warm-up steps") as caught:
        pb.fit(model, pb.posterior(model, "map"), data, epochs=1, optim=optim, progress=False)
    [message] = [str(w.message) for w in caught if "warm-up" in str(w.message)]
    assert message.startswith("fit(optim=Optimization(warmup=0.1)): 0.1 of this run's 3 steps")
    assert "a fraction of at least 0.333 (one step of this run)" in message
    assert caught[0].filename == __file__  # pointed at the user's call


def test_a_default_warmup_or_one_of_a_step_or_more_is_silent():
    """IVON's default warm-up (10 % of the run, round(0.3) = 0 steps here) is the family's,
    not the user's: no warning in a short fit; nor for a fraction giving one step (0.34 of 3
    steps: round(1.02) = 1), a warm-up in steps, or the constant schedule's steps."""
    assert _warnings_of("ivon", pb.Optimization()) == []
    said = _warnings_of("ivon", pb.Optimization(scheduler="cosine", warmup=0.1))  # the user's
    assert len(said) == 1 and "0.1 of this run's 3 steps" in said[0], said
    assert _warnings_of("map", pb.Optimization(scheduler="linear", warmup=0.34)) == []
    assert _warnings_of("map", pb.Optimization(scheduler="cosine", warmup=1)) == []
    assert _warnings_of("map", pb.Optimization(scheduler="constant", warmup=2)) == []
    said = _warnings_of("map", pb.Optimization(scheduler="constant", warmup=0.1))
    assert len(said) == 1 and "'constant' schedule starts at the full" in said[0], said
