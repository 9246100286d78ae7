r"""σN-ensembles: M members that share every weight and differ in σ-bounded norm layers and heads.

Every normalization layer ℓ (``LayerNorm``, ``BatchNorm1d``, ``BatchNorm2d``, ``RMSNorm``) is
replaced by a :class:`MemberNorm` whose member ``t`` computes

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

import copy
import logging
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..user_frame import user_stacklevel
from .adapters import (
    LoRA,
    LoRAXS,
    SiteSpec,
    _sequence_first,
    _set_submodule,
    check_int,
    check_real,
    inject_adapter,
    make_latent,
)
from .finetune import HEAD_NAMES, FineTuneModel, task_head_modules
from .layers import _hook_stores, carry_hooks, rows_first, user_forward_hooks

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
    "is_norm",
    "member_norms",
    "update_statistics",
    "STATS_KIND",
    "MAX_INIT_LOGIT",
]

#: ``SiteSpec.kind`` of a member norm layer's pre-sigmoid scale ``γ`` and of its shift ``β``.
SCALE_KIND = "signorm_scale"
SHIFT_KIND = "signorm_shift"
#: ``SiteSpec.kind`` of a member BatchNorm's running statistics (not trained by gradients)
STATS_KIND = "signorm_statistics"

_NORMS = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)

#: The largest ``|init_logit|`` (``|γ_0|``) accepted. The sigmoid's slope ``σ'(γ) = σ(1 − σ)``
#: is 1/4 at 0 and ``≈ e^{−|γ|}`` beyond: 4.5e-5 at 10 (1/5500 of its peak), and in float32
#: ``σ(γ)`` rounds to exactly 1 for ``γ ≳ 16.6`` (``1 − σ < 2^{−24}``), so the gradient of every
#: term through ``σ(γ)`` (the diversity term, and the member scale's relative change
#: ``1 − σ(γ)``) is 0 and the members never move. 10 keeps a usable slope with margin.
MAX_INIT_LOGIT = 10.0


def check_init_logit(value: Any, owner: str) -> float:
    """``value`` as a float in ``[−MAX_INIT_LOGIT, MAX_INIT_LOGIT]``, or a clear error."""
    logit = check_real("init_logit", value, owner=owner)
    if abs(logit) > MAX_INIT_LOGIT:
        raise ValueError(
            f"{owner}init_logit={logit:g} saturates the sigmoid: σ'(γ_0) = "
            f"{_sigmoid_slope(logit):.2g} (1/4 at 0), so the member scales σ(γ) get (almost) no "
            f"gradient and never move. Pass |init_logit| <= {MAX_INIT_LOGIT:g} (default 0, "
            "the steepest point)."
        )
    return logit


def _sigmoid_slope(x: float) -> float:
    s = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return s * (1.0 - s)


def is_norm(module: nn.Module) -> bool:
    """A norm layer σN converts: ``LayerNorm``, ``BatchNorm1d/2d``, ``RMSNorm`` (torch's, or a
    Hugging Face ``*RMSNorm`` with ``weight`` and ``variance_epsilon``, as LLaMA's)."""
    return isinstance(module, _NORMS) or _is_hf_rms(module)


def _is_hf_rms(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith(("RMSNorm", "T5LayerNorm"))  # T5, MT5, UMT5, LongT5
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, Tensor)
        and weight.dim() == 1
    )


def _norm_like(module: nn.Module) -> bool:
    """A module named like a norm layer (``*Norm``, ``*Norm1d``, ...) that :func:`is_norm` does
    not recognise, for a refusal's message."""
    name = type(module).__name__
    return (
        "Norm" in name
        and not is_norm(module)
        and isinstance(getattr(module, "weight", None), Tensor)
    )


def _hook_names(hooks: Sequence[object]) -> str:
    """The hooks' names, for a message: ``['scale', 'Recorder']``."""
    return str([getattr(h, "__qualname__", None) or type(h).__name__ for h in hooks][:4])


