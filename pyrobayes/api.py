"""Top-level conveniences: the ``posterior`` factory (``fit`` and ``predict`` live beside it)."""

from __future__ import annotations

import logging
import warnings
from typing import Any, cast

import torch
from pyro.nn import PyroModule
from torch import nn

from .contract import Posterior, PostHoc
from .fitted_head import HeadChangedWarning, changed_heads, still_as_built
from .registry import get_guide_class
from .user_frame import user_stacklevel

logger = logging.getLogger(__name__)

__all__ = ["posterior", "start_from"]


def posterior(model: Any, family: str = "meanfield", *, init: Any = None, **kwargs: Any) -> Any:
    """Build a posterior guide by family name (as ``laplace.Laplace(...)``).

    Parameters
    ----------
    model : FineTuneModel
    family : str
        A registered name (``pyrobayes.available_guides()``), e.g. ``"meanfield"``, ``"map"``.
    init : Posterior, optional
        A fitted guide over the same ``model`` (typically a MAP, ``"map"``) whose point starts
        a post-hoc family (``"laplace"``, ``"swag"``: any :class:`~pyrobayes.contract.PostHoc`
        posterior): the new guide's point ``θ̂`` is set to ``init.mean()`` (the MAP itself for a
        point mass) and the guide is left unfitted. Then ``pyrobayes.fit(model, guide, data,
        epochs=0)`` fits a Laplace posterior's curvature and prior precision at ``θ̂`` without
        a single MAP step, and ``pyrobayes.fit(model, guide, data, epochs=E)`` runs SWAG's
        collection phase from ``θ̂``. The model's point parameters (a head, a learned noise) are
        the model's own, so they are where the MAP fit left them. See :func:`start_from`.
    **kwargs
        Passed to the family's constructor.

    Raises
    ------
    TypeError
        When ``model`` is a plain torch network (wrap it in a
        :class:`~pyrobayes.models.FineTuneModel`) or not a model at all (``None``, a string:
        the arguments swapped, a class, a posterior, an object that cannot be called),
        ``family`` is not a name, or ``init`` is
        given for a family without a point (not ``PostHoc``) or is not a posterior.
    ValueError
        When ``init`` covers other sites (or shapes) than the new guide, was fitted on another
        model (other frozen base weights, or another head), or was never fitted (its point is
        still the model's initial value at every site, or its parameters those it was built
        with: IBDR's or σN's jittered particles).

    Warns
    -----
    HeadChangedWarning
        When the model's point parameters (the head) changed since ``init`` was fitted or
        loaded (a later SWAG fit on the same model trained them):
        :class:`pyrobayes.fitted_head.HeadChangedWarning`.

    Examples
    --------
    >>> guide = pyrobayes.posterior(model, "meanfield", init_scale=0.01)  # doctest: +SKIP
    >>> map_guide = pyrobayes.posterior(model, "map")                     # doctest: +SKIP
    >>> pyrobayes.fit(model, map_guide, loader, epochs=20)                # doctest: +SKIP
    >>> la = pyrobayes.posterior(model, "laplace", init=map_guide)        # doctest: +SKIP
    >>> pyrobayes.fit(model, la, loader, epochs=0)   # curvature at the MAP  # doctest: +SKIP
    """
    _check_model(model)
    guide = get_guide_class(family)(model, **kwargs)
    if init is not None:
        start_from(guide, init)
    return guide


def _check_model(model: Any) -> None:
    """Refuse what is not a model: ``None``, a name, a class, a posterior, anything that cannot
    be called (:func:`_check_model_kind`), and a plain torch network (an ``nn.Module`` that is
    neither a FineTuneModel nor a ``PyroModule``): a guide built on it has no latent sites, and
    its fit failed inside torch. A Pyro model of the user's own (a function, a ``PyroModule``)
    is traced on first use."""
    _check_model_kind(model)
    if (
        isinstance(model, nn.Module)
        and not isinstance(model, PyroModule)
        and getattr(model, "latent_sites", None) is None
    ):
        raise TypeError(
            f"posterior: model is a plain torch network ({type(model).__name__}), which has no "
            "latent sites to place a posterior over. Wrap it in a pyrobayes.models.FineTuneModel "
            "(model = pb.models.FineTuneModel(net, pb.models.LoRAXS(rank=..., "
            "target_modules=[...]), num_data=N)) and pass that model. For a Pyro model of your "
            "own that samples with pyro.sample, build the guide class on it directly, e.g. "
            "pb.guides.MeanFieldGuide(model)."
        )


