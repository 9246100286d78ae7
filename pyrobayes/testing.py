r"""A conformance kit for posterior families: :func:`check_family`.

Any posterior family, inside the package or written outside it, can be run through the contract
every registered family meets, on a tiny built-in problem (an MLP ``4 → 6 → 6 → 3`` with LoRA-XS
cores of rank 2 on its first two layers and a point-estimated head, 24 examples in batches of 8,
categorical likelihood):

========================  ============================================================================
``"setup"``               the guide is built from a ``FineTuneModel`` and covers its latent sites
``"fit"``                 the family's fitter (what :func:`pyrobayes.fit` drives) runs a few
                          epochs with finite losses
``"contract"``            ``sample_posterior`` shapes, reproducibility under a generator,
                          ``log_prob`` ``(S,)`` finite, ``validation_values``, and ``mean``
                          shaped as the sites and equal to the average of ``num_draws``
                          draws (below)
``"log_prob"``            ``log_prob`` is the density of what ``sample_posterior`` draws
                          (a Monte-Carlo check, below)
``"rsample"``             the fit's draws are q's: ``rsample`` (and, for an ``AnalyticKL``
                          family, ``rsample_with_kl``, what the ELBO draws) match
                          ``sample_posterior``'s means and sds per coordinate, and the
                          closed-form KL is ``E_q[log q − log p]`` (below)
``"pyro"``                Pyro's ``Predictive`` and ``Trace_ELBO`` run on the guide, and ``SVI``
                          steps it (or, for a post-hoc family, refuses it before its fit)
``"save_load"``           :func:`pyrobayes.save` → :func:`pyrobayes.load` round-trips the state,
                          the draws and ``log_prob`` exactly
``"export"``              :func:`pyrobayes.to_inference_data` writes every site's draws
``"resume"``              a fit checkpointed mid-epoch and resumed into a fresh model and guide
                          ends bit for bit where the uninterrupted fit ends
========================  ============================================================================

The ``log_prob`` check. For continuous draws it uses the importance-sampling identity
``E_{θ∼q}[r(θ)/q(θ)] = ∫ r = 1`` for any normalised density ``r`` whose support lies in ``q``'s
(Robert & Casella, 2004, "Monte Carlo Statistical Methods", sec. 3.3): ``r`` is a Gaussian fitted
to one half of the draws with its covariance shrunk by ``c²``, and the mean of the weights ``r/q``
over the other half must be 1 within five standard errors (plus 0.02 for the error of the
standard error itself). If ``q`` is Gaussian, ``Var_q(r/q) = (c²(2 − c²))^{-d/2} − 1`` in ``d``
dimensions; ``c²`` is chosen so this is 0.5, ``c² = 1 − sqrt(1 − 1.5^{-2/d})`` (0.69 for
``d = 8``), so with 2 000 weights the standard error is ≈ 0.016 whatever ``d``, and a
``log_prob`` off by a constant ``a`` moves the mean to ``e^{−a}`` (``a = 0.25``: 0.78, a 14-σ
miss). When the draws repeat (a point mass, a particle ensemble) ``q`` is discrete: each atom's
frequency among ``S`` draws must match ``exp(log_prob)`` within five binomial standard errors
``sqrt(p(1 − p)/S)``.

The ``mean`` check. The average of ``S`` independent draws of a coordinate ``θ_j`` has mean
``E_q[θ_j]`` and, by the central limit theorem, standard error ``sd_j / sqrt(S)``, with
``sd_j`` the draws' own sample standard deviation: ``mean()`` must lie within five of them of
the average (a miss has probability 5.7e-7 per coordinate), plus ``1e-6 (1 + |mean|)`` for
float32 rounding, so a point mass (``sd_j = 0``) must match its draws. For a mixture this is
the mixture mean ``(1/K) Σ_k μ_k``.

The ``rsample`` check. A family fits with the draws of ``rsample`` (an ``AnalyticKL`` family's
ELBO: ``rsample_with_kl``, which also returns ``KL(q ‖ p)``) and predicts with
``sample_posterior``: ``num_draws`` of each, per coordinate, must agree in mean within five
standard errors of the difference of two averages, ``5 sqrt(sd_a²/n + sd_b²/n)``, and in
standard deviation within five standard errors of the difference of two sample sds, each with
``Var(s) ≈ (μ₄ − σ⁴)/(4σ²(n − 1))`` (the delta method), at least the Gaussian
``σ²/(2(n − 1))``; both plus ``1e-6 (1 + |value|)`` for float32 rounding. With the default
``n = 4000`` and a Gaussian q the tolerances are 0.11 sd (means) and 0.08 sd (sds). An ``AnalyticKL`` family's KL (from
``rsample_with_kl`` and ``kl_to_prior``) must equal the Monte Carlo
``E_q[log q(θ) − log p(θ)]`` (``log_prob`` and the model's ``log_prior`` at ``n`` draws of
``sample_posterior``) within five of its standard errors ``sd/sqrt(n)`` plus
``1e-4 (1 + |KL|)``. Not checked, and said so in the report: the KL of a family without a
closed form (point masses, mixtures, SWAG, Laplace), of ``rsample_with_kl`` raising
``NotImplementedError`` (the ELBO then falls back to ``rsample`` and a Monte Carlo KL), and of
a ``prior`` other than ``"model"`` (an empirical prior the ELBO chooses).

Examples
--------
>>> from pyrobayes.testing import check_family
>>> report = check_family(MyGuide)          # doctest: +SKIP
>>> report.passed, report.failures          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyro
import pyro.optim
import torch
from torch import Tensor, nn

from .rng import seed_forked

logger = logging.getLogger(__name__)

__all__ = ["CHECKS", "ConformanceError", "ConformanceReport", "check_family", "tiny_problem"]

#: The checks :func:`check_family` runs, in order.
CHECKS: tuple[str, ...] = (
    "setup",
    "fit",
    "contract",
    "log_prob",
    "rsample",
    "pyro",
    "save_load",
    "export",
    "resume",
)

_NUM_DATA, _BATCH, _WIDTHS = 24, 8, (4, 6, 6, 3)


class ConformanceError(AssertionError):
    """A family failed :func:`check_family`; ``report`` holds every check's outcome."""

    def __init__(self, report: ConformanceReport) -> None:
        super().__init__(str(report))
        self.report = report