def _refuse_recomputed_weight(norm: nn.Module, where: str) -> None:
    """Refuse a norm layer whose weight torch recomputes at each call (the older
    ``torch.nn.utils.weight_norm`` and pruning, both forward pre-hooks, or a parametrization).

    A member layer copies the weight once, and the plain layer a member is merged into
    (:meth:`MemberNorm.merged_norm`) would recompute the pretrained weight over the member's
    scale; the older ``weight_norm`` also makes the layer impossible to copy.

    Raises
    ------
    ValueError
        Naming the layer (``where``), what recomputes its weight and how to remove it.
    """
    from torch.nn.utils import parametrize

    user = user_forward_hooks(norm)
    recomputing = [h for h in norm._forward_pre_hooks.values() if not any(h is u for u in user)]
    if not recomputing and not parametrize.is_parametrized(norm):
        return
    what = _hook_names(recomputing) if recomputing else "a parametrization"
    raise ValueError(
        f"{where} has its weight recomputed at each call by {what} "
        "(torch.nn.utils.weight_norm, pruning or torch.nn.utils.parametrize): a member norm "
        "layer copies the weight once, and the plain layer a member is merged into would "
        "recompute the pretrained weight over the member's scale. Remove it first "
        "(torch.nn.utils.remove_weight_norm(m), torch.nn.utils.prune.remove(m, 'weight') or "
        "torch.nn.utils.parametrize.remove_parametrizations(m, 'weight'), which keep the "
        "current weight), or leave the layer out with norm_modules=[...]."
    )


def _norm_channels(norm: nn.Module, upcast: bool) -> int:
    """The channel count of a norm layer that can become a member layer (refusing the ones whose
    output carries nothing the data determine: a LayerNorm over one or two features)."""
    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
        if len(norm.normalized_shape) != 1:
            raise ValueError(
                f"MemberNorm: {type(norm).__name__} over several trailing dimensions "
                f"(normalized_shape={tuple(norm.normalized_shape)}) is not supported; only "
                "a LayerNorm over the last (feature) dimension."
            )
        channels = int(norm.normalized_shape[0])
        if isinstance(norm, nn.LayerNorm) and channels <= 2:
            what = (
                "its bias alone"
                if channels == 1
                else "±1 times its weight plus its bias: the sign of the two features' difference"
            )
            raise ValueError(
                f"MemberNorm: a LayerNorm over {channels} feature(s) outputs {what}, with no "
                "gradient back into the network, so its members cannot differ in anything "
                "the data determine (a binary classifier with a LayerNorm over its two "
                "logits collapsed to the majority class). Put σN on norm layers over wider "
                "features (a hidden layer's), or leave this one out with norm_modules=[...]."
            )
    elif upcast:
        hf_weight = getattr(norm, "weight", None)
        if not isinstance(hf_weight, Tensor):
            raise TypeError(
                f"MemberNorm: the RMSNorm {type(norm).__name__} has no weight tensor to "
                "take the channel count from; leave it out with norm_modules=[...]."
            )
        channels = int(hf_weight.shape[0])
    else:
        channels = int(getattr(norm, "num_features", 0))
    return channels