def _check_model_kind(model: Any) -> None:
    """Refuse a ``model`` that is not one: the guide was built on it all the same (``None``, a
    family name, the model's class, a posterior) and the error came at the fit, as
    ``'NoneType' object has no attribute 'train'`` or a tensor printed as the message.

    Raises
    ------
    TypeError
        Naming what was passed and what to pass instead.
    """
    usage = (
        "pass the model first and the family name second: pyrobayes.posterior(model, "
        '"meanfield", ...), with model a pyrobayes.models.FineTuneModel (or a Pyro model of your '
        "own)."
    )
    if model is None:
        raise TypeError(f"posterior: model is None; {usage}")
    if isinstance(model, str):
        raise TypeError(
            f"posterior: model is the string {model!r}, not a model (are the arguments in the "
            f"wrong order?); {usage}"
        )
    if isinstance(model, type):
        raise TypeError(
            f"posterior: model is the class {model.__name__}, not a model built from it; "
            f"build the model first (model = {model.__name__}(...)) and {usage}"
        )
    if isinstance(model, Posterior):
        raise TypeError(
            f"posterior: model is a posterior ({type(model).__name__}), not a model; build the "
            "new posterior on the model that posterior was built on (pyrobayes.posterior(model, "
            "family)), or start a post-hoc family at it with init=: pyrobayes.posterior(model, "
            '"laplace", init=guide).'
        )
    if not callable(model):
        raise TypeError(f"posterior: model is a {type(model).__name__}, not a model; {usage}")


def start_from(guide: Any, init: Any) -> Any:
    """Put the point of the post-hoc ``guide`` at ``init``'s mean and mark it unfitted.

    ``θ̂_site ← init.mean()[site]`` for every site (values copied, on the guide's device and
    dtype). Equivalent to ``guide.load_state_dict(map_guide.state_dict(), strict=False)`` for a
    MAP ``init`` (the point is stored under the same ``locs.<site>`` names), but checked: the
    sites and shapes must match, and the guide must be :class:`~pyrobayes.contract.PostHoc`.

    Returns
    -------
    The guide (for chaining).
    """
    if not isinstance(guide, PostHoc):
        raise TypeError(
            f"posterior(init=...): {type(guide).__name__} has no point to start from; init= "
            "starts a post-hoc family (a PostHoc posterior such as 'laplace' or 'swag') at a "
            "fitted guide's point."
        )
    if not isinstance(init, Posterior):
        raise TypeError(
            f"posterior(init=...) expects a fitted pyrobayes posterior (e.g. the 'map' guide "
            f"after pyrobayes.fit), got {type(init).__name__}."
        )
    point = guide
    target = cast(Posterior, guide).sites
    # sites the model made latent after init was fitted (FineTuneModel.make_latent: a trained
    # head, on init's model or on a rebuilt one with that head copied over) start at the
    # network's values; any other difference in sites is an error
    added = _made_latent_since(guide, init)
    if {s: v for s, v in target.items() if s not in added} != dict(init.sites):
        missing = sorted(set(target) - set(init.sites))
        extra = sorted(set(init.sites) - set(target))
        shapes = {
            s: (tuple(init.sites[s]), tuple(target[s]))
            for s in set(target) & set(init.sites)
            if tuple(init.sites[s]) != tuple(target[s])
        }
        raise ValueError(
            f"posterior(init=...): {type(init).__name__} covers other sites than the new "
            f"{type(guide).__name__} (missing {missing[:5]}, extra {extra[:5]}, shapes "
            f"(init, new) {dict(list(shapes.items())[:5])}). Pass a guide fitted on the same model."
        )
    _check_init_model(guide, init, added)
    values = init.mean()
    _check_init_fitted(init, values)
    _warn_if_init_head_changed(guide, init, added)
    model: Any = getattr(guide, "model", None)
    with torch.no_grad():
        for site in target:
            loc = point.loc(site)
            value = model.site_value(site) if site in added else values[site]
            loc.copy_(value.to(device=loc.device, dtype=loc.dtype))
    point.reset()
    logger.info("%s starts at the point of %s", type(guide).__name__, type(init).__name__)
    return guide


def _made_latent_since(guide: Any, init: Any) -> set[str]:
    """The new guide's sites that ``init`` lacks because the model made them latent later
    (:meth:`~pyrobayes.models.FineTuneModel.make_latent`): their value is the network's. On
    init's own model any such layer; on a rebuilt model only point parameters of init's model
    whose trained values were copied over (equal), so the new posterior sits at init's fit."""
    model: Any = getattr(guide, "model", None)
    theirs: Any = getattr(init, "model", None)
    if model is None or theirs is None:
        return set()
    extra = set(cast(Posterior, guide).sites) - set(init.sites)
    specs = getattr(model, "latent_sites", {})
    kinds = {getattr(specs.get(s), "kind", None) for s in extra}
    if not kinds <= {"weight", "bias"}:
        return set()
    if theirs is model:
        return extra
    fitted = getattr(theirs, "point_params", {})
    for site in extra:
        value = fitted.get(specs[site].param_name)
        mine = model.site_value(site)
        if value is None or value.shape != mine.shape:
            return set()
        if not torch.equal(value.detach().cpu(), mine.detach().cpu()):
            return set()
    return extra


