"""The checks :func:`pyrobayes.fit` makes of a running fit, each a warning with its remedy.

- :class:`Divergence`: the loss rose far above its first value (``DivergenceWarning``);
- :func:`warn_if_fit_given_back`: an ELBO's data term climbed back towards its start;
- :class:`DataSize`: the first epoch's examples against the model's ``num_data``;
- :func:`check_first_batch`: the likelihood's and the fitter's checks of the first batch;
- :func:`watching_reach`: around a fresh fit's first step, the modules holding latent sites or
  trained parameters whose output the loss's gradient never reaches;
- :func:`check_ranks_agree`: under ``torch.distributed``, every rank runs the same fit (or
  every rank stops with the one that refused it);
- :func:`check_ranks_started`: ... and every rank stops with one that failed after that
  agreement, before the first step;
- :func:`check_checkpoint_written`: ... and with rank 0 when it failed to write a checkpoint;
- :func:`gather_rank_errors`: the one gather behind them (and Laplace's curvature pass).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as torch_dist

from ..batch import batch_size, check_not_meta, split_batch
from ..user_frame import user_stacklevel
from .distributed import world

logger = logging.getLogger("pyrobayes.infer.loop")  # the fit's log, as before the split

__all__ = [
    "BATCHES_PER_EPOCH",
    "DataSize",
    "Divergence",
    "DivergenceWarning",
    "check_checkpoint_written",
    "check_first_batch",
    "check_ranks_agree",
    "check_ranks_started",
    "gather_rank_errors",
    "warn_if_fit_given_back",
    "watching_reach",
]


class DivergenceWarning(RuntimeWarning):
    """A fit whose loss rose far above its first value: the learning rate is likely too high."""


#: A fit diverges when the median loss of the last ``_WINDOW`` steps exceeds its first loss by
#: ``_RISE`` times that loss's magnitude (three orders of magnitude; at least ``_RISE`` nats
#: for a loss that starts within 1 of zero): a descent method lowers the objective on average,
#: so a rise this large means steps overshoot (the classic sign of a too-large step size,
#: Goodfellow, Bengio & Courville, 2016, sec. 8.5), whereas the noise of a stochastic objective
#: (a minibatch, one Monte-Carlo draw) moves it by fractions of itself. The median of a window
#: ignores a single spike.
_RISE, _WINDOW = 1e3, 10


class Divergence:
    """Watches the step losses for divergence; warns once (logged and ``DivergenceWarning``).

    One comparison per step; the median is taken only once the cheap bound is crossed.
    """

    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.limit: float | None = None
        self.warned = False

    def see(self, losses: list[float], step: int) -> None:
        if self.warned:
            return
        if self.limit is None:
            self.limit = losses[0] + _RISE * max(abs(losses[0]), 1.0)
        if losses[-1] <= self.limit or len(losses) < _WINDOW:
            return
        recent = sorted(losses[-_WINDOW:])
        median = recent[_WINDOW // 2]
        if median <= self.limit:
            return
        self.warned = True
        message = (
            f"fit: the loss is diverging: the median of steps {step - _WINDOW + 1}..{step} is "
            f"{median:.4g}, over {_RISE:.0e} times the first step's {losses[0]:.4g}. Lower "
            f"the learning rate (lr={self.lr:g} now)."
        )
        logger.warning(message)
        warnings.warn(message, DivergenceWarning, stacklevel=user_stacklevel())


#: The ELBO's data term gave its fit back when its mean over the last tenth of the run is more
#: than ``_GIVEN_BACK`` of the way from its lowest tenth back to its first, at least
#: ``_MIN_RISE`` nats and ``_NUM_SE`` standard errors above the lowest tenth (the difference of
#: two tenths' means of w per-step values has standard error sqrt(s_last² + s_low²)/sqrt(w),
#: s the per-step sd in each; 4 of them leave about 3e-5 to a Gaussian fluctuation): the
#: optimiser, which lowers ``nll + kl`` on average, then bought KL with the data fit (σ growing
#: towards the prior), which minibatch and Monte-Carlo noise do not explain.
_GIVEN_BACK, _MIN_RISE, _NUM_SE = 0.5, 0.1, 4.0


def warn_if_fit_given_back(terms: dict[str, list[torch.Tensor]], model: Any) -> None:
    """Warn when the ELBO's expected NLL per example rose back towards its start (rank 0)."""
    if "nll" not in terms or "kl" not in terms or world()[1] != 0 or len(terms["nll"]) < 20:
        return  # (20 steps: two per tenth, the fewest that give each tenth a spread)
    nll = torch.stack(terms["nll"]).detach().double().cpu()
    width = len(nll) // 10
    tenths = nll[: 10 * width].reshape(10, width)
    means = tenths.mean(1)
    lowest = int(means.argmin())
    first, low, last = float(means[0]), float(means[lowest]), float(means[-1])
    spread = float((tenths[-1].var() + tenths[lowest].var()).div(width).sqrt())
    if last - low < max(_MIN_RISE, _GIVEN_BACK * (first - low), _NUM_SE * spread):
        return
    kl = float(torch.stack(terms["kl"][-width:]).mean())
    sites = getattr(model, "latent_sites", {})
    latent = sum(int(torch.Size(spec.shape).numel()) for spec in sites.values())
    num_data = getattr(model, "num_data", "?")
    message = (
        f"fit(): the ELBO's data term (expected NLL per example) rose from its lowest {low:.3g} "
        f"back to {last:.3g} by the end of the fit (it started at {first:.3g}): q's scales grew "
        f"to pay less KL(q ‖ p)/N (now {kl:.3g}) at the data's expense, and its draws blur "
        f"the network's output. At this prior, {latent} latent values for N = {num_data} "
        "examples cost more KL than the data term can pay back. Make "
        "fewer values latent (LoRA(latent='A'), LoRA-XS cores), temper the KL "
        "(optim=pb.Optimization(optimizer=pb.infer.MeanField(kl_weight=0.1))), or stop "
        "earlier on held-out data (validation=pb.Validation(...))."
    )
    logger.warning(message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


class DataSize:
    """Counts the examples of the first epoch against the model's ``num_data``; warns once.

    ``num_data`` is N, the size of the training set: every family weighs its prior (the MAP's
    ``log p(θ)``, the ELBO's ``KL(q ‖ p)``) as ``1/N`` of a minibatch's mean log-likelihood.
    A pass over the data that yields more than N examples (``R·n`` over R ranks, where a
    ``DistributedSampler`` pads each rank to ``ceil(N/R)``, so up to ``N + R − 1``) means N is
    too small: typically the batch size passed as ``num_data``, which makes the prior weigh
    ``R·n/N`` times too much and the posterior that much too wide, with no error anywhere
    else (a batch is refused only when it alone exceeds N).
    """

    def __init__(self, model: Any, guide: Any = None) -> None:
        num_data = getattr(model, "num_data", None)
        self.num_data = num_data if isinstance(num_data, int) else 0  # 0: nothing to check
        #: an IVON guide's ``ess`` set apart from ``num_data``: its prior's weight, 1/ess, in
        #: num_data's place (None: the prior weighs 1/num_data)
        ess: Any = getattr(guide, "ess", None)
        given = isinstance(ess, (int, float)) and 0 < ess != self.num_data
        self.ess: float | None = float(ess) if given else None
        self.label_key: str = getattr(model, "label_key", "labels")
        self.size, self.rank = world()
        self.count = 0
        self.done = not (self.num_data or self.ess)

    def see(self, batch: Any) -> None:
        if self.done:
            return
        try:
            self.count += batch_size(split_batch(batch, self.label_key)[0])
        except TypeError:  # a batch whose size cannot be told: no check
            self.done = True

    def count_pass(self, data: Iterable[Any]) -> None:
        """Count one pass over ``data`` and check it (:meth:`finish`): a post-hoc fit that took
        no epoch (Laplace at a MAP, ``epochs=0``), whose curvature sums over the examples
        ``data`` holds, not over ``num_data``: a subset, or the validation split passed by
        mistake, gives the curvature of other data than the MAP's objective weighed its prior
        against; under ``torch.distributed`` a loader not split per rank counts every example
        R times. In one process nothing is read twice: a list or tuple of batches is counted,
        a ``DataLoader`` sized by its sampler (:func:`_examples_per_pass`), other data not.
        Under ``torch.distributed`` the batches are read (no forward); a one-shot iterator is
        never counted."""
        if self.done or self.count or isinstance(data, Iterator):
            return
        if self.size == 1:
            counted = _examples_per_pass(data, self.label_key)
            if counted is None:
                self.done = True
                return
            self.count = counted
        else:
            for batch in data:
                self.see(batch)
        self.finish(what="the training data's pass", posthoc=True)

    def finish(
        self, complete: bool = True, what: str = "the first epoch", posthoc: bool = False
    ) -> None:
        """After the first epoch's batches (or the fit's, if it ends inside that epoch:
        ``complete`` false, when only an excess can be told); ``posthoc``: after a post-hoc
        fit's pass (a Laplace curvature at the MAP), whose data should be the MAP's."""
        if self.done:
            return
        self.done = True
        seen = self.count * self.size
        if self.rank != 0 or seen == 0:  # seen 0: resumed after the first epoch
            return
        if self.ess is not None:  # IVON's prior weighs 1/ess: num_data does not enter the fit
            self._check_ess(self.ess, seen, what)
            return
        if complete and 2 * seen < self.num_data and posthoc:
            self._warn(
                f"fit(): {what} yielded {seen} examples, but the model's num_data is "
                f"{self.num_data}. A post-hoc Laplace sums its curvature over exactly the "
                "examples it is given and reads their number as the data's, so a subset of the "
                "training set, or held-out data passed in its place, gives the curvature (and "
                "the prior precision chosen by the evidence) of other data than the MAP was "
                "fitted to. Pass the "
                "training data the MAP was fitted on (held-out data go to "
                "validation=pb.Validation(...)); if the curvature of a subset is meant, "
                "ignore this warning."
            )
            return
        if complete and 2 * seen < self.num_data:
            self._warn(
                f"fit(): {what} yielded {seen} examples, but the model's num_data is "
                f"{self.num_data}. num_data must be the size of the data the fit iterates: "
                f"with it {self.num_data / seen:.3g}x too large the prior (and KL) weighs that "
                "much too little and the posterior is too narrow (often the whole data set's "
                "size passed while training on a subset). Build the model with "
                "FineTuneModel(..., num_data=len(train_set)); if each epoch draws a sample of a "
                "larger set on purpose, ignore this warning."
            )
            return
        if seen <= self.num_data + self.size - 1:
            return
        over = "" if self.size == 1 else f" ({self.size} ranks × {self.count})"
        message = (
            f"fit(): {what} yielded {seen} examples{over}, but the model's num_data "
            f"is {self.num_data}. num_data must be the size of the training set (not the "
            f"batch size): with it too small the prior (and KL) weighs {seen / self.num_data:.3g}"
            "x too much and the posterior is too wide. Build the model with "
            "FineTuneModel(..., num_data=len(train_set)); if the data repeats examples on "
            "purpose (augmented copies), ignore this warning."
        )
        if self.size > 1 and self.count * (self.size - 1) >= self.num_data:
            message += (
                f" Each of the {self.size} ranks read {self.count} examples: under "
                "torch.distributed every rank must read its own share of the training set "
                "(a DataLoader with a DistributedSampler), or every example counts once per "
                "rank (a post-hoc Laplace sums its curvature over ranks)."
            )
        self._warn(message)

    def _check_ess(self, ess: float, seen: int, what: str) -> None:
        """Warn when an IVON guide's ``ess`` (its prior's weight is 1/ess) is below the
        examples a pass yields: the posterior is then ``seen/ess`` times too wide, as with
        ``num_data`` the batch size (an ``ess`` above the data's size narrows it on purpose,
        e.g. the IVON-LoRA recipe's 1e7, and passes)."""
        if seen <= ess + self.size - 1:
            return
        self._warn(
            f"fit(): {what} yielded {seen} examples, but the guide's ess is {ess:g}. ess "
            "is IVON's effective sample size: its prior weighs 1/ess of the mean "
            f"log-likelihood, {seen / ess:.3g}x what the data's size gives, and the "
            "posterior is that much too wide (often the batch size passed as ess). Pass "
            "ess=len(train_set), or leave it out (the model's num_data); an ess above the "
            "data's size narrows the posterior on purpose and is not warned about."
        )

    @staticmethod
    def _warn(message: str) -> None:
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


def _examples_per_pass(data: Iterable[Any], label_key: str) -> int | None:
    """The examples one pass over ``data`` yields, where telling costs no read of the data:
    the batches of a list or tuple counted (held in memory), a ``DataLoader``'s from its batch
    sampler (:func:`loader_pass_size`); ``None`` for other data."""
    if isinstance(data, (list, tuple)):
        try:
            return sum(batch_size(split_batch(b, label_key)[0]) for b in data)
        except (TypeError, ValueError):  # a batch whose size cannot be told: no check
            return None
    sizes = loader_pass_size(data)
    return None if sizes is None else sizes[1]


def loader_pass_size(data: Any) -> tuple[int, int] | None:
    """``(sampled, yielded)``: the examples a ``DataLoader``'s sampler draws per pass and those
    its batches hold, fewer by the remainder ``drop_last`` drops; ``None`` where its batch
    sampler is not torch's (an ``IterableDataset``, a custom batch sampler) or other data."""
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset

    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        return None
    sampler = data.batch_sampler
    if type(sampler) is not BatchSampler:
        return None
    try:
        sampled = len(sampler.sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
    dropped = sampled % sampler.batch_size if sampler.drop_last else 0
    return sampled, sampled - dropped


def check_first_batch(model: Any, fitter: Any, batch: Any) -> None:
    """The checks of a fresh fit's first batch, where the likelihood or the fitter has one: the
    targets against a learned Gaussian σ's start, the inputs' scale against IVON's ``h0``; a
    batch on the ``meta`` device is refused (:func:`~pyrobayes.batch.check_not_meta`: on the
    CPU the fit uses the batches as given, and torch's error there names no batch)."""
    check_not_meta(batch)
    try:
        inputs, targets = split_batch(batch, getattr(model, "label_key", "labels"))
    except (TypeError, ValueError):  # the step reports a malformed batch itself
        return
    check_targets = getattr(getattr(model, "likelihood", None), "check_target_scale", None)
    if check_targets is not None:
        check_targets(targets)
    check_inputs = getattr(fitter, "check_input_scale", None)
    if check_inputs is not None:
        check_inputs(inputs)


#: The key of a rank's record (:func:`check_ranks_agree`) holding its data's batches per epoch
#: (-1: no ``len()``), compared before the other settings.
BATCHES_PER_EPOCH = "batches per epoch"


def check_ranks_agree(record: dict[str, Any] | None, error: BaseException | None = None) -> None:
    """Under ``torch.distributed``, make every rank refuse the fit when one refuses it (or
    fails before it) or when the ranks' fits differ (a no-op in one process). Every rank calls
    it once, as the fit's first collective, with this rank's ``record`` (the settings every
    rank must share: its batches per epoch, family, fitter and its settings, rate, budget, the
    step it resumes from, ...; JSON values) or the ``error`` that stopped the fit here (a
    refused resume, or any error before the agreement: its data, its checkpoint folder).

    Without it a rank that refused the fit (a resume it could not read) or failed before it
    (data only that rank holds), or one that ran another number of steps, another family or
    another resume position, left the others waiting in an all-reduce (gloo times out after
    30 minutes), and ranks with another rate drifted apart without a word (rank 0's state is
    the one saved).

    Raises
    ------
    RuntimeError
        On the ranks that did not refuse, naming the rank that did and its error (the rank
        that refused returns here, and raises its own error).
    ValueError
        When the records differ: the ranks' batches per epoch (:data:`BATCHES_PER_EPOCH`)
        first, then naming the first differing setting and every rank's value.
    """
    size = world()[0]
    if size == 1:
        return
    gathered = gather_rank_errors(record, error, "refused the fit", "the first all-reduce")
    if gathered is None:
        return
    records = [r or {} for r, _ in gathered]
    _check_shards([r.get(BATCHES_PER_EPOCH) for r in records])
    for key in dict.fromkeys(k for r in records for k in r):  # (rank 0's order first)
        values = [r.get(key) for r in records]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values[:8]))
            raise ValueError(
                f"fit(): under torch.distributed every rank must run the same fit, but the "
                f"ranks differ in {key} ({shown}): the ranks all-reduce every step, so another "
                "budget, family or resume position leaves a rank waiting for steps the others "
                "never take, and another rate or setting makes the ranks' parameters drift "
                "apart (rank 0's are the ones saved). Launch every rank with the same fit "
                "arguments (and, to resume, a checkpoint folder every rank can read)."
            )


