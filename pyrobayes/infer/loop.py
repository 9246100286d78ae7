"""The training loop behind :func:`pyrobayes.fit`.

A short loop over the family's :class:`~pyrobayes.infer.fitter.Fitter` (``begin``, ``step`` per
batch, ``epoch_end``, ``end``) with a progress bar, logging, seeding, validation-based selection,
learning-rate schedules, atomic checkpoints and resume. A non-finite loss stops training *before*
the parameters are touched, so the last checkpoint stays good.

Under ``torch.distributed`` (launched with ``torchrun``; gloo on CPU, NCCL on GPUs) it behaves as
DDP: rank 0's parameters are broadcast at the start, every rank evaluates the objective on its own
minibatch (a ``DistributedSampler``; the model's ``num_data`` is the *global* N, so each rank's
``N/B``-scaled loss is an unbiased estimate), gradients are averaged over ranks (closure-driven
optimizers such as IVON all-reduce their own statistics), the logged loss is the mean over ranks,
and only rank 0 writes checkpoints and shows the progress bar. With equal per-rank batch sizes, R
ranks on batches of B equal one process on the union batch of R·B (tested with gloo).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sized
from pathlib import Path
from typing import Any, NamedTuple

import pyro
import torch
from tqdm.auto import tqdm

from ..batch import to_device
from .distributed import broadcast_, world
from .fitter import Fitter, make_fitter
from .schedule import check_schedule, make_scheduler
from .selection import Selection, Snapshot

logger = logging.getLogger(__name__)

__all__ = ["FitResult", "fit"]


class FitResult(NamedTuple):
    """What :func:`fit` returns.

    - **guide** - the fitted guide (the posterior).
    - **losses** - ``Tensor (num_steps,)``: the objective at every step (dataset-sum convention).
    - **state** - ``dict``: ``step``, ``epoch``, ``elapsed`` seconds, ``objective`` name.
    """

    guide: Any
    losses: torch.Tensor
    state: dict[str, Any]


def _save_checkpoint(
    directory: Path,
    guide: Any,
    model: Any,
    fitter: Fitter,
    meta: dict[str, Any],
    best: Snapshot | None = None,
    scheduler: Any = None,
) -> None:
    """Write ``directory/last`` atomically (temp folder + rename); the old one stays until then."""
    from ..io import save  # local: io imports the guide registry

    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=directory))
    save(guide, tmp / "posterior.safetensors", model=model)
    torch.save(fitter.state_dict(), tmp / "fitter.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    if best is not None:
        torch.save(best.to_dict(), tmp / "best.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    (tmp / "state.json").write_text(json.dumps(meta, indent=2))
    final = directory / "last"
    old = directory / ".last-old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def _load_checkpoint(
    directory: Path, guide: Any, model: Any, fitter: Fitter, scheduler: Any = None
) -> tuple[dict[str, Any], Snapshot | None]:
    from ..io import load_state

    final = directory / "last"
    load_state(guide, final / "posterior.safetensors", model=model)
    fitter.load_state_dict(torch.load(final / "fitter.pt", weights_only=True))
    torch.set_rng_state(torch.load(final / "rng.pt", weights_only=True)["torch"])
    if scheduler is not None and (final / "scheduler.pt").exists():
        scheduler.load_state_dict(torch.load(final / "scheduler.pt", weights_only=True))
    best = None
    if (final / "best.pt").exists():
        best = Snapshot.from_dict(torch.load(final / "best.pt", weights_only=True))
    return json.loads((final / "state.json").read_text()), best


def fit(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    epochs: int | None = None,
    num_steps: int | None = None,
    loss: Any = None,
    optimizer: Any = None,
    lr: float = 1e-2,
    device: str | torch.device | None = None,
    seed: int | None = None,
    progress_bar: bool = False,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    callback: Callable[[int, float], None] | None = None,
    val_data: Iterable[Any] | None = None,
    select_by: str = "nll",
    scheduler: str | Callable[[torch.optim.Optimizer], Any] | None = None,
    warmup: float = 0,
) -> FitResult:
    """Fit ``guide`` (the posterior) to ``model`` on ``data``.

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
    data : iterable of batches
        A ``DataLoader`` (re-iterated each epoch) or any re-iterable of batches.
    epochs, num_steps : int
        Train for this many passes over ``data`` or this many steps (one of them; with both,
        whichever ends first).
    loss : str, pyro.infer.ELBO or object with ``loss(model, guide, batch)``, optional
        Defaults to the family's objective (its fitter's ``default_objective()``).
    optimizer : torch optimizer, class or factory, optional
        Defaults to the family's (its fitter's ``default_optimizer``; Adam for SVI).
    lr : float
        Learning rate for the default optimizer.
    device : str or torch.device, optional
        Move model, guide and batches there.
    seed : int, optional
        Seeds torch and Pyro (``pyro.set_rng_seed``).
    progress_bar : bool
        Show a tqdm bar with the running loss.
    checkpoint_dir : path, optional
        Write ``<dir>/last`` (guide + head + fitter state + RNG + position) atomically every
        ``checkpoint_every`` steps and at each epoch end.
    resume : bool
        Continue from ``<checkpoint_dir>/last`` if it exists (restores guide, optimizer, RNG and
        the step counter; steps already done are not repeated).
    callback : callable(step, loss), optional
    val_data : iterable of batches, optional
        Held-out data scored at the end of every epoch at the guide's
        ``validation_values()`` (its current ``loc``); the best epoch's guide state and point
        parameters are restored when training ends, before the family's ``fit_end`` (so Laplace
        fits its curvature at the selected MAP). ``FitResult.state`` records ``best_epoch``
        (0-based) and the ``validation`` history.
    select_by : {"nll", "accuracy", "rmse"}
        The validation criterion: predictive NLL (any likelihood), accuracy (classification;
        ties broken by NLL) or RMSE (regression).
    scheduler : {"cosine", "linear"} or callable, optional
        Learning-rate schedule, stepped after every optimizer step: ``"cosine"``
        (``α_t = α·½(1 + cos(π t/T))``) or ``"linear"`` (``α_t = α(1 − t/T)``) over the run's
        ``T`` steps, or a factory ``optimizer -> LRScheduler``. Saved in checkpoints. Not with a
        fitter that schedules the learning rate itself (``SWAGGuide(swa_lr=...)``).
    warmup : int or float
        Linear warm-up before a named schedule's decay: ``α_t = α·t/W`` for the first ``W``
        steps (an int), or that fraction of the run (a float < 1; 0.06 is LoRA-XS's GLUE recipe).

    Returns
    -------
    FitResult

    Raises
    ------
    FloatingPointError
        On a non-finite loss, before any parameter is updated (checkpoints stay good).
    """
    if epochs is None and num_steps is None:
        raise ValueError("Pass epochs=... or num_steps=... to fit().")
    if (epochs is not None and epochs < 0) or (num_steps is not None and num_steps < 0):
        raise ValueError(f"Expected non-negative epochs/num_steps but got {epochs}/{num_steps}.")
    selection = Selection(val_data, select_by) if val_data is not None else None
    try:
        steps_per_epoch: int | None = len(data) if isinstance(data, Sized) else None
    except TypeError:  # a DataLoader over an IterableDataset has a __len__ that raises
        steps_per_epoch = None
    total = num_steps
    if epochs is not None and steps_per_epoch is not None:
        total = epochs * steps_per_epoch if total is None else min(total, epochs * steps_per_epoch)
    # argument errors before anything is touched (begin() resets what a fitter collects)
    check_schedule(scheduler, total, warmup)
    if seed is not None:
        pyro.set_rng_seed(seed)
    if device is not None:
        model.to(device)
        guide.to(device)
    model.train(True)
    if not guide.sites:  # a guide over a plain Pyro model sets up from its first batch
        first = to_device(next(iter(data)), device)
        with pyro.poutine.block(), pyro.poutine.trace():
            guide(first)
    fitter = make_fitter(model, guide, loss=loss, optimizer=optimizer, lr=lr)
    if scheduler is not None and fitter.manages_lr:
        raise ValueError(
            f"fit(scheduler={scheduler!r}) with {type(fitter).__name__}, which schedules the "
            f"learning rate itself ({type(guide).__name__}(swa_lr=...)). Pass one of the two."
        )
    fitter.begin(data)
    sched = make_scheduler(scheduler, fitter.optimizer, total, warmup)
    world_size, rank = world()
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    step, epoch, losses = 0, 0, []
    if resume and ckpt is not None and (ckpt / "last").exists():
        meta, saved_best = _load_checkpoint(ckpt, guide, model, fitter, sched)
        step, epoch, losses = meta["step"], meta["epoch"], list(meta["losses"])
        if selection is not None:
            selection.best = saved_best
            selection.history = list(meta.get("validation", []))
        logger.info("Resumed from %s at step %d (epoch %d)", ckpt / "last", step, epoch)
    if world_size > 1:
        broadcast_(fitter.broadcast_tensors())
    write_checkpoints = ckpt is not None and rank == 0
    bar = tqdm(
        total=total,
        initial=step,
        disable=not progress_bar or rank != 0,
        desc=type(guide).__name__,
    )
    start = time.perf_counter()
    step_in_epoch_done = step - epoch * steps_per_epoch if steps_per_epoch else 0

    def _checkpoint() -> None:
        history = selection.history if selection is not None else []
        meta = {"step": step, "epoch": epoch, "losses": losses, "validation": history}
        best = selection.best if selection is not None else None
        assert ckpt is not None  # called only when write_checkpoints
        _save_checkpoint(ckpt, guide, model, fitter, meta, best, sched)

    try:
        while (epochs is None or epoch < epochs) and (num_steps is None or step < num_steps):
            i_last_step_count = step
            for i, batch in enumerate(data):
                if i < step_in_epoch_done:  # resuming mid-epoch: skip what was done
                    continue
                if num_steps is not None and step >= num_steps:
                    break
                batch = to_device(batch, device)
                try:
                    value = fitter.step(batch)
                except FloatingPointError as err:
                    raise FloatingPointError(
                        f"{err} (fit step {step}, epoch {epoch}). Lower the learning rate or the "
                        "init_scale"
                        + (f"; the last checkpoint in {ckpt} is intact." if ckpt else ".")
                    ) from None
                losses.append(value)
                step += 1
                if sched is not None:
                    sched.step()
                bar.update(1)
                if progress_bar and step % max(1, (total or 100) // 20) == 0:
                    window = losses[-max(1, len(losses) // 10) :]
                    bar.set_postfix(init=f"{losses[0]:.4g}", avg=f"{sum(window) / len(window):.4g}")
                if callback is not None:
                    callback(step, value)
                if write_checkpoints and checkpoint_every and step % checkpoint_every == 0:
                    _checkpoint()
            else:
                if i_last_step_count == step:
                    raise ValueError("fit(): data yielded no batches.")
                step_in_epoch_done = 0
                fitter.epoch_end(epoch)
                if selection is not None:
                    measured = selection.score(model, guide, epoch)
                    logger.info("epoch %d validation: %s", epoch, measured)
                epoch += 1
                if write_checkpoints:
                    _checkpoint()
                continue
            break  # num_steps reached inside the epoch
    finally:
        bar.close()
    best_epoch = selection.restore_best(model, guide) if selection is not None else None
    if best_epoch is not None:
        logger.info("fit: restored the best validated epoch %d (%s)", best_epoch, select_by)
    fitter.end(data)
    model.train(False)
    elapsed = time.perf_counter() - start
    logger.info(
        "fit: %d steps in %.1fs, final loss %.4g",
        step,
        elapsed,
        losses[-1] if losses else float("nan"),
    )
    state = {
        "step": step,
        "epoch": epoch,
        "elapsed": elapsed,
        "objective": type(fitter.objective).__name__,
        "fitter": type(fitter).__name__,
    }
    if selection is not None:
        state.update(best_epoch=best_epoch, validation=selection.history)
    return FitResult(guide, torch.tensor(losses), state)
