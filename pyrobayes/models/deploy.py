r"""Deployment exports: a posterior mean or draw back to a peft adapter, or merged into the weights.

:func:`to_peft` turns LoRA sites into a ``peft.PeftModel`` (so the usual ``merge_and_unload`` and
``save_pretrained`` work); :func:`merged_network` folds any adapter into a copy of the base
weights,

.. math:: W = W_0 + \frac{α}{r} B A \ \text{(LoRA; Hu et al. 2022)}, \qquad
          W = W_0 + \frac{α}{r} U R V^\top \ \text{(LoRA-XS; Bałazy et al. 2024)},

and a σN-ensemble's member norm layers into plain norm layers at one member's values (weight
``c ⊙ σ(γ)``, bias ``β``, running statistics), giving a plain network with no pyrobayes layers: a Hugging Face model's ``save_pretrained``
checkpoint reloads with ``from_pretrained`` and no unexpected keys.

Both take the values to deploy, a parameter set or a fitted guide (its posterior mean): a fit
keeps the fitted values in the guide and never writes them into the network, which holds the
values the model was built with (``model.init_values()``, passed explicitly when meant).

Examples
--------
>>> net = pb.models.merged_network(model, guide)   # the posterior mean  # doctest: +SKIP
>>> net.save_pretrained("merged")                              # doctest: +SKIP
>>> AutoModelForCausalLM.from_pretrained("merged")             # doctest: +SKIP
>>> pb.models.to_peft(model, guide.mean()).save_pretrained("adapter")  # LoRA only  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..contract import Mixture, implements
from ..user_frame import user_stacklevel
from .adapters import LoRA, _module_aliases, _set_submodule
from .layers import (
    BatchedLinear,
    LoRALinear,
    LoRAXSLinear,
    carry_hooks,
    is_conv1d,
    user_forward_hooks,
)

__all__ = [
    "to_peft",
    "merged_network",
    "unwrapped_network",
    "UntemperedDeployWarning",
    "MergeRoundingWarning",
]


def unwrapped_network(model: Any) -> nn.Module:
    """A deep copy of the network with every pyrobayes adapter layer replaced by its base.

    The adapter's own submodules (a LoRA-XS ``core``, LoRA's ``lora_A`` / ``lora_B``) go with
    it; a latent :class:`BatchedLinear` elsewhere becomes an ``nn.Linear`` with its weights and
    the hooks registered on it. A module registered under several names (``net.dec = net.enc``)
    is replaced under every name, so the copy keeps it one module.
    """
    net = copy.deepcopy(model.net)
    adapters: list[str] = []
    for path, module in list(net.named_modules()):
        if any(path.startswith(a + ".") for a in adapters):
            continue  # inside an adapter layer that is gone: not part of the network any more
        if isinstance(module, (LoRALinear, LoRAXSLinear)):
            _set_submodule(net, path, module.base)
            adapters.append(path)
        elif isinstance(module, BatchedLinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight, plain.bias = module.weight, module.bias
            carry_hooks(module, plain, share=True)  # (the copy's own, as the rest of the copy)
            _set_submodule(net, path, plain)
    return net


def _one_parameter_set(model: Any, values: Any, owner: str) -> dict[str, Tensor]:
    """``values`` as one parameter set of the model's sites, checked: known names, each of its
    site's shape (not ``S`` draws of it). A fitted guide gives its posterior mean (a point
    guide's point, a Laplace guide's MAP); a mixture of particles has no one parameter set.

    Raises
    ------
    ValueError
        ``values`` is ``None`` or empty: the network holds the values the model was built with,
        which a fit never changes (the fitted values live in the guide); a mixture guide; a
        value of another shape.
    KeyError
        A site the model does not have.
    """
    if values is None or (isinstance(values, Mapping) and not values):
        raise ValueError(
            f"{owner}: pass the parameter values to deploy, e.g. pyrobayes.models.{owner}(model, "
            "guide) (the "
            "fitted guide's posterior mean) or values=guide.mean() or one draw of "
            "guide.sample_posterior. Without them it would use the values stored in the "
            "network, which are those the model was built with: a fit keeps its fitted values "
            "in the guide and never writes them into the network. To deploy the stored values "
            "on purpose (e.g. the trained weights of a peft adapter the model was built from), "
            "pass values=model.init_values()."
        )
    guide = None
    if not isinstance(values, Mapping):
        guide, values = values, _guide_values(values, owner)
    sites = model.latent_sites
    unknown = [s for s in values if s not in sites]
    if unknown:
        raise KeyError(
            f"{owner}: values has no site(s) {unknown} of this model; its sites are "
            f"{list(sites)[:8]}{' ...' if len(sites) > 8 else ''}."
        )
    missing = [s for s in sites if s not in values]
    if missing:  # they would silently keep the network's stored (initial) values
        given = "guide.mean()" if guide is not None else "values"
        raise ValueError(
            f"{owner}: values has no value for the site(s) {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} of this model ({len(missing)} of "
            f"{len(sites)}; a subset of the sites, or a guide built before model.make_latent): "
            "every latent site needs one. Pass one parameter set of all the sites; to deploy "
            "the network's stored (initial) values for the missing ones on purpose, pass "
            f"values={{**model.init_values(), **{given}}}."
        )
    for site, value in values.items():
        shape = tuple(sites[site].shape)
        if tuple(value.shape) != shape:
            many = tuple(value.shape[1:]) == shape
            raise ValueError(
                f"{owner}: values[{site!r}] has shape {tuple(value.shape)}, but one parameter "
                f"set of the site has {shape}"
                + (
                    f": these are {value.shape[0]} draws; pass one, e.g. "
                    "{s: v[0] for s, v in draws.items()}, or guide.mean()."
                    if many
                    else "."
                )
            )
    if guide is not None:
        _warn_untempered(guide, model, owner)
    return dict(values)


def _guide_values(guide: Any, owner: str) -> Mapping[str, Tensor]:
    """The posterior mean of a fitted ``guide`` (its ``mean()``), refused for a mixture."""
    mean = getattr(guide, "mean", None)
    if not callable(mean) or not hasattr(guide, "sites"):
        raise TypeError(
            f"{owner}: values must be a dict {{site: Tensor}} or a fitted pyrobayes posterior "
            f"(guide); got {type(guide).__name__}."
        )
    if implements(guide, Mixture):
        raise ValueError(
            f"{owner}: {type(guide).__name__} is a mixture of {guide.num_components} "
            "components, whose predictive is the average of its members' and whose mean is no "
            "member: deploy one member, e.g. values={s: v[0] for s, v in "
            "guide.component_locs().items()}, or merge each member and average their "
            "predictions."
        )
    values: Mapping[str, Tensor] = mean()
    return values


class UntemperedDeployWarning(UserWarning):
    """A calibrated guide (:func:`pyrobayes.calibrate`) deployed by :func:`merged_network` or
    :func:`to_peft`: a network has no place for the guide's temperature ``T``, so the deployed
    network's outputs are untempered; apply ``T`` to them yourself (logits ``/ T``; a Gaussian
    likelihood's ``σ`` times ``T``), as :func:`pyrobayes.predict` applies it."""