def _check_init_model(guide: Any, init: Any, made_latent: set[str] | None = None) -> None:
    """``init`` must sit on the new guide's model, or on one with the same frozen base weights
    and the same point parameters (a rebuilt copy with the head copied over; a point parameter
    the rebuilt model then made latent, ``made_latent``, has been compared already)."""
    from .io.compatibility import (  # local: io imports the registry
        base_fingerprint,
        differing_point_params,
    )

    mine, theirs = getattr(guide, "model", None), getattr(init, "model", None)
    if mine is None or theirs is None or mine is theirs:
        return
    here, there = base_fingerprint(mine), base_fingerprint(theirs)
    fix = (
        " Pass a guide fitted on this model, or build the new guide on init's model "
        "(pyrobayes.posterior(init.model, ...))."
    )
    if here is not None and there is not None and here["sha256"] != there["sha256"]:
        raise ValueError(
            f"posterior(init=...): the {type(init).__name__} was fitted on another model: the "
            f"frozen base weights differ (fingerprint {there['sha256'][:16]}… for init.model, "
            f"{here['sha256'][:16]}… for the model of the new {type(guide).__name__})." + fix
        )
    specs = getattr(mine, "latent_sites", {})
    moved = {specs[s].param_name for s in made_latent or ()}
    differ = differing_point_params(mine, theirs, skip=moved)
    if differ:
        raise ValueError(
            f"posterior(init=...): the {type(init).__name__} was fitted on another model whose "
            f"point parameters differ from this model's ({differ[:5]}): the post-hoc posterior "
            "would sit at init's point beside a head it was not fitted with." + fix
        )


def _warn_if_init_head_changed(guide: Any, init: Any, made_latent: set[str]) -> None:
    """Warn (:class:`~pyrobayes.fitted_head.HeadChangedWarning`) when the point parameters of
    ``init``'s model changed since ``init`` was fitted or loaded: the new post-hoc posterior
    would start at ``init``'s point beside a head ``init`` was not fitted with. A point
    parameter the model has made latent since (``made_latent``: the new guide's sites that
    start at the network's values) is no longer a point parameter, and no change."""
    specs = getattr(getattr(guide, "model", None), "latent_sites", {})
    moved = {specs[s].param_name for s in made_latent if s in specs}
    changed = [n for n in changed_heads(init, getattr(init, "model", None)) if n not in moved]
    if not changed:
        return
    warnings.warn(
        f"posterior(init=...): the model's point-estimated parameters {changed[:4]} (the head) "
        f"changed since this {type(init).__name__} was fitted or loaded, by another fit on the "
        "same model (SWAG, or Laplace with epochs > 0, train the head of the MAP they start "
        "from) or by pb.load of another posterior into it: the new "
        f"{type(guide).__name__} starts at the {type(init).__name__}'s point beside a head it "
        "was not fitted with. Build the post-hoc families before the fit that trains the head "
        "(SWAG last), give that fit its own copy of the model (copy.deepcopy(model)), or pb.save "
        f"the {type(init).__name__} after its fit and pb.load it back first to restore its head.",
        HeadChangedWarning,
        stacklevel=user_stacklevel(),
    )


def _check_init_fitted(init: Any, values: dict[str, torch.Tensor]) -> None:
    """An ``init`` whose point is still its model's initial value at every site was never
    fitted (a fit that moved nothing is indistinguishable, and as useless as a start); nor was
    one whose parameters are still those it was built with (IBDR's or σN's jittered particles,
    away from the model's values: :func:`~pyrobayes.fitted_head.still_as_built`)."""
    if still_as_built(init):
        raise ValueError(
            f"posterior(init=...): the {type(init).__name__} was never fitted (pb.fit) nor "
            "loaded (pb.load): its parameters are still those it was built with (the model's "
            "initial values plus its initialisation's jitter). Fit it first "
            "(pyrobayes.fit(model, init, data, ...)), or build the post-hoc family without "
            "init= (it then fits its own MAP stage)."
        )
    model = getattr(init, "model", None)
    site_value = getattr(model, "site_value", None)
    if site_value is None or not values:
        return
    for site, value in values.items():
        start = site_value(site)
        if start.shape != value.shape or not torch.equal(start.to(value), value.detach()):
            return
    raise ValueError(
        f"posterior(init=...): the {type(init).__name__} was never fitted: its point equals its "
        "model's initial value at every site. Fit it first (pyrobayes.fit(model, init, data, "
        "...)), or build the post-hoc family without init= (it then fits its own MAP stage)."
    )