#: Where the other ranks waited for a rank that failed as the fit started (before
#: :func:`check_ranks_started`).
_STARTED_WAIT = "rank 0's broadcast of the parameters or the first step's all-reduce"


def check_ranks_started(error: BaseException | None = None) -> None:
    """Under ``torch.distributed``, make every rank stop when one failed between the ranks'
    agreement (:func:`check_ranks_agree`) and the fit's first step (a no-op in one process).
    Every rank calls it once per fit, as the fit's second collective, with ``None`` or the
    ``error`` that stopped it there: the fitter's ``begin`` (its refusals), the resume's load
    of the checkpoint (a file this rank cannot read), the data order, the lower-block cache.

    Without it the other ranks waited for the failed one in rank 0's broadcast of the
    parameters, or in the first step's all-reduce, until gloo's timeout (30 minutes).

    Raises
    ------
    RuntimeError
        On the ranks that did not fail, naming the rank that did and its error (the rank that
        failed returns here, and raises its own error).
    """
    if world()[0] > 1:
        gather_rank_errors(None, error, "failed as the fit started", _STARTED_WAIT)


#: Where the other ranks waited for rank 0 when its checkpoint's write failed (before
#: :func:`check_checkpoint_written`), and what to do then.
_WRITE_WAIT = "the next step's all-reduce or the fit's closing barrier"
_WRITE_REMEDY = (
    "The folder keeps the last checkpoint written before (a failed write leaves none of its "
    "files): make the folder writable on rank 0 (free disk space, its permissions) and resume "
    "from it with pb.Checkpointing(..., resume=True)."
)


