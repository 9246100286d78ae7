r"""The public step API: a :class:`Fitter` fits a guide to a model one minibatch at a time.

:func:`pyrobayes.fit` is a loop over it (progress bar, validation, checkpoints, resume); a
hand-written loop or a trainer (``transformers.Trainer``, Lightning) drives it directly::

    fitter = pb.infer.make_fitter(model, guide, lr=1e-2)   # the family's fitter
    fitter.begin(loader)
    for epoch in range(epochs):
        for batch in loader:
            loss = fitter.step(batch)                        # one update
        fitter.epoch_end(epoch)
    fitter.end(loader)                                       # post-hoc families finish here

Every family has a fitter (:data:`FITTERS`, keyed by the guide's ``default_fitter``):
``"svi"`` minimises an objective (ELBO, MAP, a Pyro ELBO) with a torch optimizer; the IVON
families, SWAG and Laplace have their own (see :mod:`pyrobayes.infer.ivon`,
:mod:`pyrobayes.infer.swag`, :mod:`pyrobayes.infer.laplace`). A fitter owns the objective, the
optimizer and its state, and any statistics or hooks of its family; the guide holds only the
posterior. ``state_dict`` / ``load_state_dict`` save and restore everything the fitter owns, so a
checkpoint is ``(guide state, model point parameters, fitter state)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..batch import compute_dtype
from ..calibration import drop_temperature
from ..contract import bound_model, implements
from ..user_frame import user_stacklevel
from .distributed import all_reduce_grads_, all_reduce_mean_, world
from .meanfield import MeanField
from .objectives import MAP, SurrogateObjective, is_variational, make_objective
from .rank_errors import nan_grads_, nan_share, raise_kept, run_shared, shared_copy
from .settings import check_settings, settings_record
from .symmetrized import Symmetrized

__all__ = [
    "check_guide_model",
    "flag_non_finite",
    "Fitter",
    "SVIFitter",
    "FITTERS",
    "register_fitter",
    "make_fitter",
    "trainable_parameters",
]


def flag_non_finite(
    tensors: Sequence[torch.Tensor], found: torch.Tensor, one: torch.Tensor
) -> torch.Tensor:
    """Set ``found`` (one element, 0 on entry) nonzero when some entry of ``tensors`` is inf or
    NaN, without a device sync; returns ``found``.

    One fused kernel over all of them: the check ``torch.amp.GradScaler`` runs every step (it
    also multiplies them by the scale ``one``, 1, which leaves every value as it was). Unlike a
    sum of the entries it cannot overflow, so finite tensors are never flagged. Where the fused
    kernel does not apply (sparse tensors, tensors on several devices, a backend without it),
    one ``isfinite`` per tensor.
    """
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found, one)
    except (RuntimeError, NotImplementedError):
        bad = [~(t.coalesce().values() if t.is_sparse else t).isfinite().all() for t in tensors]
        found.copy_(torch.stack([b.to(found.device) for b in bad]).any().view(1))
    return found


def trainable_parameters(model: Any, guide: Any) -> list[torch.nn.Parameter]:
    """The guide's trainable parameters, then the model's point-estimated ones (e.g. a head)."""
    params = [p for p in guide.parameters() if p.requires_grad]
    seen = {id(p) for p in params}
    params += [p for p in getattr(model, "point_params", {}).values() if id(p) not in seen]
    return params


class _PointMasters:
    r"""Master copies, in the compute dtype, of a half-precision network's trained point
    parameters (its own ``nn.Parameter``\ s, e.g. a head) in float16 or bfloat16.

    The fit's optimizer steps the masters; the network's parameter holds its master rounded to
    its dtype before every forward of a step (:meth:`push`) and takes the gradient from the
    backward, which :meth:`grads_in` hands to the master in float32. Stepped in place in
    bfloat16, an Adam step below half of its spacing rounds away (2⁻¹¹ ≈ 4.9e-4 at ``|w|`` near
    0.1: every step of ``lr`` ≤ 2e-4), so the head never moved; the masters are the
    mixed-precision training of Micikevicius et al. (2018), "Mixed Precision Training" (ICLR).
    A master stays valid while its parameter holds it rounded: a parameter written elsewhere
    (a checkpoint's posterior loaded, a distributed broadcast, ``set_site``) to another value
    is re-read (:meth:`pull`). Empty (every method a no-op) when no point parameter is half.
    """

    def __init__(self, model: Any, guide: Any, params: Sequence[torch.nn.Parameter]) -> None:
        found = _half_points(model, guide, params)
        half = [p for _, p in found]
        self.names = [n for n, _ in found]
        self.params: list[torch.nn.Parameter] = half
        self.masters = [
            torch.nn.Parameter(p.detach().to(compute_dtype(p.dtype)), p.requires_grad) for p in half
        ]
        self._of = {id(p): m for p, m in zip(half, self.masters, strict=True)}
        self._versions: list[int | None] = [p._version for p in half]

    def stepped(self, params: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """``params`` with each half-precision point parameter replaced by its master."""
        return [self._of.get(id(p), p) for p in params]

    def names_of_masters(self) -> dict[int, str]:
        """``{id(master): the point parameter's name}``."""
        return {id(m): n for m, n in zip(self.masters, self.names, strict=True)}

    def push(self) -> None:
        """Write each master, rounded to its parameter's dtype, into the network's parameter."""
        if not self.params:  # (a float32 network: not even the no_grad context, 2 µs a call)
            return
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)):
                p.copy_(m)
                self._versions[i] = p._version

    def pull(self) -> None:
        """Re-read the master of each parameter written elsewhere since :meth:`push` to a value
        other than its master rounded (one comparison per such parameter, none otherwise)."""
        if not self.params:
            return
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)):
                if p._version != self._versions[i]:
                    if not torch.equal(m.to(p.dtype), p):
                        m.copy_(p)
                    self._versions[i] = p._version

    def grads_in(self) -> None:
        """Hand the network's parameters' gradients to their masters, in the master's dtype
        (added to a gradient the master holds), and drop them from the parameters."""
        if not self.params:
            return
        for p, m in zip(self.params, self.masters, strict=True):
            grad, p.grad = p.grad, None
            if grad is not None:
                m.grad = grad.to(m.dtype) if m.grad is None else m.grad.add_(grad)

    def drop_grads(self) -> None:
        """Drop the network's parameters' gradients (the optimizer zeroes its masters')."""
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: master}`` (cloned), after :meth:`pull`."""
        self.pull()
        return {n: m.detach().clone() for n, m in zip(self.names, self.masters, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Restore :meth:`state_dict`'s masters: each one whose rounding is the value its
        parameter holds (the checkpoint's point parameters are loaded first) is kept, any other
        re-read from its parameter; a checkpoint without them (one written before the masters,
        or by a float32 network) re-reads them all."""
        saved = state or {}
        for i, (name, m) in enumerate(zip(self.names, self.masters, strict=True)):
            value = saved.get(name)
            if isinstance(value, torch.Tensor) and value.shape == m.shape:
                m.copy_(value)
            self._versions[i] = None  # compared with the parameter by the pull below
        self.pull()