class MemberNorm(nn.Module):
    r"""A normalization layer with per-member σ-bounded scale, shift and BatchNorm statistics.

    ``y = c ⊙ σ(γ) ⊙ norm(x) + β`` with ``c = w / σ(γ_0)`` fixed (a buffer), so the layer equals
    the pretrained ``norm`` at ``γ = γ_0``, ``β = b``.

    ``gamma`` `(C,)`, ``beta`` `(C,)` and, for a BatchNorm that tracks them, the running
    statistics ``running_mean`` and ``running_var`` `(C,)` are the member's tensors (latent sites
    of the model: every member carries its own, and a member's draw carries its statistics). A
    value with a leading sample axis `(S, C)` applies sample ``s`` to its slice of a
    sample-major expanded batch. In eval mode BatchNorm normalizes with the given statistics
    (never differentiated); in training mode (``FineTuneModel(train_backbone_mode=True)``) each
    slice is normalized with its own batch statistics, which are kept in
    :attr:`batch_statistics` `(S, C)` for the fitter to fold into each member's running
    statistics (:func:`update_statistics`).

    Parameters
    ----------
    norm : nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d or an RMSNorm
        The pretrained layer (its weights are copied; the module is not kept). An RMSNorm
        (``x / √(mean(x²) + ε)``, no centring; a Hugging Face one computes it in float32, as
        LLaMA's) gets a shift ``β`` starting at 0.
    init_logit : float
        ``γ_0``, the pre-sigmoid scale that reproduces the pretrained layer (0: σ = ½, the
        steepest point of the sigmoid, so a member can grow or shrink a feature); at most
        :data:`MAX_INIT_LOGIT` in absolute value (beyond, the sigmoid saturates).
    """

    fixed_scale: Tensor
    #: the network calls the layer on sequence-first inputs ``(T, S·B, d)`` (the norms of a
    #: ``batch_first=False`` ``nn.TransformerEncoderLayer``): each draw applies to axis 1
    #: (:func:`~pyrobayes.models.layers.rows_first`); set by :meth:`SigmaNorm.inject`
    sequence_first: bool = False

    def __init__(self, norm: nn.Module, init_logit: float = 0.0) -> None:
        super().__init__()
        if not is_norm(norm):
            raise TypeError(
                "MemberNorm: expected an nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d or an "
                f"RMSNorm but got {type(norm).__name__}."
            )
        self.init_logit = check_init_logit(init_logit, "MemberNorm: ")
        _refuse_recomputed_weight(norm, f"MemberNorm: the {type(norm).__name__}")
        self.is_batch_norm = isinstance(norm, nn.modules.batchnorm._BatchNorm)
        #: "batch", "layer" or "rms"
        self.norm_kind = (
            "batch" if self.is_batch_norm else "layer" if isinstance(norm, nn.LayerNorm) else "rms"
        )
        #: an RMSNorm computed in float32 whatever the input dtype (Hugging Face's)
        self.upcast = _is_hf_rms(norm)
        eps = getattr(norm, "variance_epsilon" if self.upcast else "eps", None)
        #: ε; −1 for torch's RMSNorm default (``finfo(x.dtype).eps`` at call time)
        self.eps = -1.0 if eps is None else float(eps)
        channels = _norm_channels(norm, self.upcast)
        self.num_features = channels
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        stats_mean = getattr(norm, "running_mean", None)
        stats_var = getattr(norm, "running_var", None)
        ref = next((t for t in (weight, bias, stats_mean) if isinstance(t, Tensor)), None)
        kw: dict[str, Any] = (
            {"dtype": ref.dtype, "device": ref.device}
            if ref is not None
            else {"dtype": torch.get_default_dtype()}
        )
        w = weight.detach().clone() if weight is not None else torch.ones(channels, **kw)
        b = bias.detach().clone() if bias is not None else torch.zeros(channels, **kw)
        sig0 = 1.0 / (1.0 + math.exp(-self.init_logit))
        self.register_buffer("fixed_scale", w / sig0)
        self.gamma = nn.Parameter(torch.full((channels,), self.init_logit, **kw))
        self.beta = nn.Parameter(b)
        momentum = getattr(norm, "momentum", None)
        #: the EMA weight of a member's new batch statistics (torch's cumulative average, for
        #: ``momentum=None``, has no per-member count here: 0.1, BatchNorm's default)
        self.momentum = 0.1 if momentum is None else float(momentum)
        self.tracks_statistics = False
        self.running_mean: nn.Parameter | None = None
        self.running_var: nn.Parameter | None = None
        if self.is_batch_norm and isinstance(stats_mean, Tensor) and isinstance(stats_var, Tensor):
            self.tracks_statistics = True
            self.running_mean = nn.Parameter(stats_mean.detach().clone().to(w.dtype))
            self.running_var = nn.Parameter(stats_var.detach().clone().to(w.dtype))
        #: ``(mean, unbiased variance)`` `(S, C)` of the last training-mode forward's slices
        self.batch_statistics: tuple[Tensor, Tensor] | None = None
        #: the values per channel and member those statistics were computed over
        self.batch_count = 0
        # a frozen copy of the pretrained layer, not a submodule (no state-dict keys): the
        # template of merged_norm's plain layer
        template = copy.deepcopy(norm)
        for p in template.parameters():
            p.requires_grad_(False)
        for registry in _hook_stores(template).values():  # the hooks are the member layer's
            if isinstance(registry, dict):  # (SigmaNorm.inject carries them to it)
                registry.clear()
        self._template: tuple[nn.Module] = (template,)

    def member_scale(self, gamma: Tensor | None = None) -> Tensor:
        """``c ⊙ σ(γ)`` `(C,)` or `(S, C)`."""
        gamma = self.gamma if gamma is None else gamma
        return self.fixed_scale * torch.sigmoid(gamma)

    def forward(self, x: Tensor) -> Tensor:
        out = self._forward(rows_first(x, self.sequence_first))
        return rows_first(out, self.sequence_first)

    def _forward(self, x: Tensor) -> Tensor:
        gamma: Tensor = self.gamma
        beta: Tensor = self.beta
        sizes = {int(t.shape[0]) for t in (gamma, beta) if t.dim() == 2}
        running = self._running_statistics()
        if running is not None and not self.training:
            sizes |= {int(t.shape[0]) for t in running if t.dim() == 2}
        if len(sizes) > 1:
            raise RuntimeError(
                f"MemberNorm: the member tensors carry different sample counts {sizes}."
            )
        num_samples = sizes.pop() if sizes else 1
        if x.shape[0] % num_samples != 0:
            raise RuntimeError(
                f"MemberNorm: expected the input's leading size to be a multiple of the "
                f"{num_samples} parameter sets (a sample-major expanded batch) but got input "
                f"shape {tuple(x.shape)}."
            )
        scale = self.member_scale(gamma).expand(num_samples, -1)
        beta = beta.expand(num_samples, -1)
        if not self.is_batch_norm:
            if self.norm_kind == "layer":
                y = F.layer_norm(x, (self.num_features,), None, None, self.eps)
            else:
                y = self._rms(x)
            ys = y.reshape(num_samples, -1, self.num_features)
            out = ys * scale.unsqueeze(1).to(ys.dtype) + beta.unsqueeze(1).to(ys.dtype)
            return out.reshape(x.shape)
        # BatchNorm: channels at dim 1; (S, B, C, *spatial)
        xs = x.reshape(num_samples, -1, *x.shape[1:])
        view = (num_samples, 1, self.num_features) + (1,) * (xs.dim() - 3)
        reduce = (1,) + tuple(range(3, xs.dim()))
        if self.training or running is None:
            mean = xs.mean(dim=reduce)
            var = xs.var(dim=reduce, unbiased=False)
            if self.tracks_statistics:
                count = xs.numel() // (num_samples * self.num_features)
                unbiased = var.detach() * (count / max(count - 1, 1))
                self.batch_statistics = (mean.detach(), unbiased)
                self.batch_count = count
        else:
            # statistics, not parameters: no gradient reaches them
            mean = running[0].detach().expand(num_samples, -1)
            var = running[1].detach().expand(num_samples, -1)
        normed = (xs - mean.reshape(view)) * torch.rsqrt(var.reshape(view) + self.eps)
        out = normed * scale.reshape(view).to(xs.dtype) + beta.reshape(view).to(xs.dtype)
        return out.reshape(x.shape)

    def merged_norm(self, values: Mapping[str, Tensor]) -> nn.Module:
        r"""The pretrained layer's class at one member's values: a plain norm layer with weight
        ``c ⊙ σ(γ)``, bias ``β`` and (BatchNorm) the member's running statistics.

        Parameters
        ----------
        values : dict
            ``{"gamma", "beta", "running_mean", "running_var"}`` of one member, each `(C,)`;
            a missing one is this layer's stored value.

        Raises
        ------
        ValueError
            When a value is not one `(C,)` member (a leading sample axis), or when the pretrained
            layer has no weight (bias) to hold a member scale ``≠ 1`` (shift ``≠ 0``), e.g. an
            RMSNorm, which has no bias, with a trained shift.
        """
        plain = copy.deepcopy(self._template[0]).to(self.fixed_scale.device)
        current: dict[str, Tensor] = {"gamma": self.gamma, "beta": self.beta}
        running = self._running_statistics()
        if running is not None:
            current.update(running_mean=running[0], running_var=running[1])
        merged = {role: values.get(role, default) for role, default in current.items()}
        for role, value in merged.items():
            if tuple(value.shape) != (self.num_features,):
                raise ValueError(
                    f"MemberNorm.merged_norm: {role} has shape {tuple(value.shape)}; pass one "
                    f"member's values, shape ({self.num_features},) (e.g. one draw of "
                    "guide.sample_posterior, not the stacked members)."
                )
        targets: dict[str, Tensor | None] = {
            "weight": self.member_scale(merged["gamma"].to(self.fixed_scale.dtype)),
            "bias": merged["beta"],
            "running_mean": merged.get("running_mean"),
            "running_var": merged.get("running_var"),
        }
        neutral = {"weight": 1.0, "bias": 0.0}
        with torch.no_grad():
            for name, target in targets.items():
                if target is None:
                    continue
                slot = getattr(plain, name, None)
                if isinstance(slot, Tensor):
                    slot.copy_(target.to(slot.dtype))
                elif not bool((target == neutral.get(name, math.nan)).all()):
                    raise ValueError(
                        f"MemberNorm.merged_norm: the pretrained {type(plain).__name__} has no "
                        f"{name}, so it cannot hold this member's {name} (it differs from "
                        f"{neutral.get(name)}); use model.output(x, values) with the member's "
                        "values instead of a merged network."
                    )
        plain.train(self.training)
        return plain

    def _running_statistics(self) -> tuple[Tensor, Tensor] | None:
        """``(running_mean, running_var)`` of a BatchNorm that tracks them, else ``None``."""
        if not self.tracks_statistics:
            return None
        mean, var = self.running_mean, self.running_var
        if mean is None or var is None:
            raise RuntimeError(
                "MemberNorm: a BatchNorm member layer that tracks running statistics lost them "
                "(running_mean / running_var set to None); rebuild the model."
            )
        return mean, var

    def _rms(self, x: Tensor) -> Tensor:
        """``x / √(mean(x²) + ε)`` over the last dimension (in float32 for a HF RMSNorm)."""
        xf = x.to(torch.float32) if self.upcast else x
        eps = self.eps if self.eps >= 0 else torch.finfo(x.dtype).eps
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_features}, norm={self.norm_kind}, init_logit={self.init_logit:g}"