@dataclass
class ConformanceReport:
    """The outcome of :func:`check_family`: ``results[check] = (passed, detail)``."""

    family: str
    results: dict[str, tuple[bool, str]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when every check that ran passed."""
        return all(ok for ok, _ in self.results.values())

    @property
    def failures(self) -> list[str]:
        """The names of the checks that failed."""
        return [name for name, (ok, _) in self.results.items() if not ok]

    def __str__(self) -> str:
        lines = [f"conformance of {self.family}: " + ("passed" if self.passed else "FAILED")]
        for name, (ok, detail) in self.results.items():
            lines.append(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
        return "\n".join(lines)


@dataclass
class _Problem:
    model: Any
    data: list[tuple[Tensor, Tensor]]


def tiny_problem(
    *,
    seed: int = 0,
    adapter: Callable[[Any], Any] | None = None,
    net: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[Any, list[tuple[Tensor, Tensor]]]:
    """The kit's problem: ``(model, batches)``, the same for the same ``seed``.

    Parameters
    ----------
    seed : int
        Seeds the network, the adapter and the data.
    adapter : callable, optional
        ``LoRAXS -> adapter``: replaces the default LoRA-XS cores (rank 2 on modules ``"0"`` and
        ``"2"``), e.g. by LoRA factors of the same rank.
    net : callable, optional
        ``nn.Sequential -> nn.Module``: transforms the network before the model is built
        (e.g. appends a norm layer); keep the module names: ``"0"`` and ``"2"`` carry the
        adapter, ``"4"`` is the point-estimated head (``trainable_modules``).
    """
    from .models import FineTuneModel, LoRAXS

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(_WIDTHS) - 1):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(_WIDTHS[i], _WIDTHS[i + 1]))
    network: nn.Module = nn.Sequential(*layers)
    if net is not None:
        network = net(network)
    base_adapter: Any = LoRAXS(rank=2, target_modules=["0", "2"])
    if adapter is not None:
        base_adapter = adapter(base_adapter)
    model = FineTuneModel(network, base_adapter, num_data=_NUM_DATA, trainable_modules=["4"])
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(_NUM_DATA, _WIDTHS[0], generator=g)
    y = torch.randint(0, _WIDTHS[-1], (_NUM_DATA,), generator=g)
    return model, [(x[i : i + _BATCH], y[i : i + _BATCH]) for i in range(0, _NUM_DATA, _BATCH)]


def check_family(
    family: type | Callable[[Any], Any],
    *,
    options: Mapping[str, Any] | None = None,
    adapter: Callable[[Any], Any] | None = None,
    net: Callable[[nn.Module], nn.Module] | None = None,
    epochs: int = 3,
    lr: float = 1e-2,
    optimizer: Any = None,
    checks: Sequence[str] = CHECKS,
    num_draws: int = 4000,
    raise_on_failure: bool = True,
) -> ConformanceReport:
    """Run the registry-wide contract on ``family``, a guide class or a factory ``model -> guide``.

    Parameters
    ----------
    family : type or callable
        A :class:`~pyrobayes.guides.base.PosteriorGuide` subclass (built as ``family(model,
        **options)``) or any callable ``model -> guide``. An unregistered class is registered
        (:func:`pyrobayes.register_guide`, under its ``family``) during the ``save_load``,
        ``export`` and ``resume`` checks only: :func:`pyrobayes.load` finds a class by name.
    options : mapping, optional
        Constructor options of a guide class.
    adapter, net : callable, optional
        Transforms of the tiny problem (:func:`tiny_problem`) the family needs.
    epochs : int
        Epochs of each fit (3 batches each).
    lr : float
        Learning rate of the fits.
    optimizer : optional
        ``optimizer=`` of the fitter (default: the family's).
    checks : sequence of str
        A non-empty subset of :data:`CHECKS` (default all), with ``"setup"``, and ``"fit"``
        unless only ``"resume"`` is asked for (the other checks run on the fitted guide).
    num_draws : int
        Draws of the ``log_prob`` check, of ``contract``'s ``mean`` check and of each draw
        set of the ``rsample`` check (see the module docstring for their tolerances).
    raise_on_failure : bool
        Raise :class:`ConformanceError` (an ``AssertionError``) when a check fails.

    Returns
    -------
    ConformanceReport
        Every check's outcome with a one-line detail; ``str(report)`` lists them.

    Raises
    ------
    ConformanceError
        When ``raise_on_failure`` and a check failed; its message names the failing checks.
    ValueError
        An unknown check name, an empty ``checks``, or ``checks`` without the ``"setup"`` /
        ``"fit"`` the others need; ``epochs`` < 1, ``lr`` not a finite number > 0, or
        ``num_draws`` < 1000 (the tolerances rest on the central limit theorem: fewer draws
        would fail a correct family).
    TypeError
        ``checks`` is one string rather than a sequence of names; ``family`` is a name or a
        built guide rather than a class or a factory; a count that is not an integer.
        (``options`` with a factory, which never sees them, is a ``ValueError``.)
    """
    _check_checks(checks)
    epochs, lr, num_draws = _check_arguments(family, options, epochs, lr, num_draws)
    kit = _Kit(family, dict(options or {}), adapter, net, epochs, lr, optimizer, num_draws)
    report = ConformanceReport(kit.name)
    for name in CHECKS:
        if name not in checks:
            continue
        try:
            detail = getattr(kit, f"check_{name}")()
            report.results[name] = (True, detail)
        except Exception as err:  # noqa: BLE001 - every failure is reported under its check
            where = traceback.extract_tb(err.__traceback__)[-1]
            report.results[name] = (
                False,
                f"{type(err).__name__}: {err} (at {Path(where.filename).name}:{where.lineno})",
            )
            if name in ("setup", "fit"):  # the other checks need a built and fitted guide
                break
    logger.info("%s", report)
    if raise_on_failure and not report.passed:
        raise ConformanceError(report)
    return report


#: the fewest draws the statistical checks' tolerances hold for (the module docstring)
_MIN_DRAWS = 1000


def _check_arguments(
    family: Any, options: Any, epochs: Any, lr: Any, num_draws: Any
) -> tuple[int, float, int]:
    """Refuse a ``family`` the kit cannot build guides with and settings under which a correct
    family would fail (no fit, too few draws): each failure would be reported against the
    family. Returns ``(epochs, lr, num_draws)`` as Python numbers."""
    from .models.adapters import check_int, check_real

    owner = "check_family: "
    if isinstance(family, str):
        raise TypeError(
            f"{owner}family must be a guide class or a factory model -> guide, got the name "
            f"{family!r}; pass the class, e.g. pyrobayes.registry.get_guide_class({family!r})."
        )
    if isinstance(family, nn.Module) or not callable(family):
        what = "a built guide" if isinstance(family, nn.Module) else "not callable"
        raise TypeError(
            f"{owner}family must be a guide class or a factory model -> guide; got a "
            f"{type(family).__name__} instance ({what}). Pass its class, e.g. "
            "check_family(type(guide), options=...): the kit builds guides on its own problems."
        )
    if options and not isinstance(family, type):  # a factory is called as family(model)
        raise ValueError(
            f"{owner}options={dict(options)!r} go with a guide class; the factory "
            f"{getattr(family, '__name__', family)!r} is called as family(model) and would "
            "never see them. Pass them inside it, e.g. lambda model: MyGuide(model, **options)."
        )
    epochs = check_int("epochs", epochs, ge=1, owner=owner)
    lr = check_real("lr", lr, gt=0, owner=owner)
    num_draws = check_int("num_draws", num_draws, ge=1, owner=owner)
    if num_draws < _MIN_DRAWS:
        raise ValueError(
            f"{owner}num_draws={num_draws} is too few: the contract, log_prob and rsample "
            f"checks' 5-standard-error tolerances need at least {_MIN_DRAWS} draws (with fewer "
            f"a correct family fails them). Pass num_draws >= {_MIN_DRAWS} (default 4000)."
        )
    return epochs, lr, num_draws


def _check_checks(checks: Sequence[str]) -> None:
    """Refuse a ``checks`` list that would run nothing or run a check without what it needs."""
    if isinstance(checks, str):
        raise TypeError(
            f"check_family: checks must be a sequence of check names, got the string "
            f"{checks!r}; pass checks=({checks!r},) or a subset of {list(CHECKS)}."
        )
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"check_family: unknown checks {unknown}; choose from {list(CHECKS)}.")
    if not checks:
        raise ValueError(
            "check_family: checks is empty, so nothing would run and the report would pass; "
            f"leave checks out to run all of {list(CHECKS)}, or name a subset of them."
        )
    # every check runs on the problem "setup" builds; all but "resume" also on the guide
    # "fit" fitted (resume fits its own)
    needs = ["setup"] + (["fit"] if set(checks) - {"setup", "fit", "resume"} else [])
    lacking = [c for c in needs if c not in checks]
    if lacking:
        wanted = tuple(c for c in CHECKS if c in checks or c in lacking)
        raise ValueError(
            f"check_family: checks {list(checks)} need {lacking} (the others run on the guide "
            f"they build and fit); pass checks={wanted}."
        )


def _free_name(cls: type) -> str:
    """A registry name for an unregistered ``cls``: the first of its ``family`` and its
    lower-cased class name that is a valid name no other class holds, else
    ``"conformance-<class name>"``."""
    from .registry import _REGISTRY

    lowered = cls.__name__.lower()
    for name in (getattr(cls, "family", ""), lowered):
        valid = isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9_-]*", name)
        if valid and _REGISTRY.get(name, cls) is cls:
            return name
    name = "conformance-" + re.sub(r"[^a-z0-9_-]+", "-", lowered)
    while _REGISTRY.get(name, cls) is not cls:
        name += "-"
    return name


def _perturb(tensors: Any) -> None:
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point():
                t.add_(0.5)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the library's own warnings that a tiny problem provokes (few draws for PSIS)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto")
        warnings.filterwarnings("ignore", category=UserWarning, module="arviz")
        yield


def _seeded(seed: int, draw: Callable[[], Any]) -> Any:
    """``draw()`` without gradients on the global RNG seeded with ``seed``, restored after."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        seed_forked(seed)  # the CPU's, which the fork restores (not every GPU's)
        return draw()


def _no_analytic_kl(guide: Any) -> str:
    """Why a family's KL is not checked against its Monte Carlo estimate."""
    from .contract import Mixture, implements

    if guide.is_deterministic:
        return "a point mass has no KL to a continuous prior (its objective is not the ELBO)"
    if implements(guide, Mixture):
        return "a mixture has no closed-form KL (not AnalyticKL)"
    return "no closed-form KL (not AnalyticKL; an ELBO estimates it from log_prob)"


def _moments(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per column of ``x`` ``(n, d)``: the mean, the sample sd and the sample variance."""
    var = x.var(0)
    return x.mean(0), var.sqrt(), var


def _var_sd(sd: Tensor, x: Tensor, num: int) -> Tensor:
    """``Var(s)`` of the sample sd ``s`` of ``num`` draws (the derivation is at its use)."""
    s2 = sd.square()
    m4 = (x - x.mean(0)).pow(4).mean(0)
    return (m4 - s2.square()).clamp_min(2 * s2.square()) / (4 * (num - 1) * s2.clamp_min(1e-300))


class _Kit:
    def __init__(
        self,
        family: Any,
        options: dict[str, Any],
        adapter: Any,
        net: Any,
        epochs: int,
        lr: float,
        optimizer: Any,
        num_draws: int,
    ) -> None:
        self.family, self.options = family, options
        self.adapter, self.net = adapter, net
        self.epochs, self.lr, self.optimizer, self.num_draws = epochs, lr, optimizer, num_draws
        self.name = getattr(family, "__name__", repr(family))
        self.model: Any = None
        self.guide: Any = None
        self.data: list[tuple[Tensor, Tensor]] = []

    # ------------------------------------------------------------------ helpers
    def _problem(self, seed: int = 0) -> tuple[Any, list[tuple[Tensor, Tensor]]]:
        return tiny_problem(seed=seed, adapter=self.adapter, net=self.net)

    def _build(self, model: Any) -> Any:
        if isinstance(self.family, type):
            return self.family(model, **self.options)
        return self.family(model)

    def _fit(self, model: Any, guide: Any, data: Any) -> Any:
        from .infer import make_fitter

        pyro.set_rng_seed(0)
        fitter = make_fitter(model, guide, optimizer=self.optimizer, lr=self.lr)
        fitter.begin(data)
        losses = []
        for epoch in range(self.epochs):
            for batch in data:
                losses.append(fitter.step(batch))
            fitter.epoch_end(epoch)
        fitter.end(data)
        return losses

    @contextlib.contextmanager
    def _registered(self) -> Iterator[str]:
        """The guide's registry name; an unregistered class is registered for the check only
        (under its ``family``, else, or when that name is another class's, e.g. a subclass's
        inherited one, under a name made of its class name) and removed after it."""
        from .registry import _REGISTRY, family_of, register_guide

        cls = type(self.guide)
        try:
            known = family_of(self.guide)
        except ValueError:
            known = None
        if known is not None:
            yield known
            return
        name = _free_name(cls)
        register_guide(name, cls)
        try:
            yield name
        finally:
            if _REGISTRY.get(name) is cls:
                del _REGISTRY[name]

    # ------------------------------------------------------------------ the checks
    def check_setup(self) -> str:
        pyro.clear_param_store()
        self.model, self.data = self._problem()
        self.guide = self._build(self.model)
        self.name = f"{type(self.guide).__name__}"
        sites = set(self.guide.sites)
        _expect(
            sites == set(self.model.latent_sites),
            f"guide sites {sorted(sites)} != the model's latent sites "
            f"{sorted(self.model.latent_sites)}",
        )
        return f"{len(sites)} sites"

    def check_fit(self) -> str:
        losses = self._fit(self.model, self.guide, self.data)
        _expect(all(math.isfinite(v) for v in losses), f"non-finite losses {losses}")
        return f"{len(losses)} steps, last loss {losses[-1]:.4g}"

    def check_contract(self) -> str:
        guide, model = self.guide, self.model
        gen = torch.Generator
        a = guide.sample_posterior(5, generator=gen().manual_seed(3))
        b = guide.sample_posterior(5, generator=gen().manual_seed(3))
        _expect(set(a) == set(model.latent_sites), f"draws cover {sorted(a)}")
        for site, spec in model.latent_sites.items():
            _expect(
                tuple(a[site].shape) == (5, *spec.shape),
                f"site {site!r}: draws of shape {tuple(a[site].shape)}, expected "
                f"{(5, *spec.shape)}",
            )
            _expect(bool(torch.isfinite(a[site]).all()), f"site {site!r}: non-finite draws")
            _expect(torch.equal(a[site], b[site]), f"site {site!r}: same generator, other draws")
        if not guide.is_deterministic:
            c = guide.sample_posterior(5, generator=gen().manual_seed(4))
            _expect(
                any(not torch.equal(a[s], c[s]) for s in a),
                "another generator seed gave the same draws (is_deterministic is False)",
            )
        log_q = guide.log_prob(a)
        _expect(tuple(log_q.shape) == (5,), f"log_prob shape {tuple(log_q.shape)}, expected (5,)")
        _expect(bool(torch.isfinite(log_q).all()), f"log_prob at own draws: {log_q.tolist()}")
        values = guide.validation_values()
        _expect(set(values) == set(guide.sites), f"validation_values() covers {sorted(values)}")
        _expect(
            all(v.shape[1:] == model.latent_sites[s].shape for s, v in values.items()),
            "validation_values shapes are not (S, *site_shape)",
        )
        mean = self._check_mean()
        return f"shapes, reproducibility, log_prob, {mean}, validation_values"

    def _check_mean(self) -> str:
        """``mean()`` covers the sites at their shapes and is the mean of the draws."""
        guide, model, num = self.guide, self.model, self.num_draws
        mean = guide.mean()
        _expect(set(mean) == set(guide.sites), f"mean() covers {sorted(mean)}")
        for site, value in mean.items():
            shape = tuple(model.latent_sites[site].shape)
            _expect(
                tuple(value.shape) == shape,
                f"site {site!r}: mean() has shape {tuple(value.shape)}, expected the site's "
                f"{shape}",
            )
        draws = guide.sample_posterior(num, generator=torch.Generator().manual_seed(7))
        worst = 0.0
        for site, value in mean.items():
            x, m = draws[site].detach().double(), value.detach().double()
            # The average of n independent draws of θ_j has mean E_q[θ_j] and standard error
            # sd_j / √n (estimated from the draws' own sample sd; n ≥ 1000 makes the CLT and the
            # sd's estimate good, a mixture's mean included): a correct mean() lies within 5
            # standard errors (a miss has probability 5.7e-7 per coordinate, ≈ 5e-6 over the
            # kit's few coordinates). A point mass (sd 0) must match to float32 rounding
            # (1e-6 relative).
            avg, se = x.mean(0), x.std(0) / math.sqrt(num)
            tol = 5 * se + 1e-6 * (1 + m.abs())
            ratio = (avg - m).abs() / tol
            j = int(ratio.flatten().argmax())
            worst = max(worst, float(ratio.flatten()[j]))
            _expect(
                bool((ratio <= 1).all()),
                f"site {site!r}: mean() is {float(m.flatten()[j]):.4g} at flat index {j} but the "
                f"average of {num} draws of sample_posterior is {float(avg.flatten()[j]):.4g} "
                f"(standard error {float(se.flatten()[j]):.2g}, tolerance "
                f"{float(tol.flatten()[j]):.2g}): mean() is not the mean of q's draws",
            )
        return f"mean (shapes; {num} draws' average at {worst:.0%} of its 5-se tolerance)"

    def check_log_prob(self) -> str:
        guide = self.guide
        num = self.num_draws
        draws = guide.sample_posterior(num, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            log_q = guide.log_prob(draws).double()
        flat = torch.cat([draws[s].reshape(num, -1) for s in guide.sites], 1).double()
        _expect(bool(torch.isfinite(log_q).all()), "log_prob is not finite at q's own draws")
        atoms, inverse, counts = torch.unique(flat, dim=0, return_inverse=True, return_counts=True)
        if len(atoms) < num:  # q is discrete: frequencies against exp(log_prob)
            return self._discrete(log_q, inverse, counts, num)
        return self._importance(flat, log_q)

    @staticmethod
    def _discrete(log_q: Tensor, inverse: Tensor, counts: Tensor, num: int) -> str:
        lines = []
        for atom in range(len(counts)):
            members = log_q[inverse == atom]
            p = float(members[0].exp())
            _expect(
                bool((members == members[0]).all()), f"atom {atom}: log_prob differs between copies"
            )
            freq = float(counts[atom]) / num
            # five binomial standard errors of a frequency over num draws
            tol = 5 * math.sqrt(max(p * (1 - p), 1e-12) / num) + 1e-9
            _expect(
                abs(freq - p) <= tol,
                f"atom {atom}: drawn with frequency {freq:.4f} but exp(log_prob) = {p:.4f} "
                f"(tolerance {tol:.4f})",
            )
            lines.append(f"{freq:.3f}~{p:.3f}")
        return f"discrete q, {len(counts)} atoms: " + ", ".join(lines[:6])

    @staticmethod
    def _importance(flat: Tensor, log_q: Tensor) -> str:
        num, dim = flat.shape
        half = num // 2
        fit, test = flat[:half], flat[half:]
        loc = fit.mean(0)
        centred = fit - loc
        cov = centred.T @ centred / (half - 1)
        cov = 0.5 * (cov + cov.T) + 1e-12 * cov.diagonal().mean().clamp_min(1e-30) * torch.eye(
            dim, dtype=cov.dtype
        )
        # c²: r's covariance is c² Σ̂, Var_q(r/q) = 0.5 for a Gaussian q (the module docstring)
        shrink = 1.0 - math.sqrt(1.0 - 1.5 ** (-2.0 / dim))
        r = torch.distributions.MultivariateNormal(loc, covariance_matrix=shrink * cov)
        log_w = r.log_prob(test) - log_q[half:]
        w = log_w.exp()
        mean, se = float(w.mean()), float(w.std() / math.sqrt(len(w)))
        tol = 5 * se + 0.02
        _expect(
            abs(mean - 1.0) <= tol,
            f"E_q[r/q] = {mean:.4f}, expected 1 within {tol:.4f} (d = {dim}): log_prob is not the "
            "density of sample_posterior's draws",
        )
        return f"E_q[r/q] = {mean:.4f} ± {se:.4f} (d = {dim}, c² = {shrink:.3f}, {len(w)} weights)"

    def check_rsample(self) -> str:
        """The fit's draws are q's, and an analytic KL is ``E_q[log q − log p]``."""
        from .contract import AnalyticKL, implements

        guide, model, num = self.guide, self.model, self.num_draws
        ref = guide.sample_posterior(num, generator=torch.Generator().manual_seed(13))
        parts = [self._same_law("rsample", _seeded(17, lambda: guide.rsample(num)), ref)]
        if not implements(guide, AnalyticKL):
            return "; ".join([*parts, f"KL not checked: {_no_analytic_kl(guide)}"])
        try:
            draws, kl = _seeded(19, lambda: guide.rsample_with_kl(num, model))
        except NotImplementedError as err:  # the ELBO then uses rsample and a Monte Carlo KL
            return "; ".join(
                [*parts, f"KL not checked: rsample_with_kl has no closed form ({err})"]
            )
        parts.append(self._same_law("rsample_with_kl", draws, ref))
        prior = getattr(guide, "prior", "model")
        if prior != "model":
            return "; ".join([*parts, f"KL not checked: prior={prior!r}, not the model's"])
        with torch.no_grad():
            terms = (guide.log_prob(ref) - model.log_prior(ref)).double()
            analytic = {"rsample_with_kl": kl, "kl_to_prior": guide.kl_to_prior(model)}
        _expect(bool(torch.isfinite(terms).all()), "log q − log p is not finite at q's draws")
        # KL(q‖p) = E_q[log q(θ) − log p(θ)] (θ ~ sample_posterior, q's law by the log_prob
        # check): the average of the n per-draw terms has standard error sd(terms)/√n (CLT), so
        # the closed form must lie within 5 of them (a miss has probability 5.7e-7), plus
        # 1e-4 (1 + |KL|) for the float32 rounding of the sums over coordinates.
        mc, se = float(terms.mean()), float(terms.std()) / math.sqrt(num)
        tol = 5 * se + 1e-4 * (1 + abs(mc))
        for name, value in analytic.items():
            _expect(
                value.numel() == 1 and math.isfinite(float(value)),
                f"{name}'s KL is {value.detach().tolist()}, not one finite number",
            )
            _expect(
                abs(float(value) - mc) <= tol,
                f"{name}'s KL is {float(value):.6g} but the Monte Carlo KL(q‖p) = "
                f"E_q[log q − log p] over {num} draws of sample_posterior is {mc:.6g} "
                f"(standard error {se:.2g}, tolerance {tol:.2g}): the ELBO's KL is not q's "
                "to the model's prior",
            )
        parts.append(f"KL {float(kl):.4g} ~ Monte Carlo {mc:.4g} ± {se:.2g}")
        return "; ".join(parts)

    def _same_law(self, name: str, draws: Mapping[str, Tensor], ref: Mapping[str, Tensor]) -> str:
        """Per coordinate, the means and sds of ``draws`` and of ``ref`` (q's) agree."""
        num, worst = self.num_draws, 0.0
        _expect(set(draws) == set(ref), f"{name} covers {sorted(draws)}, not {sorted(ref)}")
        for site in ref:
            shape = (num, *ref[site].shape[1:])
            _expect(
                tuple(draws[site].shape) == shape,
                f"site {site!r}: {name}({num}) has shape {tuple(draws[site].shape)}, "
                f"expected {shape}",
            )
            x, y = (v[site].detach().reshape(num, -1).double() for v in (draws, ref))
            (mx, sx, vx), (my, sy, vy) = _moments(x), _moments(y)
            # means: two independent averages of n draws, each with standard error sd/√n
            # (CLT), so their difference has standard error √(sd_x²/n + sd_y²/n); sds: each
            # sample sd has variance Var(s) ≈ (μ4 − σ⁴)/(4σ² (n−1)) (delta method on
            # s² = σ² + O(1/√n), Var(s²) ≈ (μ4 − σ⁴)/n), at least the Gaussian σ²/(2(n−1))
            # (two equal atoms have μ4 = σ⁴, where the first order vanishes), and their
            # difference √(Var(s_x) + Var(s_y)). Both within 5 standard errors (5.7e-7 per
            # coordinate), plus 1e-6 (1 + |value|) for float32 rounding (a point mass: sd 0).
            tol_m = 5 * (vx.add(vy) / num).sqrt() + 1e-6 * (1 + my.abs())
            tol_s = 5 * (_var_sd(sx, x, num) + _var_sd(sy, y, num)).sqrt() + 1e-6 * (1 + sy)
            ratio = torch.maximum((mx - my).abs() / tol_m, (sx - sy).abs() / tol_s)
            j = int(ratio.argmax())
            worst = max(worst, float(ratio[j]))
            _expect(
                float(ratio[j]) <= 1,
                f"site {site!r} at flat index {j}: {name}'s {num} draws have mean "
                f"{float(mx[j]):.4g} and sd {float(sx[j]):.4g} but sample_posterior's have mean "
                f"{float(my[j]):.4g} and sd {float(sy[j]):.4g} (tolerances {float(tol_m[j]):.2g} "
                f"and {float(tol_s[j]):.2g}): the fit's draws do not follow q",
            )
        return f"{name}: means and sds at {worst:.0%} of their 5-se tolerances"

    def check_pyro(self) -> str:
        from .contract import PostHoc

        guide, model = self.guide, self.model
        x, y = self.data[0]
        with torch.no_grad():
            samples = pyro.infer.Predictive(model, guide=guide, num_samples=3)((x, None))
        _expect(tuple(samples["obs"].shape) == (3, len(x)), "Predictive's obs is not (3, B)")
        loss = pyro.infer.Trace_ELBO().loss(model, guide, (x, y))
        _expect(math.isfinite(loss), f"Trace_ELBO loss {loss}")
        fresh_model, data = self._problem()
        fresh = self._build(fresh_model)
        adam = pyro.optim.Adam({"lr": 1e-3})  # type: ignore[attr-defined]
        svi = pyro.infer.SVI(fresh_model, fresh, adam, pyro.infer.Trace_ELBO())
        if isinstance(fresh, PostHoc) and not fresh.is_fitted:
            try:
                svi.step(data[0])
            except RuntimeError as err:
                _expect("fitted" in str(err), f"an unfitted post-hoc guide raised {err}")
                return "Predictive, Trace_ELBO; SVI refuses the unfitted post-hoc guide"
            raise AssertionError("SVI stepped an unfitted post-hoc guide (it has no q yet)")
        values = [svi.step(batch) for batch in data]
        _expect(all(math.isfinite(v) for v in values), f"SVI losses {values}")
        return f"Predictive, Trace_ELBO {loss:.4g}, {len(values)} SVI steps"

    def check_save_load(self) -> str:
        from . import io

        guide = self.guide
        with self._registered(), tempfile.TemporaryDirectory() as tmp:
            path = io.save(guide, Path(tmp) / "posterior.safetensors")
            fresh_model, _ = self._problem()
            _perturb(fresh_model.point_params.values())  # load must restore the fitted head
            loaded = io.load(path, fresh_model)
        _expect(type(loaded) is type(guide), f"load built a {type(loaded).__name__}")
        here, there = guide.state_dict(), loaded.state_dict()
        _expect(here.keys() == there.keys(), "state_dict keys differ after load")
        for key, value in here.items():
            _expect(torch.equal(value, there[key]), f"state {key!r} differs after load")
        a = guide.sample_posterior(6, generator=torch.Generator().manual_seed(11))
        b = loaded.sample_posterior(6, generator=torch.Generator().manual_seed(11))
        for site in a:
            _expect(torch.equal(a[site], b[site]), f"site {site!r}: draws differ after load")
        for key, value in self.model.point_params.items():
            _expect(
                torch.equal(value, fresh_model.point_params[key]),
                f"point parameter {key!r} not restored by load",
            )
        _expect(torch.equal(guide.log_prob(a), loaded.log_prob(a)), "log_prob differs after load")
        return f"{len(here)} tensors, draws and log_prob equal"

    def check_export(self) -> str:
        from .diagnostics import to_inference_data

        with self._registered(), _quiet():
            idata = to_inference_data(self.model, self.guide, self.data, num_samples=4, seed=0)
        posterior = idata["posterior"]
        for site in self.guide.sites:
            _expect(site in posterior.data_vars, f"site {site!r} missing from the posterior group")
        _expect("log_likelihood" in idata.groups(), "no log_likelihood group")
        return f"groups {sorted(idata.groups())}"

    def check_resume(self) -> str:
        from . import io
        from .infer import make_fitter
        from .infer.checkpoint import rng_state, set_rng_state

        total = self.epochs * len(self.data)
        stop = total // 2 + (1 if total % 2 == 0 else 0)  # mid-way, mid-epoch when it can
        pyro.clear_param_store()
        model, data = self._problem()
        whole = self._build(model)
        self._fit(model, whole, data)
        reference = {k: v.clone() for k, v in whole.state_dict().items()}
        reference_point = {k: v.detach().clone() for k, v in model.point_params.items()}

        def run(fitter: Any, start: int, end: int) -> None:
            for step in range(start, end):
                epoch, index = divmod(step, len(data))
                fitter.step(data[index])
                if index == len(data) - 1:
                    fitter.epoch_end(epoch)

        with self._registered(), tempfile.TemporaryDirectory() as tmp:
            # what pyrobayes.fit's checkpoint holds: the posterior file (guide and head), the
            # fitter's state and the RNG states, each through its file
            folder = Path(tmp)
            model_a, _ = self._problem()
            first = self._build(model_a)
            pyro.set_rng_seed(0)
            fitter = make_fitter(model_a, first, optimizer=self.optimizer, lr=self.lr)
            fitter.begin(data)
            run(fitter, 0, stop)
            io.save(first, folder / "posterior.safetensors", model=model_a)
            torch.save(fitter.state_dict(), folder / "fitter.pt")
            torch.save(rng_state(), folder / "rng.pt")
            pyro.set_rng_seed(123)  # the checkpoint must restore every RNG
            model_b, _ = self._problem()
            second = self._build(model_b)
            # another start: the checkpoint must overwrite guide and head
            _perturb([*second.parameters(), *model_b.point_params.values()])
            fitter = make_fitter(model_b, second, optimizer=self.optimizer, lr=self.lr)
            fitter.begin(data)
            io.load_state(second, folder / "posterior.safetensors", model=model_b)
            fitter.load_state_dict(torch.load(folder / "fitter.pt", weights_only=True))
            set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
            run(fitter, stop, total)
            fitter.end(data)
        state = second.state_dict()
        for key, value in reference.items():
            _expect(torch.equal(value, state[key]), f"resumed state {key!r} differs")
        for key, value in reference_point.items():
            _expect(
                torch.equal(value, model_b.point_params[key].detach()),
                f"resumed point parameter {key!r} differs",
            )
        return f"stopped at step {stop} of {total}, resumed: {len(reference)} tensors equal"
