r"""σN-ensembles: M members that share every weight and differ in σ-bounded norm layers and heads.

Every normalization layer ℓ (``LayerNorm``, ``BatchNorm1d``, ``BatchNorm2d``) is replaced by a
:class:`MemberNorm` whose member ``t`` computes

.. math::

    \sigma\mathrm{Norm}_t(x) = c ⊙ σ(γ_t) ⊙ \mathrm{norm}_t(x) + β_t,
    \qquad c = w / σ(γ_0),

with ``norm_t`` the parameter-free normalization (BatchNorm with member ``t``'s running
statistics), ``w`` the pretrained scale and ``c`` a fixed reconstructing scale, so that at
``γ_t = γ_0``, ``β_t = b`` the layer is the pretrained one (Lopez-Gonzalez et al., 2025, the σN
conversion of a pretrained network, App. A.3). The classifier heads are replicated per member.

The members' pre-sigmoid scales ``γ``, shifts ``β`` and heads are *latent sites* of the
:class:`~pyrobayes.models.FineTuneModel`; an M-member ensemble is M point particles over them
(the ``"signorm"`` guide). A site value with a leading sample axis ``(S, C)`` applies member
``s`` to rows ``s·B … s·B + B − 1`` of the sample-major expanded batch, so the M members run in
ONE forward, like every other sample-batched layer (:mod:`pyrobayes.models.layers`).

The diversity regularizer over the regularized layers R (Lopez-Gonzalez et al., 2025, Eq. 3):

.. math::

    L_{div} = \sum_{ℓ∈R} \sum_i \sum_{m=1}^{M}
        \log \operatorname{softmax}_τ\big(σ(γ_{1,ℓ,i}), …, σ(γ_{M,ℓ,i})\big)_m ,

minimized, drives each feature towards ``k*(τ)`` owning members (:func:`owner_corner`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adapters import (
    LoRA,
    LoRAXS,
    SiteSpec,
    _set_submodule,
    check_int,
    inject_adapter,
    make_latent,
)
from .finetune import HEAD_NAMES, FineTuneModel

logger = logging.getLogger(__name__)

__all__ = [
    "MemberNorm",
    "SigmaNorm",
    "SigmaNormEnsemble",
    "SCALE_KIND",
    "SHIFT_KIND",
    "diversity",
    "owner_corner",
    "scale_sites",
    "member_norms",
    "pin_member",
]

#: ``SiteSpec.kind`` of a member norm layer's pre-sigmoid scale ``γ`` and of its shift ``β``.
SCALE_KIND = "signorm_scale"
SHIFT_KIND = "signorm_shift"

_NORMS = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)


class MemberNorm(nn.Module):
    r"""A normalization layer with per-member σ-bounded scale, shift and BatchNorm statistics.

    ``y = c ⊙ σ(γ) ⊙ norm(x) + β`` with ``c = w / σ(γ_0)`` fixed (a buffer), so the layer equals
    the pretrained ``norm`` at ``γ = γ_0``, ``β = b``.

    ``gamma`` `(C,)` and ``beta`` `(C,)` are the latent tensors; a value with a leading sample
    axis `(S, C)` applies sample ``s`` to its slice of a sample-major expanded batch. BatchNorm
    keeps running statistics per member, buffers `(M, C)`: in training mode (the backbone in
    train mode, ``FineTuneModel(train_backbone_mode=True)``) each slice is normalized with its own
    batch statistics and, when ``S = M``, updates member ``s``'s statistics; in eval mode
    slice ``s`` uses member ``s mod M``'s statistics when ``S`` is a multiple of ``M`` (the
    members guide draws members in that order).

    Parameters
    ----------
    norm : nn.LayerNorm or nn.BatchNorm1d or nn.BatchNorm2d
        The pretrained layer (its weights are copied; the module is not kept).
    num_members : int
        M.
    init_logit : float
        ``γ_0``, the pre-sigmoid scale that reproduces the pretrained layer (0: σ = ½, the
        steepest point of the sigmoid, so a member can grow or shrink a feature).
    """

    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor
    fixed_scale: Tensor

    def __init__(self, norm: nn.Module, num_members: int, init_logit: float = 0.0) -> None:
        super().__init__()
        if not isinstance(norm, _NORMS):
            raise TypeError(
                f"MemberNorm: expected an nn.LayerNorm, nn.BatchNorm1d or nn.BatchNorm2d but got "
                f"{type(norm).__name__}."
            )
        self.num_members = check_int("num_members", num_members, ge=1, owner="MemberNorm: ")
        self.init_logit = float(init_logit)
        self.is_batch_norm = isinstance(norm, nn.modules.batchnorm._BatchNorm)
        self.eps = float(norm.eps)
        if isinstance(norm, nn.LayerNorm):
            if len(norm.normalized_shape) != 1:
                raise ValueError(
                    "MemberNorm: LayerNorm over several trailing dimensions "
                    f"(normalized_shape={tuple(norm.normalized_shape)}) is not supported; only "
                    "a LayerNorm over the last (feature) dimension."
                )
            channels = int(norm.normalized_shape[0])
            self.batch_dims = 0
        else:
            channels = int(norm.num_features)
            self.batch_dims = 1 if isinstance(norm, nn.BatchNorm1d) else 2
        self.num_features = channels
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        ref = next(iter([t for t in (weight, bias) if t is not None]), None)
        kw: dict[str, Any] = (
            {"dtype": ref.dtype, "device": ref.device}
            if ref is not None
            else {"dtype": torch.get_default_dtype()}
        )
        if self.is_batch_norm and norm.running_mean is not None:
            kw["device"] = norm.running_mean.device
        w = weight.detach().clone() if weight is not None else torch.ones(channels, **kw)
        b = bias.detach().clone() if bias is not None else torch.zeros(channels, **kw)
        sig0 = 1.0 / (1.0 + math.exp(-self.init_logit))
        self.register_buffer("fixed_scale", w / sig0)
        self.gamma = nn.Parameter(torch.full((channels,), self.init_logit, **kw))
        self.beta = nn.Parameter(b)
        momentum = getattr(norm, "momentum", None)
        self.momentum: float | None = None if momentum is None else float(momentum)
        self.track_running_stats = bool(getattr(norm, "track_running_stats", False))
        if self.is_batch_norm and self.track_running_stats:
            stats_mean, stats_var = norm.running_mean, norm.running_var
            assert isinstance(stats_mean, Tensor) and isinstance(stats_var, Tensor)
            mean = stats_mean.detach().to(w.dtype)
            var = stats_var.detach().to(w.dtype)
            self.register_buffer("running_mean", mean.expand(num_members, -1).clone())
            self.register_buffer("running_var", var.expand(num_members, -1).clone())
            self.register_buffer(
                "num_batches_tracked",
                torch.zeros(num_members, dtype=torch.long, device=mean.device),
            )
        #: pins the member whose statistics an unbatched call uses (see :func:`pin_member`)
        self.member: int | None = None

    # ------------------------------------------------------------------ helpers
    def member_scale(self, gamma: Tensor | None = None) -> Tensor:
        """``c ⊙ σ(γ)`` `(C,)` or `(S, C)`."""
        gamma = self.gamma if gamma is None else gamma
        return self.fixed_scale * torch.sigmoid(gamma)

    def _statistics(self, num_samples: int) -> tuple[Tensor, Tensor]:
        """Running mean and variance `(S, C)` of the members slice ``s`` belongs to."""
        members = self.num_members
        if num_samples % members == 0:
            index = torch.arange(num_samples, device=self.running_mean.device) % members
        else:
            if self.member is not None:
                index = torch.full((num_samples,), self.member, device=self.running_mean.device)
            elif members == 1 or (
                torch.equal(self.running_mean, self.running_mean[:1].expand_as(self.running_mean))
                and torch.equal(self.running_var, self.running_var[:1].expand_as(self.running_var))
            ):
                index = torch.zeros(num_samples, dtype=torch.long, device=self.running_mean.device)
            else:
                raise RuntimeError(
                    f"MemberNorm: the {members} members have their own BatchNorm statistics, so "
                    f"{num_samples} parameter set(s) in one forward cannot tell which member "
                    "each is. Evaluate the members in order (a multiple of num_members, as the "
                    "'signorm' guide's sample_posterior does), or pin one with "
                    "pyrobayes.models.signorm.pin_member(net, t)."
                )
        return self.running_mean[index], self.running_var[index]

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        gamma: Tensor = self.gamma
        beta: Tensor = self.beta
        batched = gamma.dim() == 2 or beta.dim() == 2
        num_samples = int(gamma.shape[0]) if gamma.dim() == 2 else 1
        if beta.dim() == 2:
            num_samples = int(beta.shape[0])
        scale = self.member_scale(gamma)
        if scale.dim() == 1:
            scale = scale.expand(num_samples, -1)
        if beta.dim() == 1:
            beta = beta.expand(num_samples, -1)
        if x.shape[0] % num_samples != 0:
            raise RuntimeError(
                f"MemberNorm: expected the input's leading size to be a multiple of the "
                f"{num_samples} parameter sets (a sample-major expanded batch) but got input "
                f"shape {tuple(x.shape)}."
            )
        if not self.is_batch_norm:
            y = F.layer_norm(x, (self.num_features,), None, None, self.eps)
            ys = y.reshape(num_samples, -1, self.num_features)
            out = ys * scale.unsqueeze(1).to(ys.dtype) + beta.unsqueeze(1).to(ys.dtype)
            return out.reshape(x.shape)
        # BatchNorm: channels at dim 1; (S, B, C, *spatial)
        xs = x.reshape(num_samples, -1, *x.shape[1:])
        view = (num_samples, 1, self.num_features) + (1,) * (xs.dim() - 3)
        reduce = (1,) + tuple(range(3, xs.dim()))
        if self.training or not self.track_running_stats:
            mean = xs.mean(dim=reduce)
            var = xs.var(dim=reduce, unbiased=False)
            if self.training and self.track_running_stats:
                self._update_statistics(xs, mean, var, num_samples, batched)
        else:
            mean, var = self._statistics(num_samples)
        normed = (xs - mean.reshape(view)) * torch.rsqrt(var.reshape(view) + self.eps)
        out = normed * scale.reshape(view).to(xs.dtype) + beta.reshape(view).to(xs.dtype)
        return out.reshape(x.shape)

    def _update_statistics(
        self, xs: Tensor, mean: Tensor, var: Tensor, num_samples: int, batched: bool
    ) -> None:
        """EMA of each member's batch statistics (torch's BatchNorm rule, unbiased variance)."""
        count = xs.numel() // (num_samples * self.num_features)
        if num_samples == self.num_members:
            index = torch.arange(num_samples, device=mean.device)
        elif not batched and self.member is not None:
            index = torch.tensor([self.member], device=mean.device)
        elif self.num_members == 1:
            index = torch.zeros(1, dtype=torch.long, device=mean.device)
        else:
            raise RuntimeError(
                f"MemberNorm: in training mode the {self.num_members} members' BatchNorm "
                f"statistics are updated from a forward over all members in order, but got "
                f"{num_samples} parameter set(s)."
            )
        with torch.no_grad():
            unbiased = var * (count / max(count - 1, 1))
            self.num_batches_tracked[index] += 1
            if self.momentum is None:  # cumulative moving average, as torch
                factor = (1.0 / self.num_batches_tracked[index].to(mean.dtype)).unsqueeze(-1)
            else:
                factor = torch.full_like(mean[:, :1], float(self.momentum))
            self.running_mean[index] = (1 - factor) * self.running_mean[index] + factor * mean
            self.running_var[index] = (1 - factor) * self.running_var[index] + factor * unbiased

    def extra_repr(self) -> str:
        kind = "batch" if self.is_batch_norm else "layer"
        return f"{self.num_features}, members={self.num_members}, norm={kind}"


@contextlib.contextmanager
def pin_member(net: nn.Module, member: int) -> Iterator[None]:
    """Within the block, an unbatched call of every :class:`MemberNorm` in ``net`` uses member
    ``member``'s BatchNorm statistics (evaluating one member of an ensemble alone)."""
    norms = [m for m in net.modules() if isinstance(m, MemberNorm)]
    saved = [m.member for m in norms]
    try:
        for m in norms:
            m.member = int(member)
        yield
    finally:
        for m, old in zip(norms, saved, strict=True):
            m.member = old


