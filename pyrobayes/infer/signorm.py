r"""Fitting σN-ensembles: the members objective, its Pyro program, and the τ sweep.

Lopez-Gonzalez et al. (2025), "Controllable Diversity in Normalization-Based Implicit Ensembles
via Softmax-Temperature Modulation". The M members (point particles of the ``"signorm"`` guide)
minimise, in the dataset-sum convention,

.. math::

    L = -\frac{N}{B}\sum_b \frac1M\sum_{t=1}^{M}\log p(y_b\mid x_b,θ_t) + N λ\,L_{div},\qquad
    L_{div} = \sum_{ℓ∈R}\sum_i\sum_m \log\operatorname{softmax}_τ(σ(γ_{\cdot,ℓ,i}))_m ,

with all members in ONE sample-batched forward. As a Pyro program (:func:`members_program`):
a ``members`` plate of size M under ``poutine.scale(1/M)`` around the model (the mean member
log-likelihood, an ELBO with a fixed uniform member distribution; never the mixture marginal,
which lets one member dominate), the latent sites' prior masked out (the members are point
estimates of a multi-task model), and ``pyro.factor("sigmaN_div", −N λ L_div)``.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from torch import Tensor

from ..batch import batch_size
from ..contract import Mixture, implements
from ..models.adapters import check_real
from ..models.signorm import diversity, member_norms, scale_sites, update_statistics
from .distributed import all_reduce_sum_, world
from .fitter import SVIFitter
from .objectives import register_objective, scaled_log_likelihood, split_training_batch

logger = logging.getLogger(__name__)

__all__ = [
    "SigmaNormDiversity",
    "DiversityOptions",
    "SigmaNormObjective",
    "SigmaNormFitter",
    "members_program",
    "members_guide",
    "tau_sweep",
    "frontier",
]


@dataclass(frozen=True)
class SigmaNormDiversity:
    r"""σN's fit settings: the diversity term of its objective (Lopez-Gonzalez et al., 2025,
    Eq. 3), the fitter's, not the posterior's.

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.SigmaNormDiversity(tau=0.25, strength=0.01)))``
    or ``make_fitter(model, guide, optimizer=pb.infer.SigmaNormDiversity(...))``. Saved in the
    fitter's checkpoint (a resume under other settings is refused), not with the posterior.

    Parameters
    ----------
    tau : float
        τ > 0, the softmax temperature (0.5): small τ gives single-owner features (hard
        partition), intermediate τ about ``k*(τ)`` owners
        (:func:`pyrobayes.models.signorm.owner_corner`).
    strength : float
        λ ≥ 0, the weight of the diversity term relative to the mean per-example loss (1e-3).
    regularized : "all" or list of str or str
        The member norm layers in R (module names, suffix match, or a regex over full paths).
    optimizer : torch optimizer class or callable ``params -> Optimizer``, optional
        The torch optimizer (``None``: Adam at the fit's ``lr``; a class is built as
        ``cls(params, lr=lr)``). A checkpoint records it by name.
    """

    tau: float = 0.5
    strength: float = 1e-3
    regularized: Sequence[str] | str = "all"
    optimizer: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        owner = "SigmaNormDiversity(): "
        check_real("tau", self.tau, gt=0, owner=owner)
        check_real("strength", self.strength, ge=0, owner=owner)
        regularized = self.regularized
        if not isinstance(regularized, str):
            if not all(isinstance(r, str) for r in regularized):
                raise TypeError(f"{owner}regularized must be 'all', a str or a list of str.")
            object.__setattr__(self, "regularized", list(regularized))
        if self.optimizer is not None and not callable(self.optimizer):
            raise TypeError(
                f"{owner}optimizer must be a torch optimizer class or a callable params -> "
                f"Optimizer; got {type(self.optimizer).__name__}."
            )


@runtime_checkable
class DiversityOptions(Protocol):
    """The resolved diversity term of σN over a model (:func:`diversity_of`).

    Attributes
    ----------
    tau : float
        τ, the softmax temperature.
    strength : float
        λ, the weight of ``L_div`` relative to the mean per-example loss.
    diversity_sites : list of str
        The pre-sigmoid scale sites ``γ`` in R.
    """

    tau: float
    strength: float
    diversity_sites: list[str]


@dataclass
class _Diversity:
    tau: float
    strength: float
    diversity_sites: list[str]


def _settings_of(guide: Any) -> SigmaNormDiversity:
    """The settings given to the guide's constructor (deprecated), else the defaults."""
    return SigmaNormDiversity(**getattr(guide, "fit_settings", {}))