def check_checkpoint_written(error: BaseException | None = None) -> None:
    """Under ``torch.distributed``, make every rank stop when rank 0 failed to write a
    checkpoint (a no-op in one process). Every rank calls it once per checkpoint, after rank 0's
    write, with ``None`` or the ``error`` of that write (a full disk, a permission error; only
    rank 0 writes). One gather per checkpoint: nothing per step of a fit that writes none.

    Without it rank 0 raised its error while the other ranks went on into the next step's
    all-reduce (or the fit's closing barrier) and waited there until gloo's timeout (30
    minutes), after which the group is broken.

    Raises
    ------
    RuntimeError
        On the ranks that did not fail, naming rank 0 and its error (rank 0 returns here, and
        raises its own error).
    """
    if world()[0] > 1:
        failed = "failed to write a checkpoint"
        gather_rank_errors(None, error, failed, _WRITE_WAIT, remedy=_WRITE_REMEDY)


def gather_rank_errors(
    record: Any,
    error: BaseException | None,
    failed: str,
    waited_in: str,
    *,
    caller: str = "fit()",
    remedy: str = "Fix that rank's fit.",
) -> list[Any] | None:
    """Every rank's ``(record, error text)``, gathered in one collective (every rank calls it
    at the same point, under ``torch.distributed`` only); ``None`` on a rank that passed an
    ``error`` (it raises its own).

    Raises
    ------
    RuntimeError
        On the other ranks, when a rank passed an error: naming ``caller``, that rank, what it
        did (``failed``), its error, the collective the others would have waited in
        (``waited_in``) and what to do (``remedy``).
    """
    size = world()[0]
    mine = (record, None if error is None else f"{type(error).__name__}: {error}")
    gathered: list[Any] = [None] * size
    torch_dist.all_gather_object(gathered, mine)
    if error is not None:
        return None
    refused = [(rank, why) for rank, (_, why) in enumerate(gathered) if why is not None]
    if refused:
        rank, why = refused[0]
        raise RuntimeError(
            f"{caller}: rank {rank} of {size} {failed} ({why}); every rank stops with it (the "
            f"others would wait for it in {waited_in}). {remedy}"
        )
    return gathered