def update_statistics(net: nn.Module, members: Mapping[str, Tensor]) -> int:
    r"""Fold the last training-mode forward's batch statistics into the members' running ones.

    ``members[<path>.running_mean]`` `(M, C)` (and ``running_var``) are the members' tensors,
    updated in place with BatchNorm's rule ``r ← (1 − m) r + m · s_batch`` (unbiased variance),
    member ``t`` from slice ``t`` of a forward over the M members in order. Clears the recorded
    statistics; returns the number of layers updated.
    """
    updated = 0
    for path, layer in member_norms(net).items():
        stats = layer.batch_statistics
        if stats is None:
            continue
        layer.batch_statistics = None
        for role, value in zip(("running_mean", "running_var"), stats, strict=True):
            target = members.get(f"{path}.{role}")
            if target is None:
                continue
            if target.shape != value.shape:
                raise RuntimeError(
                    f"update_statistics: {path}.{role} holds {tuple(target.shape)} member values "
                    f"but the forward ran {tuple(value.shape)} (the members, in order)."
                )
            with torch.no_grad():
                target.mul_(1 - layer.momentum).add_(value.to(target.dtype), alpha=layer.momentum)
        updated += 1
    return updated


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
    if not isinstance(selector, str):
        _warn_unmatched(what, list(selector), candidates, type(net).__name__)
    return chosen


