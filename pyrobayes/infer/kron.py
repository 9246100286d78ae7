r"""Kronecker IVON: K-FAC statistics and the Kronecker mean update, as a :class:`Fitter`.

For a weight ``W`` `(d_out, d_in)` of a linear layer with inputs ``a`` and pre-activations
``s = W a``, the curvature is approximated by ``A ⊗ G`` (K-FAC, Martens & Grosse, 2015) and the
posterior is ``N(vec M, [λ(A ⊗ G + δI)]^{-1})`` (Noisy K-FAC, Zhang et al., 2018), updated with
IVON's momentum and step (Shen et al., 2024):

.. math::
    A ← β_2 A + (1−β_2) Â,\quad G ← β_2 G + (1−β_2) Ĝ,\quad g ← β_1 g + (1−β_1) ĝ,

    M ← M − α (h_0+δ)\, \operatorname{clip}\big(Q_G [(Q_Gᵀ (g/(1−β_1^t) + δM) Q_A) ⊘ D] Q_Aᵀ,\ ±r\big)

with ``Â = (1/R) Σ_rows a aᵀ`` over the layer input's ``R`` real (non-padding) rows,
``Ĝ = (1/(S·B)) Σ ∇_s l ∇_s lᵀ`` (``fisher``: the observed labels' gradients, one sampled label,
or the exact GGN), ``A = Q_A diag(a) Q_Aᵀ``, ``G = Q_G diag(γ) Q_Gᵀ`` re-decomposed every
``T_inv`` steps and ``D = γ aᵀ + δ`` (or the π-damped product). Same-shape sites (e.g. the
LoRA-XS cores of one model) share batched products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..batch import token_mask
from ..models.adapters import check_int
from .distributed import all_reduce_mean_, world
from .fitter import flag_non_finite, register_fitter
from .ivon import IVON, IVONFitter, mean_step_

__all__ = ["KronIVON", "KronCurvature", "KronIVONFitter", "kron_precondition"]

#: Kronecker IVON's defaults ``(beta2, diag_beta2)`` when :class:`KronIVON` leaves them unset: the
#: factors' EMA (factors are far less noisy than the Price estimate) and the diagonal sites' β2
KRON_BETAS = (0.99, 0.99999)


@dataclass(frozen=True)
class KronIVON(IVON):
    r"""Kronecker IVON's settings: :class:`~pyrobayes.infer.IVON`'s, and how the factors are
    estimated and refreshed (the fitter's, not the posterior's).

    Pass it as the fit's optimizer, ``pb.fit(model, guide, data, ...,
    optim=pb.Optimization(optimizer=pb.infer.KronIVON(T_inv=5, fisher="mc")))`` or
    ``make_fitter(model, guide, optimizer=pb.infer.KronIVON(...))``; a plain
    :class:`~pyrobayes.infer.IVON` is taken too (these three at their defaults). Saved in the
    fitter's checkpoint, not with the posterior. ``beta2`` defaults to 0.99 (the factors' EMA)
    and ``diag_beta2`` to 0.99999 (the diagonal sites').

    Parameters
    ----------
    fisher : {"empirical", "mc", "ggn"}
        ``G`` from the gradients of the observed-label loss (the empirical Fisher), from one
        label sampled from the model per example (an extra backward; the Monte Carlo Fisher of
        Martens & Grosse, 2015, Sec. 5), or the exact GGN (one extra backward per output for
        Gaussian / categorical likelihoods; ``"ggn_last"`` is an alias).
    T_stats : int
        Update the factors every ``T_stats`` steps (1).
    T_inv : int
        Re-decompose the factors every ``T_inv`` steps (10; also at the first step and at the
        end of the fit).

    Notes
    -----
    The other fields are :class:`IVON`'s: ``lr``, ``beta1``, ``beta2``, ``diag_beta2``,
    ``hess_approx`` (the diagonal sites'), ``clip_radius``, ``debias``, ``rescale_lr``,
    ``mc_samples``.
    """

    fisher: str = "empirical"
    T_stats: int = 1
    T_inv: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "KronIVON(): "
        if self.fisher == "ggn_last":
            object.__setattr__(self, "fisher", "ggn")
        if self.fisher not in ("empirical", "mc", "ggn"):
            raise ValueError(
                f"{owner}fisher must be 'empirical', 'mc' or 'ggn'; got {self.fisher!r}."
            )
        check_int("T_stats", self.T_stats, ge=1, owner=owner)
        check_int("T_inv", self.T_inv, ge=1, owner=owner)


def kron_precondition(d: Tensor, Q_A: Tensor, Q_G: Tensor, D: Tensor) -> Tensor:
    r"""``Q_G [(Q_Gᵀ d Q_A) ⊘ D] Q_Aᵀ``, i.e. ``(A ⊗ G + δI)^{-1} vec d`` for ``D = γ aᵀ + δ``
    (any damped eigenvalues ``D``; batched over leading axes)."""
    return Q_G @ (Q_G.mT @ d @ Q_A).div_(D) @ Q_A.mT


class KronCurvature:
    r"""The Kronecker block of :class:`~pyrobayes.infer.ivon.IVONOptimizer` for a
    :class:`~pyrobayes.guides.KroneckerIVONGuide`: forward hooks that record each Kronecker
    layer's inputs and outputs, the factor statistics ``Â``, ``Ĝ``, their EMA and the mean update.

    Its flat block lays the Kronecker sites out in site order; consecutive sites of one shape
    (and weight dtype) form a run that is perturbed and updated as one `(K, d_out, d_in)` stack.
    """

    def __init__(self, model: Any, guide: Any, settings: KronIVON | None = None) -> None:
        self.guide = guide
        #: the fit's settings: the Fisher estimator and the refresh periods
        self.settings = settings if settings is not None else KronIVON()
        #: the posterior's constants and the fit's settings, as the update reads them
        self.hyper: dict[str, Any] = {**guide.hyper, **self.settings.hyper(*KRON_BETAS)}
        sites = [s for s in guide.sites if guide.is_kron(s)]
        self.runs: list[tuple[list[str], int, int, torch.Size]] = []
        offset = 0
        for site in sites:
            shape, end = guide.sites[site], offset + guide.sites[site].numel()
            last = self.runs[-1] if self.runs else None
            same = last is not None and last[3] == shape
            if same and guide.param_dtype[last[0][-1]] == guide.param_dtype[site]:  # type: ignore[index]
                self.runs[-1] = (last[0] + [site], last[1], end, shape)  # type: ignore[index]
            else:
                self.runs.append(([site], offset, end, shape))
            offset = end
        self.sites = sites
        self.records: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self.G_acc: dict[str, Tensor] = {}
        self.recording = self.capture = self.recorded = False
        self.mask: Tensor | None = None
        #: the step's factor EMA, ``(factors, Â/Ĝ)``, applied when the step is kept (:meth:`commit`)
        self._pending: tuple[list[Tensor], list[Tensor]] | None = None
        #: ``(tensors, copies)``: what a re-decomposition step changed, put back by :meth:`undo`
        self._saved: tuple[list[Tensor], list[Tensor]] | None = None
        #: nonzero when one of the step's estimates is not finite (:meth:`estimates_unusable`);
        #: None when the step recorded none
        self._found: Tensor | None = None
        self._ones: dict[torch.device, Tensor] = {}  # the unit scale of _non_finite_flag
        self._row_masks: dict[Any, tuple[Tensor, int]] = {}
        self._scales: dict[Any, Tensor] = {}
        self.hooks = []
        for site in sites:  # a LoRA-XS core / LoRA factor is a linear layer of its own
            spec = model.latent_sites[site]
            path = spec.module_path
            if spec.kind in ("core", "lora_xs_core"):
                path = f"{path}.core"
            elif spec.kind in ("lora_A", "lora_B"):
                path = f"{path}.{spec.kind}"
            module = model.net.get_submodule(path)
            self.hooks.append(module.register_forward_hook(self._hook(site)))

    def _hook(self, site: str) -> Any:
        def hook(module: Any, inputs: Any, output: Tensor) -> None:
            if self.recording and torch.is_grad_enabled() and output.requires_grad:
                if self.capture:  # empirical Fisher: the closure's backward fills output.grad
                    output.retain_grad()
                self.records.setdefault(site, []).append((inputs[0].detach(), output))

        return hook

    def remove(self) -> None:
        """Remove the forward hooks."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    # ------------------------------------------------------------------ one step
    def start(self, step: int) -> None:
        """Before the closure of step ``step``: record the factor statistics every ``T_stats``."""
        settings = self.settings
        self.records, self.G_acc, self.mask, self._row_masks = {}, {}, None, {}
        self._pending = self._saved = self._found = None
        self.recording = self.recorded = step % settings.T_stats == 0
        self.capture = self.recording and settings.fisher == "empirical"

    def stop(self) -> None:
        """After the closure: nothing more is recorded."""
        self.recording = self.capture = False

    def observe(self, inputs: Any) -> None:
        """Keep the batch's token mask: ``Â`` averages over real tokens (padding is not data)."""
        if self.recording:
            mask = token_mask(inputs)
            self.mask = None if mask is None else mask.bool()

    def perturbation(self, eps: Tensor) -> Tensor:
        """``θ − M`` over the block for standard-normal ``eps`` `(S, T_kron)` (run by run)."""
        num, guide = eps.shape[0], self.guide
        parts = [
            guide.kron_perturbation(sites, eps[:, a:b].view(num, len(sites), *shape))
            for sites, a, b, shape in self.runs
        ]
        return torch.cat([p.reshape(num, -1) for p in parts], 1)

    def passes(self, model: Any, params: Tensor, targets: Tensor) -> None:
        """Extra backward passes for ``fisher="mc"`` / ``"ggn"``: each asks autograd for the
        gradients at the recorded layer outputs and adds their ``B·gᵀg`` to the site's ``Ĝ``."""
        fisher = self.settings.fisher
        if not self.recording or fisher == "empirical":
            return
        records = [(site, x, out) for site, recs in self.records.items() for x, out in recs]
        outputs = [out for _, _, out in records]
        rows = params.shape[0] * params.shape[1]  # S·B expanded examples
        if fisher == "mc":
            with torch.no_grad():
                y = model.likelihood.dist(params.detach()).sample()
            lmc = -model.log_likelihood(params, y).reshape(rows, -1).sum(-1).mean()
            passes = [torch.autograd.grad(lmc, outputs, retain_graph=True, allow_unused=True)]
        else:
            passes = [
                torch.autograd.grad(
                    params, outputs, grad_outputs=v / rows, retain_graph=True, allow_unused=True
                )
                for v in _output_hessian_roots(model.likelihood, params)
            ]
        for grads in passes:
            for (site, x, _), g in zip(records, grads, strict=True):
                if g is not None:
                    gs = g.detach().reshape(-1, g.shape[-1]).to(self.guide.state_dtype)
                    term = int(x.shape[0]) * (gs.mT @ gs)
                    self.G_acc[site] = term + self.G_acc[site] if site in self.G_acc else term

    def step_(self, m: Tensor, momentum: Tensor, grad: Tensor, step: int, lr: float) -> None:
        """The mean step of every run in place on the block's flat ``m`` and ``momentum``, after
        re-decomposing the factors every ``T_inv`` steps.

        The factors' EMA (when recorded) waits for :meth:`commit` (the optimizer's check that
        the step is usable) unless this step re-decomposes them: then it is applied now and the
        factors and decompositions it changes are kept for :meth:`undo`. A step that only moves
        the factors thus costs no copy; a re-decomposition step copies ``O(d²)`` next to its
        ``O(d³)`` ``eigh``.
        """
        guide = self.guide
        if self.recorded:
            hats, rows = self._estimates()
            if world()[0] > 1:
                _pool_rows_(hats[0::2], rows)
            all_reduce_mean_(hats)
            factors = [F_ for site in self.sites for F_ in guide.factors(site)]
            hats = [
                h if h.dtype == F_.dtype else h.to(F_.dtype)
                for h, F_ in zip(hats, factors, strict=True)
            ]
            self._pending = (factors, hats)
            self._found = self._non_finite_flag(hats)
        self.records, self.G_acc = {}, {}
        redecompose = (step + 1) % self.settings.T_inv == 0 or step == 0
        if redecompose and (self._found is None or not bool(self._found)):
            # a non-finite estimate is refused (estimates_unusable) and never decomposed: the
            # eigh of a NaN factor returns NaN, or raises on some backends, before any check
            changed = [t for site in self.sites for pair in guide.eigen(site) for t in pair]
            changed += self._pending[0] if self._pending is not None else []
            self._saved = (changed, [t.clone() for t in changed])
            self._apply_ema()
            guide.refresh()
        hp = self.hyper
        for sites, a, b, shape in self.runs:
            basis = guide.basis(sites)
            stack = (len(sites), *shape)

            def precondition(d: Tensor, basis: tuple[Tensor, Tensor, Tensor] = basis) -> Tensor:
                return kron_precondition(d, *basis)

            mean_step_(
                m[a:b].view(stack),
                momentum[a:b].view(stack),
                grad[a:b].view(stack),
                step,
                precondition,
                lr=lr,
                hess_init=hp["hess_init"],
                beta1=hp["beta1"],
                weight_decay=guide.weight_decay,
                clip_radius=hp["clip_radius"],
                debias=hp["debias"],
                rescale_lr=hp["rescale_lr"],
            )

    def estimates_unusable(self) -> Tensor | None:
        """A one-element tensor, nonzero when some factor estimate ``Â``, ``Ĝ`` of this step is
        not finite (None when the step recorded none), for the optimizer to fold into its own
        check: no device sync here.

        The factors are read only when they are re-decomposed, every ``T_inv`` steps: a
        non-finite estimate kept by the EMA would surface only there, steps later, as NaN means.
        """
        return self._found

    def non_finite_estimates(self) -> list[str]:
        """The step's estimates that are not finite, named by factor and site (one device
        sync: for the refusal's message)."""
        if self._found is None or self._pending is None:
            return []
        kinds = ("input factor A", "output-gradient factor G")
        finite = [bool(h.isfinite().all()) for h in self._pending[1]]
        return [
            f"the {kinds[j % 2]} of site {self.sites[j // 2]}"
            for j, ok in enumerate(finite)
            if not ok
        ]

    def commit(self) -> None:
        """The step was kept: apply its factor EMA ``F ← β2 F + (1−β2) F̂`` (if still pending)."""
        self._apply_ema()
        self._saved = self._found = None

    def undo(self) -> None:
        """The step was refused (or never reached :meth:`step_`): drop its statistics and its
        pending factor EMA, and put back the factors and decompositions a re-decomposition step
        changed, so the guide's factors are exactly as before the step."""
        if self._saved is not None:
            torch._foreach_copy_(*self._saved)
        self.records, self.G_acc, self._pending, self._saved = {}, {}, None, None
        self._found = None

    def _non_finite_flag(self, hats: list[Tensor]) -> Tensor:
        """One element, nonzero when some entry of ``hats`` is inf or NaN, without a sync
        (:func:`~pyrobayes.infer.fitter.flag_non_finite`, the fitter's gradient check)."""
        device = hats[0].device
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones(1, device=device)
        return flag_non_finite(hats, torch.zeros(1, device=device), one)

    def _apply_ema(self) -> None:
        """``F ← β2 F + (1−β2) F̂`` in place for the pending factors."""
        if self._pending is not None:
            factors, hats = self._pending
            self._pending = None
            torch._foreach_lerp_(factors, hats, 1.0 - self.hyper["beta2"])

    # ------------------------------------------------------------------ statistics
    def _estimates(self) -> tuple[list[Tensor], list[int]]:
        """``[Â_1, Ĝ_1, Â_2, Ĝ_2, ...]`` over the sites and the real rows behind each ``Â``.

        ``Â = Σ aᵀa / rows`` over the layer inputs' real rows; ``Ĝ = B Σ gᵀg`` over the
        gradients of the mean loss at the layer outputs (``E[g gᵀ]`` per example; padded
        positions get no gradient). Sites with one same-shape recording share one product.
        """
        recs = []
        for site in self.sites:
            rec = self.records.get(site)
            if not rec:
                raise RuntimeError(
                    f"Kronecker IVON: no curvature statistics were recorded for {site!r}; fit "
                    "with the default IVONLoss objective so the layer hooks see the sampled weights."
                )
            recs.append(rec)
        empirical, dtype = self.settings.fisher == "empirical", self.guide.state_dtype

        def grad_of(out: Tensor) -> Tensor:
            if out.grad is None:
                raise RuntimeError(
                    "Kronecker IVON: a recorded layer output got no gradient; the loss must "
                    "depend on every Kronecker site."
                )
            return out.grad

        if (
            empirical
            and all(len(r) == 1 for r in recs)
            and len({(r[0][0].shape, r[0][1].shape) for r in recs}) == 1
        ):
            num = int(recs[0][0][0].shape[0])
            real = [self._real_rows(r[0][0]) for r in recs]
            rows = real[0][1]  # one batch, one shape: the same count at every site
            # [x_1, g_1, x_2, g_2, ...]: square layers in one product, else A's and G's apart
            pairs = [t for (x, _), r in zip(real, recs, strict=True) for t in (x, grad_of(r[0][1]))]
            if pairs[0].shape == pairs[1].shape:
                z = torch.stack(pairs).flatten(1, -2).to(dtype)
                key = (len(recs), rows, num, dtype, z.device)
                scale = self._scales.get(key)
                if scale is None:  # Â = aᵀa / rows, Ĝ = num·gᵀg
                    scale = torch.tensor([1.0 / rows, float(num)] * len(recs), dtype=dtype)
                    scale = self._scales[key] = scale.to(z.device).view(-1, 1, 1)
                return list((z.mT @ z).mul_(scale).unbind(0)), [rows] * len(recs)
            x = torch.stack(pairs[0::2]).flatten(1, -2).to(dtype)
            g = torch.stack(pairs[1::2]).flatten(1, -2).to(dtype)
            A_hats, G_hats = (x.mT @ x).div_(rows).unbind(0), (g.mT @ g).mul_(num).unbind(0)
            return [t for pair in zip(A_hats, G_hats, strict=True) for t in pair], [rows] * len(
                recs
            )
        hats: list[Tensor] = []
        counts: list[int] = []
        for site, rec in zip(self.sites, recs, strict=True):
            real = [self._real_rows(x) for x, _ in rec]
            a = torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in real]).to(dtype)
            rows = sum(n for _, n in real)
            if empirical:
                grads = [(x, grad_of(o).reshape(-1, o.shape[-1]).to(dtype)) for x, o in rec]
                G_hat = sum(int(x.shape[0]) * (g.mT @ g) for x, g in grads)
            elif site in self.G_acc:
                G_hat = self.G_acc[site]
            else:
                raise RuntimeError(
                    f"Kronecker IVON: fisher={self.settings.fisher!r} recorded no output gradient "
                    f"for {site!r}."
                )
            hats += [(a.mT @ a) / rows, G_hat]  # type: ignore[list-item]
            counts.append(rows)
        return hats, counts

    def _real_rows(self, x: Tensor) -> tuple[Tensor, int]:
        """``x`` `(S·B, T, d)` with its padded token rows zeroed, and the number of real rows.

        The mask of the sample-major expanded batch is the batch's ``(B, T)`` mask tiled S
        times; inputs without the mask's token axes (a pooled layer) are kept whole.
        """
        rows, mask = x.numel() // x.shape[-1], self.mask
        if (
            mask is None
            or x.dim() != mask.dim() + 1
            or x.shape[1:-1] != mask.shape[1:]
            or x.shape[0] % mask.shape[0]
        ):
            return x, rows
        hit = self._row_masks.get((x.shape, x.dtype))
        if hit is None:
            tiled = mask.repeat(x.shape[0] // mask.shape[0], *(1,) * (mask.dim() - 1))
            hit = (tiled.unsqueeze(-1).to(x.dtype), int(tiled.sum()))
            self._row_masks[(x.shape, x.dtype)] = hit
        weights, real = hit
        return (x, rows) if real == rows else (x * weights, real)


def _pool_rows_(input_factors: list[Tensor], rows: list[int]) -> None:
    """Rescale this rank's ``Â_k = S_k / n_k`` in place so that the mean over ranks is the
    pooled ``Σ_r S_k,r / Σ_r n_k,r``: multiply by ``n_k / mean_r n_k,r``.

    Ranks whose batches hold different numbers of real (non-padding) tokens then count each token
    once, as one process on the union batch does, instead of weighting every rank equally.
    """
    counts = torch.tensor(rows, dtype=torch.float64, device=input_factors[0].device)
    mean = counts.clone()
    all_reduce_mean_([mean])
    for A, w in zip(input_factors, (counts / mean).tolist(), strict=True):
        if w != 1.0:
            A.mul_(w)


def _output_hessian_roots(likelihood: Any, params: Tensor) -> list[Tensor]:
    """Vectors ``v_k`` with ``Σ_k v_k v_kᵀ = ∇²_f (−log p(y|f))`` per example (shape of ``params``)."""
    name = getattr(likelihood, "name", "")
    if name == "gaussian":
        flat = params.reshape(params.shape[0], params.shape[1], -1)
        out = []
        for k in range(flat.shape[-1]):
            v = torch.zeros_like(flat)
            v[..., k] = 1.0 / likelihood.obs_scale
            out.append(v.reshape(params.shape))
        return out
    if getattr(likelihood, "multi_label", False):  # Bernoulli per label: diag(p (1 − p))
        root = (torch.sigmoid(params.detach()) * torch.sigmoid(-params.detach())).sqrt()
        out = []
        for k in range(params.shape[-1]):
            v = torch.zeros_like(root)
            v[..., k] = root[..., k]
            out.append(v)
        return out
    if name in ("categorical", "multiple_choice"):
        p = params.detach().softmax(-1)
        eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
        return [p[..., k : k + 1].sqrt() * (eye[k] - p) for k in range(p.shape[-1])]
    raise NotImplementedError(
        f"fisher='ggn' supports gaussian, categorical and bernoulli likelihoods, not {name!r}; "
        "use fisher='empirical' or 'mc'."
    )


class KronIVONFitter(IVONFitter):
    r"""Fits a :class:`~pyrobayes.guides.KroneckerIVONGuide`: :class:`IVONFitter` whose
    optimizer hands the Kronecker sites to a :class:`KronCurvature` (the module's update).
    ``optimizer`` may be a :class:`KronIVON` (or an :class:`~pyrobayes.infer.IVON`: the Fisher
    estimator and the refresh periods at their defaults); :meth:`state_dict` carries it.

    :meth:`end` re-decomposes the factors (the posterior is read from the decomposition) and
    removes the layer hooks.
    """

    default_betas = KRON_BETAS
    settings_class = KronIVON

    def _curvature(self) -> KronCurvature:
        settings = self.settings
        curvature = KronCurvature(
            self.model, self.guide, settings if isinstance(settings, KronIVON) else None
        )
        curvature.hyper.update(self.hyper)
        return curvature

    def end(self, data: Any = None) -> None:
        self.guide.refresh()
        curvature = getattr(self.optimizer, "curvature", None)
        if curvature is not None:
            curvature.remove()
            self.ended = (
                "end() removed the layer hooks that record the Kronecker factors. To train "
                "on, make a new fitter (pyrobayes.infer.make_fitter) for the guide."
            )


register_fitter("kron-ivon", KronIVONFitter)