def member_norms(net: nn.Module) -> dict[str, MemberNorm]:
    """``{module path: MemberNorm}`` of ``net``."""
    return {name: m for name, m in net.named_modules() if isinstance(m, MemberNorm)}


def _select(
    net: nn.Module, selector: Sequence[str] | str, candidates: list[str], what: str
) -> list[str]:
    if selector == "all":
        return candidates
    if isinstance(selector, str):
        import re

        pattern = re.compile(selector)
        chosen = [n for n in candidates if pattern.fullmatch(n)]
    else:
        targets = list(selector)
        chosen = [n for n in candidates if any(n == t or n.endswith("." + t) for t in targets)]
    if not chosen and (not isinstance(selector, Sequence) or len(selector)):
        raise ValueError(
            f"{what}={selector!r} matched no module of {type(net).__name__}. Candidates: "
            f"{candidates[:12]}{' ...' if len(candidates) > 12 else ''}."
        )
    return chosen


@dataclass
class SigmaNorm:
    r"""The σN-ensemble "adapter": member norm layers and member heads, optionally on top of
    LoRA or LoRA-XS.

    Pass it as ``adapter=`` of :class:`~pyrobayes.models.FineTuneModel` (or use
    :class:`SigmaNormEnsemble`). Each selected ``LayerNorm`` / ``BatchNorm1d`` / ``BatchNorm2d``
    becomes a :class:`MemberNorm` with latent sites ``<path>.gamma`` (kind ``signorm_scale``)
    and ``<path>.beta`` (kind ``signorm_shift``); each head ``nn.Linear`` gets latent sites
    ``<path>.weight`` and ``<path>.bias``; the inner ``adapter``'s sites come first.

    Parameters
    ----------
    num_members : int
        M, the ensemble size (BatchNorm keeps M sets of running statistics).
    norm_modules : "all" or list of str or str
        Which norm layers become member layers: all, module names (suffix match) or a regex
        over full paths.
    heads : "auto" or list of str
        ``nn.Linear`` modules replicated per member; ``"auto"`` takes the Hugging Face task head
        (``classifier``, ``score``, ...; its ``nn.Linear`` leaves) when there is one.
    adapter : LoRA or LoRAXS, optional
        An adapter injected first (σN on the norm layers together with LoRA / LoRA-XS).
    init_logit : float
        ``γ_0`` (see :class:`MemberNorm`).
    """

    num_members: int = 4
    norm_modules: Sequence[str] | str = "all"
    heads: Sequence[str] | str = "auto"
    adapter: LoRA | LoRAXS | None = None
    init_logit: float = 0.0
    kind: str = field(default="signorm", init=False)

    def __post_init__(self) -> None:
        self.num_members = check_int("num_members", self.num_members, ge=1, owner="SigmaNorm: ")
        if self.adapter is not None and not isinstance(self.adapter, (LoRA, LoRAXS)):
            raise TypeError(
                f"SigmaNorm: adapter must be LoRA(...), LoRAXS(...) or None; got "
                f"{type(self.adapter).__name__}."
            )
        if isinstance(self.heads, str) and self.heads != "auto":
            self.heads = [self.heads]
        self.init_logit = float(self.init_logit)

    @property
    def target_modules(self) -> Sequence[str] | str:
        """The inner adapter's targets (what LoRA / LoRA-XS code paths read)."""
        return self.adapter.target_modules if self.adapter is not None else []

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_members": self.num_members,
            "norm_modules": self.norm_modules
            if isinstance(self.norm_modules, str)
            else list(self.norm_modules),
            "heads": self.heads if isinstance(self.heads, str) else list(self.heads),
            "adapter": None if self.adapter is None else self.adapter.to_dict(),
            "init_logit": self.init_logit,
        }

    def inject(self, net: nn.Module, **adapter_kwargs: Any) -> list[SiteSpec]:
        """Convert ``net`` in place; return the latent sites (inner adapter, norms, heads)."""
        specs: list[SiteSpec] = []
        if self.adapter is not None:
            specs += inject_adapter(net, self.adapter, **adapter_kwargs)
        norms = [n for n, m in net.named_modules() if n and isinstance(m, _NORMS)]
        if not norms:
            raise ValueError(
                f"SigmaNorm: {type(net).__name__} has no LayerNorm / BatchNorm1d / BatchNorm2d "
                "layer to turn into member norm layers. Insert one, or use another family."
            )
        for path in _select(net, self.norm_modules, norms, "norm_modules"):
            layer = MemberNorm(net.get_submodule(path), self.num_members, self.init_logit)
            for p in layer.parameters():
                p.requires_grad_(False)  # sampled, never trained in place
            layer.train(net.training)  # the backbone's mode (eval unless train_backbone_mode)
            _set_submodule(net, path, layer)
            C = (layer.num_features,)
            specs.append(SiteSpec(f"{path}.gamma", f"{path}.gamma", path, C, SCALE_KIND))
            specs.append(SiteSpec(f"{path}.beta", f"{path}.beta", path, C, SHIFT_KIND))
        specs += make_latent(net, self._head_paths(net))
        return specs

    def _head_paths(self, net: nn.Module) -> list[str]:
        if self.heads == "auto":
            heads = [n for n, _ in net.named_modules() if n.rsplit(".", 1)[-1] in HEAD_NAMES]
            paths = []
            for head in heads:
                module = net.get_submodule(head)
                if isinstance(module, nn.Linear):
                    paths.append(head)
                else:  # e.g. RoBERTa's classifier: dense + out_proj
                    paths += [
                        f"{head}.{n}" for n, m in module.named_modules() if isinstance(m, nn.Linear)
                    ]
            return [p for p in paths if not any(p.startswith(h + ".") for h in paths if h != p)]
        linears = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)]
        return _select(net, self.heads, linears, "heads")