def _warn_untempered(guide: Any, model: Any, owner: str) -> None:
    """Warn when ``guide`` carries a temperature ``T ≠ 1``, which the deployed network drops."""
    from ..calibration import temperature  # (calibration imports models: a lazy import)
    from .likelihoods import Gaussian

    t = temperature(guide)
    if t == 1.0:
        return
    if isinstance(getattr(model, "likelihood", None), Gaussian):
        apply = f"multiply the likelihood's predictive scale σ by T (σ · {t:.4g})"
    else:
        apply = f"divide the network's logits by T before the softmax (logits / {t:.4g})"
    warnings.warn(
        f"{owner}: {type(guide).__name__} is calibrated (temperature T = {t:.4g}, "
        "pyrobayes.calibrate), but a network has no place for T: the deployed network's "
        f"outputs are untempered (the uncalibrated predictive at these values). To apply T, "
        f"{apply}; pyrobayes.predict(model, guide, ...) applies it itself.",
        UntemperedDeployWarning,
        stacklevel=user_stacklevel(),
    )


def merged_network(model: Any, values: Mapping[str, Tensor] | Any | None = None) -> nn.Module:
    r"""Copy of the network with the adapter folded into the frozen weights.

    ``W = W_0 + ΔW(θ)`` for every adapted layer (``ΔW = (α/r) B A`` for LoRA,
    ``(α/r) U R Vᵀ`` for a LoRA-XS core ``R``), and a latent layer's weights set to ``θ``. The
    result holds no pyrobayes module: saved with ``save_pretrained`` it reloads with
    ``from_pretrained`` (no unexpected keys) and computes ``f(x; θ)``.

    Each merged layer gets a weight of its own: one tied to another module's (a language
    model's ``lm_head`` and its input embeddings ``wte``) is untied in the copy, the other
    module keeping the original values, and a Hugging Face config's ``tie_word_embeddings`` is
    set to ``False`` so that ``from_pretrained`` does not tie them again.

    Hooks registered on the network's modules come with the copy; those on an adapter layer
    (``model.net.get_submodule(path)`` after the model was built) or on a latent layer are
    registered on the merged layer that replaces it, which computes the same function.

    Parameters
    ----------
    model : FineTuneModel
    values : dict or PosteriorGuide
        Required. One parameter set ``{site: Tensor(*shape)}`` (e.g. ``guide.mean()`` or one
        draw of ``guide.sample_posterior``), or a fitted guide, which gives its posterior mean
        (a MAP's point, a Laplace guide's MAP). The network itself holds the values the model
        was built with (a fit keeps the fitted ones in the guide), so they are merged only when
        asked for: ``values=model.init_values()`` (e.g. a peft adapter's trained weights that
        the model was built from).

    Returns
    -------
    nn.Module
        The network (for a Hugging Face model, its class), parameters frozen, in eval mode
        (dropout off, as :func:`pyrobayes.predict` runs it) also for a model built with
        ``train_backbone_mode=True``: call ``.train()`` on it to train it further.

    Raises
    ------
    ValueError
        ``values`` is missing (``None`` or ``{}``), lacks a latent site (the network's initial
        values on purpose: ``values={**model.init_values(), **values}``), is a mixture guide
        (particles, σN ensemble: merge one member), or several draws rather than one; an
        adapter's base layer computes its weight from a parametrization
        (``torch.nn.utils.parametrize``, ``weight_norm``), where a merged ``ΔW`` would be
        recomputed away: turn it into a plain weight first (the message says how); an
        adapter's base layer has forward hooks or pre-hooks (registered on the layer before the
        model was built), which the adapted layer applies to ``W0 x`` alone and a merged one
        would apply to ``(W0 + ΔW) x``, or a part of an adapter (``lora_A``, ``lora_B``, a
        ``core``) has some, which a merged network has no place for.
    TypeError
        An adapter's base layer is an ``nn.Linear`` subclass with a ``forward`` of its own,
        which need not compute ``x Wᵀ + b``: the adapter adds ``ΔW x`` beside that forward, a
        merged ``ΔW`` would go through it. Deploy the adapter unmerged (:func:`to_peft` for
        LoRA) or the model itself.

    Warns
    -----
    UntemperedDeployWarning
        ``values`` is a calibrated guide (:func:`pyrobayes.calibrate`, temperature ``T ≠ 1``):
        the network has no place for ``T``, so its outputs are untempered; divide its logits
        by ``T`` (a Gaussian likelihood: multiply ``σ`` by ``T``) to apply it.
    MergeRoundingWarning
        A half-precision (``bfloat16`` / ``float16``) weight rounds away more than
        a tenth of its layer's ``ΔW`` (a small update on large weights): the merged network
        then differs from the adapted one, which adds ``ΔW x`` apart. Merge in float32, or
        deploy the adapter unmerged (the message says how).
    """
    values = _one_parameter_set(model, values, "merged_network")
    _check_stock_forward(model)
    _check_adapter_hooks(model, "merged_network", base=True)
    net = unwrapped_network(model)
    _carry_adapter_hooks(model, net)
    from .signorm import MemberNorm  # (signorm imports the model, which this module serves)

    by_module: dict[str, dict[str, Tensor]] = {}
    for site, v in values.items():
        spec = model.latent_sites[site]
        by_module.setdefault(spec.module_path, {})[spec.kind] = v
    shared = _shared_tensor_ids(net)
    untied: list[str] = []
    rounded: list[tuple[str, float]] = []
    with torch.no_grad():
        for path, roles in by_module.items():
            layer = model.net.get_submodule(path)
            base = net.get_submodule(path)
            if isinstance(layer, MemberNorm):  # a σN member norm: the plain layer at the values
                member = {  # by tensor name: the two running statistics share one kind
                    spec.param_name.rsplit(".", 1)[-1]: values[site]
                    for site, spec in model.latent_sites.items()
                    if spec.module_path == path and site in values
                }
                plain = layer.merged_norm(member)
                carry_hooks(base, plain, share=True)  # the copy's own hooks on the member norm
                _set_submodule(net, path, plain)
                continue
            if isinstance(layer, LoRAXSLinear):
                delta = layer.delta_weight(roles["core"])  # (d_out, d_in)
            elif isinstance(layer, LoRALinear):
                delta = layer.delta_weight(roles.get("lora_A"), roles.get("lora_B"))
            else:  # a latent nn.Linear (make_latent takes nothing else): the draw *is* the weight
                if not isinstance(base, nn.Linear):
                    raise TypeError(
                        f"merged_network: latent sites of {path!r} sit on a "
                        f"{type(base).__name__}, which it cannot merge (LoRA, LoRA-XS, latent "
                        "nn.Linear and σN member norm layers only)."
                    )
                for role in ("weight", "bias"):
                    if role in roles:
                        untied += _replace_tensor(base, role, roles[role], shared, path)
                continue
            weight = _plain_weight(base, path)
            if not isinstance(base, nn.Linear):  # GPT-2 Conv1D stores (d_in, d_out)
                delta = delta.T
            delta = delta.to(device=weight.device)
            merged = weight.detach() + delta.to(weight.dtype)
            rounded += _rounded_share(path, weight, merged, delta)
            untied += _replace_tensor(base, "weight", merged, shared, path)
    _untie_in_config(net, untied)
    _warn_rounded(rounded, model)
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()  # a deployed network: no dropout, whatever train_backbone_mode


