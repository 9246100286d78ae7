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
ranks on batches of B equal one process on the union batch of R·B (tested with gloo). Every rank
must run the same fit: before the fitter begins, the ranks compare their batches per epoch,
family, settings, rate, budget and resume position, and a rank that refuses the fit (or fails
before it: its data, its checkpoint folder) stops them all, in one gather
(:func:`~pyrobayes.infer.fit_checks.check_ranks_agree`); so does a rank that fails after it,
before the first step (the fitter's ``begin``, the checkpoint's load, the lower-block cache),
in a second gather (:func:`~pyrobayes.infer.fit_checks.check_ranks_started`). The steps add no
collective of their own; a checkpoint adds one gather, which stops every rank with rank 0 when
its write fails (:func:`~pyrobayes.infer.fit_checks.check_checkpoint_written`). Over data
without ``len()`` each epoch's end adds an all-reduce and a gather, which stop every rank when
the ranks' data did not end together (:func:`~pyrobayes.infer.rank_errors.check_ended_together`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pyro
import torch
from tqdm.auto import tqdm

from ..batch import check_batches, detached, to_device
from ..calibration import POOL_BUFFER, TEMPERATURE_BUFFER, drop_temperature
from ..contract import bound_model, implements
from ..fitted_head import forget_fitted_head, record_fitted_head, restore_fitted_head
from ..user_frame import user_stacklevel
from .arguments import validate_fit_arguments
from .checkpoint import (
    CheckpointLock,
    clean,
    holds_run,
    latest,
    load_checkpoint,
    save_checkpoint,
)
from .data_order import DataOrder
from .data_record import batch_digest
from .distributed import barrier, broadcast_, world
from .fit_checks import (
    BATCHES_PER_EPOCH,
    DataSize,
    Divergence,
    DivergenceWarning,
    check_checkpoint_written,
    check_first_batch,
    check_ranks_agree,
    check_ranks_started,
    warn_if_fit_given_back,
    watching_reach,
)
from .fitter import Fitter, check_guide_model, make_fitter
from .objectives import ReportsTerms
from .options import Checkpointing, Optimization, Progress, Validation, upgrade_keywords
from .rank_errors import check_ended_together, keep_for_ranks
from .run_record import (
    ResumeChecks,
    budget_text,
    find_rate_source,
    qualified_name,
    record_objective,
    record_scheduler,
)
from .schedule import check_schedule, make_scheduler, warn_if_no_warmup_step
from .selection import Selection, check_select_by, warn_if_training_data

logger = logging.getLogger(__name__)

#: What :meth:`_Loop._fetched` yields in place of a batch this rank failed to fetch.
_UNFETCHED = object()

__all__ = ["DivergenceWarning", "FitResult", "fit"]


def _ended_early(fetched: int, per_epoch: int, epoch: int) -> str:
    """The error of a rank whose data ended after ``fetched`` of their ``per_epoch`` batches
    (``len()``) in ``epoch``, under ``torch.distributed``."""
    return (
        f"fit(): this rank's data yielded {fetched} batches in epoch {epoch}, but their len() "
        f"gives {per_epoch}; under torch.distributed every rank takes len() steps an epoch, "
        "all-reduced over the ranks, so the others would wait for this rank's missing steps. "
        "Make len() count the batches the data yield (a DistributedSampler gives every rank "
        "the same number)."
    )


class FitResult(NamedTuple):
    """What :func:`fit` returns.

    - **guide** - the fitted guide (the posterior).
    - **state["terms"]** - for an objective that reports named terms
      (:class:`~pyrobayes.infer.objectives.ReportsTerms`): ``{name: Tensor}`` of their value at
      every step of this call (after a resume: the steps since it); the progress bar shows
      their running averages. Terms are per training example, without additive constants:
      the ELBO reports the data term ``nll`` (expected negative log-likelihood per training
      example) and ``kl`` (``KL(q ‖ p) / N``), with ``loss = N · (nll + kl)``; MAP (and the MAP
      phase of SWAG and Laplace) ``nll`` and ``prior`` (``−log p(θ̂)`` without its normalising
      constant ``C``, over N), with ``loss = N · (nll + prior) + C``; σN ``nll`` and ``div``,
      ``loss = N · (nll + div)``; IVON ``nll`` (its loss); the symmetrized ELBO ``L_K``,
      ``elbo``, ``I_K``.
    - **losses** - ``Tensor (num_steps,)``: the objective at every step (dataset-sum convention).
    - **state** - ``dict``: ``step``, ``epoch``, ``elapsed`` seconds, ``objective`` name, and
      the fitter's own running quantities (:meth:`Fitter.report`, e.g. IBDR's ``lam``).
    """

    guide: Any
    losses: torch.Tensor
    state: dict[str, Any]


def _plain_network(model: Any) -> bool:
    """Whether ``model`` is a torch network that is neither a FineTuneModel (it has latent
    sites) nor a Pyro model of its own (a ``PyroModule``): a guide cannot trace it."""
    return (
        isinstance(model, torch.nn.Module)
        and not isinstance(model, pyro.nn.PyroModule)
        and getattr(model, "latent_sites", None) is None
    )


class _HeldTemperature:
    """A calibrated temperature (``pb.calibrate``) taken off the guide while the fit may still
    be refused.

    :func:`~pyrobayes.infer.fitter.make_fitter` drops a temperature (the fit changes the
    posterior it was fitted for). Taken off first, it is put back as it was when the fit is
    refused (:meth:`put_back`), and dropped with its warning only once every refusal is past
    and the fit changes the guide (:meth:`settle`): a fit of no step keeps it.
    """

    def __init__(self, guide: Any) -> None:
        self.guide = guide
        buffers = getattr(guide, "_buffers", None) or {}
        self.held = {k: buffers.pop(k) for k in (TEMPERATURE_BUFFER, POOL_BUFFER) if k in buffers}

    def put_back(self) -> None:
        """Return the temperature to the guide, as it was."""
        held, self.held = self.held, {}
        if held:
            self.guide._buffers.update(held)

    def settle(self, changes: bool) -> None:
        """Past every refusal: drop the temperature (and say so) when the fit ``changes`` the
        guide, else keep it."""
        self.put_back()
        if changes:
            drop_temperature(self.guide, owner="fit: ")


