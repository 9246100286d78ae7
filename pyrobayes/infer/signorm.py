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
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from ..models.signorm import diversity, update_statistics
from .fitter import SVIFitter
from .objectives import register_objective, scaled_log_likelihood, split_training_batch

logger = logging.getLogger(__name__)

__all__ = [
    "DiversityOptions",
    "SigmaNormObjective",
    "SigmaNormFitter",
    "members_program",
    "members_guide",
    "tau_sweep",
    "frontier",
]


@runtime_checkable
class DiversityOptions(Protocol):
    """A members posterior that carries σN's diversity options (the ``"signorm"`` guide).

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


def _members(guide: Any) -> tuple[Mixture, DiversityOptions]:
    if not (implements(guide, Mixture) and implements(guide, DiversityOptions)):
        raise TypeError(
            "The 'signorm' objective fits the members of a σN-ensemble (a Mixture posterior "
            "with tau, strength and diversity_sites, e.g. pb.posterior(model, 'signorm')); got "
            f"{type(guide).__name__}."
        )
    return cast(Mixture, guide), cast(DiversityOptions, guide)


class SigmaNormObjective:
    r"""``L = −(N/B) Σ_b (1/M) Σ_t log p(y_b | θ_t) + N λ L_div`` over the M members.

    Reports the terms per training example, so that ``loss = N · (nll + div)`` exactly (as the
    ELBO's ``nll + kl`` and MAP's ``nll + prior``): ``nll``, the members' mean negative
    log-likelihood of one example, and ``div``, ``λ L_div`` (0 without a diversity term).
    """

    def __init__(self) -> None:
        self._terms: dict[str, Tensor] = {}

    def loss(self, model: Any, guide: Any, batch: Any) -> Tensor:
        mixture, options = _members(guide)
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
    ``FineTuneModel(train_backbone_mode=True)``: in eval mode the statistics stay fixed)."""

    def _after_step(self) -> None:
        net = getattr(self.model, "net", None)
        if net is not None and implements(self.guide, Mixture):
            update_statistics(net, cast(Mixture, self.guide).component_locs())


class _MaskSites(Messenger):
    """Mask the log-density of the named sample sites (here: the members' prior)."""

    def __init__(self, sites: Iterable[str]) -> None:
        super().__init__()
        self.sites = set(sites)

    def _process_message(self, msg: Any) -> None:
        if msg["type"] == "sample" and msg["name"] in self.sites:
            msg["mask"] = False


def members_program(model: Any, guide: Any) -> Callable[[Any], None]:
    r"""σN's objective as a Pyro model over one batch (pair it with :func:`members_guide`).

    ``plate("members", M)`` with ``poutine.scale(1/M)`` around ``model(batch)`` (the latent
    sites' prior masked: no prior on the members), then
    ``pyro.factor("sigmaN_div", −N λ L_div(γ))``. With the members' Delta guide,
    ``Trace_ELBO().differentiable_loss(program, members_guide(guide), batch)`` equals
    :class:`SigmaNormObjective`'s loss.
    """
    mixture, options = _members(guide)
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
    mixture, _ = _members(guide)
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
    **guide_options: Any,
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
    **guide_options
        Further ``"signorm"`` guide options (``num_members``, ``strength``, ...).

    Returns
    -------
    list of dict
        One row per τ: ``tau``, ``accuracy``, ``nll``, ``ece``, ``disagreement`` (mean pairwise
        fraction of differing member predictions), ``member_nll`` (mean member NLL; Jensen:
        ``nll ≤ member_nll``) and ``on_frontier`` (1.0 / 0.0).
    """
    from ..metrics import calibration_error
    from ..predictive import predict
    from ..registry import get_guide_class
    from .loop import fit

    rows: list[dict[str, float]] = []
    for tau in taus:
        model = make_model()
        guide = get_guide_class("signorm")(model, tau=float(tau), **guide_options)
        fit(model, guide, train_data, epochs=epochs, lr=lr, seed=seed)
        members = int(cast(Mixture, guide).num_components)
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