def _hook_names(hooks: list[Any]) -> str:
    """The hooks' names, for a message: ``['scale', 'Recorder']``."""
    return str([getattr(h, "__qualname__", None) or type(h).__name__ for h in hooks][:4])


def _check_adapter_hooks(model: Any, owner: str, *, base: bool) -> None:
    """Refuse forward hooks / pre-hooks that a deployed network could not apply as the adapted
    one does: on an adapter's own submodules (``lora_A``, ``lora_B``, a LoRA-XS ``core``),
    which no deployed network has, and with ``base`` on an adapter's frozen base layer, which
    sees ``W0 x`` alone (the adapter adds ``ΔW x`` after them) while a merged layer's hooks see
    ``(W0 + ΔW) x``. Hooks on the adapter layer itself are carried over (its deployed layer
    computes the same function); hooks on other modules are copied with the network.

    Raises
    ------
    ValueError
        Naming the module the hooks sit on, the adapter layer and what to do.
    """
    for path, layer in model.net.named_modules():
        if not isinstance(layer, (LoRALinear, LoRAXSLinear)):
            continue
        for name, inner in layer.named_modules():
            hooks = user_forward_hooks(inner) if inner is not layer else []
            if not hooks or (inner is layer.base and not base):
                continue
            where = f"{path}.{name}"
            if inner is layer.base:
                raise ValueError(
                    f"{owner}: the frozen base layer {where!r} of the adapted layer {path!r} "
                    f"has forward hook(s) or pre-hook(s) {_hook_names(hooks)} (registered on "
                    "the layer before the adapter was built): the adapted layer applies them to "
                    "the base's part W0 x alone and adds the adapter's ΔW x after them, while a "
                    "merged layer would apply them to (W0 + ΔW) x, so the merged network would "
                    "differ from the adapted one. Remove them from the base (their handles' "
                    f".remove(), or model.net.get_submodule({where!r})._forward_hooks.clear() "
                    "and ._forward_pre_hooks.clear()) and, to act on the whole layer, register "
                    f"them on model.net.get_submodule({path!r}), which the merged network "
                    "keeps; or deploy the adapter unmerged (pyrobayes.models.to_peft for LoRA, "
                    "whose base layer applies them as here, or the model itself)."
                )
            raise ValueError(
                f"{owner}: {where!r}, a part of the adapted layer {path!r}, has forward "
                f"hook(s) or pre-hook(s) {_hook_names(hooks)}, which the deployed network "
                "cannot carry (its adapter's parts are folded into the layer or replaced by "
                "peft's): it would differ from the adapted one. Remove them (their handles' "
                f".remove(), or model.net.get_submodule({where!r})._forward_hooks.clear() and "
                "._forward_pre_hooks.clear()), register them on the whole layer "
                f"model.net.get_submodule({path!r}) instead, or deploy the model itself."
            )


