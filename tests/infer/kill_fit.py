"""A fit that SIGKILLs itself at a chosen point, for the kill-and-resume tests.

Run as ``python -m tests.infer.kill_fit FAMILY CHECKPOINT_DIR MODE N`` from the repository root:

- ``step N``: right after fit step ``N`` (before that step's checkpoint);
- ``switch N``: inside the ``N``-th checkpoint write, after the generation folder is complete and
  before ``LATEST`` is switched to it;
- ``fsync N``: inside a checkpoint write, at the ``N``-th file flush (a half-written generation).

:func:`problem` and :func:`run` are what the test runs in-process for the uninterrupted and the
resumed fits, so all three see the same set-up.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import pyro
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from pyrobayes.infer import checkpoint, grouped
from tests import families
from tests.common import mlp_problem

EPOCHS, NUM_DATA, BATCH = 3, 40, 8  # 5 steps per epoch, 15 in all
STEPS_PER_EPOCH = NUM_DATA // BATCH
LR = {"ivon": 0.05, "kron-ivon": 0.05}


def problem(family: str) -> tuple[Any, Any, DataLoader]:
    """A tiny MLP with a LoRA-XS site and a point-estimated head, and a shuffling loader."""
    prob = mlp_problem(
        (4, 8, 3),
        pb.models.LoRAXS(rank=2, target_modules=["0"]),
        num_data=NUM_DATA,
        seed=0,
        data_seed=1,
        trainable_modules=["2"],
        family=family,
    )
    loader = DataLoader(TensorDataset(prob.x, prob.y), batch_size=BATCH, shuffle=True)
    return prob.model, families.posterior(prob.model, family), loader


def run(family: str, **kw: Any) -> tuple[Any, Any, pb.infer.FitResult]:
    model, guide, loader = problem(family)
    result = pb.fit(
        model, guide, loader, epochs=EPOCHS, seed=7, lr=LR.get(family, 1e-2), **grouped(**kw)
    )
    return model, guide, result


def _die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _on_call(n: int, original: Any) -> Any:
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            _die()
        return original(*args, **kwargs)

    return wrapper


def main(family: str, directory: str, mode: str, n: int) -> None:
    torch.set_default_dtype(torch.float64)  # as tests/conftest.py
    torch.set_num_threads(1)
    pyro.enable_validation(True)
    pyro.set_rng_seed(0)
    callback = None
    if mode == "step":
        callback = lambda step, loss: _die() if step == n else None  # noqa: E731
    elif mode == "switch":
        checkpoint._switch = _on_call(n, checkpoint._switch)
    elif mode == "fsync":
        checkpoint._fsync = _on_call(n, checkpoint._fsync)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    run(family, checkpoint_dir=directory, checkpoint_every=1, callback=callback)
    raise SystemExit("the fit ended without being killed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
