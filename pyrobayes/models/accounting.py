"""Parameter accounting: what a fine-tuning method trains and what its posterior stores."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..contract import Posterior
from .layers import LoRAXSLinear

__all__ = ["count_parameters"]


def count_parameters(guide_or_model: Any) -> dict[str, int]:
    """Count trainable numbers and posterior storage of a guide (or a model alone).

    Parameters
    ----------
    guide_or_model : PosteriorGuide or FineTuneModel

    Returns
    -------
    dict
        - ``latent``: numbers in the latent sites (``Σ_l r_l²`` for LoRA-XS cores);
        - ``head``: point-estimated parameters of the model (e.g. the classifier);
        - ``trainable``: ``latent + head``;
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
    latent = sum(int(torch.Size(s.shape).numel()) for s in sites.values())
    head = sum(int(p.numel()) for p in getattr(model, "point_params", {}).values())
    lora = 0
    net = getattr(model, "net", None)
    if net is not None:
        for module in net.modules():
            if isinstance(module, LoRAXSLinear):
                lora += module.rank * (module.in_features + module.out_features)
    out = {"latent": latent, "head": head, "trainable": latent + head, "lora_same_rank": lora}
    if is_guide:
        out["posterior_storage"] = int(guide_or_model.num_posterior_parameters())
    return out