def _carry_adapter_hooks(model: Any, net: nn.Module) -> None:
    """Register the hooks of each adapter layer of ``model.net`` on the layer at its path in
    ``net``, the deployed copy (a merged ``nn.Linear`` or peft's LoRA layer, which compute the
    same function): copied, so that the deployed network's hooks are its own."""
    for path, layer in model.net.named_modules():
        if isinstance(layer, (LoRALinear, LoRAXSLinear)):
            carry_hooks(layer, net.get_submodule(path))


def _check_stock_forward(model: Any) -> None:
    """Refuse to merge into an adapter's base layer whose ``forward`` is not ``nn.Linear``'s.

    Raises
    ------
    TypeError
        The base layer of an adapted module is an ``nn.Linear`` subclass with a ``forward`` of
        its own (e.g. one scaling its output or transforming its weight): the adapted layer
        computes ``base(x) + ΔW x``, the merged one ``base(x)`` with ``W0 + ΔW`` inside, which
        differ unless that forward is ``x Wᵀ + b``.
    """
    for path, layer in model.net.named_modules():
        if not isinstance(layer, (LoRALinear, LoRAXSLinear)):
            continue
        base = layer.base
        if not isinstance(base, nn.Linear) or type(base).forward is nn.Linear.forward:
            continue
        unmerged = (
            "pyrobayes.models.to_peft(model, values) (peft adds the update beside the layer, "
            "as here; do not merge_and_unload it) or "
            if isinstance(layer, LoRALinear)
            else ""
        )
        raise TypeError(
            f"merged_network: the base layer of {path!r} is a {type(base).__name__}, an "
            "nn.Linear subclass with a forward of its own, which need not compute x W^T + b: "
            "the adapter adds ΔW x beside that forward, while a ΔW merged into its weight goes "
            "through it (a forward that scales its output or transforms its weight changes "
            "it), so the merged network could differ from the adapted one. Deploy the adapter "
            f"unmerged: {unmerged}the model itself (pyrobayes.predict(model, guide, ...)). If "
            "its forward does compute x W^T + b, build the model on a plain nn.Linear holding "
            "the same weight and bias."
        )


