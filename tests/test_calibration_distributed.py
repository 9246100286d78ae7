"""``pb.calibrate`` under ``torch.distributed`` (gloo, 2 CPU processes) fits one temperature.

Each rank holds its shard of the held-out data; the objective is the NLL summed over both shards
divided by their total count (all-reduced inside the objective), so both ranks must get the same
``T``, the one-process ``T`` on the union of the shards. The shards are made to disagree (labels
drawn at different temperatures), so a per-rank fit (``all_ranks=False``, what ``calibrate`` did
before) gives clearly different temperatures: the comparison is not between equal halves.
"""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch import nn

import pyrobayes as pb
from pyrobayes.fitted_head import NeverFittedWarning
from pyrobayes.models import LoRAXS
from tests.common import split_batches

pytestmark = [
    pytest.mark.integration,  # every test spawns two gloo ranks
    # the MAP at its initialisation on purpose (the teacher's weights); the never-fitted warning
    # itself is tested in tests/test_fitted_head.py
    pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning"),
]

NUM_PER_RANK, SCALE = 400, 3.0
# the labels of rank r's shard are drawn from softmax(W x / LABEL_T[r]) while the model's logits
# are SCALE · W x: rank 0's optimal T is about 3, rank 1's about 6
LABEL_T = (1.0, 2.0)


def _problem() -> tuple[pb.models.FineTuneModel, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """A MAP point mass over a linear model (LoRA-XS core at zero: the prediction is the scaled
    teacher's) and the two ranks' held-out shards, in batches of 100."""
    g = torch.Generator().manual_seed(0)
    d, c = 6, 4
    w = 1.5 * torch.randn(c, d, generator=g)
    lin = nn.Linear(d, c, bias=False)
    with torch.no_grad():
        lin.weight.copy_(SCALE * w)
    model = pb.models.FineTuneModel(
        nn.Sequential(lin),
        LoRAXS(rank=1, projection="svd", target_modules=["0"], init_scale=0.0),
        num_data=2 * NUM_PER_RANK,
        trainable_modules=[],
    )
    shards = []
    for label_t in LABEL_T:
        x = torch.randn(NUM_PER_RANK, d, generator=g)
        probs = torch.softmax(x @ w.T / label_t, -1)
        y = torch.multinomial(probs, 1, generator=g).squeeze(-1)
        shards.append(split_batches(x, y, 100))
    return model, shards


def _calibrate(shard: list, **kwargs) -> float:
    model, _ = _problem()
    guide = pb.posterior(model, "map")
    return pb.calibrate(model, guide, shard, num_samples=1, **kwargs)


def _worker(rank: int, init_file: str, out_dir: str, dtype: str) -> None:
    torch.set_default_dtype(getattr(torch, dtype))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=NeverFittedWarning)  # as pytestmark, per rank
    torch_dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),  # a rank left waiting fails instead of hanging
    )
    try:
        shard = _problem()[1][rank]
        together = _calibrate(shard)
        alone = _calibrate(shard, all_ranks=False)  # this rank's data only: no collective
        # an error on one rank (no data) is raised on both: none waits in the objective
        try:
            _calibrate([] if rank == 1 else shard)
            raised = "nothing"
        except ValueError as err:
            raised = str(err)
        torch.save(
            {"together": together, "alone": alone, "raised": raised},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
        torch_dist.barrier()  # both ranks done before the teardown
    finally:
        torch_dist.destroy_process_group()
    os._exit(0)  # see tests/infer/test_distributed.py::_exit_without_finalizers


def test_two_gloo_ranks_fit_the_one_process_temperature_of_the_union(tmp_path: Path) -> None:
    if not torch_dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), dtype), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    _, shards = _problem()
    union = _calibrate(shards[0] + shards[1])  # one process on both shards
    assert r0["together"] == r1["together"]  # the same objective values: the same steps
    # the one-process T on the union, to the golden-section tolerance (1e-8 in log T) and the
    # round-off of sum/count against a mean
    assert r0["together"] == pytest.approx(union, rel=1e-6)
    # the shards disagree: fitted alone (what each rank got before) they differ from the union
    assert r0["alone"] == pytest.approx(_calibrate(shards[0]), rel=1e-12)
    assert r1["alone"] == pytest.approx(_calibrate(shards[1]), rel=1e-12)
    assert r0["alone"] < union / 1.2 and r1["alone"] > union * 1.2, (r0, r1, union)
    assert "val_data yielded no batches" in r1["raised"]
    assert "another rank's held-out data failed" in r0["raised"]