def _check_shards(per_epoch: list[int | None]) -> None:
    """Refuse ranks whose data have other numbers of batches per epoch (-1: no ``len()``): the
    ranks all-reduce every step, so the longer rank would wait for a step the shorter never
    takes (gloo times out after 30 minutes)."""
    counts = [n for n in per_epoch if n is not None]
    if counts and min(counts) != max(counts):
        raise ValueError(
            f"fit(): under torch.distributed the ranks' data have different numbers of "
            f"batches per epoch ({min(counts)} to {max(counts)}; -1: no len()), but every step "
            "all-reduces over the ranks. Give each rank a DistributedSampler over the same "
            "dataset (it pads the shards to equal sizes) and the same batch size."
        )


def _watched_modules(model: Any) -> dict[str, list[str]]:
    """The modules of ``model.net`` holding its latent sites or trained point parameters, by
    path, each with the names of what it holds (an adapter's point factor, LoRA's ``lora_B``
    under ``latent="A"``, counts for its adapted layer)."""
    held: dict[str, list[str]] = {}
    for site, spec in getattr(model, "latent_sites", {}).items():
        held.setdefault(spec.module_path, []).append(site)
    sites = sorted(held, key=len, reverse=True)
    net = getattr(model, "net", None)
    if not isinstance(net, torch.nn.Module):
        return held
    paths = {id(p): path for path, m in net.named_modules() for p in m.parameters(False)}
    for name, param in getattr(model, "point_params", {}).items():
        path = paths.get(id(param))
        if path is None or not param.requires_grad:  # (the likelihood's σ: no module)
            continue
        inside = [m for m in sites if path == m or path.startswith(m + ".")]
        held.setdefault(inside[0] if inside else path, []).append(name)
    return held