#: A half-precision merge that loses more than this share of ``ΔW`` (relative Frobenius error
#: of the merged update) to rounding is warned about.
_ROUNDING_RTOL = 0.1


class MergeRoundingWarning(UserWarning):
    """:func:`merged_network` into half-precision weights (``bfloat16``, ``float16``) that round
    away much of an adapter's ``ΔW``: a small update on large weights falls below their
    rounding step, so the merged network differs from the adapted one (which adds ``ΔW x``
    apart). Merge in float32 (``model.net.float()`` before merging) or deploy the adapter
    unmerged (:func:`to_peft`)."""


def _rounded_share(
    path: str, weight: Tensor, merged: Tensor, delta: Tensor
) -> list[tuple[str, float]]:
    """``[(path, share)]`` when the half-precision ``merged = weight + delta`` keeps ``delta``
    with a relative error ``share`` above :data:`_ROUNDING_RTOL`, else ``[]``."""
    if not weight.is_floating_point() or weight.element_size() > 2:
        return []
    exact = delta.detach().float()
    norm = float(exact.norm())
    if norm == 0.0 or not math.isfinite(norm):
        return []
    kept = merged.float() - weight.detach().float()
    share = float((kept - exact).norm()) / norm
    return [(path, share)] if share > _ROUNDING_RTOL else []


def _warn_rounded(rounded: list[tuple[str, float]], model: Any) -> None:
    """Warn (:class:`MergeRoundingWarning`) naming the layers whose ``ΔW`` rounding lost."""
    if not rounded:
        return
    listed = ", ".join(f"{p!r} ({share:.0%})" for p, share in rounded[:4])
    more = f" and {len(rounded) - 4} more" if len(rounded) > 4 else ""
    lora = isinstance(getattr(model, "adapter", None), LoRA)
    peft = "pyrobayes.models.to_peft(model, values) or " if lora else ""
    warnings.warn(
        f"merged_network: the half-precision weights lose much of the adapter's update ΔW to "
        f"rounding (relative error of the merged ΔW: {listed}{more}): a small update on large "
        "weights falls below their rounding step, so the merged network differs from the "
        "adapted one, which adds ΔW x apart. Merge in float32 (model.net.float() before "
        f"merged_network; cast the merged network back only if the rounding is acceptable), "
        f"or deploy the adapter unmerged: {peft}the model itself.",
        MergeRoundingWarning,
        stacklevel=user_stacklevel(),
    )