def _device_of(model: Any) -> torch.device | None:
    """The device of ``model``'s parameters when it is not the CPU (batches are moved there),
    else ``None`` (batches are used as given)."""
    parameters = model.parameters() if isinstance(model, torch.nn.Module) else iter(())
    first = next(parameters, None)
    if first is None or first.device.type == "cpu":
        return None
    return first.device


class _Plan(NamedTuple):
    """When a fit ends: ``epochs`` and/or ``num_steps``, ``total`` steps if known."""

    epochs: int | None
    num_steps: int | None
    total: int | None
    steps_per_epoch: int | None

    @classmethod
    def of(cls, data: Any, epochs: int | None, num_steps: int | None) -> _Plan:
        check_batches(data, "fit()")  # a data set of single examples has a length too
        try:
            per_epoch: int | None = len(data) if isinstance(data, Sized) else None
        except TypeError:  # a DataLoader over an IterableDataset has a __len__ that raises
            per_epoch = None
        total = num_steps
        if epochs is not None and per_epoch is not None:
            total = epochs * per_epoch if total is None else min(total, epochs * per_epoch)
        return cls(epochs, num_steps, total, per_epoch)


@dataclass
class _Position:
    """Where a fit is: ``in_epoch`` batches of epoch ``epoch`` done (its end work not yet)."""

    step: int = 0
    epoch: int = 0
    in_epoch: int = 0
    losses: list[float] = field(default_factory=list)
    data_seed: int | None = None
    saved_at: int | None = None  # the step of the last checkpoint written or resumed from
    # the digest of the batch the checkpoint resumed from took last (in_epoch-th of epoch)
    replayed: str | None = None


def _earlier_keywords(fit: Callable[..., FitResult]) -> Callable[..., FitResult]:
    """``fit`` taking, for one release, the keywords it took before its groups.

    ``num_steps``, ``loss``, ``optimizer``, ``scheduler``, ``warmup``, ``val_data``,
    ``select_by``, ``patience``, ``checkpoint_dir``, ``checkpoint_every``, ``resume``,
    ``overwrite``, ``progress_bar`` and ``callback`` are folded into their group
    (:func:`~pyrobayes.infer.options.upgrade_keywords`); ``device`` moves the model there. Each
    warns once (``DeprecationWarning``) with the new spelling. The signature users see
    (``inspect.signature``, the API reference) is ``fit``'s own.
    """
    own = set(inspect.signature(fit).parameters)

    @functools.wraps(fit)
    def accepting(model: Any, guide: Any, data: Iterable[Any], **kwargs: Any) -> FitResult:
        old = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        device = old.pop("device", None)
        if device is not None:
            warnings.warn(
                "fit(device=...) is deprecated and will be removed in the next release: move "
                "the model first (model.to(device)); fit runs where its parameters are.",
                DeprecationWarning,
                stacklevel=user_stacklevel(),
            )
            model.to(device)
        if old:  # the old flat spelling: checked as it was, then folded into the groups
            flat = {k: v for k, v in old.items() if k in _FLAT_CHECKED}
            flat.setdefault("num_steps", getattr(kwargs.get("optim"), "num_steps", None))
            validate_fit_arguments(
                epochs=kwargs.get("epochs"),
                lr=kwargs.get("lr"),
                validated=old.get("val_data") is not None,
                **flat,
            )
            groups = {g: kwargs.pop(g, None) for g in ("optim", "validation", "checkpoint")}
            groups["progress"] = kwargs.pop("progress", None)
            kwargs.update(upgrade_keywords(old, groups))
        return fit(model, guide, data, **kwargs)

    return accepting


