"""A ``peft.PeftModel`` with LoRA layers taken apart for :class:`~pyrobayes.models.FineTuneModel`:
its base network, its LoRA config as a pyrobayes :class:`~pyrobayes.models.LoRA`, and its
trained weights.

A peft model whose function the import could not keep is refused by name rather than imported
changed: several active adapters (their updates add up), adapter layers disabled
(``disable_adapter_layers``) or merged into the base weights (``merge_adapter``), and the
``LoraConfig`` settings :meth:`~pyrobayes.models.LoRA.from_peft` refuses (``lora_bias``,
``trainable_token_indices``, DoRA, rsLoRA, per-module ranks), and a LoRA layer on a module
pyrobayes' LoRA does not adapt (peft's LoRA on an ``nn.Embedding`` or a convolution: only
``nn.Linear`` and GPT-2's ``Conv1D``), whose trained update the import would drop.

A ``lora_dropout > 0`` is imported with a :class:`LoRADropoutWarning` naming the adapter and the
value: pyrobayes' LoRA has no dropout, so a fit runs without it (the noise of the posterior over
the LoRA factors takes its part as the regulariser), while the adapted function at evaluation,
where peft's dropout is off, is the peft model's. Published adapters commonly carry
``lora_dropout=0.05``; set ``lora_dropout=0`` in the ``LoraConfig`` (a loaded peft model:
``peft_model.peft_config[name].lora_dropout = 0``) to import without the warning."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any

from torch import Tensor, nn

from ..user_frame import user_stacklevel
from .adapters import LoRA, find_target_modules
from .layers import is_conv1d

__all__ = ["LoRADropoutWarning"]


class LoRADropoutWarning(UserWarning):
    """A peft LoRA adapter imported with ``lora_dropout > 0``, which pyrobayes' LoRA does not
    apply (it has no dropout): a fit runs without it, the noise of the posterior over the LoRA
    factors taking its part as the regulariser. The adapted function at evaluation (peft's
    dropout is off in eval mode) is unchanged. ``lora_dropout=0`` in the ``LoraConfig``
    silences it."""


def _warn_if_dropout(config: Any, what: str, silence: str) -> None:
    """Warn (:class:`LoRADropoutWarning`) that the ``lora_dropout`` of the peft ``config`` is
    not applied.

    Parameters
    ----------
    config : peft.LoraConfig
    what : str
        The adapter, as the message names it (``"the peft LoRA adapter 'default'"``).
    silence : str
        How to set its dropout to 0, for the message.
    """
    p = getattr(config, "lora_dropout", 0.0)
    if not isinstance(p, (int, float)) or p <= 0:
        return
    warnings.warn(
        f"FineTuneModel: {what} has lora_dropout={p:g}, which pyrobayes' LoRA does not apply "
        "(it has no dropout): the fit runs without it, the posterior's sampling noise (under "
        "MAP, the prior's weight decay) taking its part as the regulariser. The adapted "
        "function at evaluation "
        f"(peft's dropout is off in eval mode) is unchanged. To silence this, {silence}.",
        LoRADropoutWarning,
        stacklevel=user_stacklevel(),
    )


def _flagged(layers: list[tuple[str, Any]], attr: str) -> str:
    """The first of ``layers`` whose ``attr`` is true, quoted (``"'q' ..."`` when more are),
    or ``""`` when none is."""
    names = [name for name, m in layers if getattr(m, attr, False)]
    return f"{names[0]!r}{' ...' if len(names) > 1 else ''}" if names else ""


def _lora_layers(net: Any) -> list[tuple[str, Any]]:
    """The peft LoRA layers of ``net`` (modules with a ``lora_A`` ``ModuleDict``), by name."""
    return [
        (name, module)
        for name, module in net.named_modules()
        if isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
    ]


def _check_peft_model(net: Any) -> str:
    """The one active adapter of the peft model ``net``, or a ``ValueError`` saying why its
    function cannot be imported as it is (and what to do).

    Raises
    ------
    ValueError
        ``net`` is peft's tuner (``peft_model.base_model``) rather than the ``PeftModel``; more
        than one adapter is active; the adapter layers are disabled; an adapter is merged into
        the base weights (``merge_adapter``); the active adapter is not LoRA.
    """
    kind = type(net).__name__
    active = getattr(net, "active_adapter", None)
    if not isinstance(active, str):
        raise ValueError(
            f"FineTuneModel: net is a peft {kind} (the tuner a PeftModel wraps, "
            "peft_model.base_model), not a PeftModel; pass the PeftModel itself (what "
            "peft.get_peft_model or PeftModel.from_pretrained returns)."
        )
    layers = _lora_layers(net)
    names = sorted(
        {a for _, m in layers for a in getattr(m, "active_adapters", ())}
        | set(getattr(net, "active_adapters", None) or [active])
    )
    if len(names) > 1:
        raise ValueError(
            f"FineTuneModel: the peft model has several active adapters {names}, whose updates "
            "add up; pyrobayes imports one LoRA adapter. Activate one "
            "(peft_model.set_adapter(name)), or fold them into the base weights "
            "(peft_model.merge_and_unload()) and build with a fresh adapter=LoRA(...)."
        )
    disabled = _flagged(layers, "disable_adapters")
    if disabled:
        raise ValueError(
            f"FineTuneModel: the peft model's adapter layers are disabled ({disabled}: "
            "disable_adapter_layers()), so it computes "
            "the base network, while an import would make the adapter act. Enable them "
            "(peft_model.base_model.enable_adapter_layers()) to import the adapter, or pass "
            "peft_model.unload() (the base network) with adapter=LoRA(...) to start afresh."
        )
    merged = _flagged(layers, "merged")
    if merged:
        raise ValueError(
            f"FineTuneModel: the peft model's adapter is merged into the base weights "
            f"({merged}: merge_adapter()), and its "
            "LoRA weights would be imported on top of them, counting the update twice. Call "
            "peft_model.unmerge_adapter() first, or pass peft_model.merge_and_unload() (the "
            "adapter folded into the weights) with a fresh adapter=LoRA(...)."
        )
    config = net.peft_config[active]
    if type(config).__name__ != "LoraConfig":
        raise ValueError(
            f"FineTuneModel: the peft model's active adapter {active!r} is a "
            f"{type(config).__name__}; pyrobayes imports LoRA adapters only. Pass "
            "peft_model.merge_and_unload() with adapter=LoRA(...) or LoRAXS(...)."
        )
    return active


def _check_adapted_layers(net: Any, active: str) -> None:
    """Refuse a LoRA layer of the ``active`` adapter on a module pyrobayes' LoRA does not adapt
    (peft's LoRA on an ``nn.Embedding``, a convolution, a parameter): the import would drop its
    trained update (an embedding's ``lora_embedding_A`` is no ``lora_A``) or fail on it.

    Raises
    ------
    ValueError
        A layer's base module is neither an ``nn.Linear`` nor GPT-2's ``Conv1D``; the message
        names its path and type.
    """
    prefix = "base_model.model."
    for name, module in _lora_layers(net):
        embedding_a = getattr(module, "lora_embedding_A", None)
        if active not in module.lora_A and not (embedding_a is not None and active in embedding_a):
            continue
        get_base = getattr(module, "get_base_layer", None)
        base = get_base() if callable(get_base) else getattr(module, "base_layer", module)
        if isinstance(base, nn.Linear) or is_conv1d(base):
            continue
        path = name[len(prefix) :] if name.startswith(prefix) else name
        raise ValueError(
            f"FineTuneModel: the peft LoRA adapter {active!r} adapts {path!r} (a "
            f"{type(base).__name__}), but pyrobayes' LoRA adapts nn.Linear layers and "
            "transformers' GPT-2 Conv1D only, so an import would drop that layer's trained "
            "update. Pass peft_model.merge_and_unload() (the trained adapter folded into the "
            "weights) with a fresh adapter=LoRA(...) on linear layers, or train the peft "
            f"adapter with target_modules leaving {path!r} out."
        )


def _peft_to_pyrobayes(net: Any, explicit: Any = None) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    """Unwrap a ``peft.PeftModel`` with LoRA layers: base network, LoRA config, trained weights.

    ``net`` is duck-typed (``peft_config``, ``active_adapter``, ``unload``), as the caller checks,
    and checked by :func:`_check_peft_model`. The adapter targets exactly the modules peft
    adapted (its ``layers_to_transform`` and ``exclude_modules`` included); an ``explicit``
    adapter (a pyrobayes :class:`LoRA` or a ``peft.LoraConfig``) may only change which factors
    are latent (``LoRA(latent="A")``), not the rank, scaling or modules of the trained weights;
    any other adapter is refused.
    """
    active = _check_peft_model(net)
    _check_adapted_layers(net, active)
    adapter = LoRA.from_peft(net.peft_config[active], scoped=True)
    _warn_if_dropout(
        net.peft_config[active],
        f"the peft LoRA adapter {active!r}",
        f"set peft_model.peft_config[{active!r}].lora_dropout = 0 before importing",
    )
    if explicit is not None and type(explicit).__name__ == "LoraConfig":
        _warn_if_dropout(explicit, "adapter=LoraConfig(...)", "pass it with lora_dropout=0")
        explicit = LoRA.from_peft(explicit, scoped=True)  # (its scope is compared below)
    weights: dict[str, Tensor] = {}
    prefix = "base_model.model."
    for name, module in _lora_layers(net):
        if active not in module.lora_A:
            continue
        path = name[len(prefix) :] if name.startswith(prefix) else name
        lora_b = getattr(module, "lora_B", None)
        for role, holder in (("lora_A", module.lora_A), ("lora_B", lora_b)):
            weight = getattr(holder[active], "weight", None) if holder else None
            if not isinstance(weight, Tensor):
                raise TypeError(
                    f"FineTuneModel: the peft LoRA layer {name!r} has no {role} weight for "
                    f"adapter {active!r}; pass a peft model with LoRA layers "
                    "(or the unloaded base network and adapter=LoRA(...))."
                )
            weights[f"{path}.{role}.weight"] = weight.detach().clone()
    base = net.unload()
    adapted = sorted({name.rsplit(".", 2)[0] for name in weights})
    if adapted and (
        adapter.target_modules == "all-linear"  # peft's special value, not a regex
        or sorted(find_target_modules(base, adapter.target_modules)) != adapted
    ):
        # peft's layers_to_transform / exclude_modules narrowed its targets: name the paths
        adapter = dataclasses.replace(
            adapter, target_modules="^(" + "|".join(re.escape(p) for p in adapted) + ")$"
        )
    result: Any = adapter
    if explicit is not None:  # (no LoRA layers left, e.g. merged: nothing trained to fit)
        result = _explicit_peft_adapter(explicit, adapter, base, adapted) if adapted else explicit
    return base, result, weights


def _explicit_peft_adapter(
    explicit: Any, adapter: LoRA, base: nn.Module, adapted: list[str]
) -> LoRA:
    """``explicit``, checked against the peft model's own ``adapter`` (its trained weights fix
    the rank, scaling and modules): only ``latent`` may differ."""
    same = (
        isinstance(explicit, LoRA)
        and explicit.rank == adapter.rank
        and math.isclose(explicit.scaling, adapter.scaling)
        and sorted(find_target_modules(base, explicit.target_modules)) == adapted
    )
    if not same:
        raise ValueError(
            f"FineTuneModel: net is a peft LoRA model (r={adapter.rank}, alpha={adapter.alpha:g} "
            f"on {adapted}) and adapter={explicit!r} differs from it, so its trained weights do "
            "not fit. Drop adapter= to keep the peft adapter (LoRA(rank, alpha, the same targets, "
            "latent='A') may change only which factors are latent), or pass net.unload() (the "
            "base network, the adapter dropped) or net.merge_and_unload() (the trained adapter "
            "folded into the weights) with the adapter you want."
        )
    return dataclasses.replace(adapter, latent=explicit.latent)
