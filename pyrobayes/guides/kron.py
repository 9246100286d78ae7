r"""Kronecker IVON posterior (SPECS 5b.2): a Kronecker-factored Gaussian per 2-D adapter weight.

For a weight ``W ∈ R^{d_out×d_in}`` fed by inputs ``a`` with pre-activations ``s = W a``:

.. math:: q(\operatorname{vec} W) = \mathcal N\big(\operatorname{vec} M,\ [λ(A ⊗ G + δ I)]^{-1}\big)

with ``A ≈ E[a aᵀ]``, ``G ≈ E[∇_s l ∇_s lᵀ]`` (EMAs with rate ``1−β2``), ``λ = ess``,
``δ = weight_decay``. The default ``damping="exact"`` damps in the Kronecker eigenbasis
(:class:`~pyrobayes.distributions.KronEigenNormal`); ``damping="factored"`` is the Noisy K-FAC
π-damping, a true :class:`~pyrobayes.distributions.MatrixNormal`.

Covered sites: LoRA-XS cores (``a = down·x``, ``s = R a``), LoRA factors ``A`` (``a = x``,
``s = A x``) and ``B`` (``a = A x``, ``s = B a``), and whole latent ``nn.Linear`` weights. Biases
(the weight is not augmented with its bias: the bias is its own site) and every other site use
diagonal IVON (Section 5).
"""

from __future__ import annotations

from typing import Any

import pyro.distributions as dist
import torch
from torch import Tensor

from ..batch import token_mask
from ..distributions import KronEigenNormal, MatrixNormal
from ..infer.distributed import all_reduce_mean_, world
from ..infer.ivon import (
    damped_eigenvalues,
    eigh_factor,
    kron_step_,
)
from .ivon import IVONGuide

__all__ = ["KroneckerIVONGuide"]

_KRON_KINDS = ("core", "lora_xs_core", "weight", "lora_A", "lora_B")