def diversity_of(model: Any, settings: SigmaNormDiversity) -> DiversityOptions:
    """``settings`` over ``model``: τ, λ and the scale sites of the layers in R."""
    sites = scale_sites(model, settings.regularized)
    return _Diversity(float(settings.tau), float(settings.strength), sites)


def _members(guide: Any) -> Mixture:
    if not implements(guide, Mixture):
        raise TypeError(
            "The 'signorm' objective fits the members of a σN-ensemble (a Mixture posterior, "
            f"e.g. pb.posterior(model, 'signorm')); got {type(guide).__name__}."
        )
    return cast(Mixture, guide)


class SigmaNormObjective:
    r"""``L = −(N/B) Σ_b (1/M) Σ_t log p(y_b | θ_t) + N λ L_div`` over the M members.

    Reports the terms per training example, so that ``loss = N · (nll + div)`` exactly (as the
    ELBO's ``nll + kl`` and MAP's ``nll + prior``): ``nll``, the members' mean negative
    log-likelihood of one example, and ``div``, ``λ L_div`` (0 without a diversity term).

    Parameters
    ----------
    settings : SigmaNormDiversity, optional
        τ, λ and R; default the fitter's (:class:`SigmaNormFitter` binds them), else those given
        to the guide (deprecated), else :class:`SigmaNormDiversity`'s defaults.
    """

    def __init__(self, settings: SigmaNormDiversity | None = None) -> None:
        self.settings = settings
        self._terms: dict[str, Tensor] = {}
        self._resolved: tuple[int, SigmaNormDiversity, DiversityOptions] | None = None

    def options(self, model: Any, guide: Any) -> DiversityOptions:
        """The diversity term over ``model`` (resolved once per model and settings)."""
        settings = self.settings or _settings_of(guide)
        cached = self._resolved
        if cached is None or cached[0] != id(model) or cached[1] != settings:
            cached = (id(model), settings, diversity_of(model, settings))
            self._resolved = cached
        return cached[2]

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        mixture = _members(guide)
        options = self.options(model, guide)
        values = mixture.component_locs()  # (M, *shape): all members in one batched forward
        nll = -scaled_log_likelihood(model, values, batch)
        inputs, _ = split_training_batch(model, batch)
        num_data = model.num_data or batch_size(inputs)
        if options.strength == 0 or not options.diversity_sites:
            self._terms = {"nll": nll.detach() / num_data, "div": torch.zeros_like(nll.detach())}
            return nll
        div = diversity([values[s] for s in options.diversity_sites], options.tau)
        self._terms = {"nll": nll.detach() / num_data, "div": options.strength * div.detach()}
        return nll + num_data * options.strength * div

    def terms(self) -> dict[str, Tensor]:
        return self._terms


register_objective("signorm", SigmaNormObjective)