def _half_points(
    model: Any, guide: Any, params: Sequence[torch.nn.Parameter]
) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of each of ``params`` that is a float16 or bfloat16 point
    parameter of ``model`` (not the guide's)."""
    guide_ids = {id(p) for p in guide.parameters()}
    named = {id(p): n for n, p in getattr(model, "point_params", {}).items()}
    return [
        (named[id(p)], p)
        for p in params
        if id(p) in named and id(p) not in guide_ids and compute_dtype(p.dtype) != p.dtype
    ]


def _warn_half_points_in_place(model: Any, guide: Any) -> None:
    """Warn when an optimizer passed built will step the network's bfloat16 point parameters in
    place (float16 ones under Adam are refused at the first step): the fit cannot give them
    float32 masters (:class:`_PointMasters`), and a step below half of bfloat16's spacing
    rounds away (every step of ``lr`` <= 2e-4 at ``|w|`` near 0.1)."""
    half = _half_points(model, guide, list(getattr(model, "point_params", {}).values()))
    if not half or all(p.dtype == torch.float16 for _, p in half):
        return
    names = [n for n, _ in half]
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    warnings.warn(
        f"fit(): the optimizer passed built steps the network's half-precision point "
        f"parameters ({shown}) in place, in their dtype, where a step below half the dtype's "
        "spacing rounds away (bfloat16: every step of lr <= 2e-4 at |w| near 0.1), so they may "
        "not move. Pass the optimizer's class or a factory params -> Optimizer instead "
        "(optim=pb.Optimization(optimizer=torch.optim.AdamW) or a lambda over its params): "
        "the fit then steps float32 masters of them.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _refuse_float16_adam(optimizer: torch.optim.Optimizer, model: Any, guide: Any) -> None:
    """Refuse float16 parameters under an optimizer whose ``eps`` rounds to 0 in float16 (Adam's
    1e-8 is below float16's smallest subnormal, 6e-8): its squared-gradient average of a small
    gradient underflows too, so the first step divides by 0 and writes inf or NaN into them.
    The network's float16 point parameters are stepped through float32 masters
    (:class:`_PointMasters`) unless the optimizer was passed built over them."""
    names = {id(p): n for n, p in getattr(model, "point_params", {}).items()}
    names.update({id(p): f"the guide's {n}" for n, p in guide.named_parameters()})
    for group in optimizer.param_groups:
        eps = group.get("eps")
        if not isinstance(eps, float) or torch.tensor(eps, dtype=torch.float16) != 0:
            continue
        half = [p for p in group["params"] if p.dtype == torch.float16]
        if half:
            which = [names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in half][:3]
            raise TypeError(
                f"fit(): {len(half)} trained parameter(s) are float16 ({', '.join(which)}...), "
                f"and {type(optimizer).__name__}'s eps = {eps:g} rounds to 0 in float16, so its "
                "first step divides by zero and writes inf/NaN into them (whatever the learning "
                "rate). Fit a bfloat16 or float32 copy of the network (net.to(torch.bfloat16) "
                "before building the model), or pass an optimizer with eps >= 1e-4, or its class "
                "or a factory params -> Optimizer rather than a built one (the fit then steps "
                "float32 masters of the network's float16 point parameters)."
            )


class Fitter:
    r"""Fits ``guide`` to ``model`` one minibatch at a time (the base of every family's fitter).

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
        Set up (built from a ``FineTuneModel``, or called once on a batch for a plain Pyro model).
    loss : str, pyro.infer.ELBO or object with ``loss(model, guide, batch)``, optional
        The objective; default the family's (:meth:`default_objective`).
    optimizer : torch optimizer, Optimizer class or callable ``params -> Optimizer``, optional
        Default the family's (:meth:`default_optimizer`).
    lr : float, optional
        Learning rate of the default optimizer (or of an Optimizer class); default the family's
        :attr:`default_lr` (Adam's 1e-2; IVON's and Kronecker IVON's step α = 0.1).

    Attributes
    ----------
    objective
        The resolved objective.
    optimizer : torch.optim.Optimizer
    params : list of Parameter
        What the fit trains: the guide's trainable parameters and the model's point ones. A
        float16 or bfloat16 point parameter is stepped through a float32 master copy (the
        optimizer holds the master; the network's parameter holds it rounded, and its gradient
        reaches the master in float32), unless the optimizer was passed built.
    num_steps : int
        Updates applied so far.
    manages_lr : bool
        True when the fitter schedules the learning rate itself (then
        :func:`pyrobayes.fit` refuses a ``scheduler``).
    default_scheduler : str or None
        The family's learning-rate schedule where ``fit``'s ``Optimization(scheduler=...)`` is
        left unset (``None``: a constant rate; IVON's: ``"cosine"``). ``scheduler="constant"``
        turns it off.
    default_warmup : float
        The warm-up of that default schedule when ``Optimization(warmup=...)`` is left at 0
        (a fraction of the run; IVON's: 0.1). A schedule the fit names gets the fit's warm-up.
    reads_data_at_end : bool
        True when :meth:`end` makes another pass over the training data (Laplace's
        curvature): :func:`pyrobayes.fit` then refuses a one-shot iterator that training
        would have used up.
    settings : dataclass or None
        The fit's settings record (``pb.infer.IVON``, ``SWAG``, ...; ``None`` for a family
        without any, e.g. MAP): saved in :meth:`state_dict`, checked on resume. A subclass sets
        it before calling this constructor.
    validation_data : iterable of batches or None
        The held-out batches of :func:`pyrobayes.fit`'s ``validation=`` (set by the fit loop
        before :meth:`begin`; ``None`` without one): a post-hoc family may choose on them
        (``pb.infer.Laplace(prior_optimization="validation")``).
    """

    settings: Any = None
    validation_data: Iterable[Any] | None = None
    default_scheduler: str | None = None
    default_warmup: float = 0.0
    #: the learning rate when the caller gives none (``pb.fit(lr=None)``): Adam's 1e-2
    default_lr: float = 1e-2
    #: the posterior is collected along the training trajectory (SWAG's moments): restoring an
    #: earlier epoch's state (``pb.Validation``'s selection) drops what came after it
    collects_trajectory: bool = False
    reads_data_at_end: bool = False

    def __init__(
        self,
        model: Any,
        guide: Any,
        *,
        loss: Any = None,
        optimizer: Any = None,
        lr: float | None = None,
    ) -> None:
        if not guide.sites:
            raise RuntimeError(
                f"{type(guide).__name__} has no sites yet: build it from a FineTuneModel, or call "
                "it once on a batch (guide(batch)) before making its fitter."
            )
        self._lr_given = lr  # None: the family's default (an optimizer passed keeps its own)
        lr = type(self).default_lr if lr is None else lr
        if lr < 0:
            raise ValueError(f"Expected lr >= 0 but got {lr}.")
        #: the learning rate the optimizer was built with (the family's default when none given)
        self.lr = float(lr)
        self.model = model
        self.guide = guide
        self.objective = make_objective(self.default_objective() if loss is None else loss)
        if (
            getattr(model, "num_data", 0) is None
            and not getattr(guide, "is_deterministic", False)
            and (
                is_variational(self.objective)
                or isinstance(self.objective, MAP)
                or getattr(self.objective, "weighs_batches_by_num_data", False)  # IBDRLoss
            )
        ):  # N/B-weighted objective of a posterior with N unknown: N would be each batch's size
            raise ValueError(
                f"{type(guide).__name__} is fitted with "
                f"{type(getattr(self.objective, 'elbo', self.objective)).__name__}, which "
                "weights each minibatch by N/B with N the model's num_data, but the model has "
                "num_data=None: every minibatch would count as the whole data set (a posterior "
                "far too wide). Build the model with FineTuneModel(num_data=N), N the number of "
                "training examples."
            )
        self.params = trainable_parameters(model, guide)
        #: float32 masters of the half-precision point parameters, which the optimizer steps in
        #: their place (:class:`_PointMasters`; none for an optimizer passed built over them)
        built = isinstance(optimizer, torch.optim.Optimizer)
        self._masters = _PointMasters(model, guide, () if built else self.params)
        if built:
            _warn_half_points_in_place(model, guide)
        self.optimizer = self._build_optimizer(optimizer, lr)
        self.num_steps = 0
        self._grad_check: tuple[torch.Tensor, torch.Tensor] | None = None  # _check_buffers
        #: why :meth:`step` is refused after :meth:`end` (a family whose ``end`` fixed a
        #: posterior at the current parameters sets it; its :meth:`begin` clears it)
        self.ended: str | None = None

    @property
    def manages_lr(self) -> bool:
        """True when the fitter schedules the learning rate itself (none here)."""
        return False

    # ------------------------------------------------------------------ the family's defaults
    def default_objective(self) -> Any:
        """The family's objective (a name such as ``"elbo"``, or an object with ``loss``)."""
        return self.guide.default_objective

    def _refuse_variational(self, why: str) -> None:
        """Raise when the objective is an ELBO: for families fitted by a procedure of their own."""
        if is_variational(self.objective):
            raise ValueError(
                f"{type(self).__name__} cannot fit {type(self.guide).__name__} with "
                f"{type(getattr(self.objective, 'elbo', self.objective)).__name__}: {why} "
                "Pass loss=None (the family's own objective)."
            )

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A built optimizer (an instance, or a factory's) must step every parameter the fit
        trains (the guide's and the model's point parameters), and its own rate is the fit's:
        an ``lr`` given beside it is not used (warned), and :attr:`lr` reads the optimizer's."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [p for p in self._masters.stepped(self.params) if id(p) not in held]
        if missing:
            names = {id(p): f"guide.{n}" for n, p in self.guide.named_parameters()}
            names.update({id(p): f"model.{n}" for n, p in self.model.named_parameters()})
            names.update(
                {
                    i: f"model.{n} (its float32 master)"
                    for i, n in self._masters.names_of_masters().items()
                }
            )
            listed = [names.get(id(p), f"a {tuple(p.shape)} parameter") for p in missing]
            raise ValueError(
                f"{type(self).__name__}: the optimizer passed does not hold {len(missing)} of "
                f"the {len(self.params)} parameters this fit trains ({listed[:4]}): they would "
                "never move, and the fit would report losses of a posterior it does not train. "
                "Build it over pb.infer.trainable_parameters(model, guide) (or pass an "
                "Optimizer class, or a factory params -> Optimizer, which gets them); to keep "
                "the head fixed, leave it out of the model's trainable_modules."
            )
        rate = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        if rate is not None:
            self._take_rate(
                float(rate),
                f"the optimizer passed carries its own rate (lr={float(rate):g}, its first "
                "group's). Set the rate when building the optimizer, or pass its class.",
            )

    def _take_rate(self, rate: float, why: str) -> float:
        """Make ``rate``, set elsewhere than the fit's ``lr`` (an optimizer passed built, a
        settings record's ``lr``), the fit's: :attr:`lr` reads it, and an ``lr`` given to the
        fit beside it that differs is warned of as unused (``why`` says what sets the rate)."""
        given = self._lr_given
        if given is not None and float(given) != rate:
            warnings.warn(
                f"{type(self).__name__}: lr={given:g} is not used: {why}",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        self.lr = rate
        return rate

    def default_optimizer(self, params: list[torch.nn.Parameter], lr: float) -> Any:
        """The family's optimizer over ``params``; Adam here."""
        return torch.optim.Adam(params, lr=lr)

    def _build_optimizer(self, spec: Any, lr: float) -> torch.optim.Optimizer:
        params = self._masters.stepped(self.params)  # the half point parameters' masters
        if spec is None:
            return self.default_optimizer(params, lr)
        if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
            # every concrete optimizer takes lr (the abstract base takes a defaults dict)
            optimizer_class: Callable[..., torch.optim.Optimizer] = spec
            return optimizer_class(params, lr=lr)
        if isinstance(spec, torch.optim.Optimizer) or callable(spec):
            built = spec if isinstance(spec, torch.optim.Optimizer) else spec(params)
            if isinstance(built, torch.optim.Optimizer):
                self._adopt_optimizer(built)
            return built
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, an Optimizer class, or a callable "
            f"params -> Optimizer; got {type(spec).__name__}."
        )

    # ------------------------------------------------------------------ the step API
    def check_begin(self) -> None:
        """Raise what :meth:`begin` would refuse, changing nothing (none here).

        :func:`pyrobayes.fit` calls it before the ranks' agreement under ``torch.distributed``,
        so that one rank's refusal stops every rank before any of them begins (and resets its
        guide); in one process a refused fit leaves the guide as it was either way."""

    def begin(self, data: Iterable[Any] | None = None) -> None:
        """Called once before the first step (a family resets what it collects here)."""

    def step(self, batch: Any) -> float:
        """One update on ``batch``; returns the objective's value before the update.

        Under ``torch.distributed`` the value is the mean over ranks and the gradients are
        averaged over ranks (closure-driven optimizers reduce their own statistics).

        Raises
        ------
        FloatingPointError
            On a non-finite loss or gradient, before any parameter is touched (the message
            names the parameters, and their sites, whose gradients are not finite).
        """
        if self.ended is not None:
            raise RuntimeError(f"{type(self).__name__}.step() after end(): {self.ended}")
        if self.num_steps == 0:  # before the first update only (a post-hoc fit takes none)
            _refuse_float16_adam(self.optimizer, self.model, self.guide)
        self._masters.pull()  # a point parameter written since the last step: its new value
        value = self._update(batch)
        if not math.isfinite(value):
            raise_kept(f"step {self.num_steps}")  # one rank's error: every rank stops with it
            raise FloatingPointError(
                f"Non-finite loss ({value}) at step {self.num_steps}; parameters were not updated."
            )
        self.num_steps += 1
        self._after_step()
        return value

    def _update(self, batch: Any) -> float:
        """Evaluate the objective, back-propagate and apply the optimizer; return the loss."""
        optim = self.optimizer
        model, guide, objective = self.model, self.guide, self.objective
        surrogate = implements(objective, SurrogateObjective)
        masters = self._masters
        if getattr(optim, "needs_closure", False):

            def closure() -> torch.Tensor:
                self._zero_grad()
                masters.push()  # the masters as the optimizer left them (IVON's perturbed)
                if surrogate:  # back-propagates itself
                    loss = torch.tensor(objective.loss_and_grads(model, guide, batch))
                else:
                    loss = objective.loss(model, guide, batch)
                    loss.backward()
                masters.grads_in()
                return loss

            try:  # torch types the closure as returning float; closures return the loss tensor
                return float(optim.step(closure))  # type: ignore[arg-type]
            finally:
                masters.push()  # the masters as the step left them (IVON's restored means)
        self._zero_grad()
        distributed = world()[0] > 1
        if surrogate:  # the gradients are there already; the update waits for the check
            mean = run_shared(
                lambda: torch.tensor(
                    objective.loss_and_grads(model, guide, batch), dtype=torch.float64
                ),
                nan_share,
            )
            loss = None
        else:
            device = self.params[0].device if self.params else None
            loss = run_shared(
                lambda: objective.loss(model, guide, batch), lambda: nan_share(device)
            )
            mean = shared_copy(loss) if distributed else loss
        if distributed:
            all_reduce_mean_([mean])
        value = mean.item()  # float(mean) without its detach: the same number
        if not math.isfinite(value):
            return value
        if loss is not None:
            run_shared(loss.backward, lambda: nan_grads_(self.params))
        if distributed:
            all_reduce_grads_(self.params)
        self._check_grads()
        self._optimizer_step()
        return value

    def _zero_grad(self) -> None:
        """Drop the gradients of the optimizer's parameters and of the network's half-precision
        point parameters (whose masters the optimizer holds)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._masters.drop_grads()

    def _optimizer_step(self) -> None:
        """The optimizer's step on the gradients of the backward: the half-precision point
        parameters' go to their float32 masters first, which the network then holds rounded."""
        self._masters.grads_in()
        self.optimizer.step()
        self._masters.push()

    def _check_grads(self) -> None:
        """Raise ``FloatingPointError`` if any gradient is non-finite (:func:`flag_non_finite`:
        one fused kernel over all gradients, one host read)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        found, one = self._check_buffers(grads[0].device)
        if not flag_non_finite(grads, found, one).item():
            return
        found.zero_()  # the flag stays 0 between steps (the check only ever sets it)
        raise_kept(f"step {self.num_steps}'s backward")  # one rank's error: all stop with it
        bad = {id(p) for p in self.params if p.grad is not None and not p.grad.isfinite().all()}
        raise FloatingPointError(
            f"Non-finite gradient at step {self.num_steps} in {', '.join(self._names(bad))}; "
            "parameters were not updated."
        )

    def _check_buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The found-non-finite flag (0) and the unit scale of :meth:`_check_grads` on
        ``device``, made once per device rather than every step."""
        cached = self._grad_check
        if cached is None or cached[0].device != device:
            cached = (
                torch.zeros(1, dtype=torch.float32, device=device),
                torch.ones(1, dtype=torch.float32, device=device),
            )
            self._grad_check = cached
        return cached

    def _names(self, ids: set[int]) -> list[str]:
        """Readable names of the parameters whose ``id`` is in ``ids``: the guide's (with
        their site) and the model's point parameters."""
        out = []
        sites = sorted(self.guide.sites, key=len, reverse=True)
        for name, p in self.guide.named_parameters():
            if id(p) in ids:
                site = next((s for s in sites if f".{s}" in f".{name}"), None)
                out.append(f"{name} (site {site})" if site else name)
                ids = ids - {id(p)}
        for name, p in getattr(self.model, "point_params", {}).items():
            if id(p) in ids:
                out.append(f"{name} (point parameter)")
                ids = ids - {id(p)}
        return out + [f"a parameter of shape {tuple(p.shape)}" for p in self.params if id(p) in ids]

    def report(self) -> dict[str, float]:
        """The fitter's own running quantities (e.g. IBDR's dual variable), shown on
        :func:`pyrobayes.fit`'s progress bar and returned in ``FitResult.state``; none here."""
        return {}

    def _after_step(self) -> None:
        """Called after every successful update (SWAG collects step-wise here)."""

    def epoch_end(self, epoch: int) -> None:
        """Called after each pass over the data (``epoch`` counts from 0)."""

    def end(self, data: Iterable[Any] | None = None) -> None:
        """Called once after the last step (post-hoc families fit their posterior here)."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the fitter owns: the optimizer state, the step count, the fit's settings
        (:attr:`settings`, when the family has any), the float32 masters of a half-precision
        network's point parameters (``"point_masters"``, only then: the network holds them
        rounded) and the family's own counters (the guide's state is saved with the guide)."""
        state = {"optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps}
        if self.settings is not None:
            state["settings"] = settings_record(self.settings)
        if self._masters.params:  # rounded in the network, so not re-derivable from it
            state["point_masters"] = self._masters.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a checkpoint written with other settings."""
        if self.settings is not None:
            check_settings(self, state.get("settings"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps = int(state.get("num_steps", 0))
        self._masters.load_state_dict(state.get("point_masters"))

    def broadcast_tensors(self) -> Sequence[torch.Tensor]:
        """What rank 0 broadcasts at the start of a distributed fit: the trainable parameters,
        the guide's other parameters and its floating-point buffers."""
        ids = {id(p) for p in self.params}
        rest = [p for p in self.guide.parameters() if id(p) not in ids]
        buffers = [b for b in self.guide.buffers() if b.is_floating_point()]
        return [*self.params, *rest, *buffers]


class SVIFitter(Fitter):
    r"""Stochastic variational inference: minimise the objective with a torch optimizer.

    The default fitter (``default_fitter = "svi"``): the guide's ``default_objective``
    (``"elbo"``: the reparameterized negative ELBO; ``"map"``: the negative log joint at a
    point) with Adam.

    ``optimizer`` may be a :class:`~pyrobayes.infer.meanfield.MeanField` record (or
    :class:`~pyrobayes.infer.symmetrized.Symmetrized`, which adds the objective's K): the fit's
    settings, then the default Adam steps the guide's scales at ``scale_lr · lr``. Without one,
    a guide with such settings (``fit_settings_class``) is fitted under those given to its
    constructor (deprecated) or the defaults. :meth:`state_dict` holds them; a checkpoint
    written under others is refused (one written before they moved here resumes).
    """

    def __init__(self, model: Any, guide: Any, *, optimizer: Any = None, **kwargs: Any) -> None:
        if isinstance(optimizer, MeanField):
            self.settings, optimizer = optimizer, None
            if self.settings.scale_lr != 1.0 and not callable(
                getattr(guide, "optimizer_groups", None)
            ):
                raise ValueError(
                    f"{type(self).__name__}: optimizer={self.settings!r} sets the learning rate "
                    f"of the posterior scales, but {type(guide).__name__} has none "
                    "(no optimizer_groups); pass scale_lr=1.0 or a plain torch optimizer."
                )
        elif self.settings is None:
            self.settings = _settings_of(guide)
        super().__init__(model, guide, optimizer=optimizer, **kwargs)
        if isinstance(self.settings, MeanField):
            self.objective = self.settings.bind(self.objective)

    def default_optimizer(self, params: list[torch.nn.Parameter], lr: float) -> Any:
        """Adam over ``params``; the guide's scales at ``scale_lr · lr`` where the guide offers
        ``optimizer_groups(params, lr, scale_lr)`` (mean-field's)."""
        groups = getattr(self.guide, "optimizer_groups", None)
        if not callable(groups):
            return torch.optim.Adam(params, lr=lr)
        scale_lr = float(getattr(self.settings, "scale_lr", 1.0))
        return torch.optim.Adam(groups(params, lr, scale_lr), lr=lr)


def _settings_of(guide: Any) -> MeanField | None:
    """The settings record of ``guide``'s family (``fit_settings_class``) built from those given
    to its constructor (deprecated, ``guide.fit_settings``), else ``None``."""
    records: dict[str, type[MeanField]] = {"MeanField": MeanField, "Symmetrized": Symmetrized}
    cls = records.get(str(getattr(guide, "fit_settings_class", "")))
    return None if cls is None else cls(**getattr(guide, "fit_settings", {}))


def _check_settings_family(guide: Any, optimizer: Any) -> None:
    """Refuse another family's fit-settings record (``pb.infer.SWAG(...)`` for an IVON guide,
    ``Symmetrized(...)`` for mean-field, whose ``num_permutations`` it would ignore): the record
    must be the guide's own (``fit_settings_class``) or a base it widens (``IVON`` for
    Kronecker IVON)."""
    from . import IBDR, IVON, SWAG, KronIVON, Laplace, SigmaNormDiversity

    records = (IBDR, IVON, SWAG, KronIVON, Laplace, SigmaNormDiversity, MeanField, Symmetrized)
    if not isinstance(optimizer, records):
        return
    expected = {c.__name__: c for c in records}.get(str(getattr(guide, "fit_settings_class", "")))
    if expected is not None and issubclass(expected, type(optimizer)):
        _warn_guide_settings_unused(guide, optimizer)
        return
    own = f"pb.infer.{expected.__name__}(...)" if expected else "a torch optimizer (or none)"
    raise TypeError(
        f"fit: optimizer={type(optimizer).__name__}(...) holds another family's settings; "
        f"{type(guide).__name__} takes {own}."
    )


def _warn_guide_settings_unused(guide: Any, record: Any) -> None:
    """Warn that the fit settings given to ``guide``'s constructor (deprecated) are not used
    when the fit passes its own record: the record holds every setting, at its defaults where
    not given (a guide's ``start_epoch=5`` beside ``SWAG(swa_lr=...)`` collected from 0)."""
    given = dict(getattr(guide, "fit_settings", None) or {})
    if not given:
        return
    keys = ", ".join(f"{k}={v!r}" for k, v in given.items())
    warnings.warn(
        f"fit: the settings given to {type(guide).__name__}'s constructor ({keys}; deprecated) "
        f"are not used: the fit's {type(record).__name__}(...) holds all of its settings, at "
        f"their defaults where not given. Give them in the record: "
        f"pb.infer.{type(record).__name__}({keys}, ...).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


#: Fitter classes by name; a guide's ``default_fitter`` is a key.
FITTERS: dict[str, type[Fitter]] = {"svi": SVIFitter}


def register_fitter(name: str, cls: type[Fitter]) -> type[Fitter]:
    """Register a :class:`Fitter` subclass under ``name`` (``KeyError`` on a collision)."""
    if name in FITTERS and FITTERS[name] is not cls:
        raise KeyError(f"Fitter name {name!r} is already registered to {FITTERS[name].__name__}.")
    FITTERS[name] = cls
    return cls


def _describe(model: Any) -> str:
    sites = getattr(model, "latent_sites", None)
    what = f"{type(model).__name__} at {id(model):#x}"
    return f"{what} ({len(sites)} latent sites)" if sites else what


def check_guide_model(model: Any, guide: Any, where: str = "fit") -> None:
    """Refuse to fit ``guide`` with a ``model`` other than the one it was built on.

    A guide is bound to its model (``guide.model``): it reads its sites from it, and
    ``pb.save(guide)`` writes that model's point parameters (the head). Fitting it with another
    model, even one of the same shapes, would train this model's head beside a posterior whose
    file then pairs it with the other model's.

    Raises
    ------
    ValueError
        Naming both models and the fix.
    """
    bound = bound_model(guide)
    if bound is None or bound is model:
        _refuse_uncovered_sites(model, guide, where)
        return
    same = getattr(bound, "latent_sites", None) is not None and {
        s: tuple(spec.shape) for s, spec in bound.latent_sites.items()
    } == {s: tuple(spec.shape) for s, spec in (getattr(model, "latent_sites", None) or {}).items()}
    raise ValueError(
        f"{where}(model, guide): the {type(guide).__name__} was built on another model "
        f"(guide.model: {_describe(bound)}) than the model passed ({_describe(model)})"
        + ("; they have the same sites and shapes, but are different objects" if same else "")
        + ". A guide is bound to the model it was built on (pb.save(guide) writes that model's "
        "head). Build the guide on this model (pb.posterior(model, ...)), or pass the model it "
        "was built on."
    )


def _refuse_uncovered_sites(model: Any, guide: Any, where: str) -> None:
    """Refuse a guide without a posterior over some of the model's latent sites (made latent
    by ``model.make_latent`` after the guide was built): a fit would train them neither as
    point parameters (they are latent now) nor as the guide's, leaving them as they are."""
    latent = getattr(model, "latent_sites", None) or {}
    sites = getattr(guide, "sites", None)
    if not latent or not sites:
        return
    missing = sorted(set(latent) - set(sites))
    if not missing:
        return
    raise ValueError(
        f"{where}(model, guide): the {type(guide).__name__} has no posterior over the model's "
        f"latent sites {missing[:4]}{' ...' if len(missing) > 4 else ''} (made latent by "
        "model.make_latent after the guide was built): a fit would leave them at their values, "
        "trained neither as point parameters nor as the guide's. Build a new guide on the model "
        "(pb.posterior(model, family); a Laplace or SWAG posterior can start from this fitted "
        "one: pb.posterior(model, 'laplace', init=guide))."
    )


def make_fitter(model: Any, guide: Any, **kwargs: Any) -> Fitter:
    """The fitter of ``guide``'s family (``FITTERS[guide.default_fitter]``) over ``model``.

    ``kwargs`` (``loss``, ``optimizer``, ``lr``) go to its constructor.

    Raises
    ------
    ValueError
        When ``guide`` was built on another model (:func:`check_guide_model`).
    """
    name = guide.default_fitter
    try:
        cls = FITTERS[name]
    except KeyError:
        raise ValueError(
            f"{type(guide).__name__}.default_fitter = {name!r} is not a registered fitter "
            f"({sorted(FITTERS)}); register it with pyrobayes.infer.register_fitter."
        ) from None
    _check_settings_family(guide, kwargs.get("optimizer"))
    fitter = cls(model, guide, **kwargs)  # its own argument errors first (e.g. no sites yet)
    check_guide_model(model, guide, "fit")
    # pb.fit holds a temperature off the guide until its own refusals are past, and drops it
    # only for a fit that changes the guide (loop._HeldTemperature): this drop is a hand-driven
    # fitter's
    drop_temperature(guide, owner="fit: ")
    return fitter
