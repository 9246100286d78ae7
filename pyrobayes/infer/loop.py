"""The training loop behind :func:`pyrobayes.fit`.

A short loop over the family's :class:`~pyrobayes.infer.fitter.Fitter` (``begin``, ``step`` per
batch, ``epoch_end``, ``end``) with a progress bar, logging, seeding, validation-based selection,
learning-rate schedules, crash-safe checkpoints (:mod:`pyrobayes.infer.checkpoint`) and exact
resume. A non-finite loss or gradient stops training *before* the parameters are touched, so the
last checkpoint stays good. ``fit`` owns the per-epoch order of a ``DataLoader`` (its generators
are seeded from the fit's seed and the epoch), so a run resumed mid-epoch sees the same batches.

Under ``torch.distributed`` (launched with ``torchrun``; gloo on CPU, NCCL on GPUs) it behaves as
DDP: rank 0's parameters are broadcast at the start, every rank evaluates the objective on its own
minibatch (a ``DistributedSampler``; the model's ``num_data`` is the *global* N, so each rank's
``N/B``-scaled loss is an unbiased estimate), gradients are averaged over ranks (closure-driven
optimizers such as IVON all-reduce their own statistics), the logged loss is the mean over ranks,
and only rank 0 writes checkpoints and shows the progress bar. With equal per-rank batch sizes, R
ranks on batches of B equal one process on the union batch of R·B (tested with gloo).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sized
from pathlib import Path
from typing import Any, NamedTuple

import pyro
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..batch import to_device
from ..contract import implements
from .arguments import validate_fit_arguments
from .checkpoint import CheckpointLock, clean, holds_run, latest, load_checkpoint, save_checkpoint
from .distributed import broadcast_, world
from .fitter import make_fitter
from .objectives import ReportsTerms
from .schedule import check_schedule, make_scheduler
from .selection import Selection

logger = logging.getLogger(__name__)

__all__ = ["FitResult", "fit"]


class FitResult(NamedTuple):
    """What :func:`fit` returns.

    - **guide** - the fitted guide (the posterior).
    - **state["terms"]** - for an objective that reports named terms
      (:class:`~pyrobayes.infer.objectives.ReportsTerms`): ``{name: Tensor}`` of their value at
      every step of this call (after a resume: the steps since it); the progress bar shows
      their running averages. The ELBO reports the data term ``nll`` (expected negative
      log-likelihood per training example) and ``kl`` (``KL(q ‖ p)``), with
      ``loss = N · nll + kl``; MAP (and the MAP phase of SWAG and Laplace) reports ``nll``,
      ``prior`` (``−log p(θ̂)`` without its normalising constant) and ``prior_const``, with
      ``loss = N · nll + prior + prior_const``; the symmetrized ELBO ``L_K``, ``elbo``, ``I_K``.
    - **losses** - ``Tensor (num_steps,)``: the objective at every step (dataset-sum convention).
    - **state** - ``dict``: ``step``, ``epoch``, ``elapsed`` seconds, ``objective`` name, and
      the fitter's own running quantities (:meth:`Fitter.report`, e.g. IBDR's ``lam``).
    """

    guide: Any
    losses: torch.Tensor
    state: dict[str, Any]


def _mix_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same on every machine and Python (not ``hash``)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class _DataOrder:
    """``fit``'s ownership of a ``DataLoader``'s per-epoch order.

    Before each epoch the generators of its samplers (``RandomSampler`` of ``shuffle=True``,
    or any sampler with a ``generator`` attribute) and the loader's own generator (the base
    seed of its workers) are replaced by ones seeded from ``(seed, epoch)``, and ``set_epoch``
    is called on samplers that have it (``DistributedSampler``). Nothing is drawn from the
    global RNG, so the order of an epoch does not depend on where in it a run was resumed.
    The original generators are put back by :meth:`restore`.
    """

    def __init__(self, data: Any, seed: int) -> None:
        self.seed = seed
        self.loader = data if isinstance(data, DataLoader) else None
        self.samplers: list[Any] = []
        self._saved: list[tuple[Any, Any]] = []
        if self.loader is None:
            return
        for sampler in (
            self.loader.sampler,
            self.loader.batch_sampler,
            getattr(self.loader.batch_sampler, "sampler", None),
        ):
            if sampler is not None and all(sampler is not s for s in self.samplers):
                self.samplers.append(sampler)
        self._saved = [
            (obj, obj.generator)
            for obj in (self.loader, *self.samplers)
            if hasattr(obj, "generator")
        ]

    def set_epoch(self, epoch: int) -> None:
        for k, (obj, _) in enumerate(self._saved):
            obj.generator = torch.Generator().manual_seed(_mix_seed(self.seed, epoch, k))
        for sampler in self.samplers:
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)

    def restore(self) -> None:
        for obj, generator in self._saved:
            obj.generator = generator


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
    overwrite: bool = False,
    callback: Callable[[int, float], None] | None = None,
    val_data: Iterable[Any] | None = None,
    select_by: str = "nll",
    patience: int | None = None,
    scheduler: str | Callable[[torch.optim.Optimizer], Any] | None = None,
    warmup: float = 0,
) -> FitResult:
    """Fit ``guide`` (the posterior) to ``model`` on ``data``.

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
    data : iterable of batches
        A ``DataLoader`` (re-iterated each epoch) or any re-iterable of batches. ``fit`` owns a
        ``DataLoader``'s per-epoch order: before each epoch the generators of its sampler
        (``RandomSampler`` of ``shuffle=True``, or any sampler with a ``generator``) and of the
        loader (its workers' base seed) are replaced by generators seeded from the
        fit's seed and the epoch, and a sampler's ``set_epoch(epoch)`` is called
        (``DistributedSampler``); the originals are put back at the end. Epoch ``e``'s order is
        thus a function of ``(seed, e)`` alone, and a run resumed mid-epoch skips exactly the
        batches already done (without ``seed`` the data seed is drawn from torch's RNG once and
        saved in the checkpoint). Other iterables must yield the same batches each pass for an
        exact resume.
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
        Seeds torch and Pyro (``pyro.set_rng_seed``) and the data order.
    progress_bar : bool
        Show a tqdm bar with the running loss.
    checkpoint_dir : path, optional
        Write a checkpoint (guide + point parameters + fitter state + RNG states + schedule +
        validation + position in the data) every ``checkpoint_every`` steps and at each epoch
        end, crash-safely: each is a complete, fsynced generation folder ``<dir>/ckpt-NNNNNN``
        that the file ``<dir>/LATEST`` is atomically switched to before the previous one is
        deleted, so a kill at any instant leaves a checkpoint that ``resume=True`` finds (see
        :mod:`pyrobayes.infer.checkpoint`). The folder is locked (``<dir>/.lock``, an OS file
        lock) while the fit runs: a second fit on it is refused. Leftovers of a killed fit are
        removed at the start.
    resume : bool
        Continue from the newest checkpoint in ``checkpoint_dir`` if there is one (restores
        guide, point parameters, optimizer, RNG states, schedule and position: the rest of the
        run is the same as without the interruption, bit for bit, mid-epoch too). The earlier
        single-folder layout (``<dir>/last``) is still read.
    overwrite : bool
        Allow a new fit (``resume=False``) into a ``checkpoint_dir`` that holds another run's
        checkpoint; without it that is refused. The old checkpoint stays until this run's first
        checkpoint replaces it.
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
    patience : int, optional
        Early stopping (needs ``val_data``): end the fit after ``patience`` epochs in a row that
        do not improve on the best validation score; ``epochs`` is then the cap. The best epoch
        is restored as without it. ``FitResult.state["stopped_early"]`` says whether the rule
        ended the fit before the cap. The rule reads the validation history, which checkpoints
        keep, so a resumed fit stops at the same epoch.
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
        On a non-finite loss or gradient, before any parameter is updated (the message names
        the step, and the parameters for a gradient; checkpoints stay good).
    RuntimeError
        When another fit holds ``checkpoint_dir``.
    FileExistsError
        When ``checkpoint_dir`` holds another run's checkpoint and neither ``resume`` nor
        ``overwrite`` is set.
    """
    validate_fit_arguments(
        epochs=epochs,
        num_steps=num_steps,
        lr=lr,
        warmup=warmup,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        overwrite=overwrite,
        patience=patience,
        validated=val_data is not None,
    )
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
    world_size, rank = world()
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    with contextlib.ExitStack() as stack:
        if ckpt is not None and rank == 0:  # only rank 0 writes
            stack.enter_context(CheckpointLock(ckpt))
            if not resume and not overwrite and holds_run(ckpt):
                raise FileExistsError(
                    f"{ckpt} holds the checkpoint of another run ({latest(ckpt)}). Pass "
                    "resume=True to continue it, overwrite=True to replace it, or another "
                    "checkpoint_dir."
                )
            removed = clean(ckpt)
            if removed:
                logger.info("Removed what an interrupted fit left in %s: %s", ckpt, removed)
        return _run(
            model,
            guide,
            data,
            epochs=epochs,
            num_steps=num_steps,
            total=total,
            steps_per_epoch=steps_per_epoch,
            loss=loss,
            optimizer=optimizer,
            lr=lr,
            device=device,
            seed=seed,
            progress_bar=progress_bar,
            ckpt=ckpt,
            checkpoint_every=checkpoint_every,
            resume=resume,
            callback=callback,
            selection=selection,
            patience=patience,
            scheduler=scheduler,
            warmup=warmup,
        )


def _run(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    epochs: int | None,
    num_steps: int | None,
    total: int | None,
    steps_per_epoch: int | None,
    loss: Any,
    optimizer: Any,
    lr: float,
    device: str | torch.device | None,
    seed: int | None,
    progress_bar: bool,
    ckpt: Path | None,
    checkpoint_every: int | None,
    resume: bool,
    callback: Callable[[int, float], None] | None,
    selection: Selection | None,
    patience: int | None,
    scheduler: str | Callable[[torch.optim.Optimizer], Any] | None,
    warmup: float,
) -> FitResult:
    """The body of :func:`fit`, its arguments checked and its checkpoint folder locked."""
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
    # the position: `in_epoch` batches of epoch `epoch` done (its end work not yet)
    step, epoch, in_epoch, losses = 0, 0, 0, []
    data_seed = seed
    found = latest(ckpt) if resume and ckpt is not None else None
    if found is not None:
        meta, saved_best = load_checkpoint(found, guide, model, fitter, sched)
        step, epoch, losses = meta["step"], meta["epoch"], list(meta["losses"])
        if "batch" in meta:
            in_epoch = meta["batch"]
        elif steps_per_epoch:  # the earlier layout: derived from the step
            in_epoch = step - epoch * steps_per_epoch
        data_seed = meta.get("data_seed", data_seed)
        if selection is not None:
            selection.best = saved_best
            selection.history = list(meta.get("validation", []))
        logger.info("Resumed from %s at step %d (epoch %d)", found, step, epoch)
    if data_seed is None and isinstance(data, DataLoader):  # as a DataLoader would draw it
        data_seed = int(torch.empty((), dtype=torch.int64).random_().item())
    order = _DataOrder(data, 0 if data_seed is None else data_seed)
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
    reporter = fitter.objective if implements(fitter.objective, ReportsTerms) else None
    terms: dict[str, list[float]] = {}

    def _checkpoint(epoch_end_done: bool) -> None:
        meta = {
            "step": step,
            "epoch": epoch,
            "batch": in_epoch,
            "epoch_end_done": epoch_end_done,
            "data_seed": data_seed,
            "losses": losses,
            "validation": selection.history if selection is not None else [],
        }
        best = selection.best if selection is not None else None
        if ckpt is None:  # called only when write_checkpoints
            raise RuntimeError("fit(): no checkpoint_dir to write to.")
        save_checkpoint(ckpt, guide, model, fitter, meta, best, sched)

    def _batches_done() -> bool:  # all batches of the epoch done, its end work not
        return in_epoch > 0 and steps_per_epoch is not None and in_epoch >= steps_per_epoch

    def _end_may_be_pending() -> bool:  # ... or maybe so (an iterable without a length)
        return in_epoch > 0 and (steps_per_epoch is None or in_epoch >= steps_per_epoch)

    stopped_early = False
    try:
        while (epochs is None or epoch < epochs) and (
            num_steps is None or step < num_steps or _end_may_be_pending()
        ):
            # early stopping, decided between epochs from the (checkpointed) history alone
            if selection is not None and in_epoch == 0 and selection.exhausted(patience):
                stopped_early = True
                logger.info(
                    "fit: stopped early after epoch %d (%d epochs without a better %s)",
                    epoch - 1,
                    patience,
                    selection.select_by,
                )
                break
            seen, stopped = 0, False
            if not _batches_done():  # else: resumed after the last batch, before the end
                order.set_epoch(epoch)
                for batch in data:
                    seen += 1
                    if seen <= in_epoch:  # resumed mid-epoch: done already
                        continue
                    if num_steps is not None and step >= num_steps:
                        stopped = True
                        break
                    batch = to_device(batch, device)
                    try:
                        value = fitter.step(batch)
                    except FloatingPointError as err:
                        raise FloatingPointError(
                            f"{err} (fit step {step}, epoch {epoch}). Lower the learning rate or "
                            "the init_scale"
                            + (f"; the last checkpoint in {ckpt} is intact." if ckpt else ".")
                        ) from None
                    losses.append(value)
                    if reporter is not None:
                        for name, term in reporter.terms().items():
                            terms.setdefault(name, []).append(float(term))
                    step += 1
                    in_epoch += 1
                    if sched is not None:
                        sched.step()
                    bar.update(1)
                    if progress_bar and step % max(1, (total or 100) // 20) == 0:
                        window = losses[-max(1, len(losses) // 10) :]
                        avg = sum(window) / len(window)
                        extra = {k: f"{v:.3g}" for k, v in fitter.report().items()}
                        bar.set_postfix(init=f"{losses[0]:.4g}", avg=f"{avg:.4g}", **extra)
                    if progress_bar and terms and step % max(1, (total or 100) // 20) == 0:
                        width = max(1, len(losses) // 10)  # the loss's window
                        shown = ", ".join(
                            f"{name}={sum(v[-width:]) / len(v[-width:]):.4g}"
                            for name, v in terms.items()
                        )
                        bar.set_postfix_str(f"{bar.postfix}, {shown}" if bar.postfix else shown)
                    if callback is not None:
                        callback(step, value)
                    if write_checkpoints and checkpoint_every and step % checkpoint_every == 0:
                        _checkpoint(epoch_end_done=False)
                if stopped:
                    break  # num_steps reached inside the epoch
                if seen == 0 and in_epoch == 0:
                    raise ValueError("fit(): data yielded no batches.")
                if seen < in_epoch:
                    raise ValueError(
                        f"fit(): data yielded {seen} batches in epoch {epoch}, but the "
                        f"checkpoint resumed from records {in_epoch} done in it. Resume with the "
                        "data the run was started with."
                    )
            # the epoch's end work (also where a run killed after its last step resumes)
            fitter.epoch_end(epoch)
            if selection is not None:
                measured = selection.score(model, guide, epoch)
                logger.info("epoch %d validation: %s", epoch, measured)
            epoch += 1
            in_epoch = 0
            if write_checkpoints:
                _checkpoint(epoch_end_done=True)
    finally:
        order.restore()
        bar.close()
    best_epoch = selection.restore_best(model, guide) if selection is not None else None
    if best_epoch is not None and selection is not None:
        logger.info(
            "fit: restored the best validated epoch %d (%s)", best_epoch, selection.select_by
        )
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
        **fitter.report(),
    }
    if reporter is not None:
        state["terms"] = {name: torch.tensor(v) for name, v in terms.items()}
    if selection is not None:
        state.update(
            best_epoch=best_epoch, validation=selection.history, stopped_early=stopped_early
        )
    return FitResult(guide, torch.tensor(losses), state)