class KroneckerIVONGuide(IVONGuide):
    r"""Kronecker-factored variational online Newton over 2-D adapter weights.

    Parameters
    ----------
    model : FineTuneModel
    ess, hess_init, beta1, weight_decay, mc_samples, hess_approx, clip_radius, debias,
    rescale_lr, lr, init_loc
        As :class:`~pyrobayes.guides.IVONGuide` (``hess_approx`` only for the diagonal sites).
        ``A`` and ``G`` start at ``sqrt(h0) I`` so ``A ⊗ G = h0 I``.
    beta2 : float
        EMA of the Kronecker factors (0.99; factors are far less noisy than the Price estimate).
    diag_beta2 : float
        IVON's Hessian EMA for the diagonal sites (0.99999).
    damping : {"exact", "factored"}
        Damping in the eigenbasis (``λ(γ aᵀ + δ)``) or Noisy K-FAC π-damping (matrix normal).
    fisher : {"empirical", "mc", "ggn"}
        ``G`` from the gradients of the observed-label loss, from one label sampled from the
        model per example (an extra backward), or the exact GGN (one extra backward per output
        for Gaussian / categorical likelihoods; ``"ggn_last"`` is an alias).
    T_stats : int
        Update the factors every ``T_stats`` steps.
    T_inv : int
        Re-decompose the factors every ``T_inv`` steps (and at the end of ``fit``).

    Notes
    -----
    The factor statistics assume the per-example mean loss of :class:`IVONLoss`: with ``B``
    examples (``S·B`` rows after the sample expansion) and ``R`` rows per module input,
    ``Â = (1/R) Σ ā āᵀ`` and ``Ĝ = (S·B) Σ_rows ∂L/∂s ∂L/∂sᵀ = (1/(S·B)) Σ ∇_s l ∇_s lᵀ``
    (SPECS "expand" convention for sequences). For token inputs ``(B, T, d)`` the rows of ``Â``
    are the real tokens only: :class:`IVONLoss` hands the batch's ``attention_mask`` to the guide
    before the forward (a custom objective that does not keeps every row).
    """

    family = "kron-ivon"

    def __init__(
        self,
        model: Any,
        *,
        beta2: float = 0.99,
        diag_beta2: float = 0.99999,
        damping: str = "exact",
        fisher: str = "empirical",
        T_stats: int = 1,
        T_inv: int = 10,
        **kwargs: Any,
    ) -> None:
        if damping not in ("exact", "factored"):
            raise ValueError(f"Expected damping 'exact' or 'factored' but got {damping!r}.")
        fisher = "ggn" if fisher == "ggn_last" else fisher
        if fisher not in ("empirical", "mc", "ggn"):
            raise ValueError(f"Expected fisher 'empirical', 'mc' or 'ggn' but got {fisher!r}.")
        if T_stats < 1 or T_inv < 1:
            raise ValueError(f"Expected T_stats, T_inv >= 1 but got {T_stats}, {T_inv}.")
        self.damping = damping
        self.fisher = fisher
        self.T_stats = int(T_stats)
        self.T_inv = int(T_inv)
        self.diag_beta2 = float(diag_beta2)
        self._kron: dict[str, tuple[str, str]] = {}  # site -> (kind, module_path)
        # per step: site -> [(core input, core output)], and G sums of the extra Fisher passes
        self._stats: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self._G_acc: dict[str, Tensor] = {}
        self._recording = False
        self._capture_G = False
        self._t = 0
        self._hooks: list[Any] = []
        self._root_cache: dict[str, tuple[tuple[int, ...], Tensor]] = {}
        specs = getattr(model, "latent_sites", {}) or {}
        for site, spec in specs.items():
            if spec.kind in _KRON_KINDS and len(spec.shape) == 2:
                self._kron[site] = (spec.kind, spec.module_path)
        super().__init__(
            model,
            beta2=beta2,
            diag_beta2=diag_beta2,
            damping=damping,
            fisher=fisher,
            T_stats=T_stats,
            T_inv=T_inv,
            **kwargs,
        )
        self._register_hooks(model)
        # the step counter drives the T_stats / T_inv schedule: saved with the guide, so a resumed
        # fit re-decomposes on the same steps as an uninterrupted one
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.__dict__["_t"] = int(self._buffers["num_updates"])

    # ------------------------------------------------------------------ set-up
    def _setup_curvature(self, site: str, i: int, loc: Tensor) -> None:
        if site not in self._kron:
            self.register_buffer(f"hess_{i}", torch.full_like(loc, self.hyper["hess_init"]))
            return
        d_out, d_in = loc.shape
        root = self.hyper["hess_init"] ** 0.5
        kw = {"dtype": loc.dtype, "device": loc.device}
        self.register_buffer(f"A_{i}", root * torch.eye(d_in, **kw))
        self.register_buffer(f"G_{i}", root * torch.eye(d_out, **kw))
        self.register_buffer(f"eigval_in_{i}", torch.full((d_in,), root, **kw))
        self.register_buffer(f"eigvec_in_{i}", torch.eye(d_in, **kw))
        self.register_buffer(f"eigval_out_{i}", torch.full((d_out,), root, **kw))
        self.register_buffer(f"eigvec_out_{i}", torch.eye(d_out, **kw))

    def is_kron(self, site: str) -> bool:
        return site in self._kron

    def factors(self, site: str) -> tuple[Tensor, Tensor]:
        """``(A, G)`` of a Kronecker site."""
        i = self._index[site]
        buffers = self._buffers  # direct reads: PyroModule.__getattr__ costs µs per call
        return buffers[f"A_{i}"], buffers[f"G_{i}"]

    def eigen(self, site: str) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """Cached ``((a, Q_A), (γ, Q_G))``."""
        names = self.__dict__.setdefault("_eig_names", {}).get(site)
        if names is None:
            i = self._index[site]
            names = (f"eigval_in_{i}", f"eigvec_in_{i}", f"eigval_out_{i}", f"eigvec_out_{i}")
            self._eig_names[site] = names
        b = self._buffers
        return (b[names[0]], b[names[1]]), (b[names[2]], b[names[3]])

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-decompose every factor (done every ``T_inv`` steps and at the end of ``fit``)."""
        self._decompose(list(self._kron))

    def _decompose(self, sites: list[str]) -> None:
        """Eigendecompose the factors of ``sites``; same-shape factors share one batched ``eigh``."""
        factors: list[Tensor] = []
        targets: list[tuple[Tensor, Tensor]] = []
        for site in sites:
            A, G = self.factors(site)
            (a, qa), (g, qg) = self.eigen(site)
            factors += [A, G]
            targets += [(a, qa), (g, qg)]
        groups: dict[tuple[Any, ...], list[int]] = {}
        for k, F_ in enumerate(factors):
            groups.setdefault((F_.shape, F_.dtype, F_.device), []).append(k)
        for idx in groups.values():
            if len(idx) == 1:
                vals, vecs = eigh_factor(factors[idx[0]])
                vals, vecs = vals[None], vecs[None]
            else:
                vals, vecs = eigh_factor(torch.stack([factors[k] for k in idx]))
            for j, k in enumerate(idx):
                targets[k][0].copy_(vals[j])
                targets[k][1].copy_(vecs[j])

    def damped(self, site: str) -> Tensor:
        """Eigenvalues of ``A ⊗ G + δ`` (as damped) in the Kronecker basis, ``(d_out, d_in)``."""
        (a, _), (g, _) = self.eigen(site)
        return damped_eigenvalues(a, g, self.weight_decay, self.damping)

    # ------------------------------------------------------------------ posterior
    def get_posterior(self, site: str) -> dist.Distribution:
        if site not in self._kron:
            return super().get_posterior(site)
        dtype = self._param_dtype[site]
        (a, Qa), (g, Qg) = self.eigen(site)
        loc = self.loc(site)
        if self.damping == "exact":
            P = self.ess * self.damped(site)
            return KronEigenNormal(loc.to(dtype), Qa.to(dtype), Qg.to(dtype), P.to(dtype))
        # factored: U = λ⁻¹ Q_G diag(1/(γ+√δ/π)) Q_Gᵀ, V = Q_A diag(1/(a+π√δ)) Q_Aᵀ
        tiny = torch.finfo(a.dtype).tiny
        pi = (a.mean().clamp_min(tiny) / g.mean().clamp_min(tiny)).sqrt()
        root = self.weight_decay**0.5
        U = (Qg / (self.ess * (g + root / pi))) @ Qg.mT
        V = (Qa / (a + pi * root)) @ Qa.mT
        L_U = torch.linalg.cholesky(0.5 * (U + U.mT))
        L_V = torch.linalg.cholesky(0.5 * (V + V.mT))
        return MatrixNormal(loc.to(dtype), L_U.to(dtype), L_V.to(dtype))

    def _perturbation(self, site: str, eps: Tensor) -> Tensor:
        if site not in self._kron:
            return super()._perturbation(site, eps)
        (a, Qa), (g, Qg) = self.eigen(site)
        # sqrt(λ D) only changes when the eigenvalues do: cache it on their version counters
        key = (id(a), a._version, id(g), g._version)
        hit = self._root_cache.get(site)
        if hit is None or hit[0] != key:
            hit = (key, (self.ess * self.damped(site)).sqrt())
            self._root_cache[site] = hit
        return Qg @ (eps / hit[1]) @ Qa.mT

    def _is_diag(self, site: str) -> bool:
        return site not in self._kron

    def _diag_beta2(self) -> float:
        return self.diag_beta2

    def _flat_perturbation(self, eps: Tensor) -> Tensor:
        if not self._kron:
            return super()._flat_perturbation(eps)
        num = eps.shape[0]
        parts = []
        for sites, (a, b), shape in self._runs():
            if len(sites) == 1:
                part = self._perturbation(sites[0], eps[:, a:b].view(num, *shape))
            else:  # K same-shape Kronecker sites side by side: one batched product
                part = self._stacked_perturbation(sites, eps[:, a:b].view(num, len(sites), *shape))
            parts.append(part.reshape(num, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _runs(self) -> list[tuple[list[str], tuple[int, int], torch.Size]]:
        """Consecutive sites of the flat layout grouped into runs of same-shape Kronecker sites."""
        runs = self.__dict__.get("_runs_cache")
        if runs is None:
            lay = self._layout()
            runs = []
            for site, (a, b), shape in zip(lay.sites, lay.bounds, lay.shapes, strict=True):
                last = runs[-1] if runs else None
                if (
                    last is not None
                    and site in self._kron
                    and last[0][-1] in self._kron
                    and last[2] == shape
                    and self._param_dtype[site] == self._param_dtype[last[0][-1]]
                ):
                    runs[-1] = (last[0] + [site], (last[1][0], b), shape)
                else:
                    runs.append(([site], (a, b), shape))
            self.__dict__["_runs_cache"] = runs
        return runs

    def _kron_runs(self) -> tuple[list[tuple[list[str], tuple[int, int], torch.Size]], list[str]]:
        """The runs of Kronecker sites (see :meth:`_runs`) and their sites in order (cached)."""
        hit = self.__dict__.get("_kron_runs_cache")
        if hit is None:
            runs = [run for run in self._runs() if run[0][0] in self._kron]
            hit = (runs, [site for run in runs for site in run[0]])
            self.__dict__["_kron_runs_cache"] = hit
        return hit

    def _stacked_perturbation(self, sites: list[str], eps: Tensor) -> Tensor:
        """``Q_G (ε ⊘ sqrt(λD)) Q_Aᵀ`` for K stacked sites, ``eps`` `(S, K, d_out, d_in)`."""
        (a, Qa), (g, Qg) = self._stacked_eigen(sites)
        key = tuple(sites)
        cache = self.__dict__.setdefault("_stacked_root_cache", {})
        hit = cache.get(key)
        if hit is None or hit[0] is not a:  # the stacked eigenvalues are rebuilt on change
            damped = damped_eigenvalues(a, g, self.weight_decay, self.damping)
            hit = (a, (self.ess * damped).sqrt())
            cache[key] = hit
        return Qg @ (eps / hit[1]) @ Qa.mT

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self, model: Any) -> None:
        net = getattr(model, "net", None)
        for site, (kind, path) in self._kron.items():
            # a LoRA-XS core is its own (batched) linear layer: its input is a = down·x and its
            # output s = R a, so the hook reads both factors' statistics without recomputing them
            if kind in ("core", "lora_xs_core"):
                path = f"{path}.core"
            elif kind in ("lora_A", "lora_B"):  # LoRA factors are linear layers of their own
                path = f"{path}.{kind}"
            module = net.get_submodule(path)
            self._hooks.append(module.register_forward_hook(self._make_hook(site)))

    def _make_hook(self, site: str) -> Any:
        def hook(module: Any, inputs: Any, output: Tensor) -> None:
            if not (self._recording and torch.is_grad_enabled() and output.requires_grad):
                return
            if self._capture_G:  # empirical Fisher: the closure's backward fills output.grad
                output.retain_grad()
            # the Gram matrices aᵀa and gᵀg are formed at update time, batched over sites
            self._stats.setdefault(site, []).append((inputs[0].detach(), output))

        return hook

    def _begin_step(self) -> None:
        super()._begin_step()
        self.__dict__["_stats"] = {}
        self.__dict__["_token_mask"] = None
        self.__dict__["_row_masks"] = {}
        self.__dict__["_G_acc"] = {}
        self.__dict__["_recording"] = bool(self._kron) and self._t % self.T_stats == 0
        self.__dict__["_capture_G"] = self._recording and self.fisher == "empirical"

    def _end_step(self) -> None:
        self.__dict__["_recording"] = False
        self.__dict__["_capture_G"] = False

    def _observe_inputs(self, inputs: Any) -> None:
        """Keep the batch's token mask (called by :class:`IVONLoss` before the forward): ``Â``
        averages over real tokens only, since padded positions are not data."""
        if self._recording:
            mask = token_mask(inputs)
            self.__dict__["_token_mask"] = None if mask is None else mask.bool()

    def _real_rows(self, x: Tensor) -> tuple[Tensor, int]:
        """``x`` `(S·B, T, d)` with its padded token rows zeroed, and the number of real rows.

        The mask of the sample-major expanded batch is the batch's ``(B, T)`` mask tiled S
        times. Inputs without the mask's token axes (a pooled layer, non-sequence data) are
        kept whole.
        """
        rows = x.numel() // x.shape[-1]
        mask = self.__dict__.get("_token_mask")
        if (
            mask is None
            or x.dim() != mask.dim() + 1
            or x.shape[1:-1] != mask.shape[1:]
            or x.shape[0] % mask.shape[0]
        ):
            return x, rows
        cache = self.__dict__.setdefault("_row_masks", {})
        hit = cache.get((x.shape, x.dtype))
        if hit is None:
            tiled = mask.repeat(x.shape[0] // mask.shape[0], *(1,) * (mask.dim() - 1))
            hit = cache[(x.shape, x.dtype)] = (tiled.unsqueeze(-1).to(x.dtype), int(tiled.sum()))
        weights, real = hit
        return (x, rows) if real == rows else (x * weights, real)

    def _curvature_passes(self, model: Any, params: Tensor, targets: Tensor) -> None:
        """Extra backward passes for ``fisher="mc"`` / ``"ggn"`` (called by :class:`IVONLoss`).

        Each pass asks autograd for the gradients at the recorded core outputs directly and adds
        their ``B·gᵀg`` to the site's ``G`` estimate.
        """
        if not self._recording or self.fisher == "empirical":
            return
        records = [(site, x, out) for site, recs in self._stats.items() for x, out in recs]
        outputs = [out for _, _, out in records]
        rows = params.shape[0] * params.shape[1]  # S·B expanded examples
        if self.fisher == "mc":
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
        acc = self.__dict__.setdefault("_G_acc", {})
        for grads in passes:
            for (site, x, _), g in zip(records, grads, strict=True):
                if g is None:
                    continue
                gs = g.detach().reshape(-1, g.shape[-1]).to(self.state_dtype)
                term = int(x.shape[0]) * (gs.mT @ gs)
                acc[site] = term if site not in acc else acc[site] + term

    def _factor_estimates(self, sites: list[str]) -> tuple[list[Tensor], list[int]]:
        """``[Â_1, Ĝ_1, Â_2, Ĝ_2, ...]`` for ``sites`` from this step's recordings, and the
        number of real rows behind each ``Â``.

        ``Â = Σ aᵀa / rows`` over the core inputs' real (non-padding) rows; ``Ĝ = B Σ gᵀg`` over
        the gradients of the mean loss at the core outputs (so ``Ĝ`` estimates the per-example
        ``E[g gᵀ]``; padded positions get no gradient). Sites with one recording of the same
        shape share one batched product.
        """
        recs = []
        for site in sites:
            rec = self._stats.get(site)
            if not rec:
                raise RuntimeError(
                    "KroneckerIVONGuide: no curvature statistics were recorded for "
                    f"{site!r}; fit with the default IVONLoss objective so the module "
                    "hooks see the sampled weights."
                )
            recs.append(rec)
        empirical = self.fisher == "empirical"

        def grad_of(out: Tensor) -> Tensor:
            if out.grad is None:
                raise RuntimeError(
                    "KroneckerIVONGuide: the recorded core output got no gradient; the loss "
                    "must depend on every Kronecker site."
                )
            return out.grad

        dtype = self.state_dtype
        same_shapes = len({(r[0][0].shape, r[0][1].shape) for r in recs}) == 1
        if empirical and all(len(r) == 1 for r in recs) and same_shapes:
            num = int(recs[0][0][0].shape[0])
            real = [self._real_rows(r[0][0]) for r in recs]
            xs = [x for x, _ in real]
            rows = real[0][1]  # one batch, one shape: the same count for every site
            gs = [grad_of(r[0][1]) for r in recs]
            if xs[0].shape == gs[0].shape:  # square cores: [x_1, g_1, x_2, ...] in ONE product
                z = torch.stack([t for pair in zip(xs, gs, strict=True) for t in pair])
                z = z.reshape(z.shape[0], -1, z.shape[-1])
                z = z if z.dtype == dtype else z.to(dtype)
                scale = self._factor_scales(len(recs), rows, num, z)
                return list((z.mT @ z).mul_(scale).unbind(0)), [rows] * len(recs)
            x = torch.stack(xs)
            g = torch.stack(gs)
            x = x.reshape(len(recs), -1, x.shape[-1]).to(dtype)
            g = g.reshape(len(recs), -1, g.shape[-1]).to(dtype)
            A = (x.mT @ x).div_(rows)
            G = (g.mT @ g).mul_(num)
            pairs = zip(A.unbind(0), G.unbind(0), strict=True)
            return [t for pair in pairs for t in pair], [rows] * len(recs)
        hats: list[Tensor] = []
        counts: list[int] = []
        acc = self.__dict__.get("_G_acc", {})
        for site, rec in zip(sites, recs, strict=True):
            real = [self._real_rows(x) for x, _ in rec]
            a = torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in real]).to(dtype)
            rows = sum(n for _, n in real)
            if empirical:
                G = sum(
                    int(x.shape[0]) * (g.mT @ g)
                    for x, g in (
                        (x, grad_of(out).reshape(-1, out.shape[-1]).to(dtype)) for x, out in rec
                    )
                )
            else:
                if site not in acc:
                    raise RuntimeError(
                        f"KroneckerIVONGuide: fisher={self.fisher!r} recorded no output "
                        f"gradient for {site!r}."
                    )
                G = acc[site]
            hats += [(a.mT @ a) / rows, G]
            counts.append(rows)
        return hats, counts

    def _factor_scales(self, num_sites: int, rows: int, num: int, like: Tensor) -> Tensor:
        """``[1/rows, num, 1/rows, num, ...]`` `(2K, 1, 1)`: Â = aᵀa/rows, Ĝ = num·gᵀg (cached)."""
        key = (num_sites, rows, num, like.dtype, like.device)
        hit = self.__dict__.get("_scale_cache")
        if hit is None or hit[0] != key:
            scale = torch.tensor([1.0 / rows, float(num)] * num_sites, dtype=like.dtype)
            hit = (key, scale.to(like.device).view(-1, 1, 1))
            self.__dict__["_scale_cache"] = hit
        return hit[1]

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def ivon_update(self, optimizer: Any, lr: float) -> None:
        """Update the Kronecker sites (the diagonal ones went through the optimizer's flat step)."""
        hp = self.hyper
        if self._kron:
            grads_all, _ = self._flat_grads()
            num = grads_all.shape[0]
            runs, sites = self._kron_runs()
            # ḡ per run of same-shape sites: one view and one mean over the samples, (K, *shape)
            grads = [
                grads_all[:, a:b].view(num, len(run_sites), *shape).mean(0)
                if num > 1
                else grads_all[0, a:b].view(len(run_sites), *shape)
                for run_sites, (a, b), shape in runs
            ]
            factors = [F_ for site in sites for F_ in self.factors(site)]
            if self._recording_done:
                hats, rows = self._factor_estimates(sites)
                if world()[0] > 1:
                    _pool_rows_(hats[0::2], rows)
                all_reduce_mean_(grads + hats)
                # A ← β2 A + (1−β2) Â, G ← β2 G + (1−β2) Ĝ for every factor at once
                beta2 = hp["beta2"]
                if any(h.dtype != F_.dtype for h, F_ in zip(hats, factors, strict=True)):
                    hats = [h.to(F_.dtype) for h, F_ in zip(hats, factors, strict=True)]
                torch._foreach_lerp_(factors, hats, 1.0 - beta2)
            else:
                all_reduce_mean_(grads)
            if (self._t + 1) % self.T_inv == 0 or self._t == 0:
                self._decompose(sites)
            for (run_sites, _, _), grad in zip(runs, grads, strict=True):
                self._kron_mean_update(optimizer, lr, run_sites, grad)
        self.__dict__["_t"] = self._t + 1  # plain attributes: skip nn.Module.__setattr__
        self._buffers["num_updates"].fill_(self._t)
        self.__dict__["_stats"] = {}
        self.__dict__["_G_acc"] = {}
        self.__dict__["_noise"] = None

    def _kron_mean_update(self, optimizer: Any, lr: float, sites: list[str], grad: Tensor) -> None:
        """SPECS 5b.2 steps 4-5 for K same-shape Kronecker sites in ONE batched step.

        ``kron_step_`` broadcasts over a leading axis, so K cores of the same shape cost one set
        of kernels. The stacked means and momenta `(K, *shape)` persist between steps (the
        per-site tensors stay the source of truth: rebuilt when anyone else writes them).
        """
        hp = self.hyper
        lay = self._layout()
        locs = lay.loc_tensors()
        ps = [locs[lay.position[site]] for site in sites]
        states = [optimizer.state[p] for p in ps]
        key = tuple(sites)
        caches = self.__dict__.setdefault("_mean_stacks", {})
        stack = caches.get(key)
        if stack is None or not stack.valid(ps, states):
            for p, st in zip(ps, states, strict=True):
                if "momentum" not in st:
                    st["momentum"] = torch.zeros_like(p)
                    st["step"] = torch.tensor(0)
            steps = {int(st["step"]) for st in states}
            if len(steps) != 1:  # sites with different histories (one joined later): one by one
                for k, site in enumerate(sites):
                    self._kron_mean_update(optimizer, lr, [site], grad[k : k + 1])
                return
            stack = caches[key] = _MeanStack(ps, states, steps.pop())
        step = stack.step
        eig = self._stacked_eigen(sites)
        (_, Q_A), (_, Q_G) = eig
        damped = self._stacked_damped(sites, eig)
        dtype = stack.momentum.dtype
        kron_step_(
            stack.M,
            stack.momentum,
            step,
            grad if grad.dtype == dtype else grad.to(dtype),
            Q_A,
            Q_G,
            damped,
            lr=lr,
            hess_init=hp["hess_init"],
            beta1=hp["beta1"],
            weight_decay=hp["weight_decay"],
            clip_radius=hp["clip_radius"],
            debias=hp["debias"],
            rescale_lr=hp["rescale_lr"],
        )
        stack.write(ps, step + 1)

    def _stacked_damped(self, sites: list[str], eig: Any = None) -> Tensor:
        """Damped eigenvalues `(K, d_out, d_in)` of ``sites``, cached until the factors change.

        ``eig``: the result of ``_stacked_eigen(sites)`` when the caller already has it.
        """
        (a, _), (g, _) = self._stacked_eigen(sites) if eig is None else eig
        cache = self.__dict__.setdefault("_damped_cache", {})
        hit = cache.get(tuple(sites))
        if hit is None or hit[0] is not a or hit[1] is not g:
            hit = (a, g, damped_eigenvalues(a, g, self.weight_decay, self.damping))
            cache[tuple(sites)] = hit
        return hit[2]

    def _stacked_eigen(
        self, sites: list[str]
    ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """``((a, Q_A), (γ, Q_G))`` of ``sites`` stacked on a leading axis, cached on versions."""
        eig = [self.eigen(site) for site in sites]
        key = tuple((id(t), t._version) for e in eig for pair in e for t in pair)
        cache = self.__dict__.setdefault("_stack_cache", {})
        hit = cache.get(tuple(sites))
        if hit is None or hit[0] != key:
            stacked = tuple(
                tuple(torch.stack([e[side][part] for e in eig]) for part in range(2))
                for side in range(2)
            )
            hit = (key, stacked)
            cache[tuple(sites)] = hit
        (a, qa), (g, qg) = hit[1]
        return (a, qa), (g, qg)

    @property
    def _recording_done(self) -> bool:
        return bool(self._kron) and self._t % self.T_stats == 0

    def fit_end(self, model: Any, data: Any) -> None:
        self.refresh()


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
        inv = 1.0 / likelihood.obs_scale
        flat = params.reshape(params.shape[0], params.shape[1], -1)
        out = []
        for k in range(flat.shape[-1]):
            v = torch.zeros_like(flat)
            v[..., k] = inv
            out.append(v.reshape(params.shape))
        return out
    if name in ("categorical", "multiple_choice"):
        p = params.detach().softmax(-1)
        root = p.sqrt()
        out = []
        for k in range(p.shape[-1]):
            e = torch.zeros_like(p)
            e[..., k] = 1.0
            out.append(root[..., k : k + 1] * (e - p))
        return out
    raise NotImplementedError(
        f"fisher='ggn' supports gaussian and categorical likelihoods, not {name!r}; "
        "use fisher='empirical' or 'mc'."
    )


class _MeanStack:
    """Stacked means ``M`` and momenta `(K, *shape)` of a run of same-shape Kronecker sites.

    Reused while the per-site tensors are the same objects with unchanged ``_version`` and the
    optimizer's ``momentum`` entries are still views of this stack; else rebuilt from them.
    """

    def __init__(self, ps: list[Tensor], states: list[dict], step: int) -> None:
        self.M = torch.stack([p.detach() for p in ps]).to(states[0]["momentum"].dtype)
        self.momentum = torch.stack([st["momentum"] for st in states])
        self.params = list(ps)
        self.views = list(self.momentum.unbind(0))
        self.m_views = list(self.M.unbind(0))
        self.step = step
        self.counter = torch.tensor(step)  # shared by the sites' optimizer states
        for st, v in zip(states, self.views, strict=True):
            st["momentum"] = v
            st["step"] = self.counter
        self.versions = [p._version for p in ps]

    def valid(self, ps: list[Tensor], states: list[dict]) -> bool:
        return (
            len(ps) == len(self.params)
            and all(a is b for a, b in zip(ps, self.params, strict=True))
            and [p._version for p in ps] == self.versions
            and all(st.get("momentum") is v for st, v in zip(states, self.views, strict=True))
            and all(st.get("step") is self.counter for st in states)
        )

    def write(self, ps: list[Tensor], counter: int) -> None:
        if self.M.dtype == ps[0].dtype:
            torch._foreach_copy_(ps, self.m_views)
        else:
            for p, v in zip(ps, self.m_views, strict=True):
                p.copy_(v)
        self.step = counter
        self.counter.fill_(counter)
        self.versions = [p._version for p in ps]