@_earlier_keywords
def fit(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    epochs: int | None = None,
    lr: float | None = None,
    seed: int | None = None,
    optim: Optimization | None = None,
    validation: Validation | None = None,
    checkpoint: Checkpointing | None = None,
    progress: Progress | bool | None = None,
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
        saved in the checkpoint). Data other than a list or tuple of batches (an
        ``IterableDataset``, a re-iterable generator) are read on torch's, Python's and NumPy's
        global generators seeded from the data seed and the epoch (the fit's own draws kept
        apart), and a dataset's ``set_epoch(epoch)`` is called before each epoch, so data that
        shuffle with either resume exactly too; a resume that replays another batch than the
        interrupted run took warns.
    epochs : int, optional
        Train for this many passes over ``data`` (or pass a step budget,
        ``optim=Optimization(num_steps=...)``; with both, whichever ends first).
    lr : float, optional
        Learning rate for the default optimizer; default the family's
        (:attr:`~pyrobayes.infer.Fitter.default_lr`: 1e-2 for Adam, the optimizer of every
        family but IVON's and Kronecker IVON's, whose step α defaults to 0.1).
    seed : int, optional
        Seeds torch and Pyro (``pyro.set_rng_seed``) and the data order.
    optim : Optimization, optional
        The objective, optimizer, learning-rate schedule and step budget (default: the family's
        objective, optimizer and schedule: a constant rate, IVON's a cosine).
    validation : Validation, optional
        Held-out data scored after every epoch, the best epoch restored, early stopping.
    checkpoint : Checkpointing, optional
        Crash-safe checkpoints and exact resume.
    progress : Progress or bool, optional
        The progress bar and a per-step callback; ``True``/``False`` is ``Progress(bar=...)``.
        The default shows the bar in interactive use only (:class:`Progress`).

    Returns
    -------
    FitResult

    Warns
    -----
    DivergenceWarning
        Once, when the median loss of the last 10 steps exceeds the first step's loss by over
        10³ times its magnitude (at least 10³ for a first loss within 1 of zero): a diverging
        fit; lower ``lr``.
    UserWarning
        When ``validation``'s data are ``data`` itself (or a loader over the same dataset):
        selection and early stopping would follow the training fit. At a resume inside an
        epoch, when the data replay another batch there than the interrupted run took (their
        order comes from a generator of their own that fit does not seed).

    Raises
    ------
    FloatingPointError
        On a non-finite loss or gradient, before any parameter is updated (the message names
        the step, and the parameters for a gradient; checkpoints stay good).
    RuntimeError
        When another fit holds the checkpoint folder.
    FileExistsError
        When the checkpoint folder holds another run's checkpoint and neither ``resume`` nor
        ``overwrite`` is set.
    NotADirectoryError
        When the checkpoint folder is a file or lies below one.
    TypeError
        When the guide was built on a plain torch network (not a FineTuneModel).
    ValueError
        When a resumed checkpoint was written with other validation data (other examples, in
        any batching), or with validation data that this call does not pass (or the other way
        round); with another objective, optimizer, learning rate, schedule or scheduler
        (class or settings), training data, seed or ``select_by``; or at a position past this
        call's ``epochs`` / ``num_steps``. Also for a one-shot iterator as training or
        validation data that the fit would read more than once. Every refusal comes before
        the guide is touched: a refused fit leaves it, its fitted state and its calibrated
        temperature as they were (a fit that takes no step keeps the temperature too).

    Notes
    -----
    The fit runs on the device of the model's parameters (``model.to("cuda")`` first): the
    guide is moved there and so is every batch. The keywords of earlier releases
    (``num_steps``, ``device``, ``loss``, ``optimizer``, ``scheduler``, ``warmup``,
    ``val_data``, ``select_by``, ``patience``, ``checkpoint_dir``, ``checkpoint_every``,
    ``resume``, ``overwrite``, ``progress_bar``, ``callback``) still work for one release, with
    a ``DeprecationWarning`` naming the new spelling.
    """
    groups = {"optim": optim, "validation": validation, "checkpoint": checkpoint}
    with contextlib.ExitStack() as stack:
        try:
            loop = _start(stack, model, guide, data, groups, progress, epochs, lr, seed)
        except Exception as err:  # every rank stops with this one (the others wait in run())
            check_ranks_agree(None, err)
            raise
        return loop.run()


def _start(
    stack: contextlib.ExitStack,
    model: Any,
    guide: Any,
    data: Iterable[Any],
    groups: dict[str, Any],
    progress: Progress | bool | None,
    epochs: int | None,
    lr: float | None,
    seed: int | None,
) -> _Loop:
    """:func:`fit`'s checks of its arguments, its checkpoint folder claimed (rank 0) and the
    loop built: everything before the ranks' agreement, whose errors :func:`fit` hands to the
    agreement (:func:`~pyrobayes.infer.fit_checks.check_ranks_agree`) so that under
    ``torch.distributed`` a rank's own error (its data, a folder only rank 0 claims) stops
    every rank instead of leaving them waiting in the agreement's collective."""
    options = _Options.of({**groups, "progress": progress})
    args = validate_fit_arguments(  # plain Python numbers (a NumPy seed passes the checks)
        epochs=epochs,
        num_steps=options.optim.num_steps,
        lr=lr,
        warmup=options.optim.warmup,
        validated=options.validation is not None,
        seed=seed,
    )
    plan = _Plan.of(data, args.epochs, options.optim.num_steps)
    _refuse_one_shot(data, plan, options.validation)
    if options.validation is not None:
        warn_if_training_data(options.validation.data, data)
    # argument errors before anything is touched (begin() resets what a fitter collects)
    check_schedule(options.optim.scheduler, plan.total, options.optim.warmup)
    if options.checkpoint is not None and world()[1] == 0:  # only rank 0 writes
        _claim_folder(stack, options.checkpoint)
    return _Loop(model, guide, data, plan, options, lr=args.lr, seed=args.seed)


def _most_epochs(plan: _Plan) -> int | None:
    """The most epochs ``plan`` starts (``None``: not known before the fit runs)."""
    by_steps = None
    if plan.total is not None and plan.steps_per_epoch:
        by_steps = -(-plan.total // plan.steps_per_epoch)
    known = [n for n in (plan.epochs, by_steps) if n is not None]
    return min(known) if known else None


def _refuse_one_shot(data: Iterable[Any], plan: _Plan, validation: Validation | None) -> None:
    """Refuse a one-shot iterator the fit would read again after using it up: training data
    over several epochs, validation data scored after each of several epochs (the second
    epoch's validation found it empty, after the first epochs had trained)."""
    epochs = plan.epochs
    if isinstance(data, Iterator) and epochs is not None and epochs > 1:
        raise ValueError(
            f"fit(epochs={epochs}): data is a one-shot iterator ({type(data).__name__}), "
            "used up by the first epoch. Pass a list of batches or a DataLoader (which every "
            "epoch iterates afresh), or fit one epoch."
        )
    held_out = validation.data if validation is not None else None
    most = _most_epochs(plan)
    if isinstance(held_out, Iterator) and (most is None or most > 1):
        runs = f"{most} epochs" if most is not None else "an unknown number of epochs"
        raise ValueError(
            f"fit(validation=Validation(data)): the validation data is a one-shot iterator "
            f"({type(held_out).__name__}), which the first epoch's validation uses up, and "
            f"this fit ({budget_text(plan.epochs, plan.num_steps)}) runs {runs}. Pass a list of "
            "batches or a DataLoader (read afresh after every epoch)."
        )


_FLAT_CHECKED = (
    "num_steps",
    "warmup",
    "checkpoint_dir",
    "checkpoint_every",
    "resume",
    "overwrite",
    "patience",
)


class _Options(NamedTuple):
    """The four groups of :func:`fit`, each filled in or ``None`` (off)."""

    optim: Optimization
    validation: Validation | None
    checkpoint: Checkpointing | None
    progress: Progress

    @classmethod
    def of(cls, groups: dict[str, Any]) -> _Options:
        if groups["progress"] is None or isinstance(groups["progress"], bool):
            groups = {**groups, "progress": Progress(bar=groups["progress"])}
        kinds = {"optim": Optimization, "validation": Validation}
        kinds.update(checkpoint=Checkpointing, progress=Progress)
        for name, kind in kinds.items():
            if groups[name] is not None and not isinstance(groups[name], kind):
                raise TypeError(
                    f"fit({name}=...) takes a pyrobayes.{kind.__name__}; got "
                    f"{type(groups[name]).__name__}."
                )
        optim = groups["optim"] or Optimization()
        return cls(optim, groups["validation"], groups["checkpoint"], groups["progress"])


def _claim_folder(stack: contextlib.ExitStack, checkpoint: Checkpointing) -> None:
    """Lock the checkpoint folder, refuse another run's checkpoint, remove leftovers."""
    folder = checkpoint.path
    _check_folder_path(checkpoint)
    stack.enter_context(CheckpointLock(folder))
    if not checkpoint.resume and not checkpoint.overwrite and holds_run(folder):
        raise FileExistsError(
            f"{folder} holds the checkpoint of another run ({latest(folder)}). Pass "
            "Checkpointing(..., resume=True) to continue it, overwrite=True to replace it, or "
            "another folder."
        )
    removed = clean(folder)
    if removed:
        logger.info("Removed what an interrupted fit left in %s: %s", folder, removed)


def _check_folder_path(checkpoint: Checkpointing) -> None:
    """Refuse a checkpoint folder that is a file or lies below one (the folder could not be
    created: the OS error alone does not say it is the checkpoint folder)."""
    folder = checkpoint.path
    for path in (folder, *folder.parents):
        if not path.exists():
            continue
        if path.is_dir():
            return
        where = "is a file" if path == folder else f"lies below the file {path}"
        raise NotADirectoryError(
            f"fit(checkpoint=Checkpointing(dir={str(checkpoint.dir)!r})): the checkpoint "
            f"folder {folder} {where}, so it cannot be created there. Pass a folder path for "
            "the checkpoints (created if missing), e.g. Checkpointing(dir='runs/ckpt')."
        )


def _warn_if_no_epoch_ends(plan: _Plan) -> None:
    """Warn when a validated fit's step budget ends inside its first epoch: validation (and
    its selection and patience) runs at epoch ends, so it would never run."""
    per_epoch, total = plan.steps_per_epoch, plan.total
    if per_epoch and total is not None and 0 < total < per_epoch:
        warnings.warn(
            f"fit: num_steps={total} ends the fit inside its first epoch ({per_epoch} steps), "
            "and validation= runs at epoch ends, so no epoch is scored or selected and "
            "patience never acts. Give at least one epoch's steps, or drop validation=.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _warn_if_rate_zero(optimizer: Any, plan: _Plan) -> None:
    """Warn when every parameter group steps at rate 0 (before any schedule) in a fit that
    plans steps: nothing would move, and the fit would report the losses of its start."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups or plan.total == 0:
        return
    rates = [g.get("initial_lr", g.get("lr")) for g in groups]
    if all(isinstance(r, (int, float)) and r == 0 for r in rates):
        warnings.warn(
            "fit: the learning rate is 0 (lr=0, or an optimizer built so), so no parameter "
            "moves and the guide stays as it starts. Pass lr > 0 (or leave lr out: the "
            "family's default).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


class _Loop(ResumeChecks):
    """One call of :func:`fit`: its arguments checked and its checkpoint folder locked."""

    def __init__(
        self,
        model: Any,
        guide: Any,
        data: Iterable[Any],
        plan: _Plan,
        options: _Options,
        *,
        lr: float | None,
        seed: int | None,
    ) -> None:
        self.model, self.guide, self.data, self.plan = model, guide, data, plan
        self.device, self.seed = _device_of(model), seed
        self.validation, self.progress = options.validation, options.progress
        self.ckpt = options.checkpoint.path if options.checkpoint is not None else None
        self.resume = options.checkpoint is not None and options.checkpoint.resume
        self.every = options.checkpoint.every if options.checkpoint is not None else None
        self.selection = (
            Selection(options.validation.data, options.validation.select_by)
            if options.validation is not None
            else None
        )
        likelihood = getattr(model, "likelihood", None)
        if self.selection is not None and likelihood is not None:  # before the first epoch
            classification = bool(getattr(likelihood, "is_classification", True))
            check_select_by(self.selection.select_by, classification=classification)
        if seed is not None:
            pyro.set_rng_seed(seed)
        if self.device is not None:
            guide.to(self.device)
        # nothing the guide holds changes before every refusal is past (run(): held.settle)
        self.held = _HeldTemperature(guide)
        try:
            self.fitter, self.sched = self._prepare(options.optim, lr)
            self._check_fitter()
        except BaseException:
            self.held.put_back()
            raise
        self.lr = self.fitter.lr  # the family's default where none was given
        self.rate_source = find_rate_source(options.optim.optimizer)
        self.pos = _Position(data_seed=seed)
        # every rank takes part in a checkpoint (its outcome's gather); rank 0 alone writes it
        self.checkpoints = self.ckpt is not None
        self.write = self.checkpoints and world()[1] == 0
        self.show = self.progress.show_bar and world()[1] == 0
        self.reporter = (
            self.fitter.objective if implements(self.fitter.objective, ReportsTerms) else None
        )
        self.terms: dict[str, list[torch.Tensor]] = {}
        self.divergence = Divergence(self.lr)
        self.data_size = DataSize(model, guide)
        self.stopped_early = False
        self.last_batch: Any = None  # the last batch stepped on (a checkpoint's digest)

    def _check_fitter(self) -> None:
        """The refusals and warnings that need the fitter (before it begins)."""
        fitter, plan, data = self.fitter, self.plan, self.data
        if isinstance(data, Iterator) and fitter.reads_data_at_end and plan.epochs != 0:
            raise ValueError(
                f"fit(): data is a one-shot iterator ({type(data).__name__}), and "
                f"{type(fitter).__name__} reads the training data again after training "
                "(the curvature pass), when training has used it up. Pass a list of batches "
                "or a DataLoader."
            )
        _warn_if_rate_zero(fitter.optimizer, plan)
        if self.selection is not None:
            _warn_if_no_epoch_ends(plan)
        if self.selection is not None and fitter.collects_trajectory:
            warnings.warn(
                f"fit: validation= selects an epoch and restores the guide's state there, so "
                f"the {type(self.guide).__name__}'s moments collected after the selected epoch "
                "are dropped (and an early stop ends the collection). To keep every collected "
                "iterate, fit it without validation= and choose its start_epoch instead.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _prepare(self, optim: Optimization, lr: float | None) -> tuple[Fitter, Any]:
        """Set up the guide, build the fitter and the schedule (the fitter begins, which resets
        what a post-hoc family collected, only once every refusal is past: :meth:`run`)."""
        model, guide = self.model, self.guide
        model.train(True)
        # before the set-up trace: a guide of another model (the plain network, say) fails in
        # it with an error of torch's
        check_guide_model(model, guide, "fit")
        if not guide.sites:  # a guide over a plain Pyro model sets up from its first batch
            self._set_up()
        fitter = make_fitter(model, guide, loss=optim.loss, optimizer=optim.optimizer, lr=lr)
        if optim.scheduler is not None and fitter.manages_lr:
            raise ValueError(
                f"fit(optim=Optimization(scheduler={optim.scheduler!r})) with "
                f"{type(fitter).__name__}, which schedules the learning rate itself "
                "(pb.infer.SWAG(swa_lr=...)). Pass one of the two."
            )
        validation = self.validation
        fitter.validation_data = validation.data if validation is not None else None
        spec, warmup = optim.scheduler, optim.warmup
        if spec is None and not fitter.manages_lr:  # the family's own (IVON: cosine)
            spec = fitter.default_scheduler
            warmup = warmup or (fitter.default_warmup if spec is not None else 0)
            if spec is not None and self.plan.total is None:
                logger.info(
                    "fit: %s's default %r schedule needs the run's length (epochs with a "
                    "data loader that has a length, or num_steps); the rate stays constant.",
                    type(fitter).__name__,
                    spec,
                )
                spec, warmup = None, 0
        if optim.warmup:  # the user's warm-up (a family's default may round to 0 silently)
            warn_if_no_warmup_step(spec, self.plan.total, warmup)
        sched = make_scheduler(spec, fitter.optimizer, self.plan.total, warmup)
        self.schedule_record = None if sched is None else [qualified_name(spec), float(warmup)]
        # taken as built, before a step moves them (a resume compares them: _check_run)
        self.scheduler_record = record_scheduler(sched)
        self.objective_record = record_objective(fitter.objective)
        return fitter, sched

    def _set_up(self) -> None:
        """Set up a guide over a plain Pyro model from the first batch; a guide built on a
        plain torch network (no FineTuneModel, no Pyro model) is refused naming it."""
        first = to_device(next(iter(self.data)), self.device)
        try:
            with pyro.poutine.block(), pyro.poutine.trace():
                self.guide(first)
        except Exception as err:
            traced = bound_model(self.guide)
            if not _plain_network(traced):
                raise
            raise TypeError(
                f"fit(model, guide): the {type(self.guide).__name__} was built on a plain torch "
                f"network ({type(traced).__name__}), not on a pyrobayes FineTuneModel, so it "
                "has no latent sites and tracing it on a batch failed "
                f"({type(err).__name__}: {err}). Wrap the network first: "
                "model = pb.models.FineTuneModel(net, adapter, num_data=N), then build the "
                "guide on it, guide = pb.posterior(model, family), and fit the two."
            ) from err

    # ------------------------------------------------------------------ the run
    def run(self) -> FitResult:
        try:  # every refusal before the guide changes (a refused fit leaves it as it was)
            found = self._agreed_resume()  # (the checkpoint's posterior fits the guide too)
        except BaseException:
            self.held.put_back()
            raise
        with contextlib.ExitStack() as ends:  # the data order, the bar, the lower-block cache
            try:
                before = self._begin(found, ends)
            except Exception as err:  # every rank stops with this one (the others wait below)
                check_ranks_started(err)
                raise
            check_ranks_started()  # (once per fit: the steps gather nothing)
            if world()[0] > 1:
                broadcast_(self.fitter.broadcast_tensors())
            self._epochs()
        # rank 0 wrote the last checkpoint: no rank returns (and, say, resumes from the folder
        # in its next fit) before the write is complete
        barrier()
        result = self._result()  # (the fitter's end: Laplace's MAP refits may train the head)
        fitter = self.fitter  # a 0-step fit still fits Laplace (at a MAP) and SWAG (one iterate)
        if self.pos.step > 0 or fitter.reads_data_at_end or fitter.collects_trajectory:
            record_fitted_head(self.guide, self.model)  # what predict checks the head against
        else:  # nothing was fitted: the guide is what it was (never fitted stays never fitted)
            restore_fitted_head(self.guide, before)
            warnings.warn(
                f"fit: no optimizer step was taken (epochs={self.plan.epochs}, "
                f"num_steps={self.plan.num_steps}), so the {type(self.guide).__name__} is "
                "unchanged. Give it epochs >= 1 (a post-hoc Laplace fits at epochs=0).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        return result

    def _begin(self, found: Path | None, ends: contextlib.ExitStack) -> Any:
        """Begin the agreed fit: the fitter begins, the checkpoint ``found`` is loaded, the
        data order, the bar and the lower-block cache are set up (undone by ``ends``); returns
        the guide's fitted head before (:meth:`run`'s). A rank's error here reaches the others
        through :meth:`run`'s gather (:func:`~pyrobayes.infer.fit_checks.check_ranks_started`),
        before any collective of the fit's: nothing here is one."""
        try:  # the fitter's own refusals (Laplace's settings) come before its reset, which
            # begins the fit: the temperature stays held until then
            self.fitter.begin(self.data)  # (resets what a post-hoc family collected)
        except BaseException:
            self.held.put_back()
            raise
        before = forget_fitted_head(self.guide)  # the head is this fit's to train until it ends
        self.held.settle(changes=found is not None or self._changes_guide())
        if found is not None:
            self._resume(found)
        pos = self.pos
        # (a list or tuple of batches draws nothing: no data seed, as before)
        if pos.data_seed is None and not isinstance(self.data, (list, tuple)):
            pos.data_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self.order = DataOrder(self.data, 0 if pos.data_seed is None else pos.data_seed)
        ends.callback(self.order.restore)
        self.bar = tqdm(
            total=self.plan.total,
            initial=pos.step,
            disable=not self.show,
            desc=type(self.guide).__name__,
        )
        ends.callback(self.bar.close)
        self.start = time.perf_counter()
        # (it reads only the frozen blocks below the adapted ones, which the broadcast of the
        # guide's and trainable parameters leaves alone)
        self.order.read(ends.enter_context, self._lower_block_cache())
        self.order.end_reads()  # (the read-ahead's streams: each epoch seeds its own)
        return before

    def _changes_guide(self) -> bool:
        """Whether a new fit changes the guide: it plans a step, or its family fits at its end
        (Laplace's curvature) or collects an iterate there (SWAG) at zero epochs too."""
        plan, fitter = self.plan, self.fitter
        no_step = plan.total == 0 or plan.epochs == 0 or plan.num_steps == 0
        return not no_step or fitter.reads_data_at_end or fitter.collects_trajectory

    def _lower_block_cache(self) -> contextlib.AbstractContextManager[None]:
        """A FineTuneModel's cache of its frozen lower blocks over the training and validation
        data, for a fit planned to pass the data at least twice (the cache's one pass over it
        costs about what one epoch's lower blocks do; the same plan on resume, the same choice)."""
        caching = getattr(self.model, "caching_lower_blocks", None)
        plan = self.plan
        if not callable(caching) or not plan.total or not plan.steps_per_epoch:
            return contextlib.nullcontext()
        if plan.total < 2 * plan.steps_per_epoch:
            return contextlib.nullcontext()
        # it reads the data ahead, in an order of its own: no draw from the loader's
        # generators (which every epoch replaces and the end of the fit restores)
        self.order.set_epoch(-1)
        return caching(self.data, self.fitter.validation_data)

    def _epochs(self) -> None:
        """Epochs (or their remainder) until the plan, or the early-stopping rule, ends."""
        plan, pos = self.plan, self.pos
        while (plan.epochs is None or pos.epoch < plan.epochs) and (
            plan.num_steps is None or pos.step < plan.num_steps or self._end_may_be_pending()
        ):
            if self._stops_early():
                return
            if not self._batches_done():  # else: resumed after the last batch, before the end
                try:
                    trained_on = self._train_epoch()
                finally:
                    self.order.end_reads()
                self.data_size.finish(trained_on)  # the first epoch's count, checked once
                if not trained_on:  # num_steps reached inside the epoch
                    if self.checkpoints and pos.saved_at != pos.step:
                        self._checkpoint(epoch_end_done=False)
                    return
            self._end_epoch()

    def _batches_done(self) -> bool:  # all batches of the epoch done, its end work not
        per_epoch, done = self.plan.steps_per_epoch, self.pos.in_epoch
        return done > 0 and per_epoch is not None and done >= per_epoch

    def _end_may_be_pending(self) -> bool:  # ... or maybe so (an iterable without a length)
        per_epoch, done = self.plan.steps_per_epoch, self.pos.in_epoch
        return done > 0 and (per_epoch is None or done >= per_epoch)

    def _stops_early(self) -> bool:
        """The early-stopping rule, decided between epochs from the (checkpointed) history."""
        validation, selection = self.validation, self.selection
        if selection is None or validation is None or self.pos.in_epoch != 0:
            return False
        if not selection.exhausted(validation.patience):
            return False
        self.stopped_early = True
        logger.info(
            "fit: stopped early after epoch %d (%d epochs without a better %s)",
            self.pos.epoch - 1,
            validation.patience,
            selection.select_by,
        )
        return True

    def _train_epoch(self) -> bool:
        """The epoch's remaining batches; ``False`` when ``num_steps`` ended the fit in it."""
        pos, num_steps, per_epoch = self.pos, self.plan.num_steps, self.plan.steps_per_epoch
        self.order.set_epoch(pos.epoch)
        seen = 0
        for batch in self._fetched():
            seen += 1
            if batch is _UNFETCHED:  # this rank's error, kept: the step shares NaN, all stop
                self._step(None)
            if pos.epoch == 0:
                self.data_size.see(batch)
                if seen == 1 and pos.step == 0:  # a fresh fit's first batch
                    try:
                        check_first_batch(self.model, self.fitter, batch)
                    except Exception as error:  # one rank's: its step shares NaN, all stop
                        keep_for_ranks(error)
            if seen <= pos.in_epoch:  # resumed mid-epoch: done already
                if seen == pos.in_epoch:
                    self._check_replayed(batch)
                continue
            if num_steps is not None and pos.step >= num_steps:
                return False
            # a fresh fit's first step: the modules whose output its gradient never reaches
            with watching_reach(self.model) if pos.step == 0 else contextlib.nullcontext():
                self._step(batch)
            if num_steps is not None and pos.step >= num_steps and per_epoch is not None:
                if pos.in_epoch < per_epoch:  # ends inside the epoch: no next batch to fetch
                    return False
        if seen == 0 and pos.in_epoch == 0:
            if pos.epoch > 0 and isinstance(self.data, Iterator):
                raise ValueError(
                    f"fit(): data yielded no batches in epoch {pos.epoch}: it is a one-shot "
                    f"iterator ({type(self.data).__name__}) that epoch 0 used up. Pass a list "
                    "of batches or a DataLoader."
                )
            raise ValueError("fit(): data yielded no batches.")
        if seen < pos.in_epoch:
            raise ValueError(
                f"fit(): data yielded {seen} batches in epoch {pos.epoch}, but the "
                f"checkpoint resumed from records {pos.in_epoch} done in it. Resume with the "
                "data the run was started with."
            )
        return True

    def _fetched(self) -> Iterator[Any]:
        """The data's batches. Under ``torch.distributed`` an error fetching one on this rank
        (an unreadable file of its shard) is kept and :data:`_UNFETCHED` is yielded, whose step
        shares NaN in the step's all-reduce, so every rank stops with that error
        (:mod:`~pyrobayes.infer.rank_errors`); in one process it is raised as it is.

        With a ``len()`` (every rank's the same: :func:`check_ranks_agree`) the read that ends
        the epoch is made under ``torch.distributed`` before the epoch's last step
        (:meth:`_check_ended`), and data that end before their ``len()`` are this rank's error:
        made after the last step, that read's error (or a rank's data ending early) left the
        other ranks past the epoch's end, in another collective, until gloo's timeout. Without a
        ``len()`` the ranks check that their data ended together where each one's ended, and
        where the step budget is spent (:func:`~pyrobayes.infer.rank_errors.check_ended_together`).

        Every read is made on the data's own random streams (:meth:`DataOrder.read`).
        """
        size, read = world()[0], self.order.read
        per_epoch = self.plan.steps_per_epoch if size > 1 else None
        unsized = size > 1 and self.plan.steps_per_epoch is None
        batches, fetched = read(iter, self.data), 0
        while True:
            if unsized and self._budget_spent(fetched):
                yield from self._read_past_budget(batches, fetched)
                return
            try:
                batch = read(next, batches)
            except StopIteration:
                if unsized:
                    check_ended_together(fetched, self.pos.epoch, device=self._share_device())
                if per_epoch is None or fetched >= per_epoch:
                    return
                keep_for_ranks(ValueError(_ended_early(fetched, per_epoch, self.pos.epoch)))
                yield _UNFETCHED
                return
            except Exception as error:
                keep_for_ranks(error)
                yield _UNFETCHED
                return
            fetched += 1
            if fetched == per_epoch:  # the epoch's last batch: its end read before its step
                self._check_ended(batches, per_epoch)
                yield batch
                return
            yield batch

    def _budget_spent(self, fetched: int) -> bool:
        """Whether the step budget is spent once ``fetched`` batches of the epoch are read (the
        ones a resume skips aside)."""
        num_steps, pos = self.plan.num_steps, self.pos
        return num_steps is not None and pos.step >= num_steps and fetched >= pos.in_epoch

    def _read_past_budget(self, batches: Iterator[Any], fetched: int) -> Iterator[Any]:
        """The read past a spent step budget, under ``torch.distributed`` without ``len()``: a
        batch (yielded, then :meth:`_train_epoch` ends the fit inside the epoch) or the
        epoch's end (its end work follows). The ranks check that they agree
        (:func:`~pyrobayes.infer.rank_errors.check_ended_together`): a rank that went to its
        epoch's end work would wait there for ranks that ended the fit."""
        try:
            batch, error = self.order.read(next, batches, _UNFETCHED), None
        except Exception as err:
            batch, error = _UNFETCHED, err
        more = batch is not _UNFETCHED
        epoch, device = self.pos.epoch, self._share_device()
        check_ended_together(fetched, epoch, more=more, error=error, device=device)
        if more:
            yield batch

    def _share_device(self) -> torch.device | None:
        """Where a step shares its loss (the fitter's parameters' device)."""
        params = self.fitter.params
        return params[0].device if params else None

    def _check_replayed(self, batch: Any) -> None:
        """A resumed epoch's last batch skipped: warn when it is not the one the interrupted
        run took last (:meth:`DataOrder.warn_if_replay_differs`; rank 0's data only, whose
        batch the checkpoint records)."""
        pos = self.pos
        recorded, pos.replayed = pos.replayed, None
        if recorded is None or world()[1] != 0 or batch_digest(batch) == recorded:
            return
        self.order.warn_if_replay_differs(self.data, pos.epoch, pos.in_epoch)

    def _check_ended(self, batches: Iterator[Any], per_epoch: int) -> None:
        """The read that should end the epoch after its ``per_epoch`` batches, under
        ``torch.distributed``: an error it raises, or a batch past ``len()``, is kept for the
        epoch's last step (:func:`~pyrobayes.infer.rank_errors.keep_for_ranks`)."""
        try:
            extra = self.order.read(next, batches, _UNFETCHED)
        except Exception as error:
            keep_for_ranks(error)
            return
        if extra is not _UNFETCHED:
            keep_for_ranks(
                ValueError(
                    f"fit(): this rank's data yielded more than the {per_epoch} batches its "
                    f"len() gives per epoch (epoch {self.pos.epoch}); under torch.distributed "
                    "every rank takes len() steps an epoch, all-reduced over the ranks. Make "
                    "len() count the batches the data yield."
                )
            )

    def _step(self, batch: Any) -> None:
        """One optimizer step and its bookkeeping."""
        pos = self.pos
        try:
            value = self.fitter.step(to_device(detached(batch), self.device))
        except FloatingPointError as err:
            # the generic advice only where the fitter's message gives none of its own (IVON's
            # names hess_init, a mean-field scale has no say there)
            advice = (
                "" if "lower" in str(err).lower() else " Lower the learning rate or the init_scale"
            )
            kept = f" The last checkpoint in {self.ckpt} is intact." if self.ckpt else ""
            raise FloatingPointError(
                f"{err} (fit step {pos.step}, epoch {pos.epoch}).{advice}{kept}"
            ) from None
        pos.losses.append(value)
        self.last_batch = batch  # (a reference: its digest is taken by a checkpoint only)
        if self.reporter is not None:  # kept as tensors: no device sync per step
            for name, term in self.reporter.terms().items():
                self.terms.setdefault(name, []).append(term)
        pos.step += 1
        pos.in_epoch += 1
        if self.sched is not None:
            self.sched.step()
        self.divergence.see(pos.losses, pos.step)
        if self.show:
            self._show()
        if self.progress.callback is not None:
            self.progress.callback(pos.step, value)
        if self.checkpoints and self.every and pos.step % self.every == 0:
            self._checkpoint(epoch_end_done=False)

    def _show(self) -> None:
        """Advance the bar; every 1/20 of the run, its running averages."""
        bar, losses, step = self.bar, self.pos.losses, self.pos.step
        bar.update(1)
        if step % max(1, (self.plan.total or 100) // 20) != 0:
            return
        width = max(1, len(losses) // 10)  # the running window: the last tenth
        window = losses[-width:]
        extra = {k: f"{v:.3g}" for k, v in self.fitter.report().items()}
        bar.set_postfix(init=f"{losses[0]:.4g}", avg=f"{sum(window) / len(window):.4g}", **extra)
        if self.terms:
            shown = ", ".join(
                f"{name}={float(torch.stack(v[-width:]).mean()):.4g}"
                for name, v in self.terms.items()
            )
            bar.set_postfix_str(f"{bar.postfix}, {shown}" if bar.postfix else shown)

    def _end_epoch(self) -> None:
        """The epoch's end work (also where a run killed after its last step resumes)."""
        pos = self.pos
        self.fitter.epoch_end(pos.epoch)
        if self.selection is not None:
            measured = self.selection.score(self.model, self.guide, pos.epoch)
            logger.info("epoch %d validation: %s", pos.epoch, measured)
        pos.epoch += 1
        pos.in_epoch = 0
        if self.checkpoints:
            self._checkpoint(epoch_end_done=True)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, epoch_end_done: bool) -> None:
        """Rank 0 writes a checkpoint (:meth:`_write_checkpoint`); under ``torch.distributed``
        every rank then learns its outcome in one gather, so a failed write (a full disk, a
        permission error) stops every rank with rank 0's error instead of leaving the others
        in the next step's all-reduce (:func:`~pyrobayes.infer.fit_checks.check_checkpoint_written`).
        A failed write leaves the folder's last checkpoint as it was (:func:`save_checkpoint`)."""
        try:
            if self.write:
                with self.order.outside_reads():  # (the fit's own states: a resume replays)
                    self._write_checkpoint(epoch_end_done)
        except Exception as err:
            check_checkpoint_written(err)
            raise
        check_checkpoint_written()
        self.pos.saved_at = self.pos.step

    def _write_checkpoint(self, epoch_end_done: bool) -> None:
        pos, selection = self.pos, self.selection
        meta = {
            "step": pos.step,
            "epoch": pos.epoch,
            "batch": pos.in_epoch,
            "epoch_end_done": epoch_end_done,
            "data_seed": pos.data_seed,
            # the epoch's last batch taken, which a resume compares with the one it replays
            "batch_sha256": batch_digest(self.last_batch) if pos.in_epoch else None,
            "losses": pos.losses,
            "validation": selection.history if selection is not None else [],
            "validation_data": self._val_fingerprint(),
            "lr": self.lr,
            # the steps the schedule spans (its shape depends on them): None without one
            "schedule_steps": self.plan.total if self.sched is not None else None,
            # the run's budget, named when a resume asks for less than the position
            "budget": {"epochs": self.plan.epochs, "num_steps": self.plan.num_steps},
            "run": self._run_record(),
        }
        best = selection.best if selection is not None else None
        if self.ckpt is None:  # called only when writing checkpoints
            raise RuntimeError("fit(): no checkpoint folder to write to.")
        save_checkpoint(self.ckpt, self.guide, self.model, self.fitter, meta, best, self.sched)

    def _resume(self, found: Path) -> None:
        """Continue from the checkpoint ``found`` (:meth:`_checked_resume`'s)."""
        meta, saved_best = load_checkpoint(
            found,
            self.guide,
            self.model,
            self.fitter,
            self.sched,
            steps_per_epoch=self.plan.steps_per_epoch,
            check_base=False,  # compared by _checked_resume's check_posterior, before begin
        )
        pos = self.pos
        pos.step, pos.epoch, pos.losses = meta["step"], meta["epoch"], list(meta["losses"])
        if "batch" in meta:
            pos.in_epoch = meta["batch"]
        elif self.plan.steps_per_epoch:  # the earlier layout: derived from the step
            pos.in_epoch = pos.step - pos.epoch * self.plan.steps_per_epoch
        pos.data_seed = meta.get("data_seed", pos.data_seed)
        pos.replayed = meta.get("batch_sha256") if pos.in_epoch else None
        pos.saved_at = pos.step
        if self.selection is not None:
            self.selection.best = saved_best
            self.selection.history = list(meta.get("validation", []))
        logger.info("Resumed from %s at step %d (epoch %d)", found, pos.step, pos.epoch)

    def _agreed_resume(self) -> Path | None:
        """:meth:`_checked_resume`, then, under ``torch.distributed``, the ranks' agreement
        (:func:`~pyrobayes.infer.fit_checks.check_ranks_agree`, the fit's first collective): a
        rank's refusal or error here or before (:func:`fit`) stops every rank, and so do ranks
        whose fits differ (:meth:`_rank_record`: their batches per epoch first)."""
        try:
            found = self._checked_resume()
            record = self._rank_record(found)
            self.fitter.check_begin()  # its refusals before any rank begins (resets its guide)
        except Exception as err:
            check_ranks_agree(None, err)
            raise
        check_ranks_agree(record)
        return found

    def _rank_record(self, found: Path | None) -> dict[str, Any] | None:
        """What every rank of a distributed fit must share (``None`` in one process): the run
        record but its seed and data (each rank's own shard), the family, fitter, settings,
        rate and budget, the step it resumes from (0: a new fit) and its checkpoints (whether
        it writes any, and every how many steps: every rank gathers each one's outcome)."""
        if world()[0] == 1:
            return None
        run = self._run_record()
        run.pop("seed", None)
        run.pop("training_data", None)
        step = json.loads((found / "state.json").read_text())["step"] if found else 0
        per_epoch = self.plan.steps_per_epoch
        return {
            BATCHES_PER_EPOCH: -1 if per_epoch is None else per_epoch,
            "guide": type(self.guide).__name__,
            "fitter": type(self.fitter).__name__,
            "settings": repr(self.fitter.settings),
            "lr": self.lr,
            "epochs": self.plan.epochs,
            "num_steps": self.plan.num_steps,
            "the step resumed from": step,
            # every rank gathers rank 0's outcome of each checkpoint: the same ones on every rank
            "checkpoints (written, every)": [self.checkpoints, self.every],
            **run,
        }

    # ------------------------------------------------------------------ the result
    def _result(self) -> FitResult:
        model, guide, fitter, pos, selection = (
            self.model,
            self.guide,
            self.fitter,
            self.pos,
            self.selection,
        )
        best_epoch = selection.restore_best(model, guide) if selection is not None else None
        if best_epoch is not None and selection is not None:
            logger.info(
                "fit: restored the best validated epoch %d (%s)", best_epoch, selection.select_by
            )
        if fitter.reads_data_at_end:  # a post-hoc fit of no epoch: its pass is checked here
            self.data_size.count_pass(self.data)
        fitter.end(self.data)
        for p in fitter.params:  # the last step's gradients: memory, and stale for a later
            p.grad = None  # optimizer (Pyro's SVI on the guide would step them)
        if best_epoch is None:  # a restored epoch is not the run's last q
            warn_if_fit_given_back(self.terms, model)
        model.train(False)
        elapsed = time.perf_counter() - self.start
        final = pos.losses[-1] if pos.losses else float("nan")
        logger.info("fit: %d steps in %.1fs, final loss %.4g", pos.step, elapsed, final)
        state = {
            "step": pos.step,
            "epoch": pos.epoch,
            "elapsed": elapsed,
            "objective": type(fitter.objective).__name__,
            "fitter": type(fitter).__name__,
            **fitter.report(),
        }
        if self.reporter is not None:
            dtype = torch.get_default_dtype()
            state["terms"] = {
                name: torch.stack([t.detach() for t in v]).to("cpu", dtype)
                for name, v in self.terms.items()
            }
        if selection is not None:
            state.update(
                best_epoch=best_epoch,
                validation=selection.history,
                stopped_early=self.stopped_early,
            )
        return FitResult(guide, torch.tensor(pos.losses), state)