class _ReachProbe(torch.autograd.Function):
    """Identity on a module's output (a copy) whose backward hands the output's gradient to
    ``record``. A tensor hook on the output itself does not fire when the network changes the
    output in place (Wav2Vec2's classifier zeroes the padding of its projector's output with
    an ``index_put_``), and neither does a hook on its ``grad_fn``; the copy's node does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, record: Any) -> torch.Tensor:  # noqa: D102
        ctx.record = record
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        ctx.record(grad)
        return grad, None


@contextlib.contextmanager
def watching_reach(model: Any) -> Iterator[None]:
    """Within the block (a fresh fit's first step), record for every module holding latent
    sites or trained point parameters whether the loss's gradient reaches its output; on
    leaving it without an error, warn (rank 0) naming the modules it never reached.

    The gradient at a module's output is the data term's alone (a prior or KL acts on the
    parameters, not on an output), so a module it does not reach is one whose values never
    reach the prediction: the forward does not run it, or runs it where the output is not read
    (Longformer's last-layer query/value: its classifier reads the ``[CLS]`` token, whose
    output attends globally through ``query_global``/``value_global``). A fit leaves such
    values at their start, latent ones at the prior, silently. No forward is added: forward
    hooks pass the step's outputs through :class:`_ReachProbe` (a copy of each watched output,
    in this step only) and record one flag per module on the device, read with one
    synchronisation at the end. A module whose output is not a tensor (or a tuple or list of
    them) is not judged."""
    net = getattr(model, "net", None)
    held = _watched_modules(model) if world()[1] == 0 else {}
    if not held or not isinstance(net, torch.nn.Module):
        yield
        return
    flags: dict[str, torch.Tensor] = {}
    unjudged: set[str] = set()

    def watch(path: str) -> Any:
        def record(grad: torch.Tensor) -> None:
            hit = grad.ne(0).any()
            flags[path] = hit if path not in flags else flags[path] | hit

        def probe(tensor: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                return _ReachProbe.apply(tensor, record)
            return tensor

        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            if isinstance(out, torch.Tensor):
                return probe(out)
            if isinstance(out, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in out):
                return type(out)(probe(t) for t in out)
            unjudged.add(path)
            return None

        return hook

    modules = dict(net.named_modules())
    handles = [modules[p].register_forward_hook(watch(p)) for p in held if p in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    hits = torch.stack(list(flags.values())).tolist() if flags else []  # one synchronisation
    reached = {p for p, hit in zip(flags, hits, strict=True) if hit} | unjudged
    unreached = [p for p in held if p in modules and p not in reached] if flags else []
    if unreached:
        _warn_unreached(model, unreached)


def _warn_unreached(model: Any, unreached: list[str]) -> None:
    shown = ", ".join(repr(p) for p in unreached[:6]) + (" ..." if len(unreached) > 6 else "")
    message = (
        f"fit(): in the first step the loss's gradient never reached the output of "
        f"{len(unreached)} module(s) of {type(model.net).__name__} holding latent or trained "
        f"values: {shown}. Their values do not reach the prediction (the forward does not "
        "run them, or runs them where the output is not read: Longformer's last-layer "
        "query/value, whose [CLS] token attends globally through query_global/value_global), "
        "so the fit leaves them at their start, latent ones at the prior. Leave them out of "
        "target_modules / latent_modules (a mixture-of-experts expert the first batch routes "
        "no token to gets no gradient either: then ignore this)."
    )
    logger.warning(message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
