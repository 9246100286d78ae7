"""Silent cases, round 4: a resume whose checkpointed optimizer steps another set of parameter
tensors than this fit's is refused before the fitter's ``begin`` (and before the guide's load),
naming both layouts, instead of torch's "parameter group that doesn't match the size" after the
guide was reset and overwritten."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import pyrobayes as pb
from pyrobayes.testing import tiny_problem
from tests.common import init_gloo_rank
from tests.infer.lifecycle import Kill, killer, quiet_fit, same_state, state


# ---------------------------------------------------------------- 1. another optimizer layout
@pytest.mark.parametrize("family", ["swag", "laplace", "map"])
def test_a_resume_whose_optimizer_steps_other_tensors_leaves_the_guide(tmp_path, family):
    """The checkpoint's optimizer held one more tensor (a factory adding it); the resume's
    optimizer state was loaded only after begin (SWAG's moments, Laplace's fit reset) and the
    guide's load, and torch refused it without naming either side."""
    extra = torch.nn.Parameter(torch.zeros(3))
    model, data = tiny_problem()
    with pytest.raises(Kill):
        quiet_fit(
            model,
            pb.posterior(model, family),
            data,
            epochs=3,
            seed=0,
            optim=pb.Optimization(optimizer=lambda ps: torch.optim.Adam([*ps, extra], lr=0.01)),
            checkpoint=pb.Checkpointing(tmp_path, every=1),
            progress=pb.Progress(bar=False, callback=killer(4)),
        )
    model, data = tiny_problem()
    guide = pb.posterior(model, family)
    quiet_fit(model, guide, data, epochs=4, seed=0)
    before = state(guide)
    head = {k: v.detach().clone() for k, v in model.point_params.items()}
    with pytest.raises(ValueError, match=r"over 5 parameter tensor\(s\).*Adam steps 4"):
        pb.fit(
            model,
            guide,
            data,
            epochs=3,
            seed=0,
            optim=pb.Optimization(optimizer=lambda ps: torch.optim.Adam(list(ps), lr=0.01)),
            checkpoint=pb.Checkpointing(tmp_path, resume=True),
            progress=False,
        )
    assert getattr(guide, "is_fitted", True) and same_state(guide, before)
    assert all(torch.equal(model.point_params[k], v) for k, v in head.items())


# ---------------------------------------------------------------- 2. ranks that run other fits
def _checkpointed(folder: Path) -> None:
    """A MAP fit interrupted after step 3, checkpointed at every step (at step 2 last)."""
    model, data = tiny_problem()
    with pytest.raises(Kill):
        quiet_fit(
            model,
            pb.posterior(model, "map"),
            data,
            epochs=2,
            lr=0.01,
            seed=0,
            checkpoint=pb.Checkpointing(folder, every=1),
            progress=pb.Progress(bar=False, callback=killer(3)),
        )


def _rank_fit(rank: int, case: str, folder: Path) -> str:
    """This rank's fit of ``case``: what it raised (or "nothing")."""
    model, data = tiny_problem()
    kwargs: dict[str, Any] = {"epochs": 2, "lr": 0.01, "seed": 0, "progress": False}
    if case == "lr" and rank == 1:
        kwargs["lr"] = 0.02
    if case == "epochs" and rank == 1:
        kwargs["epochs"] = 3
    if case == "resume":  # rank 1 cannot see rank 0's checkpoint (another node's disk)
        kwargs["checkpoint"] = pb.Checkpointing(folder / f"node{rank}", resume=True)
    if case == "refused":  # rank 1's resume is refused (another rate than the checkpoint's)
        kwargs["checkpoint"] = pb.Checkpointing(folder / "node0", resume=True)
        kwargs["lr"] = 0.05 if rank == 1 else 0.01
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pb.fit(model, pb.posterior(model, "map"), data, **kwargs)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "nothing"


def _ranks_worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank running every case of :func:`_rank_fit` in turn (a short timeout: a rank
    left waiting fails the test instead of hanging it for gloo's 30 minutes)."""
    import os

    import torch.distributed as torch_dist

    init_gloo_rank(rank, init_file, dtype, seconds=20)
    try:
        results = {
            c: _rank_fit(rank, c, Path(folder)) for c in ("lr", "epochs", "resume", "refused")
        }
        torch.save(results, os.path.join(folder, f"ranks{rank}.pt"))
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()
    os._exit(0)  # without gloo's interpreter teardown (see tests/infer/test_distributed.py)


@pytest.mark.integration
def test_ranks_running_other_fits_are_refused_on_every_rank(tmp_path):
    """Under torch.distributed only the ranks' batches per epoch were compared: a rank with
    another rate drifted apart silently (rank 0's state saved), and another budget, a rank
    resuming from another step or a rank whose resume was refused left the others waiting in
    an all-reduce until gloo's timeout."""
    import torch.distributed as torch_dist
    import torch.multiprocessing as mp

    if not torch_dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    _checkpointed(tmp_path / "node0")
    mp.spawn(
        _ranks_worker,
        args=(
            str(tmp_path / "init"),
            str(tmp_path),
            str(torch.get_default_dtype()).removeprefix("torch."),
        ),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"ranks{r}.pt", weights_only=True) for r in range(2)]
    for rank in ranks:
        assert "differ in lr (rank 0: 0.01, rank 1: 0.02)" in rank["lr"], rank["lr"]
        assert "differ in epochs (rank 0: 2, rank 1: 3)" in rank["epochs"], rank["epochs"]
        assert "the step resumed from (rank 0: 2, rank 1: 0)" in rank["resume"], rank["resume"]
    assert ranks[1]["refused"].startswith("ValueError") and "lr=0.01" in ranks[1]["refused"]
    assert ranks[0]["refused"].startswith("RuntimeError: fit(): rank 1 of 2 refused the fit")


# ---------------------------------------------------------------- 3. a truncated checkpoint file
@pytest.mark.parametrize("name", ["fitter.pt", "rng.pt", "scheduler.pt", "best.pt"])
def test_a_truncated_checkpoint_file_is_refused_by_name_before_the_guide_changes(tmp_path, name):
    """A generation is complete when its files are there; one cut short (a disk full, a copy
    interrupted) was read only in the resume's load, after begin had reset SWAG's moments and
    the guide's state was restored, with torch's "failed finding central directory" or, for
    rng.pt, a bare "[Errno 22] Invalid argument", naming no file."""
    from pyrobayes.infer.checkpoint import latest

    run = {
        "epochs": 3,
        "seed": 0,
        "validation": pb.Validation(tiny_problem()[1][:1]),
        "optim": pb.Optimization(scheduler="cosine"),
    }
    model, data = tiny_problem()
    with pytest.raises(Kill):
        quiet_fit(
            model,
            pb.posterior(model, "swag"),
            data,
            checkpoint=pb.Checkpointing(tmp_path, every=1),
            progress=pb.Progress(bar=False, callback=killer(4)),
            **run,
        )
    part = latest(tmp_path) / name
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    model, data = tiny_problem()
    guide = pb.posterior(model, "swag")
    quiet_fit(model, guide, data, epochs=4, seed=0)
    before, collected = state(guide), int(guide.swag_num_collected)
    with pytest.raises(ValueError, match=rf"{name} does not read as a checkpoint file"):
        quiet_fit(model, guide, data, checkpoint=pb.Checkpointing(tmp_path, resume=True), **run)
    assert int(guide.swag_num_collected) == collected and same_state(guide, before)
