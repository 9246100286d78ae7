"""A ``peft.PeftModel`` with LoRA layers taken apart for :class:`~pyrobayes.models.FineTuneModel`:
its base network, its LoRA config as a pyrobayes :class:`~pyrobayes.models.LoRA`, and its
trained weights."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from torch import Tensor, nn

from .adapters import LoRA, find_target_modules


def _peft_to_pyrobayes(net: Any, explicit: Any = None) -> tuple[nn.Module, LoRA, dict[str, Tensor]]:
    """Unwrap a ``peft.PeftModel`` with LoRA layers: base network, LoRA config, trained weights.

    ``net`` is duck-typed (``peft_config``, ``active_adapter``, ``unload``), as the caller checks.
    The adapter targets exactly the modules peft adapted (its ``layers_to_transform`` and
    ``exclude_modules`` included); an ``explicit`` adapter may only change which factors are
    latent (``LoRA(latent="A")``), not the rank, scaling or modules of the trained weights.
    """
    config = net.peft_config[net.active_adapter]
    adapter = LoRA.from_peft(config, scoped=True)
    weights: dict[str, Tensor] = {}
    prefix = "base_model.model."
    for name, module in net.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and net.active_adapter in lora_a:
            path = name[len(prefix) :] if name.startswith(prefix) else name
            lora_b = getattr(module, "lora_B", None)
            for role, holder in (("lora_A", lora_a), ("lora_B", lora_b)):
                weight = getattr(holder[net.active_adapter], "weight", None) if holder else None
                if not isinstance(weight, Tensor):
                    raise TypeError(
                        f"FineTuneModel: the peft LoRA layer {name!r} has no {role} weight for "
                        f"adapter {net.active_adapter!r}; pass a peft model with LoRA layers "
                        "(or the unloaded base network and adapter=LoRA(...))."
                    )
                weights[f"{path}.{role}.weight"] = weight.detach().clone()
    base = net.unload()
    adapted = sorted({name.rsplit(".", 2)[0] for name in weights})
    if adapted and sorted(find_target_modules(base, adapter.target_modules)) != adapted:
        # peft's layers_to_transform / exclude_modules narrowed its targets: name the paths
        adapter = dataclasses.replace(
            adapter, target_modules="^(" + "|".join(re.escape(p) for p in adapted) + ")$"
        )
    if explicit is not None:  # (no LoRA layers left, e.g. merged: nothing trained to fit)
        adapter = _explicit_peft_adapter(explicit, adapter, base, adapted) if adapted else explicit
    return base, adapter, weights


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
            "base network) with the adapter you want."
        )
    return dataclasses.replace(adapter, latent=explicit.latent)
