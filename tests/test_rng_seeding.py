"""Seeding a forked RNG touches only the generators the fork restores.

``torch.manual_seed`` also reseeds every GPU's generator (``torch.cuda.manual_seed_all``;
queued until CUDA starts, so it is recorded here on a CPU-only machine). Inside
``fork_rng(devices=[])`` those generators are not restored: the training data's record, read
under fixed seeds when a fit checkpoints, left every GPU's generator at ``manual_seed(N - 1)``
after the fit's own seed (measured: calls ``[123, 0, 12, 23]`` for ``seed=123``, N = 24), so
a checkpointed fit's draws on a GPU followed the data's size, not its seed, and every seed drew
the same noise there. The ArviZ export's posterior-predictive seed reseeded every GPU too.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from pyrobayes.testing import tiny_problem


def _record_seeding_of_every_gpu(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(int(seed)))
    return calls


def test_a_checkpointed_fit_seeds_the_gpus_with_its_own_seed_only(monkeypatch, tmp_path):
    """The only reseeding of every GPU in a checkpointed fit is the fit's own ``seed``."""
    model, batches = tiny_problem()
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    calls = _record_seeding_of_every_gpu(monkeypatch)
    guide = pb.posterior(model, "meanfield")
    checkpoint = pb.Checkpointing(tmp_path / "ckpt")
    pb.fit(model, guide, loader, epochs=1, seed=123, progress=False, checkpoint=checkpoint)
    assert calls == [123]


def test_the_exports_predictive_seed_leaves_the_gpus_alone(monkeypatch):
    """``to_inference_data(..., seed=3)`` draws its posterior predictive on a forked RNG seeded
    from ``seed``: no GPU's generator is reseeded."""
    model, batches = tiny_problem()
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, batches, epochs=1, seed=0, progress=False)
    calls = _record_seeding_of_every_gpu(monkeypatch)
    pb.to_inference_data(model, guide, batches, num_samples=4, seed=3)
    assert calls == []