class SigmaNormEnsemble(FineTuneModel):
    r"""A pretrained network as an M-member σN-ensemble (Lopez-Gonzalez et al., 2025).

    ``FineTuneModel(net, SigmaNorm(num_members, norm_modules, heads, adapter), ...)``: every
    selected norm layer becomes a :class:`MemberNorm` (per-member ``γ``, ``β``, BatchNorm
    statistics; the function at ``γ = γ_0``, ``β = b`` is the pretrained one) and the heads
    become latent sites. Fit it with the ``"signorm"`` guide (M point particles over these
    sites), whose objective is the mean member log-likelihood plus ``λ L_div``:

    .. math::

        L = -\frac{N}{B}\frac1M \sum_{t=1}^{M}\sum_{b} \log p(y_b \mid f_t(x_b))
            + N λ L_{div}(σ(γ_{1:M})).

    Parameters
    ----------
    net : nn.Module
        A Hugging Face model or a plain ``nn.Module`` with LayerNorm / BatchNorm layers.
    adapter : LoRA or LoRAXS, optional
        Adapters trained (as member particles) together with the norm layers.
    num_members : int
        M.
    norm_modules : "all" or list of str or str
        Which norm layers become member layers.
    heads : "auto" or list of str
        The ``nn.Linear`` heads replicated per member.
    init_logit : float
        ``γ_0`` (0: σ(γ_0) = ½).
    **kwargs
        :class:`~pyrobayes.models.FineTuneModel` arguments (``likelihood``, ``num_data``,
        ``trainable_modules``, ``train_backbone_mode`` for BatchNorm batch statistics, ...).
        ``prior_scale`` is the N(0, s_p²) prior other objectives (Pyro's ELBOs) see; the σN
        objective uses no prior (members are point estimates of a multi-task model).
    """

    def __init__(
        self,
        net: nn.Module,
        adapter: LoRA | LoRAXS | None = None,
        *,
        num_members: int = 4,
        norm_modules: Sequence[str] | str = "all",
        heads: Sequence[str] | str = "auto",
        init_logit: float = 0.0,
        **kwargs: Any,
    ) -> None:
        config = SigmaNorm(
            num_members=num_members,
            norm_modules=norm_modules,
            heads=heads,
            adapter=adapter,
            init_logit=init_logit,
        )
        super().__init__(net, config, **kwargs)

    @property
    def num_members(self) -> int:
        """M."""
        assert isinstance(self.adapter, SigmaNorm)
        return self.adapter.num_members