class SigmaNormFitter(SVIFitter):
    r"""Adam on :class:`SigmaNormObjective`; after each step, each member's BatchNorm running
    statistics take in its batch statistics (``r_t ← (1 − m) r_t + m s_t``, member ``t`` from
    its slice of the step's batched forward; only with the backbone in training mode,
    ``FineTuneModel(train_backbone_mode=True)``: in eval mode the statistics stay fixed).

    ``optimizer`` may be a :class:`SigmaNormDiversity` (the fit's settings: τ, λ, R and the
    torch optimizer); else the settings are those given to the guide (deprecated) or the
    defaults. :meth:`state_dict` holds them; a checkpoint written under others is refused.
    """

    settings: SigmaNormDiversity  # the fit's settings record (Fitter.settings)

    def __init__(self, model: Any, guide: Any, *, optimizer: Any = None, **kwargs: Any) -> None:
        #: the fit's settings: ``optimizer`` when it is a :class:`SigmaNormDiversity`, else
        #: those given to the guide's constructor (deprecated), else the defaults
        if isinstance(optimizer, SigmaNormDiversity):
            self.settings, optimizer = optimizer, optimizer.optimizer
        else:
            self.settings = _settings_of(guide)
        super().__init__(model, guide, optimizer=optimizer, **kwargs)
        if isinstance(self.objective, SigmaNormObjective) and self.objective.settings is None:
            self.objective = SigmaNormObjective(self.settings)  # bound to this fit's settings
        if isinstance(self.objective, SigmaNormObjective):
            self.objective.options(model, guide)  # R resolved now: a bad name fails here

    def default_objective(self) -> SigmaNormObjective:
        return SigmaNormObjective()

    def _after_step(self) -> None:
        net = getattr(self.model, "net", None)
        if net is not None and implements(self.guide, Mixture):
            pool_batch_statistics(net)
            update_statistics(net, cast(Mixture, self.guide).component_locs())


def pool_batch_statistics(net: Any) -> None:
    r"""Under ``torch.distributed``, each σN BatchNorm's recorded batch statistics made those of
    the whole batch, the ranks' shares together, so that every rank folds the same values into
    its members' running statistics (before, each rank took in its own share's and the ranks'
    running statistics, hence their posteriors, drifted apart: 0.3 after 18 steps on two ranks).

    One all-reduce, after the step (which every rank finished), of ``n_r``, ``n_r m_r`` and
    ``Σ x² = (n_r − 1) v_r + n_r m_r²`` per layer, member and channel, in float64: the batch's
    mean ``m = Σ n_r m_r / N`` and unbiased variance ``(Σ x² − N m²) / (N − 1)`` are exact
    (``N = Σ n_r``). The forward itself normalises with its rank's share's statistics, as
    torch's ``BatchNorm`` under ``DistributedDataParallel`` does without ``SyncBatchNorm``.
    A no-op in one process."""
    if world()[0] == 1:
        return
    recorded = [
        (layer, layer.batch_statistics, layer.batch_count)
        for layer in member_norms(net).values()
        if layer.batch_statistics is not None
    ]
    if not recorded:
        return
    parts: list[Tensor] = []
    for _, (mean, var), count in recorded:
        mean, var, n = mean.double(), var.double(), float(count)
        parts += [mean * n, var * (n - 1) + mean.square() * n, mean.new_full((1,), n)]
    flat = torch.cat([t.reshape(-1) for t in parts])
    all_reduce_sum_([flat])
    offset = 0
    for layer, (mean, _), _ in recorded:
        size = mean.numel()
        total, squares = flat[offset : offset + size], flat[offset + size : offset + 2 * size]
        count_all = flat[offset + 2 * size]  # (on the device: no host read)
        offset += 2 * size + 1
        pooled = total / count_all
        var_all = (squares - count_all * pooled.square()) / (count_all - 1.0).clamp_min(1.0)
        shape, dtype = mean.shape, mean.dtype
        layer.batch_statistics = (
            pooled.reshape(shape).to(dtype),
            var_all.reshape(shape).to(dtype),
        )


class _MaskSites(Messenger):
    """Mask the log-density of the named sample sites (here: the members' prior)."""

    def __init__(self, sites: Iterable[str]) -> None:
        super().__init__()
        self.sites = set(sites)

    def _process_message(self, msg: Any) -> None:
        if msg["type"] == "sample" and msg["name"] in self.sites:
            msg["mask"] = False