def _warn_unmatched(what: str, entries: list[str], paths: list[str], owner: str) -> None:
    """Warn of the list entries that match none of ``paths`` while others do (a typo, or a
    layer of a kind σN does not take): without a word they would be left out silently."""
    unmatched = [t for t in entries if not any(p == t or p.endswith("." + t) for p in paths)]
    if not unmatched or len(unmatched) == len(entries):
        return
    warnings.warn(
        f"{what} entries {unmatched} match no candidate of {owner} and are ignored; only the "
        f"other entries are taken. Candidates: {paths[:12]}{' ...' if len(paths) > 12 else ''}.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


#: norm-like layers σN does not convert (left as they are under ``norm_modules="all"``, said)
_UNCONVERTED_NORMS = (
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.batchnorm._BatchNorm,
)


def _log_unconverted(net: nn.Module) -> None:
    """Log the norm layers ``norm_modules="all"`` leaves out (GroupNorm, InstanceNorm,
    BatchNorm3d, ...): their scales stay shared by every member."""
    left = [
        f"{n} ({type(m).__name__})"
        for n, m in net.named_modules()
        if n and isinstance(m, _UNCONVERTED_NORMS) and not is_norm(m)
    ]
    if left:
        logger.warning(
            "SigmaNorm(norm_modules='all'): %d norm layer(s) of a kind σN does not convert stay "
            "shared by every member: %s%s (it converts LayerNorm, BatchNorm1d/2d and RMSNorm).",
            len(left),
            left[:8],
            " ..." if len(left) > 8 else "",
        )


def _check_conversion(path: str, original: nn.Module, layer: MemberNorm) -> None:
    """Raise when ``layer`` at its initial values is not ``original`` on a random input (a norm
    class whose formula differs from the one recognised, e.g. a ``(1 + w)``-scaled RMSNorm).

    Both run through ``forward`` itself: the user's hooks on ``original`` (carried over to
    ``layer`` after the check) neither see the random input nor change the comparison."""
    if getattr(original, "data_format", None) == "channels_first":
        raise ValueError(
            f"SigmaNorm: the norm layer {path!r} ({type(original).__name__}) normalises the "
            "channels of a (B, C, H, W) map (data_format='channels_first'), and σN's member "
            "norm the last axis. Leave it out with norm_modules=[...] (e.g. ConvNeXt's "
            r"channels-last norms, r'.*layers\.\d+\.layernorm')."
        )
    ref = layer.fixed_scale
    shape = (4, layer.num_features) + ((2, 2) if isinstance(original, nn.BatchNorm2d) else ())
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 0.5).to(
        dtype=ref.dtype, device=ref.device
    )
    mode = original.training
    try:
        original.eval()
        layer_mode = layer.training
        layer.eval()
        with torch.no_grad():
            expected, got = original.forward(x), layer.forward(x)
        layer.train(layer_mode)
    finally:
        original.train(mode)
    tol = 1e-3 if ref.dtype in (torch.float16, torch.bfloat16) else 1e-5
    error = float((got - expected).abs().max()) / max(float(expected.abs().max()), 1e-12)
    if not error <= tol:
        raise ValueError(
            f"SigmaNorm: the member norm layer for {path!r} ({type(original).__name__}) does not "
            f"reproduce it (relative error {error:.2g}); its formula is not a LayerNorm, "
            "BatchNorm or RMSNorm (x/√(mean x² + ε)·w). Leave it out with norm_modules=[...]."
        )