def scale_sites(model: Any, regularized: Sequence[str] | str = "all") -> list[str]:
    """The pre-sigmoid scale sites ``<path>.gamma`` of ``model``'s member norm layers that the
    diversity term covers: all, or those whose module path matches ``regularized`` (suffix match
    per entry, or a regex over full paths)."""
    sites = {
        spec.module_path: site
        for site, spec in getattr(model, "latent_sites", {}).items()
        if spec.kind == SCALE_KIND
    }
    if regularized == "all":
        return list(sites.values())
    paths = list(sites)
    if isinstance(regularized, str):
        import re

        pattern = re.compile(regularized)
        chosen = [p for p in paths if pattern.fullmatch(p)]
    else:
        chosen = [p for p in paths if any(p == t or p.endswith("." + t) for t in regularized)]
    if not chosen and (isinstance(regularized, str) or len(regularized)):
        raise ValueError(
            f"regularized={regularized!r} matches no member norm layer; they are {paths}."
        )
    return [sites[p] for p in chosen]


def diversity(gammas: Iterable[Tensor], tau: float) -> Tensor:
    r"""``L_div = Σ_ℓ Σ_i Σ_m log softmax_τ(σ(γ_{·,ℓ,i}))_m`` (without λ), minimized in training.

    Parameters
    ----------
    gammas : iterable of Tensor
        Pre-sigmoid member scales, each `(M, C)` (members first).
    tau : float
        τ > 0, the softmax temperature.

    Returns
    -------
    Tensor
        A scalar; ``M·C·log(1/M)`` summed over layers at uniform scales, lower at owner corners.
    """
    total: Tensor | None = None
    for gamma in gammas:
        term = torch.log_softmax(torch.sigmoid(gamma) / tau, dim=0).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total


def owner_corner(num_members: int, tau: float) -> int:
    r"""``argmin_k f(k)``, ``f(k) = k/τ − M log(k e^{1/τ} + M − k)``: the number of owning members
    (σ = 1) per feature at the regularizer's minimizing corner (the rest at σ = 0).

    Its continuous relaxation is ``k*/M = τ − 1/(e^{1/τ} − 1)``.
    """
    best, value = 1, math.inf
    for k in range(1, num_members + 1):
        # k/τ − M log(k e^{1/τ} + M − k) = k/τ − M (1/τ + log(k + (M − k) e^{−1/τ}))
        f = k / tau - num_members * (1 / tau + math.log(k + (num_members - k) * math.exp(-1 / tau)))
        if f < value - 1e-12:
            best, value = k, f
    return best