def _shared_tensor_ids(net: nn.Module) -> set[int]:
    """The ids of the parameters that several modules hold (tied weights: GPT-2's ``lm_head``
    and ``wte``); a module registered under several names counts once."""
    owners: dict[int, set[int]] = {}
    for _, module in net.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(module))
    return {pid for pid, mods in owners.items() if len(mods) > 1}


def _replace_tensor(
    module: nn.Module, name: str, value: Tensor, shared: set[int], path: str
) -> list[str]:
    """Give ``module`` a fresh parameter ``name`` holding ``value`` (never written into the old
    tensor, which may be tied to another module's: the copy unties it).

    Returns
    -------
    list of str
        ``[f"{path}.{name}"]`` when the old tensor was shared with another module, else ``[]``.
    """
    old = getattr(module, name)
    fresh = value.detach().to(dtype=old.dtype, device=old.device).clone()
    setattr(module, name, nn.Parameter(fresh, requires_grad=False))
    return [f"{path}.{name}"] if id(old) in shared else []


def _plain_weight(base: nn.Module, path: str) -> Tensor:
    """The stored weight of an adapter's base layer at ``path``, which ``merged_network`` can
    replace: a plain parameter, not one computed from others by a parametrization.

    Raises
    ------
    TypeError
        The base layer has no weight tensor.
    ValueError
        Its weight is computed (``torch.nn.utils.parametrize``, ``weight_norm``): a merged
        ``ΔW`` written there would be recomputed away.
    """
    weight = getattr(base, "weight", None)
    if not isinstance(weight, Tensor):  # an adapter's base: nn.Linear or GPT-2 Conv1D
        raise TypeError(
            f"merged_network: the base layer of {path!r} ({type(base).__name__}) has no "
            "weight tensor to fold the adapter into."
        )
    stored = base._parameters.get("weight", base._buffers.get("weight"))
    if stored is None or stored is not weight:  # parametrize, or the hook-based weight_norm
        raise ValueError(
            f"merged_network: the base layer of {path!r} ({type(base).__name__}) computes its "
            "weight from other tensors (a torch.nn.utils.parametrize parametrization such as "
            "weight_norm's weight_g / weight_v), so a merged ΔW written into it would be "
            "recomputed away and the merged network would be the original one. To merge, first "
            "turn its weight into a plain tensor in the model (the function is unchanged): "
            "torch.nn.utils.parametrize.remove_parametrizations(model.net.get_submodule("
            f"{path + '.base'!r}), 'weight') (for the older torch.nn.utils.weight_norm: "
            "torch.nn.utils.remove_weight_norm), or deploy the model itself."
        )
    return stored


def _untie_in_config(net: nn.Module, untied: list[str]) -> None:
    """After ``merged_network`` untied ``untied`` from the tensors they shared (a merged
    ``lm_head`` and the input embeddings), a Hugging Face config must not tie them again:
    ``from_pretrained`` would re-tie the reloaded copy (dropping the merged ``lm_head``)."""
    if not untied:
        return
    config = getattr(net, "config", None)
    get_text = getattr(config, "get_text_config", None)
    for cfg in {id(c): c for c in (config, get_text() if callable(get_text) else None)}.values():
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False) is True:
            cfg.tie_word_embeddings = False


