"""Parameter accounting: what a fine-tuning method trains and what its posterior stores."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..contract import Posterior
from .layers import LoRALinear, LoRAXSLinear

__all__ = ["count_parameters"]


def count_parameters(guide_or_model: Any) -> dict[str, int]:
    """Count trainable numbers and posterior storage of a guide (or a model alone).

    Parameters
    ----------
    guide_or_model : PosteriorGuide or FineTuneModel

    Returns
    -------
    dict
        - ``latent``: numbers in the latent sites the guide describes (its ``sites``; a model
          alone: all of its latent sites). ``Σ_l r_l²`` for LoRA-XS cores. A site the guide
          does not cover (one made latent by ``model.make_latent`` after the guide was built)
          is neither fitted nor stored, so it is not counted;
        - ``point_adapter``: point-estimated adapter factors of the model (``LoRA(latent="A")``:
          every ``B``), trained in place;
        - ``head``: the other point-estimated parameters of the model (the task head, a learned
          noise scale);
        - ``trainable``: ``latent + point_adapter + head``;
        - ``lora_same_rank``: trainable adapter numbers a LoRA of the same rank on the same
          layers would have (``Σ_l r_l (d_in + d_out)``; 0 when no LoRA-XS layer is present);
        - ``posterior_storage``: numbers that describe q (only for a guide, a
          :class:`~pyrobayes.contract.Posterior`: its ``num_posterior_parameters()``).

    Raises
    ------
    TypeError
        When the guide's model is not a :class:`~pyrobayes.models.FineTuneModel` (a guide of
        an ``AutoGuideList`` over a model function of your own): its sites' specs are unknown.
    """
    is_guide = isinstance(guide_or_model, Posterior)
    model = guide_or_model.model if is_guide else guide_or_model
    if not hasattr(model, "latent_sites"):  # a guide of an AutoGuideList: poutine.block(model)
        model = inspect.unwrap(model)
    if not hasattr(model, "latent_sites"):
        raise TypeError(
            f"count_parameters: {type(model).__name__} is not a pyrobayes FineTuneModel (no "
            "latent_sites); pass the guide of one, or the model itself."
        )
    sites = model.latent_sites
    covered = list(guide_or_model.sites) if is_guide else list(sites)
    latent = sum(int(torch.Size(sites[s].shape).numel()) for s in covered if s in sites)
    net = getattr(model, "net", None)
    factors = head = 0
    for name, p in getattr(model, "point_params", {}).items():
        if _is_lora_factor(net, name):
            factors += int(p.numel())
        else:
            head += int(p.numel())
    lora = 0
    if net is not None:
        for module in net.modules():
            if isinstance(module, LoRAXSLinear):
                lora += module.rank * (module.in_features + module.out_features)
    out = {
        "latent": latent,
        "point_adapter": factors,
        "head": head,
        "trainable": latent + factors + head,
        "lora_same_rank": lora,
    }
    if is_guide:
        out["posterior_storage"] = int(guide_or_model.num_posterior_parameters())
    return out


def _is_lora_factor(net: Any, name: str) -> bool:
    """Whether the point parameter ``name`` is a LoRA layer's ``lora_A`` / ``lora_B`` weight."""
    path, _, tail = name.rpartition(".")
    owner, _, role = path.rpartition(".")
    if net is None or tail != "weight" or role not in ("lora_A", "lora_B"):
        return False
    try:
        return isinstance(net.get_submodule(owner), LoRALinear)
    except AttributeError:
        return False
