"""σN with the backbone in training mode (``FineTuneModel(train_backbone_mode=True)``) over a
BatchNorm network under ``torch.distributed``: each rank folded its own share's batch
statistics into the members' running statistics, nothing pooled them, and the ranks ended with
different posteriors in silence (a hunt, two gloo ranks, 18 steps: the members' running means
0.30 apart, predictive probabilities up to 0.05). The batch statistics are now pooled over the
ranks after each step (:func:`pyrobayes.infer.signorm.pool_batch_statistics`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch import nn

import pyrobayes as pb
from pyrobayes.infer.signorm import pool_batch_statistics
from pyrobayes.models.signorm import member_norms
from tests.common import split_batches

NUM_DATA, BATCH = 96, 16


def _problem() -> tuple[pb.models.FineTuneModel, list]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(5, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 3),
    )  # fmt: skip
    adapter = pb.models.SigmaNorm(
        num_members=3,
        adapter=pb.models.LoRAXS(rank=3, target_modules=["0", "3"], init_scale=0.1),
        heads=[],
    )
    model = pb.models.FineTuneModel(
        net, adapter, trainable_modules=["5"], num_data=NUM_DATA, train_backbone_mode=True
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_DATA, 5, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return model, split_batches(x, y, BATCH)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    try:
        model, batches = _problem()
        part = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        guide = pb.posterior(model, "signorm")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a 96-example toy: not its calibration
            pb.fit(model, guide, [(x[part], y[part]) for x, y in batches], epochs=3, lr=1e-2)
        state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
        torch.save(state, os.path.join(out_dir, f"signorm{rank}.pt"))
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.slow  # two spawned ranks, ~15 s; the pooling's arithmetic is checked below
def test_the_ranks_hold_the_same_running_statistics(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"signorm{r}.pt", weights_only=True) for r in range(2)]
    running = [k for k in ranks[0] if "running_" in k]
    assert running, sorted(ranks[0])
    for key in ranks[0]:  # the gradients are averaged and the statistics pooled: identical
        torch.testing.assert_close(ranks[0][key], ranks[1][key], rtol=0, atol=0, msg=key)


def test_pooled_statistics_are_the_whole_batchs(monkeypatch):
    """The pooling arithmetic, two ranks simulated in one process: the shares' ``(n, mean,
    unbiased variance)`` give the whole batch's mean and unbiased variance (float64, summed in
    another order: 1e-12)."""
    import pyrobayes.infer.signorm as signorm

    model, batches = _problem()
    model.double().net.train(True)
    norm = next(iter(member_norms(model.net).values()))
    x = batches[0][0].double()
    stats = []
    for rows in (x, x[:5], x[5:]):  # the whole batch, then uneven shares
        with torch.no_grad():
            model.output(rows, {})
        stats.append((norm.batch_statistics, norm.batch_count))
    (whole, _), *shares = stats
    assert [n for _, n in shares] == [5, 11]

    monkeypatch.setattr(signorm, "world", lambda: (2, 0))
    flats: list[torch.Tensor] = []  # each rank's buffer, before the all-reduce
    monkeypatch.setattr(signorm, "all_reduce_sum_", lambda ts: flats.append(ts[0].clone()))
    for statistics, count in shares:
        norm.batch_statistics, norm.batch_count = statistics, count
        pool_batch_statistics(model.net)
    total = flats[0] + flats[1]
    monkeypatch.setattr(signorm, "all_reduce_sum_", lambda ts: ts[0].copy_(total))
    norm.batch_statistics, norm.batch_count = shares[0]
    pool_batch_statistics(model.net)
    assert norm.batch_statistics is not None
    torch.testing.assert_close(norm.batch_statistics[0], whole[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm.batch_statistics[1], whole[1], rtol=1e-12, atol=1e-12)
    assert (whole[0] - shares[0][0][0]).abs().max() > 1e-3  # a share's are not the batch's