def members_program(
    model: Any, guide: Any, settings: SigmaNormDiversity | None = None
) -> Callable[[Any], None]:
    r"""σN's objective as a Pyro model over one batch (pair it with :func:`members_guide`).

    ``plate("members", M)`` with ``poutine.scale(1/M)`` around ``model(batch)`` (the latent
    sites' prior masked: no prior on the members), then
    ``pyro.factor("sigmaN_div", −N λ L_div(γ))``. With the members' Delta guide,
    ``Trace_ELBO().differentiable_loss(program, members_guide(guide), batch)`` equals
    :class:`SigmaNormObjective`'s loss. ``settings``: τ, λ and R (default: those given to the
    guide, deprecated, else :class:`SigmaNormDiversity`'s defaults).
    """
    mixture = _members(guide)
    options = diversity_of(model, settings or _settings_of(guide))
    num_members = mixture.num_components
    sites = list(model.latent_sites)

    def program(batch: Any) -> None:
        with poutine.trace() as tape:
            with (
                pyro.plate("members", num_members, dim=-2),
                poutine.scale(scale=1.0 / num_members),
                _MaskSites(sites),
            ):
                model(batch)
        if options.strength == 0 or not options.diversity_sites:
            return
        trace = tape.trace
        gammas = [
            cast(Tensor, trace.nodes[s]["value"]).reshape(num_members, *model.latent_sites[s].shape)
            for s in options.diversity_sites
        ]
        inputs, _ = split_training_batch(model, batch)
        num_data = model.num_data or batch_size(inputs)
        pyro.factor("sigmaN_div", -num_data * options.strength * diversity(gammas, options.tau))

    return program


def members_guide(guide: Any) -> Callable[[Any], dict[str, Tensor]]:
    """The Pyro guide of :func:`members_program`: every member's point in the members plate."""
    mixture = _members(guide)
    num_members = mixture.num_components

    def members(batch: Any) -> dict[str, Tensor]:
        locs = mixture.component_locs()
        out = {}
        with pyro.plate("members", num_members, dim=-2):
            for site, value in locs.items():
                event = value.dim() - 1
                point = value.reshape(num_members, 1, *value.shape[1:])
                out[site] = pyro.sample(site, dist.Delta(point, event_dim=event))
        return out

    return members


# ---------------------------------------------------------------------------------------------
# the τ sweep
# ---------------------------------------------------------------------------------------------


def _disagreement(probs: Tensor) -> float:
    """Mean over pairs of members of the fraction of examples whose argmax differs."""
    labels = probs.argmax(-1)  # (M, N)
    num = labels.shape[0]
    if num < 2:
        return 0.0
    total, pairs = 0.0, 0
    for a in range(num):
        for b in range(a + 1, num):
            total += float((labels[a] != labels[b]).double().mean())
            pairs += 1
    return total / pairs


def frontier(rows: Sequence[Mapping[str, float]]) -> list[int]:
    """Indices of the rows on the accuracy–calibration frontier: no other row has accuracy at
    least as high and ECE at least as low, one of them strictly."""
    out = []
    for i, r in enumerate(rows):
        dominated = any(
            o["accuracy"] >= r["accuracy"]
            and o["ece"] <= r["ece"]
            and (o["accuracy"] > r["accuracy"] or o["ece"] < r["ece"])
            for j, o in enumerate(rows)
            if j != i
        )
        if not dominated:
            out.append(i)
    return out