def _carry_norm_hooks(path: str, original: nn.Module, layer: MemberNorm) -> None:
    """Register the hooks of the norm layer ``original`` on ``layer``, its member layer at
    ``path`` (shared registries: a handle the user holds still removes its hook).

    The member layer at its initial values computes the pretrained layer's function, so the
    network keeps the function it had with its hooks, rather than losing them in silence (an
    observing hook that records activations) or failing the conversion check (a hook that
    changes the output). A forward hook then sees the member layer's output for every draw
    at once (the sample-major expanded batch, S·B rows) and the member layer as its module
    argument; :func:`~pyrobayes.models.merged_network` carries them to the plain layer.
    """
    hooks = user_forward_hooks(original)
    carry_hooks(original, layer, share=True)
    if hooks:
        logger.info(
            "SigmaNorm: the forward hook(s) or pre-hook(s) %s registered on the norm layer %r "
            "now run on its member layer (%s), which replaces it: they see every member's "
            "output at once (S·B rows, sample-major) and the MemberNorm as their module.",
            _hook_names(hooks),
            path,
            type(layer).__name__,
        )


@dataclass
class SigmaNorm:
    r"""The σN-ensemble "adapter": member norm layers and member heads, optionally on top of
    LoRA or LoRA-XS.

    Pass it as ``adapter=`` of :class:`~pyrobayes.models.FineTuneModel` (or use
    :class:`SigmaNormEnsemble`). Each selected ``LayerNorm`` / ``BatchNorm1d`` / ``BatchNorm2d`` /
    ``RMSNorm``
    becomes a :class:`MemberNorm` with latent sites ``<path>.gamma`` (kind ``signorm_scale``)
    and ``<path>.beta`` (kind ``signorm_shift``); each head ``nn.Linear`` gets latent sites
    ``<path>.weight`` and ``<path>.bias``; the inner ``adapter``'s sites come first.

    Parameters
    ----------
    num_members : int
        M, the ensemble size (the ``"signorm"`` guide's default number of members).
    norm_modules : "all" or list of str or str
        Which norm layers become member layers: all, module names (suffix match) or a regex
        over full paths.
    heads : "auto" or list of str
        ``nn.Linear`` modules replicated per member; ``"auto"`` takes the task head that
        ``FineTuneModel(trainable_modules="auto")`` trains (``classifier``, ``score``, ..., and
        the modules a Hugging Face task model adds beside its base model, such as BART's
        ``classification_head``; their ``nn.Linear`` leaves) when there is one.
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
        self.init_logit = check_init_logit(self.init_logit, "SigmaNorm: ")

    @property
    def target_modules(self) -> Sequence[str] | str | None:
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
        norms = [n for n, m in net.named_modules() if n and is_norm(m)]
        if not norms:
            others = sorted({type(m).__name__ for m in net.modules() if _norm_like(m)})
            seen = (
                f" (its {', '.join(others)} computes another formula or keeps its ε elsewhere, "
                "e.g. Gemma's (1 + w)-scaled RMSNorm)"
                if others
                else ""
            )
            raise ValueError(
                f"SigmaNorm: {type(net).__name__} has no LayerNorm / BatchNorm / RMSNorm layer "
                f"σN can convert into member norm layers{seen}. Insert one, or use another family."
            )
        if self.norm_modules == "all":
            _log_unconverted(net)
        for path in _select(net, self.norm_modules, norms, "norm_modules"):
            original = net.get_submodule(path)
            _refuse_recomputed_weight(original, f"SigmaNorm: the norm layer {path!r}")
            layer = MemberNorm(original, self.init_logit)
            layer.sequence_first = _sequence_first(net, path)
            _check_conversion(path, original, layer)
            for p in layer.parameters():
                p.requires_grad_(False)  # sampled, never trained in place
            layer.train(net.training)  # the backbone's mode (eval unless train_backbone_mode)
            _set_submodule(net, path, layer)
            _carry_norm_hooks(path, original, layer)
            C = (layer.num_features,)
            specs.append(SiteSpec(f"{path}.gamma", f"{path}.gamma", path, C, SCALE_KIND))
            specs.append(SiteSpec(f"{path}.beta", f"{path}.beta", path, C, SHIFT_KIND))
            if layer.tracks_statistics:
                for role in ("running_mean", "running_var"):
                    specs.append(SiteSpec(f"{path}.{role}", f"{path}.{role}", path, C, STATS_KIND))
        specs += make_latent(net, self._head_paths(net))
        return specs

    def _head_paths(self, net: nn.Module) -> list[str]:  # noqa: D102
        if self.heads == "auto":
            # the modules trainable_modules="auto" takes: classifier, score, ... and what a
            # Hugging Face task model adds beside its base model (BART's classification_head)
            heads = task_head_modules(net)
            paths = []
            for head in heads:
                module = net.get_submodule(head)
                if isinstance(module, nn.Linear):
                    paths.append(head)
                else:  # e.g. RoBERTa's classifier: dense + out_proj
                    paths += [
                        f"{head}.{n}" for n, m in module.named_modules() if isinstance(m, nn.Linear)
                    ]
            paths = [p for p in paths if not any(p.startswith(h + ".") for h in paths if h != p)]
            if not paths:  # (an explicit heads=[] is a choice: said nothing)
                logger.warning(
                    "SigmaNorm(heads='auto') found no head (a linear module named one of %s, or "
                    "a layer a Hugging Face task model adds beside its base model): "
                    "the members share the network's output layer, so only their norm layers "
                    "differ (and head_init has nothing to act on). Pass heads=[<path of the "
                    "output layer>] to give each member its own.",
                    sorted(HEAD_NAMES),
                )
            return paths
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
        A Hugging Face model or a plain ``nn.Module`` with LayerNorm / BatchNorm / RMSNorm
        layers.
    adapter : LoRA or LoRAXS, optional
        Adapters trained (as member particles) together with the norm layers.
    num_members : int
        M.
    norm_modules : "all" or list of str or str
        Which norm layers become member layers.
    heads : "auto" or list of str
        The ``nn.Linear`` heads replicated per member.
    init_logit : float
        ``γ_0`` (0: σ(γ_0) = ½), ``|γ_0| <=`` :data:`MAX_INIT_LOGIT` = 10.
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
        if not isinstance(self.adapter, SigmaNorm):
            raise TypeError(
                f"SigmaNormEnsemble: the adapter is {type(self.adapter).__name__}, not the "
                "SigmaNorm it was built with; do not replace model.adapter."
            )
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
    if not isinstance(regularized, str):
        _warn_unmatched("regularized", list(regularized), paths, "the member norm layers")
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