def to_peft(model: Any, values: Mapping[str, Tensor] | Any | None = None) -> Any:
    """A ``peft.PeftModel`` carrying the LoRA sites' values (posterior mean or one draw).

    The base network is a copy without pyrobayes layers; ``save_pretrained`` writes a peft
    adapter that plain ``peft.PeftModel.from_pretrained`` loads. A task head trained with the
    adapter (a point parameter, or a layer made latent: ``FineTuneModel.make_latent``) is one of
    peft's ``modules_to_save``, so the saved adapter carries it (at ``values`` where it is
    latent) and loading onto a freshly initialised pretrained network restores it; without it
    the reloaded head would be the fresh one.

    Parameters
    ----------
    model : FineTuneModel
        Built with a LoRA adapter.
    values : dict or PosteriorGuide
        Required. One parameter set ``{site: Tensor(*shape)}`` (``guide.mean()``, one draw),
        or a fitted guide (its posterior mean), as for :func:`merged_network`; the network's
        own values (``model.init_values()``: the adapter's initialisation, ``lora_B = 0``,
        unless the model was built from a trained peft adapter) only when passed explicitly.

    Returns
    -------
    peft.PeftModel
        In eval mode (dropout off, as :func:`pyrobayes.predict` runs the model) also for a
        model built with ``train_backbone_mode=True``: call ``.train()`` to train it further.

    Raises
    ------
    TypeError
        When the model's adapter is not LoRA (LoRA-XS has no peft layout: use
        :func:`merged_network`).
    ValueError
        When an adapted module is registered under several names (``net.dec = net.enc``),
        which peft adapts under one name only (use :func:`merged_network`); when ``values``
        is missing, lacks a latent site, is a mixture guide or several draws (see
        :func:`merged_network`).

    Warns
    -----
    UntemperedDeployWarning
        ``values`` is a calibrated guide: the adapter's outputs are untempered (see
        :func:`merged_network`).
    """
    from peft import LoraConfig, get_peft_model

    adapter = model.adapter
    if not isinstance(adapter, LoRA):
        raise TypeError(
            f"to_peft needs a LoRA adapter but the model has {type(adapter).__name__}; "
            "use pyrobayes.models.merged_network(model, values) instead."
        )
    paths = sorted(
        {s.module_path for s in model.latent_sites.values() if s.kind.startswith("lora")}
    )
    names = {aliases[0]: aliases for _, aliases in _module_aliases(model.net).values()}
    shared = {p: names[p] for p in paths if len(names.get(p, ())) > 1}
    if shared:  # peft adapts a module under the one name named_modules() gives, not the others
        path, aliases = next(iter(shared.items()))
        raise ValueError(
            f"to_peft: the adapted module {path!r} is registered under several names "
            f"{aliases}; peft would adapt it under {path!r} only and leave the others the "
            "frozen layer. Use pyrobayes.models.merged_network(model, values), which folds the "
            "adapter into the one shared layer."
        )
    values = _one_parameter_set(model, values, "to_peft")
    _check_adapter_hooks(model, "to_peft", base=False)
    net = unwrapped_network(model)
    # the modules trained beside the adapter, which peft must save with it: the point head and
    # the layers made latent (weight and bias sites)
    heads = sorted(
        {
            *model.head_modules(),
            *(s.module_path for s in model.latent_sites.values() if s.kind in ("weight", "bias")),
        }
    )
    # GPT-2's Conv1D stores its weight (in, out): peft needs fan_in_fan_out for it (and warns
    # and sets it itself otherwise)
    conv1d = any(is_conv1d(net.get_submodule(p)) for p in paths)
    config = LoraConfig(
        r=adapter.rank,
        fan_in_fan_out=conv1d,
        # peft annotates lora_alpha as int but only divides by it: a float alpha is kept exact
        lora_alpha=adapter.alpha if adapter.alpha is not None else adapter.rank,  # type: ignore[arg-type]
        target_modules=paths,
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
        modules_to_save=heads or None,
    )
    peft_model = get_peft_model(net, config)
    _carry_adapter_hooks(model, peft_model.get_base_model())
    state = {}
    for site, v in values.items():
        spec = model.latent_sites[site]
        if spec.kind in ("lora_A", "lora_B"):
            state[f"base_model.model.{spec.module_path}.{spec.kind}.default.weight"] = v
        elif spec.module_path in heads:  # a head made latent: its weight or bias, as given
            state[f"base_model.model.{spec.module_path}.modules_to_save.default.{spec.kind}"] = v
    for name, p in model.point_params.items():  # LoRA(latent="A"): every B is a point
        path, _, role = name.removesuffix(".weight").rpartition(".")
        if role in ("lora_A", "lora_B"):
            state[f"base_model.model.{path}.{role}.default.weight"] = p.detach()
    # a point head needs nothing more: peft's copy (modules_to_save) holds its trained values
    missing = set(state) - set(dict(peft_model.named_parameters()))
    if missing:
        raise RuntimeError(f"peft layout mismatch; missing {sorted(missing)[:3]}")
    with torch.no_grad():
        params = dict(peft_model.named_parameters())
        for k, v in state.items():
            params[k].copy_(v)
    return peft_model.eval()  # a deployed network: no dropout, whatever train_backbone_mode