def tau_sweep(
    make_model: Callable[[], Any],
    train_data: Iterable[Any],
    eval_data: Iterable[Any],
    *,
    taus: Sequence[float] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0),
    epochs: int = 10,
    lr: float = 1e-2,
    seed: int = 0,
    run_dir: str | Path | None = None,
    **options: Any,
) -> list[dict[str, float]]:
    r"""Fit a σN-ensemble for each τ and trace the accuracy–calibration frontier.

    Parameters
    ----------
    make_model : callable
        Returns a fresh model (e.g. a :class:`~pyrobayes.models.SigmaNormEnsemble`) per τ.
    train_data, eval_data : iterables of batches
        Fitted on the first, scored on the second (with targets).
    taus : sequence of float
        The τ grid.
    epochs, lr, seed
        :func:`pyrobayes.fit` settings (the same seed for every τ).
    run_dir : str or Path, optional
        Where ``tau_sweep.json`` and the frontier plot ``tau_sweep.png`` are written.
    **options
        ``strength`` and ``regularized`` (the fit's :class:`SigmaNormDiversity`, with each τ);
        the rest are ``"signorm"`` guide options (``num_particles``, ``init_noise``, ...).

    Returns
    -------
    list of dict
        One row per τ: ``tau``, ``accuracy``, ``nll``, ``ece``, ``disagreement`` (mean pairwise
        fraction of differing member predictions), ``member_nll`` (mean member NLL; Jensen:
        ``nll ≤ member_nll``) and ``on_frontier`` (1.0 / 0.0).
    """
    from ..metrics import calibration_error
    from ..predictive import ShuffledDataWarning, predict
    from ..registry import get_guide_class
    from .loop import fit
    from .options import Optimization

    fit_keys = ("strength", "regularized")
    diversity = {k: v for k, v in options.items() if k in fit_keys}
    guide_options = {k: v for k, v in options.items() if k not in fit_keys}
    rows: list[dict[str, float]] = []
    for tau in taus:
        model = make_model()
        likelihood = getattr(model, "likelihood", None)
        if not getattr(likelihood, "is_classification", False) or getattr(
            likelihood, "multi_label", False
        ):
            raise ValueError(
                "tau_sweep scores one class per example (accuracy, NLL, ECE and the members' "
                "disagreement of a categorical or multiple-choice predictive), but make_model's "
                f"likelihood is {getattr(likelihood, 'name', likelihood)!r}. Fit σN at each τ "
                "with pb.fit and score it with pb.metrics.report instead."
            )
        guide = get_guide_class("signorm")(model, **guide_options)
        settings = SigmaNormDiversity(tau=float(tau), **diversity)
        optim = Optimization(optimizer=settings)
        fit(model, guide, train_data, epochs=epochs, lr=lr, seed=seed, optim=optim)
        members = int(cast(Mixture, guide).num_components)
        with warnings.catch_warnings():  # scored against pred.targets: any order is right
            warnings.simplefilter("ignore", ShuffledDataWarning)
            pred = predict(model, guide, eval_data, num_samples=members)
        probs, labels = pred.probs, pred.targets
        if labels is None:
            raise ValueError(
                "tau_sweep: eval_data carries no targets, so accuracy, NLL and ECE cannot be "
                "scored; pass labelled batches ((x, y) tuples, or dicts with 'labels')."
            )
        mean = probs.mean(0)
        nll = float(-torch.log(mean.gather(-1, labels[:, None]).clamp_min(1e-30)).mean())
        member_nll = float(
            -torch.log(probs.gather(-1, labels.expand(probs.shape[0], -1)[..., None]))
            .clamp_max(1e30)
            .mean()
        )
        rows.append(
            {
                "tau": float(tau),
                "accuracy": float((mean.argmax(-1) == labels).double().mean()),
                "nll": nll,
                "ece": float(calibration_error(probs, labels).ece),
                "disagreement": _disagreement(probs),
                "member_nll": member_nll,
            }
        )
        logger.info("tau_sweep: %s", rows[-1])
    on = set(frontier(rows))
    for i, row in enumerate(rows):
        row["on_frontier"] = 1.0 if i in on else 0.0
    if run_dir is not None:
        folder = Path(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tau_sweep.json").write_text(json.dumps(rows, indent=2))
        plot_frontier(rows).savefig(folder / "tau_sweep.png", dpi=120, bbox_inches="tight")
    return rows


def plot_frontier(rows: Sequence[Mapping[str, float]], ax: Any = None) -> Any:
    """Accuracy against ECE per τ (labelled), the frontier joined by a line; returns the figure."""
    from matplotlib.figure import Figure

    if ax is None:
        fig = Figure(figsize=(4.5, 3.5))  # no pyplot: no global state, any backend
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    ece = [r["ece"] for r in rows]
    acc = [r["accuracy"] for r in rows]
    ax.scatter(ece, acc, color="tab:blue")
    for r in rows:
        ax.annotate(f"τ={r['tau']:g}", (r["ece"], r["accuracy"]), fontsize=8)
    front = sorted(frontier(rows), key=lambda i: ece[i])
    if front:
        ax.plot([ece[i] for i in front], [acc[i] for i in front], color="tab:orange", lw=1)
    ax.set_xlabel("ECE")
    ax.set_ylabel("accuracy")
    ax.set_title("σN-ensemble: accuracy–calibration over τ")
    if not math.isfinite(sum(ece)):
        logger.warning("plot_frontier: non-finite ECE values")
    return fig
